"""What a quantization costs in accuracy, measured on logits: cosine similarity, KL divergence, top-1 agreement.

Each prompt goes through the reference model (unquantized weights, KV cache in the activation dtype) and through
the candidate (quantized weights and/or a quantized KV cache) as one ragged prefill, whose K/V are written to the
cache and read back for attention, so a quantized KV cache is exercised too; every position's next-token logits are
compared in fp32 (``compare_logits``). Random-weight models are harsher here than trained ones: their nearly flat
logits let a small perturbation reorder the top tokens, where a trained model's large margins absorb it.
"""

from __future__ import annotations

from typing import Any

import torch

from workbench.kv.cache import KVCache
from workbench.model.attention import build_metadata


@torch.inference_mode()
def prompt_logits(model: Any, prompt: list[int], kv_cache_dtype: str = "auto") -> torch.Tensor:
    """Next-token logits (fp32) at every position of one prompt, (len(prompt), vocab), through a fresh pool."""
    block_size = 16
    blocks = -(-len(prompt) // block_size)
    cache = KVCache(model.config, blocks, block_size, dtype=model.dtype, device=model.device,
                    kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    meta = build_metadata([len(prompt)], [len(prompt)], [list(range(blocks))], block_size, model.device)
    ids = torch.tensor(prompt, dtype=torch.long, device=model.device)
    return model.compute_logits(model.forward(ids, meta, cache)).float()


def compare_logits(ref: torch.Tensor, cand: torch.Tensor) -> dict[str, float]:
    """Cosine, KL(ref || cand) and top-1 agreement of two (positions, vocab) logit tensors, averaged over positions."""
    ref, cand = ref.float(), cand.float()
    cosine = torch.nn.functional.cosine_similarity(ref, cand, dim=-1)
    log_p, log_q = torch.log_softmax(ref, dim=-1), torch.log_softmax(cand, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    top1 = (ref.argmax(dim=-1) == cand.argmax(dim=-1)).float()
    return {"cosine": float(cosine.mean()), "kl": float(kl.mean()), "top1_agreement": float(top1.mean())}


def logit_agreement(
    reference: Any, candidate: Any, prompts: list[list[int]], kv_cache_dtype: str = "auto"
) -> dict[str, float]:
    """``compare_logits`` over every position of every prompt: ``reference`` with a plain cache, ``candidate``
    with ``kv_cache_dtype``; also ``num_positions``."""
    ref = torch.cat([prompt_logits(reference, p) for p in prompts])
    cand = torch.cat([prompt_logits(candidate, p, kv_cache_dtype) for p in prompts])
    return {**compare_logits(ref, cand), "num_positions": int(ref.shape[0])}
