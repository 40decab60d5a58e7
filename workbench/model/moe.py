"""A mixture-of-experts MLP: a router picks ``k`` of ``E`` SwiGLU experts per token, plus optional shared experts.

Routing, the variants of the published models:

- softmax (Mixtral; Qwen2-MoE / Qwen3-MoE): ``p = softmax(router(x))`` over all experts, the top-k kept; with
  ``norm_topk_prob`` they are renormalised to sum to 1 (Mixtral always, which equals a softmax over the top-k
  logits; Qwen2-MoE as its config says).
- sigmoid with expert groups (DeepSeek-V3, "noaux_tc"): ``s = sigmoid(router(x))``; experts are chosen on
  ``s + e_score_correction_bias`` (the load-balancing bias, used for the choice only) among the ``topk_group`` of
  ``n_group`` groups whose two best experts score highest; the chosen ``s`` are renormalised (``norm_topk_prob``)
  and multiplied by ``routed_scaling_factor``.

Shared experts run on every token: Qwen2-MoE's behind a per-token sigmoid gate, DeepSeek's ungated.

``MoE.forward`` runs the grouped expert loop (``grouped_experts``), the reference: each expert hit by the batch
multiplies the rows routed to it (one gather, two matrix products, one weighted scatter-add); a compiled step calls
it as one opaque operator (``workbench::moe_experts``). A decode step therefore reads only the experts its batch
routes to: the distinct experts of B tokens (``workbench.roofline.expected_distinct_experts``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.config import ModelConfig
from workbench.device import graph_op
from workbench.model.layers import SwiGLU


def route(
    logits: torch.Tensor,  # (T, E) router logits
    cfg: ModelConfig,
    correction_bias: torch.Tensor | None = None,  # (E,) DeepSeek-V3's selection bias
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) fp32, expert ids (T, k) int64) of each token's top-k experts under ``cfg``'s routing."""
    k = cfg.num_experts_per_tok
    if cfg.router_scoring == "softmax":
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, k, dim=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    scores = torch.sigmoid(logits.float())  # (T, E)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    t, e = choice.shape
    groups = choice.view(t, cfg.n_group, e // cfg.n_group)
    group_score = groups.topk(min(2, e // cfg.n_group), dim=-1).values.sum(dim=-1)  # (T, n_group)
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(cfg.topk_group, dim=-1).indices, True)
    choice = choice.masked_fill(~keep.repeat_interleave(e // cfg.n_group, dim=1), float("-inf"))
    ids = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


def grouped_experts(
    x: torch.Tensor,  # (T, hidden)
    weights: torch.Tensor,  # (T, k) fp32
    ids: torch.Tensor,  # (T, k)
    w_gate_up: torch.Tensor,  # (E, 2I, hidden)
    w_down: torch.Tensor,  # (E, hidden, I)
) -> torch.Tensor:
    """Sum over each token's experts of weight * SwiGLU expert(x): each expert hit by the batch multiplies the rows
    routed to it (one gather, two matrix products, one weighted scatter-add). (T, hidden)."""
    out = torch.zeros_like(x)
    flat = ids.reshape(-1)  # (T*k,): token t's j-th expert at t*k + j
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
    token_of = order // ids.shape[1]  # (T*k,) the token of each sorted assignment
    w_sorted = weights.reshape(-1)[order]
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue  # an expert no token chose is never read
        rows = token_of[start : start + n]
        gate, up = F.linear(x[rows], w_gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[expert])  # (n, hidden)
        out.index_add_(0, rows, (y * w_sorted[start : start + n, None]).to(x.dtype))
        start += n
    return out


# ``grouped_experts`` as one operator of a compiled step (its loop runs over the experts the batch routes to, which no
# graph can trace without a guard on the routing)
moe_experts = graph_op(
    "workbench::moe_experts",
    "(Tensor x, Tensor weights, Tensor ids, Tensor w_gate_up, Tensor w_down) -> Tensor",
    grouped_experts,
    lambda x, weights, ids, w_gate_up, w_down: torch.empty_like(x),
)


class MoE(nn.Module):
    """Router + ``num_experts`` SwiGLU experts (weights stacked: ``w_gate_up`` (E, 2I, hidden), ``w_down``
    (E, hidden, I)) + the optional shared expert. ``forward``: (T, hidden) -> (T, hidden)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = nn.Linear(h, e, bias=False)  # the router
        if cfg.router_scoring == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(e))
        else:
            self.e_score_correction_bias = None
        self.w_gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w_down = nn.Parameter(torch.empty(e, h, i))
        self.shared_expert = (
            SwiGLU(h, cfg.shared_expert_intermediate_size) if cfg.shared_expert_intermediate_size else None
        )
        self.shared_expert_gate = nn.Linear(h, 1, bias=False) if cfg.shared_expert_gated else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> (weights (T, k) fp32, ids (T, k))."""
        logits = F.linear(x.float(), self.gate.weight.float()) if self.cfg.router_scoring == "sigmoid" else self.gate(x)
        return route(logits, self.cfg, self.e_score_correction_bias)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The grouped expert loop (``grouped_experts``): sum over each token's experts of weight * expert(x).
        x: (T, hidden). Under ``torch.compile`` an opaque operator: the loop's shapes depend on the routing."""
        if torch.compiler.is_compiling():
            return moe_experts(x, weights, ids, self.w_gate_up, self.w_down)
        return grouped_experts(x, weights, ids, self.w_gate_up, self.w_down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert.forward(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


# ---- HF checkpoints: per-expert tensors of Mixtral, Qwen2-MoE and DeepSeek-V3 -> the stacked ones ---------------
def _hf_names(cfg: ModelConfig, layer: int) -> tuple[str, tuple[str, str, str]]:
    """(MLP prefix, expert tensor names (gate, up, down)) of one layer in the checkpoint; the router is ``gate``."""
    if cfg.architecture == "MixtralForCausalLM":
        return f"model.layers.{layer}.block_sparse_moe.", ("w1", "w3", "w2")
    return f"model.layers.{layer}.mlp.", ("gate_proj", "up_proj", "down_proj")


def _shared_prefix(cfg: ModelConfig) -> str:
    return "shared_experts." if cfg.architecture == "DeepseekV3ForCausalLM" else "shared_expert."


def hf_moe_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and shapes of one MoE layer's MLP."""
    p, (g, u, d) = _hf_names(cfg, layer)
    h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (e, h)}
    if cfg.router_scoring == "sigmoid":
        shapes[p + "gate.e_score_correction_bias"] = (e,)
    for x in range(e):
        shapes |= {p + f"experts.{x}.{g}.weight": (i, h), p + f"experts.{x}.{u}.weight": (i, h),
                   p + f"experts.{x}.{d}.weight": (h, i)}  # fmt: skip
    si = cfg.shared_expert_intermediate_size
    if si:
        s = p + _shared_prefix(cfg)
        shapes |= {s + "gate_proj.weight": (si, h), s + "up_proj.weight": (si, h), s + "down_proj.weight": (h, si)}
    if cfg.shared_expert_gated:
        shapes[p + "shared_expert_gate.weight"] = (1, h)
    return shapes


def moe_state(cfg: ModelConfig, layer: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our ``layers.{layer}.mlp.*`` parameters and buffers from the checkpoint's tensors of that layer."""
    p, (g, u, d) = _hf_names(cfg, layer)
    o = f"layers.{layer}.mlp."
    e = range(cfg.num_experts)
    state = {
        o + "gate.weight": tensors[p + "gate.weight"],
        o + "w_gate_up": torch.stack(
            [torch.cat((tensors[p + f"experts.{x}.{g}.weight"], tensors[p + f"experts.{x}.{u}.weight"])) for x in e]
        ),
        o + "w_down": torch.stack([tensors[p + f"experts.{x}.{d}.weight"] for x in e]),
    }
    if cfg.router_scoring == "sigmoid":
        state[o + "e_score_correction_bias"] = tensors[p + "gate.e_score_correction_bias"]
    if cfg.shared_expert_intermediate_size:
        s = p + _shared_prefix(cfg)
        state[o + "shared_expert.gate_up_proj.weight"] = torch.cat(
            (tensors[s + "gate_proj.weight"], tensors[s + "up_proj.weight"])
        )
        state[o + "shared_expert.down_proj.weight"] = tensors[s + "down_proj.weight"]
    if cfg.shared_expert_gated:
        state[o + "shared_expert_gate.weight"] = tensors[p + "shared_expert_gate.weight"]
    return state
