"""Notebook 02's MLA and mixture-of-experts sections: what they compute, and the claims they decide.

- ``mla_variants``: an MLA model (DeepSeek-V3) beside its MHA, GQA and MQA counterparts (same layers and heads, K
  of ``qk_nope + qk_rope`` and V of ``v_head_dim`` per KV head): KV bytes per token, the sequences of a length that
  fit in a KV budget, and the time a decode step spends reading the cache at the hardware's bandwidth.
- ``moe_decode_bytes``: the roofline's decode weight bytes of an MoE model against batch size
  (``workbench.roofline.moe_decode_cost``: the expected distinct experts ``E (1 - (1 - k/E)^B)``), beside the bytes
  of the experts a model's router *actually* chose in one decode step of ``B`` sequences on this machine
  (``measure_distinct_experts``: the router's choices counted per MoE layer).
- claims, through ``claims.make_claim`` (analytical: no timing rounds).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from workbench.config import ModelConfig, dtype_bytes
from workbench.errors import ConfigError
from workbench.experiments.claims import CONFIRMED, NOT_CONFIRMED, exact_ratio, make_claim
from workbench.hardware import HardwareSpec
from workbench.kv.sizing import attention_variants
from workbench.roofline import expected_distinct_experts, moe_decode_cost


def mla_variants(
    cfg: ModelConfig, hw: HardwareSpec, seq_len: int, kv_budget_bytes: float, batch: int, kv_dtype: str = "bf16"
) -> list[dict[str, Any]]:
    """Rows (kind, num_kv_heads, bytes_per_token, ratio_to_mha, max_seqs, kv_read_ms) for ``cfg``'s MLA and its
    MHA / GQA (8 KV heads) / MQA counterparts. ``max_seqs``: sequences of ``seq_len`` tokens in ``kv_budget_bytes``;
    ``kv_read_ms``: one decode step of ``batch`` such sequences reading their caches at ``hw.mem_bandwidth``."""
    if not cfg.is_mla:
        raise ConfigError(f"{cfg.name} is not an MLA model (kv_lora_rank 0); pick one such as DeepSeek-V3")
    sizes = [(v["kind"], v["num_kv_heads"], v["bytes_per_token"], v["ratio_to_mha"])
             for v in attention_variants(cfg, kv_dtype, gqa_kv_heads=8)]  # fmt: skip
    return [
        {
            "kind": kind,
            "num_kv_heads": heads,
            "bytes_per_token": bpt,
            "ratio_to_mha": ratio,
            "max_seqs": int(kv_budget_bytes // (bpt * seq_len)),
            "kv_read_ms": batch * seq_len * bpt / hw.mem_bandwidth * 1e3,
        }
        for kind, heads, bpt, ratio in sizes
    ]


def moe_decode_bytes(cfg: ModelConfig, batch_sizes: Sequence[int], dtype: str = "bf16") -> list[dict[str, Any]]:
    """Per batch size: expected distinct experts per MoE layer, decode weight bytes (one GPU, no context), and
    those bytes per sequence."""
    rows = []
    for b in batch_sizes:
        cost = moe_decode_cost(cfg, b, 0, dtype=dtype)
        rows.append(
            {
                "batch": b,
                "expected_experts": cost.distinct_experts,
                "weight_bytes": cost.weight_bytes,
                "bytes_per_seq": cost.weight_bytes / b,
            }
        )
    return rows


@torch.inference_mode()
def measure_distinct_experts(
    model: Any, batch_sizes: Sequence[int], prompt_len: int = 8, seed: int = 0
) -> list[dict[str, Any]]:
    """Per batch size ``B``: ``B`` random prompts are prefilled, then one decode step runs and the distinct experts
    the routers chose in it are counted per MoE layer (mean over layers), with the weight bytes that reading only
    those experts costs (``moe_decode_cost``'s non-expert bytes plus the counted experts)."""
    from workbench.model.moe import MoE

    cfg = model.config
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if not moes:
        raise ConfigError(f"{cfg.name} has no mixture-of-experts layer")
    counts: list[int] = []
    gen = torch.Generator().manual_seed(seed)
    rows = []
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * dtype_bytes(str(model.dtype))
    for b in batch_sizes:
        prompts = torch.randint(3, cfg.vocab_size, (b, prompt_len), generator=gen).tolist()
        cache = model.new_cache(b, prompt_len + 1)
        logits = model.prefill(prompts, cache, list(range(b)))
        counts.clear()
        try:
            for m in moes:  # route is a method, not a submodule: wrap it for the step
                m._route_orig = m.route
                m.route = _counting(m, counts)
            model.decode(logits.argmax(-1).tolist(), cache, list(range(b)))
        finally:
            for m in moes:
                del m.route  # the class's method again
                del m._route_orig
        measured = sum(counts) / len(counts)
        cost = moe_decode_cost(cfg, b, 0, dtype=str(model.dtype))
        routed = cfg.num_moe_layers * expert_bytes
        rows.append(
            {
                "batch": b,
                "measured_experts": measured,
                "expected_experts": expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, b),
                "measured_weight_bytes": cost.weight_bytes - routed * cost.distinct_experts + routed * measured,
                "predicted_weight_bytes": cost.weight_bytes,
            }
        )
    return rows


def _counting(module: Any, counts: list[int]) -> Any:
    original = module._route_orig

    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = original(x)
        counts.append(int(torch.unique(ids).numel()))
        return weights, ids

    return route


# ---- claims ------------------------------------------------------------------------------------------------------
def mla_caches_less_than_gqa(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """MLA caches fewer bytes per token than MHA and GQA counterparts (and so fits more sequences)."""
    by = {r["kind"]: r for r in rows}
    mla = by["MLA"]
    ok = all(mla["bytes_per_token"] < by[k]["bytes_per_token"] for k in ("MHA", "GQA"))
    ok = ok and mla["max_seqs"] >= by["GQA"]["max_seqs"]
    text = "; ".join(
        f"{r['kind']}: {r['bytes_per_token'] / 1024:.1f} KiB/token, {r['max_seqs']} sequences" for r in rows
    )
    return make_claim(
        "MLA caches fewer bytes per token than MHA and GQA",
        CONFIRMED if ok else NOT_CONFIRMED,
        {
            **exact_ratio("GQA", by["GQA"]["bytes_per_token"], "MLA", mla["bytes_per_token"], "lower"),
            **{r["kind"]: dict(r) for r in rows},
        },  # fmt: skip
        text,
        (),
    )


def moe_bytes_per_seq_fall_with_batch(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """An MoE decode step's weight bytes grow with the batch (more distinct experts) while the bytes per sequence
    fall: the batch shares the experts it reads."""
    grow = all(b["weight_bytes"] > a["weight_bytes"] for a, b in zip(rows, rows[1:]))
    fall = all(b["bytes_per_seq"] < a["bytes_per_seq"] for a, b in zip(rows, rows[1:]))
    first, last = rows[0], rows[-1]
    text = (
        f"batch {first['batch']}: {first['weight_bytes'] / 2**30:.2f} GiB read, batch {last['batch']}: "
        f"{last['weight_bytes'] / 2**30:.2f} GiB ({last['bytes_per_seq'] / 2**30:.3f} GiB per sequence)"
    )
    return make_claim(
        "MoE decode reads more experts as the batch grows, fewer bytes per sequence",
        CONFIRMED if grow and fall else NOT_CONFIRMED,
        {  # the ratio: bytes per sequence, the largest batch against the smallest
            **exact_ratio(
                f"batch {first['batch']}",
                first["bytes_per_seq"],
                f"batch {last['batch']}",
                last["bytes_per_seq"],
                "lower",
            ),
            "rows": [dict(r) for r in rows],
        },  # fmt: skip
        text,
        (),
    )


def _worst_expert_ratio(rows: Sequence[dict[str, Any]], errors: Sequence[float], tolerance: float) -> dict[str, Any]:
    """The worst row's measured / expected distinct experts as the claim's ratio: exact (the routers' counts of
    seeded inputs), ``direction`` "within" 1 +- ``tolerance``."""
    r = rows[max(range(len(errors)), key=errors.__getitem__)]
    ratio = r["measured_experts"] / r["expected_experts"]
    return {"arms": ["expected", "measured"], "ratio": ratio, "ci_low": ratio, "ci_high": ratio, "rounds": 0,
            "margin": tolerance, "confidence": None, "direction": "within", "of": f"B={r['batch']}"}  # fmt: skip


def distinct_experts_as_predicted(rows: Sequence[dict[str, Any]], tolerance: float = 0.25) -> dict[str, Any]:
    """The routers' measured distinct experts per step are within ``tolerance`` of ``E (1 - (1 - k/E)^B)``."""
    errors = [abs(r["measured_experts"] / r["expected_experts"] - 1) for r in rows]
    worst = max(errors)
    text = (
        ", ".join(f"B={r['batch']}: {r['measured_experts']:.2f} measured vs {r['expected_experts']:.2f}" for r in rows)
        + f"; worst relative error {worst:.1%} (margin {tolerance:.0%})"
    )
    return make_claim(
        "Distinct experts per decode step follow E(1-(1-k/E)^B)",
        CONFIRMED if worst <= tolerance else NOT_CONFIRMED,
        {**_worst_expert_ratio(rows, errors, tolerance), "relative_errors": errors},
        text,
        (),
    )
