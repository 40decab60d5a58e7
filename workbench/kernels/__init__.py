"""The project's kernels, imported as ``workbench.kernels``; their files live in the top-level ``kernels/`` directory.

Triton kernels for attention over the paged KV cache and C++ ops for the CPU, each beside a plain-PyTorch fp32
reference. Ops (one file each):
    kv_write                 scatter a step's new K/V rows into the paged pool (``workbench.kernels.kv_write``)
    paged_decode_attention   one query per sequence, split-K over the context (``workbench.kernels.paged_decode``)
    paged_prefill_attention  ragged query chunks, causal over cached prefix + chunk (``kernels/paged_prefill.py``)
    paged decode on the CPU  a C++ op over the pool in place (``workbench.kernels.paged_decode_cpu``)
    quantized linear (CPU)   int8 / int4 weight-only products in C++ (``workbench.kernels.quant_linear_cpu``)
References of the same ops live in ``workbench.kernels.reference``; ``python -m workbench.kernels.bench`` measures
them on a GPU. Import an op from its file (``from workbench.kernels.paged_decode import paged_decode_attention``).

The cache layout is the engine's (``workbench.kv.cache``): ``(num_blocks, block_size, num_kv_heads, head_dim)``
per layer, a token at position ``p`` in slot ``block_table[p // block_size] * block_size + p % block_size``.

Why the directory is not an importable top-level ``kernels`` package: that import name belongs to Hugging Face's
"kernels" hub library, which transformers (5.25 and later) installs as a dependency and imports when it finds it.
A top-level ``kernels/__init__.py`` of ours, first on ``sys.path`` whenever a command runs from the repository,
would shadow that library and break transformers (``ImportError: cannot import name 'CUDAProperties' from
'kernels'``). So ``kernels/`` has no ``__init__.py`` (at most a namespace portion, which an installed regular
package always wins over), and this package's search path is that directory. Importing it loads neither torch
nor triton.
"""

from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"
if not (KERNELS_DIR / "_common.py").is_file():
    raise ImportError(
        f"workbench.kernels: the kernels directory {KERNELS_DIR} is missing; the workbench runs from a clone of its "
        "repository (pip install -e .), whose top-level kernels/ holds the ops"
    )
__path__ = [str(KERNELS_DIR)]
