"""The import name ``kernels`` is Hugging Face's "kernels" hub library's (transformers 5.25 and later depend on it):
our ops import as ``workbench.kernels`` and the repository's ``kernels/`` directory must never shadow that library.

transformers probes for the library (``is_kernels_available``) and imports names from it when found; every command
of ours runs with the repository first on ``sys.path``, so a top-level ``kernels/__init__.py`` there would be taken
for the library and break transformers (``cannot import name 'CUDAProperties' from 'kernels'``).
"""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _in_repo(code: str) -> str:
    """``code``'s stdout, run by this interpreter from the repository's root (its directory first on sys.path)."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _hub_library_installed() -> bool:
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_import_is_light_and_finds_the_ops_in_the_kernels_directory():
    out = _in_repo(
        "import sys, workbench.kernels as k; assert 'torch' not in sys.modules and 'triton' not in sys.modules; "
        "print(k.__path__[0])"
    )
    assert Path(out) == REPO / "kernels"
    assert not (REPO / "kernels" / "__init__.py").exists()


def test_the_repository_offers_no_top_level_kernels_package():
    """From the repository's root, ``kernels`` is the hub library where it is installed, else at most a namespace
    portion of our directory (no file of its own, which transformers' probe treats as absent)."""
    origin = _in_repo(
        "import importlib.util as u; s = u.find_spec('kernels'); "
        "print('' if s is None or s.origin is None else s.origin)"
    )
    if _hub_library_installed():
        assert origin and Path(origin).resolve().parent != (REPO / "kernels").resolve(), origin
    else:
        assert origin == "", origin


def test_transformers_probe_and_hub_integration_with_our_directory_present():
    """transformers' own answer from the repository's root: the library is available exactly when it is installed,
    and its hub-kernels integration imports (it fails with ours mistaken for the library)."""
    probe = _in_repo(
        "from transformers.utils import import_utils; import transformers.integrations.hub_kernels; "
        "print(import_utils.is_kernels_available.__wrapped__())"
    )
    if _hub_library_installed():  # False where the installed version is outside transformers' range: never an error
        assert probe in ("True", "False")
    else:
        assert probe == "False"


def test_tiny_llama_forward_with_our_package_importable():
    import transformers

    import workbench.kernels  # noqa: F401

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        logits = model(ids).logits  # (1, 5, vocab)
        generated = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert logits.shape == (1, 5, 64) and torch.isfinite(logits).all()
    assert generated.shape == (1, 8)
