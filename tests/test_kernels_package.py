"""The top-level name ``kernels`` is also the HF "kernels" hub library's: ours must not be mistaken for it.

transformers probes for that library (``is_kernels_available``) and imports it when found; our package must make
the probe answer "no", stay cheap to import, and leave a transformers model working.
"""

import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def test_import_is_light():
    code = "import sys, kernels; assert 'torch' not in sys.modules and 'triton' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_transformers_does_not_take_ours_for_the_hub_library():
    from transformers.utils import import_utils

    assert import_utils.is_kernels_available.__wrapped__() is False  # uncached probe, with ours importable


def test_tiny_llama_forward_with_our_package_importable():
    import transformers

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
