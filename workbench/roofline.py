"""Roofline model of a Llama-family decoder: FLOPs and bytes of every operation in prefill, decode or a mixed step.

For a ``ModelConfig``, a ``HardwareSpec`` and a step (some sequences prefilling a chunk of new tokens on top
of cached ones, others decoding one token), this module counts the floating-point operations and the bytes
moved to and from memory by each operation, places each on the hardware's roofline and predicts its time as
``max(flops / peak, bytes / bandwidth)``. A step's predicted time is the sum of its operations' times (the
kernels run one after another), which is a floor: real kernels reach neither ceiling exactly.

Counting conventions
--------------------
- A multiply-add is 2 FLOPs: a linear layer of ``in -> out`` features over ``N`` tokens is ``2 * in * out * N``.
- Per layer: ``attn_norm``, ``q_proj``, ``k_proj``, ``v_proj`` (with their biases when the model has them),
  ``rope`` (on Q and K; 3 FLOPs per element; the cos/sin tables are not counted), ``kv_write`` (new K and V
  into the cache), ``attn_scores`` (Q K^T), ``softmax``, ``attn_value`` (P V), ``o_proj``, ``attn_residual``,
  ``mlp_norm``, ``gate_proj``, ``up_proj``, ``act_mul`` (SiLU(gate) * up), ``down_proj``, ``mlp_residual``;
  each is reported summed over the layers. Once per model: ``embedding`` (a gather of one row per new token),
  ``final_norm`` and ``lm_head``, both on the last token of each sequence only (every sequence in a step is
  taken to produce logits).
- RMSNorm is 4 FLOPs per element (square, sum, scale by 1/rms, scale by weight); a residual add 1;
  SiLU(gate) * up 6 (negate, exp, add, divide for the sigmoid, times gate, times up); softmax 5 per
  score (max, subtract, exp, sum, divide; the 1/sqrt(head_dim) scale is folded into Q).
- Causal attention counts only the lower triangle: a sequence with ``p`` cached tokens and ``n`` new ones has
  ``n * p + n * (n + 1) / 2`` (query, key) pairs (new token ``i`` sees the ``p`` cached keys and the ``i + 1``
  new keys up to itself); ``attn_scores`` and ``attn_value`` are each ``2 * num_heads * head_dim`` FLOPs per
  pair. Decode at context length ``L`` is the case ``n = 1, p = L - 1``: ``L`` pairs.
- Attention is one fused kernel (FlashAttention / paged-attention style): scores and probabilities stay on
  chip. It reads Q (activations), reads each sequence's K and V once from the cache (``p + n`` tokens of
  ``num_kv_heads * head_dim`` each, in the KV dtype: so KV bytes read in decode scale with the number of KV
  heads, not query heads), and writes the output; ``softmax`` writes only the fp32 log-sum-exp per head and
  query row. Every other operation reads its inputs and writes its outputs through memory once (no fusion),
  and each weight is read once per step (perfect reuse across the step's tokens).
- Bytes are split into weights, KV cache and activations (``weight_bytes``, ``kv_bytes``, ``act_bytes``).
- Mixture of experts: an MoE layer's MLP is ``router`` (plus Qwen2-MoE's shared-expert gate), ``expert_gate_proj``,
  ``expert_up_proj``, ``expert_act_mul``, ``expert_down_proj`` (``k`` experts per token: FLOPs from the active
  parameters) and the shared expert's ``shared_*`` ops; a routed expert's weights are read once per expected distinct
  expert of the step, ``E (1 - (1 - k/E)^T)`` for ``T`` new tokens (``distinct_experts_per_gpu``), so decode bytes
  are the active weights' at batch 1 and tend to the total. Dense layers of an MoE model keep ``gate_proj`` ... The
  top-k selection and the weighted sum of the ``k`` outputs are not counted (``2 k h`` per token). A routed expert's
  product runs ``T k / distinct`` rows (its matrix-product efficiency under a calibration).
- MLA (``kv_lora_rank > 0``), in the absorbed form the paged model runs for prefill and decode alike: ``q_a_proj``,
  ``q_a_norm``, ``q_b_proj`` (or ``q_proj``), ``kv_a_proj``, ``kv_a_norm``, ``q_absorb`` (W_UK per head),
  ``attn_scores`` over the ``r + dr`` latent entry (``2 heads (r + dr)`` per pair), ``attn_value`` over its ``r``
  latent values (``2 heads r``; the entry is read once, by ``attn_scores``), ``v_absorb`` (W_UV), ``o_proj``.
- Peaks: matmuls (projections, LM head, attention products) run at ``hw.peak(act_dtype)``; norms, rope,
  softmax, the activation and residual adds at the vector peak (``hw.vector_flops``, the fp32 figure).

Parallelism, calibration and formats
------------------------------------
- ``tensor_parallel_size`` x ``pipeline_parallel_size``: the table is one GPU's (``Shard``: its share of the heads,
  the intermediate size and the vocabulary; the layers of the largest stage) and the step's ``time_s`` is its wall
  time on the whole group: communication ops ``tp_all_reduce`` (after O and after down in each layer, ring:
  ``base + 2 (n-1) hop + 2 (n-1)/n bytes / bandwidth``, ``workbench.hardware.ring_all_reduce_time``),
  ``lm_head_gather`` (the vocabulary-split logits, a ring all-gather), ``pp_send`` (activations between stages)
  and ``pipeline_bubble`` (the other stages' time: a step is one batch through every stage in turn); with
  disaggregation, ``kv_transfer`` (``kv_transfer_op``). Interconnects come from ``accelerators.yaml``.
- ``expert_parallel_size`` (MoE, TP 1): a stage is that many GPUs, attention data-parallel over them (the step's
  sequences spread evenly: each statistic's coefficient divided by ``ep``), each GPU holding every non-expert weight
  and ``E / ep`` experts per layer and reading ``1 / ep`` of the distinct ones; ``moe_all_to_all`` is the dispatch and
  the combine of each MoE layer (``Interconnect.all_to_all_s`` of ``tokens / ep x k x hidden`` values per GPU).
- ``calibration`` (``workbench.hardware.Calibration``; None = the ideal roofline above): a matrix product over
  ``M`` rows reaches ``max * M / (M + half)`` of the peak (a weight-only int8/int4 product with ``half`` at most
  ``WEIGHT_ONLY_TILE_ROWS``), memory streams at ``memory_efficiency``, no kernel is
  shorter than ``kernel_floor_s`` (its ``bound`` then reads ``floor``), every kernel adds ``kernel_latency_s`` (its
  fixed cost: launch, first-wave ramp-up, tail) to that, and ``step_overhead`` adds the host's time.
- ``dtype`` is the activations'; ``quantization`` the linear weights' (bytes by ``quantized_matrix_bytes``, scales
  included; int8/int4 weight-only, fp8 computing at the FP8 peak, an error without one); ``kv_dtype`` the cache's
  (bytes by ``ModelConfig.kv_bytes_per_token``, int8's per-token scales included), so the simulator's pool and
  every byte count here agree.

The fast path (``RooflineModel.step_time``/``time_from_stats``) reduces a step to four sums (new tokens,
sequences, attended pairs, context tokens read) and evaluates precomputed per-operation coefficients, so the
serving simulator can call it hundreds of thousands of times; ``step_cost(..., detailed=True)`` builds the
per-operation table, and ``reference_step_cost`` recounts it sequence by sequence, operation by operation.
This module imports neither torch nor matplotlib.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from workbench.config import (
    DEFAULT_GROUP_SIZE,
    KV_CACHE_DTYPES,
    ModelConfig,
    canonical_dtype,
    canonical_quantization,
    ceil_div,
    dtype_bytes,
    quantized_matrix_bytes,
    resolve_kv_cache_dtype,
)
from workbench.errors import ConfigError
from workbench.hardware import IDEAL, Calibration, HardwareSpec, get_hardware

LAYER_OPS = (
    "attn_norm", "q_proj", "k_proj", "v_proj", "rope", "kv_write", "attn_scores", "softmax", "attn_value",
    "o_proj", "attn_residual", "mlp_norm", "gate_proj", "up_proj", "act_mul", "down_proj", "mlp_residual",
)  # fmt: skip
MODEL_OPS = ("embedding", "final_norm", "lm_head")
MATMUL_OPS = frozenset({"q_proj", "k_proj", "v_proj", "attn_scores", "attn_value", "o_proj", "gate_proj",
                        "up_proj", "down_proj", "lm_head", "q_a_proj", "q_b_proj", "kv_a_proj", "q_absorb",
                        "v_absorb", "router", "expert_gate_proj", "expert_up_proj", "expert_down_proj",
                        "shared_gate_proj", "shared_up_proj", "shared_down_proj"})  # fmt: skip
# the operations an MLA attention and an MoE layer add (beside LAYER_OPS' dense ones they replace)
MLA_OPS = ("q_a_proj", "q_a_norm", "q_b_proj", "kv_a_proj", "kv_a_norm", "q_absorb", "v_absorb")
MOE_OPS = ("router", "expert_gate_proj", "expert_up_proj", "expert_act_mul", "expert_down_proj", "shared_gate_proj",
           "shared_up_proj", "shared_act_mul", "shared_down_proj")  # fmt: skip
NORM_FLOPS_PER_ELEMENT = 4
ROPE_FLOPS_PER_ELEMENT = 3
SOFTMAX_FLOPS_PER_SCORE = 5
ACT_MUL_FLOPS_PER_ELEMENT = 6
RESIDUAL_FLOPS_PER_ELEMENT = 1
LSE_BYTES = 4  # fp32 log-sum-exp per head and query row, written by a fused attention kernel

# statistics of a step that every operation's cost is linear in
STAT_NAMES = ("tokens", "seqs", "pairs", "context")


def linear_flops(in_features: int, out_features: int, num_tokens: int) -> int:
    """FLOPs of ``y = x W^T`` for ``num_tokens`` rows: 2 per multiply-add."""
    return 2 * in_features * out_features * num_tokens


def attended_pairs(num_new: int, num_cached: int) -> int:
    """(query, key) pairs of causal attention for ``num_new`` tokens after ``num_cached`` cached ones."""
    return num_new * num_cached + num_new * (num_new + 1) // 2


@dataclass(frozen=True)
class OpCost:
    """One operation, summed over the layers (``count``), on one hardware."""

    name: str
    flops: float
    weight_bytes: float
    kv_bytes: float
    act_bytes: float
    time_s: float
    bound: str  # "compute", "memory", "floor" (the kernel floor), "link" (communication), "idle", "host"
    count: int = 1
    link_bytes: float = 0.0  # bytes this GPU sends over its interconnect (communication ops)

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.act_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved (0 for an operation that neither computes nor touches memory: communication,
        waiting, host time)."""
        if not self.bytes:
            return math.inf if self.flops else 0.0
        return self.flops / self.bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "flops": self.flops,
            "bytes": self.bytes,
            "intensity": self.intensity,
            "bound": self.bound,
            "time_s": self.time_s,
            "weight_bytes": self.weight_bytes,
            "kv_bytes": self.kv_bytes,
            "act_bytes": self.act_bytes,
            "count": self.count,
            "link_bytes": self.link_bytes,
        }


@dataclass(frozen=True)
class StepCost:
    """Totals of one step; ``ops`` holds the per-operation table when it was asked for."""

    flops: float
    weight_bytes: float
    kv_bytes: float
    act_bytes: float
    time_s: float
    compute_time_s: float  # sum over ops of flops / peak
    memory_time_s: float  # total bytes / bandwidth
    num_tokens: int
    num_seqs: int
    ops: tuple[OpCost, ...] | None = None
    link_bytes: float = 0.0  # bytes one GPU sends over its interconnect in the step
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.act_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte of the whole step."""
        return self.flops / self.bytes if self.bytes else math.inf

    @property
    def bound(self) -> str:
        return "compute" if self.compute_time_s >= self.memory_time_s else "memory"

    def bytes_by_kind(self) -> dict[str, float]:
        """Where the step's bytes go: weights, KV cache, activations."""
        return {"weights": self.weight_bytes, "kv": self.kv_bytes, "activations": self.act_bytes}

    def to_dict(self) -> dict[str, Any]:
        """The JSON of one phase: flops, bytes, time_s, intensity, ops (and more keys for reading)."""
        return {
            "flops": self.flops,
            "bytes": self.bytes,
            "time_s": self.time_s,
            "intensity": self.intensity,
            "bound": self.bound,
            "compute_time_s": self.compute_time_s,
            "memory_time_s": self.memory_time_s,
            "weight_bytes": self.weight_bytes,
            "kv_bytes": self.kv_bytes,
            "act_bytes": self.act_bytes,
            "num_tokens": self.num_tokens,
            "num_seqs": self.num_seqs,
            "link_bytes": self.link_bytes,
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "expert_parallel_size": self.expert_parallel_size,
            "ops": [op.to_dict() for op in self.ops or ()],
        }


def read_bandwidth(hw: HardwareSpec) -> float:
    """The memory read bandwidth (bytes/s) MBU divides by: a measured spec's measured read bandwidth (on CUDA the
    spec's ceiling is the copy bandwidth, its read bandwidth is in ``details``); a datasheet's bandwidth otherwise."""
    return float(hw.details.get("read_bandwidth", hw.mem_bandwidth))


def memory_bandwidth_utilization(read_bytes: float, seconds: float, hw: HardwareSpec) -> float:
    """MBU, the one definition every report uses: the bytes a step must read from memory, its weights and the KV
    cache it attends to (activations left out: they are small and mostly stay in caches), per second, over the
    memory read bandwidth (``read_bandwidth``)."""
    return read_bytes / seconds / read_bandwidth(hw)


@dataclass(frozen=True)
class Utilization:
    """How much of the hardware a measured step used."""

    measured_time_s: float
    achieved_flops_per_s: float
    achieved_bytes_per_s: float  # weight + KV bytes per second (what MBU counts)
    mfu: float  # achieved FLOP/s over the matmul peak of the dtype
    mbu: float  # memory_bandwidth_utilization: weight + KV bytes per second over the read bandwidth
    predicted_time_s: float

    def to_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Shard:
    """What one GPU of a tensor-parallel x pipeline-parallel group holds and computes (vLLM's sharding).

    Megatron-style tensor parallelism over ``tensor_parallel_size`` GPUs: Q, K, V, gate and up are split by output
    (column-parallel), O and down by input (row-parallel, one all-reduce after each); query heads are divided
    evenly, KV heads too, or replicated one per GPU when there are fewer KV heads than GPUs (vLLM's rule); the
    intermediate size is divided evenly; the LM head and the embedding table are split by vocabulary (vLLM's
    ``VocabParallelEmbedding`` / ``ParallelLMHead``, the vocabulary padded to a multiple of the group), and the
    logits are gathered. Pipeline parallelism over ``pipeline_parallel_size`` stages: consecutive layers per stage,
    ``ceil(layers / stages)`` on the largest, which paces the pipeline; the embedding on the first stage, the final
    norm and the LM head on the last (a tied head keeps its own copy there).
    """

    tensor_parallel_size: int
    pipeline_parallel_size: int
    num_heads: int  # query heads per GPU
    num_kv_heads: int  # KV heads per GPU (replicated when the model has fewer than the group)
    head_dim: int
    intermediate_size: int  # per GPU
    vocab_size: int  # vocabulary rows per GPU
    num_layers: int  # layers of the largest stage
    expert_parallel_size: int = 1  # GPUs per stage that split the routed experts (attention data-parallel over them)
    num_local_experts: int = 0  # routed experts each GPU holds
    moe_intermediate_size: int = 0  # one expert's intermediate size per GPU
    shared_expert_intermediate_size: int = 0  # per GPU

    @classmethod
    def of(
        cls, cfg: ModelConfig, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
        expert_parallel_size: int = 1,
    ) -> Shard:  # fmt: skip
        """The shard of ``cfg``; a ``ConfigError`` naming the dimension a group size does not divide, or the
        expert-parallel layout that cannot be (``check_expert_parallel``; EP runs with tensor_parallel_size 1)."""
        tp, pp, ep = tensor_parallel_size, pipeline_parallel_size, expert_parallel_size
        for fname, value in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{fname} must be a positive integer, got {value!r}")
        check_expert_parallel(cfg, ep)
        if ep > 1 and tp > 1:
            raise ConfigError(f"{cfg.name}: expert_parallel_size {ep} runs attention data-parallel over the EP "
                              f"ranks, one GPU each (DeepSeek-V3's layout); it needs tensor_parallel_size 1, got "
                              f"{tp}")  # fmt: skip
        if cfg.num_heads % tp:
            raise ConfigError(f"{cfg.name}: tensor_parallel_size {tp} does not divide its {cfg.num_heads} attention "
                              "heads")  # fmt: skip
        if not cfg.is_mla and cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
            raise ConfigError(f"{cfg.name}: tensor_parallel_size {tp} and its {cfg.num_kv_heads} KV heads: one must "
                              "divide the other")  # fmt: skip
        sizes = [("intermediate size", cfg.intermediate_size)]
        if cfg.is_moe:
            sizes += [("expert intermediate size", cfg.moe_intermediate_size),
                      ("shared expert intermediate size", cfg.shared_expert_intermediate_size)]  # fmt: skip
        for what, size in sizes:
            if size % tp:
                raise ConfigError(f"{cfg.name}: tensor_parallel_size {tp} does not divide its {what} {size}")
        if pp > cfg.num_layers:
            raise ConfigError(f"{cfg.name}: pipeline_parallel_size {pp} exceeds its {cfg.num_layers} layers")
        return cls(tp, pp, cfg.num_heads // tp, max(1, cfg.num_kv_heads // tp), cfg.head_dim,
                   cfg.intermediate_size // tp, ceil_div(cfg.vocab_size, tp), ceil_div(cfg.num_layers, pp), ep,
                   cfg.num_experts // ep, cfg.moe_intermediate_size // tp,
                   cfg.shared_expert_intermediate_size // tp)  # fmt: skip

    @property
    def num_gpus(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.expert_parallel_size

    def layer_counts(self, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        """Per kind of layer, (layers of it on the largest stage, in the model): 'layer' (every layer), 'dense'
        (a dense MLP), 'moe' (a mixture of experts). A kind's layers are taken as spread evenly over the stages
        (exact with one stage; DeepSeek-V3's three dense layers in fact all sit on the first)."""
        pp = self.pipeline_parallel_size
        moe = cfg.num_moe_layers
        dense = cfg.num_layers - moe
        return {"layer": (self.num_layers, cfg.num_layers), "dense": (ceil_div(dense, pp), dense),
                "moe": (ceil_div(moe, pp), moe)}  # fmt: skip

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        """(out, in) of each of a layer's weight matrices on one GPU: ``ModelConfig.linear_shapes`` of the shard's
        heads and intermediate size."""
        local = cfg.with_overrides(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                   intermediate_size=self.intermediate_size)  # fmt: skip
        return local.linear_shapes()

    def layer_weight_bytes(
        self, cfg: ModelConfig, dtype: str, quantization: str | None, group_size: int = DEFAULT_GROUP_SIZE
    ) -> dict[str, float]:
        """Bytes of each weight-reading operation of one layer on one GPU: the matrices under ``quantization``
        (scales included), biases and norm weights in ``dtype``."""
        a = dtype_bytes(dtype)
        if cfg.is_moe or cfg.is_mla:
            cfg.check_quantization(quantization, group_size)  # refused: these weights are counted in ``dtype``
            return {name: n * a for name, n in self._moe_mla_weight_params(cfg).items()}
        bias = a if cfg.attention_bias else 0
        out: dict[str, float] = {"attn_norm": cfg.hidden_size * a, "mlp_norm": cfg.hidden_size * a}
        for name, (o, i) in self.linear_shapes(cfg).items():
            if canonical_quantization(quantization) == "int4" and i % group_size:
                raise ConfigError(f"{cfg.name}: int4 group size {group_size} does not divide {name}'s input size {i} "
                                  f"on one of {self.tensor_parallel_size} GPUs")  # fmt: skip
            out[name] = quantized_matrix_bytes(o, i, quantization, dtype, group_size)
            if name in ("q_proj", "k_proj", "v_proj"):
                out[name] += o * bias
        return out

    def _moe_mla_weight_params(self, cfg: ModelConfig) -> dict[str, int]:
        """Parameters per weight-reading operation of one layer on one GPU, for an MoE and/or MLA model (Qwen3's
        ``qk_norm``: its q and k norm weights, replicated under TP): MLA's
        projections (``kv_b_proj`` split into its W_UK and W_UV halves, ``q_absorb`` and ``v_absorb``, as the
        absorbed form runs them), the dense MLP's, the router (with Qwen2-MoE's shared-expert gate) and the shared
        expert's; ``expert_*_proj`` are ONE routed expert's matrix (what a step reads per distinct expert)."""
        h, nh = cfg.hidden_size, self.num_heads
        out = {"attn_norm": h, "mlp_norm": h}
        if cfg.is_mla:
            r, dr, dn, dv, qd = (
                cfg.kv_lora_rank,
                cfg.qk_rope_head_dim,
                cfg.qk_nope_head_dim,
                cfg.v_head_dim,
                cfg.head_dim,
            )
            if cfg.q_lora_rank is None:
                out["q_proj"] = h * nh * qd
            else:
                qr = cfg.q_lora_rank
                out.update(q_a_proj=h * qr, q_a_norm=qr, q_b_proj=qr * nh * qd)
            out.update(kv_a_proj=h * (r + dr), kv_a_norm=r, q_absorb=nh * dn * r, v_absorb=nh * dv * r,
                       o_proj=nh * dv * h)  # fmt: skip
        else:
            for name, (o, i) in self.linear_shapes(cfg).items():
                if name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    out[name] = o * i + (o if cfg.attention_bias and name != "o_proj" else 0)
            if cfg.qk_norm:
                out["qk_norm"] = 2 * cfg.head_dim
        inter = self.intermediate_size
        out.update(gate_proj=inter * h, up_proj=inter * h, down_proj=inter * h)
        if cfg.is_moe:
            e, mi, si = cfg.num_experts, self.moe_intermediate_size, self.shared_expert_intermediate_size
            out["router"] = (
                h * e + (e if cfg.router_scoring == "sigmoid" else 0) + (h if cfg.shared_expert_gated else 0)
            )
            out.update(expert_gate_proj=mi * h, expert_up_proj=mi * h, expert_down_proj=mi * h)
            if si:
                out.update(shared_gate_proj=si * h, shared_up_proj=si * h, shared_down_proj=si * h)
        return out

    def _layer_held_params(self, cfg: ModelConfig, layer: int) -> int:
        """Parameters of ``layer`` one GPU holds: its attention shard, the norms, and its dense MLP shard or its
        router, its ``num_local_experts`` routed experts and the shared expert's shard."""
        w = self._moe_mla_weight_params(cfg)
        mlp = ("gate_proj", "up_proj", "down_proj")
        experts = ("expert_gate_proj", "expert_up_proj", "expert_down_proj")
        moe = ("router", "shared_gate_proj", "shared_up_proj", "shared_down_proj")
        held = sum(n for name, n in w.items() if name not in (*mlp, *experts, *moe))
        if cfg.is_moe_layer(layer):
            return held + sum(w.get(name, 0) for name in moe) + self.num_local_experts * sum(w[x] for x in experts)
        return held + sum(w[name] for name in mlp)

    def lm_head_bytes(self, cfg: ModelConfig, dtype: str, quantization: str | None, group_size: int) -> float:
        """The LM head's rows on one GPU under ``quantization`` (a tied head: a quantized copy of the table), or
        unquantized in ``dtype``."""
        if canonical_quantization(quantization) is None:
            return self.vocab_size * cfg.hidden_size * dtype_bytes(dtype)
        return quantized_matrix_bytes(self.vocab_size, cfg.hidden_size, quantization, dtype, group_size)

    def weight_bytes(
        self, cfg: ModelConfig, dtype: str = "bf16", quantization: str | None = None,
        group_size: int = DEFAULT_GROUP_SIZE,
    ) -> int:  # fmt: skip
        """Weight bytes of the most loaded GPU (equal to ``cfg.weight_bytes`` for one GPU). An MoE / MLA model is
        counted stage by stage, layer by layer (``_layer_held_params``): under expert parallelism each GPU holds
        every non-expert weight and ``num_experts / expert_parallel_size`` routed experts per MoE layer."""
        a = dtype_bytes(dtype)
        embedding = self.vocab_size * cfg.hidden_size * a
        head = self.lm_head_bytes(cfg, dtype, quantization, group_size)
        # an unquantized tied head is the embedding table itself; a quantized one is a copy held beside it
        shares_table = cfg.tie_word_embeddings and canonical_quantization(quantization) is None
        if cfg.is_moe or cfg.is_mla:
            cfg.check_quantization(quantization, group_size)
            per_stage, pp = [], self.pipeline_parallel_size
            for stage in range(pp):
                layers = range(stage * self.num_layers, min(cfg.num_layers, (stage + 1) * self.num_layers))
                total = sum(self._layer_held_params(cfg, i) for i in layers) * a
                total += embedding if stage == 0 else 0
                if stage == pp - 1:
                    total += cfg.hidden_size * a + (0 if shares_table and pp == 1 else head)
                per_stage.append(total)
            return int(max(per_stage))
        layer = sum(self.layer_weight_bytes(cfg, dtype, quantization, group_size).values())
        last = cfg.hidden_size * a + head  # final norm + LM head
        if self.pipeline_parallel_size == 1:
            ends = embedding + last - (head if shares_table else 0)
        else:
            ends = max(embedding, last)
        return int(self.num_layers * layer + ends)

    def kv_bytes_per_token(self, cfg: ModelConfig, kv_dtype: str = "bf16") -> int:
        """KV bytes one GPU caches per token: its layers x its KV heads (int8 scales included); MLA's one latent
        entry per layer is replicated on every GPU of a tensor-parallel group (shared by all heads)."""
        if cfg.is_mla:
            return cfg.kv_bytes_per_token(kv_dtype) // cfg.num_layers * self.num_layers
        per_head_layer = cfg.kv_bytes_per_token(kv_dtype) // (2 * cfg.num_layers * cfg.num_kv_heads)
        return 2 * self.num_layers * self.num_kv_heads * per_head_layer


def _op_coefficients(
    cfg: ModelConfig, shard: Shard, weights: dict[str, float], head_bytes: float, a: int, kv_token: float
) -> dict[str, tuple[tuple[float, ...], ...]]:
    """Per operation on ONE GPU, for ONE layer (or once per model): coefficients on (1, tokens, seqs, pairs,
    context) of (flops, weight_bytes, kv_bytes, act_bytes).

    tokens: new tokens in the step; seqs: sequences; pairs: attended (query, key) pairs;
    context: tokens whose K and V are read (cached + new, per sequence). ``weights``: bytes of each weight-reading
    op of a layer; ``head_bytes``: the LM head's; ``kv_token``: bytes of one token's K (or V) in one layer.
    A routed expert's weights are not here (``_expert_weight_bytes``: they scale with the distinct experts).
    Under expert parallelism the step's sequences are spread evenly over the ``ep`` GPUs (attention is data
    parallel): every statistic's coefficient is divided by ``ep``.
    """
    h, q, kv, inter, v = cfg.hidden_size, shard.q_size, shard.kv_size, shard.intermediate_size, shard.vocab_size
    nh = shard.num_heads
    bias = 1 if cfg.attention_bias else 0
    zero = (0, 0, 0, 0, 0)

    def per_token(x: float) -> tuple[float, ...]:
        return (0, x, 0, 0, 0)

    def const(x: float) -> tuple[float, ...]:
        return (x, 0, 0, 0, 0)

    def proj(name: str, in_f: int, out_f: int, has_bias: int) -> tuple[tuple[float, ...], ...]:
        flops = per_token(2 * in_f * out_f + has_bias * out_f)
        return flops, const(weights[name]), zero, per_token((in_f + out_f) * a)

    def norm(name: str, size: int = h) -> tuple[tuple[float, ...], ...]:
        return per_token(NORM_FLOPS_PER_ELEMENT * size), const(weights[name]), zero, per_token(2 * size * a)

    def act_mul(size: float) -> tuple[tuple[float, ...], ...]:
        return per_token(ACT_MUL_FLOPS_PER_ELEMENT * size), zero, zero, per_token(3 * size * a)

    def per_head(name: str, in_f: int, out_f: int) -> tuple[tuple[float, ...], ...]:  # one in x out matrix per head
        return per_token(2 * nh * in_f * out_f), const(weights[name]), zero, per_token(nh * (in_f + out_f) * a)

    residual = (per_token(RESIDUAL_FLOPS_PER_ELEMENT * h), zero, zero, per_token(3 * h * a))
    if cfg.is_mla:
        # absorbed form (workbench.model.mla, what the paged model runs in prefill and decode): an MQA of head size
        # r + dr over the latent entries, W_UK folded into the query, W_UV applied to the output
        r, dr, dn, dv, qd = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.head_dim
        attention = {"attn_norm": norm("attn_norm")}
        if cfg.q_lora_rank is None:
            attention["q_proj"] = proj("q_proj", h, nh * qd, 0)
        else:
            qr = cfg.q_lora_rank
            attention.update(q_a_proj=proj("q_a_proj", h, qr, 0), q_a_norm=norm("q_a_norm", qr),
                             q_b_proj=proj("q_b_proj", qr, nh * qd, 0))  # fmt: skip
        entry = 2 * kv_token  # one latent + rope entry per token and layer (V is a view of it: read once)
        attention.update({
            "kv_a_proj": proj("kv_a_proj", h, r + dr, 0),
            "kv_a_norm": norm("kv_a_norm", r),
            "rope": (per_token(ROPE_FLOPS_PER_ELEMENT * (nh + 1) * dr), zero, zero, per_token(2 * (nh + 1) * dr * a)),
            "kv_write": (zero, zero, per_token(entry), per_token((r + dr) * a)),
            "q_absorb": per_head("q_absorb", dn, r),
            "attn_scores": ((0, 0, 0, 2 * nh * (r + dr), 0), zero, (0, 0, 0, 0, entry), per_token(nh * (r + dr) * a)),
            "softmax": ((0, 0, 0, SOFTMAX_FLOPS_PER_SCORE * nh, 0), zero, zero, per_token(LSE_BYTES * nh)),
            "attn_value": ((0, 0, 0, 2 * nh * r, 0), zero, zero, per_token(nh * r * a)),
            "v_absorb": per_head("v_absorb", r, dv),
            "o_proj": proj("o_proj", nh * dv, h, 0),
        })  # fmt: skip
    else:
        attention = {
            "attn_norm": norm("attn_norm"),
            "q_proj": proj("q_proj", h, q, bias),
            "k_proj": proj("k_proj", h, kv, bias),
            "v_proj": proj("v_proj", h, kv, bias),
            **({"qk_norm": norm("qk_norm", q + kv)} if cfg.qk_norm else {}),  # Qwen3: each head's q and k
            "rope": (per_token(ROPE_FLOPS_PER_ELEMENT * (q + kv)), zero, zero, per_token(2 * (q + kv) * a)),
            "kv_write": (zero, zero, per_token(2 * kv_token), per_token(2 * kv * a)),
            "attn_scores": ((0, 0, 0, 2 * q, 0), zero, (0, 0, 0, 0, kv_token), per_token(q * a)),
            "softmax": ((0, 0, 0, SOFTMAX_FLOPS_PER_SCORE * nh, 0), zero, zero, per_token(LSE_BYTES * nh)),
            "attn_value": ((0, 0, 0, 2 * q, 0), zero, (0, 0, 0, 0, kv_token), per_token(q * a)),
            "o_proj": proj("o_proj", q, h, 0),
        }
    layer = {**attention, "attn_residual": residual, "mlp_norm": norm("mlp_norm")}
    if cfg.num_moe_layers < cfg.num_layers:  # dense MLPs
        layer.update({
            "gate_proj": proj("gate_proj", h, inter, 0),
            "up_proj": proj("up_proj", h, inter, 0),
            "act_mul": act_mul(inter),
            "down_proj": proj("down_proj", inter, h, 0),
        })  # fmt: skip
    if cfg.is_moe:
        e, k, mi, si = (
            cfg.num_experts,
            cfg.num_experts_per_tok,
            shard.moe_intermediate_size,
            shard.shared_expert_intermediate_size,
        )
        gate = h if cfg.shared_expert_gated else 0
        layer["router"] = (per_token(2 * h * (e + (1 if gate else 0))), const(weights["router"]), zero,
                           per_token((h + e) * a))  # fmt: skip

        def routed(in_f: int, out_f: int) -> tuple[tuple[float, ...], ...]:  # k expert rows per token
            return per_token(k * 2 * in_f * out_f), zero, zero, per_token(k * (in_f + out_f) * a)

        layer.update(expert_gate_proj=routed(h, mi), expert_up_proj=routed(h, mi), expert_act_mul=act_mul(k * mi),
                     expert_down_proj=routed(mi, h))  # fmt: skip
        if si:
            layer.update(shared_gate_proj=proj("shared_gate_proj", h, si, 0),
                         shared_up_proj=proj("shared_up_proj", h, si, 0), shared_act_mul=act_mul(si),
                         shared_down_proj=proj("shared_down_proj", si, h, 0))  # fmt: skip
    layer["mlp_residual"] = residual
    per_seq = lambda x: (0, 0, x, 0, 0)
    model = {
        "embedding": (zero, per_token(h * a), zero, per_token(h * a)),
        "final_norm": (per_seq(NORM_FLOPS_PER_ELEMENT * h), const(h * a), zero, per_seq(2 * h * a)),
        "lm_head": (per_seq(2 * h * v), const(head_bytes), zero, per_seq((h + v) * a)),
    }
    out = {**layer, **model}
    ep = shard.expert_parallel_size
    if ep > 1:
        out = {name: tuple((c[0], *(x / ep for x in c[1:])) for c in coefs) for name, coefs in out.items()}
    return out


def _expert_weight_bytes(cfg: ModelConfig, weights: dict[str, float]) -> dict[str, float]:
    """Bytes one distinct routed expert adds to each expert operation of one layer on one GPU."""
    return (
        {name: weights[name] for name in ("expert_gate_proj", "expert_up_proj", "expert_down_proj")}
        if cfg.is_moe
        else {}
    )


def _op_kind(name: str) -> str:
    """Which layers an operation runs in (``Shard.layer_counts``' kinds), or 'model' (once per step)."""
    if name in MODEL_OPS:
        return "model"
    if name in ("gate_proj", "up_proj", "act_mul", "down_proj"):
        return "dense"
    if name == "router" or name.startswith(("expert_", "shared_")):
        return "moe"
    return "layer"


def _dot(coef: tuple[float, ...], x: tuple[float, ...]) -> float:
    return coef[0] * x[0] + coef[1] * x[1] + coef[2] * x[2] + coef[3] * x[3] + coef[4] * x[4]


def resolve_dtypes(
    dtype: str, act_dtype: str | None = None, kv_dtype: str | None = None, quantization: str | None = None
) -> tuple[str, str, str | None]:
    """(activations, KV cache, weight quantization) of a roofline.

    ``dtype`` is the activations' (vLLM's ``--dtype``): fp32, fp16 or bf16. For the older calls that named the
    weights' format there, ``dtype='fp8'`` or ``'int8'`` means that ``quantization`` with bf16 activations (or
    ``act_dtype``). ``kv_dtype``: 'auto'/None (the activations'), 'fp8', 'int8' (``resolve_kv_cache_dtype``) or an
    explicit float dtype.
    """
    name = canonical_dtype(dtype)
    quant = canonical_quantization(quantization)
    if name in ("fp8", "int8"):
        if quant is not None and quant != name:
            raise ConfigError(f"dtype {dtype!r} names a weight format and quantization says {quantization!r}")
        quant, name = name, "bf16"
    act = canonical_dtype(act_dtype) if act_dtype is not None else name
    if act in ("fp8", "int8"):
        raise ConfigError(f"activation dtype must be fp32, fp16 or bf16, got {act_dtype!r}: FP8 compute is "
                          "--quantization fp8")  # fmt: skip
    if kv_dtype is None or str(kv_dtype).lower() in KV_CACHE_DTYPES:
        kv = resolve_kv_cache_dtype(kv_dtype, act)
    else:
        kv = canonical_dtype(kv_dtype)
    return act, kv, quant


@dataclass(frozen=True)
class StepWork:
    """What a step computes and moves, whatever the hardware: FLOPs and bytes by kind."""

    flops: float
    weight_bytes: float
    kv_bytes: float
    act_bytes: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.act_bytes


def _shard_coefficients(
    cfg: ModelConfig, shard: Shard, act: str, kv: str, quant: str | None, group_size: int
) -> tuple[dict[str, tuple[tuple[float, ...], ...]], dict[str, float]]:
    """The per-operation coefficients of one GPU and the bytes per distinct expert of its routed-expert ops."""
    weights = shard.layer_weight_bytes(cfg, act, quant, group_size)
    head = shard.lm_head_bytes(cfg, act, quant, group_size)
    kv_token = shard.kv_bytes_per_token(cfg, kv) / (2 * shard.num_layers)
    return _op_coefficients(cfg, shard, weights, head, dtype_bytes(act), kv_token), _expert_weight_bytes(cfg, weights)


def distinct_experts_per_gpu(cfg: ModelConfig, num_tokens: float, expert_parallel_size: int = 1) -> float:
    """Expected distinct routed experts one GPU reads in one MoE layer of a step of ``num_tokens`` tokens:
    ``expected_distinct_experts`` over the whole group, ``1 / expert_parallel_size`` of them on each GPU (0 for a
    dense model)."""
    if not cfg.is_moe or num_tokens <= 0:
        return 0.0
    e = cfg.num_experts
    return e * (1.0 - (1.0 - cfg.num_experts_per_tok / e) ** num_tokens) / expert_parallel_size


def step_work(
    cfg: ModelConfig,
    dtype: str = "bf16",
    prefill_chunks: Iterable[tuple[int, int]] = (),
    decode_contexts: Sequence[int] = (),
    kv_dtype: str | None = None,
    act_dtype: str | None = None,
    quantization: str | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> StepWork:
    """FLOPs and bytes of a step (prefill chunks ``(num_new, num_cached)``, decodes at context lengths) on one
    GPU, counted without any hardware spec: the same operation table ``RooflineModel`` prices."""
    act, kv, quant = resolve_dtypes(dtype, act_dtype, kv_dtype, quantization)
    shard = Shard.of(cfg)
    x = (1.0, *(float(v) for v in RooflineModel.batch_stats(prefill_chunks, decode_contexts)))
    totals = [0.0, 0.0, 0.0, 0.0]
    if x[1] > 0:
        counts = shard.layer_counts(cfg)
        per_op, expert_bytes = _shard_coefficients(cfg, shard, act, kv, quant, group_size)
        distinct = distinct_experts_per_gpu(cfg, x[1])
        for name, coefs in per_op.items():
            count = 1 if _op_kind(name) == "model" else counts[_op_kind(name)][1]
            for i, coef in enumerate(coefs):
                totals[i] += count * _dot(coef, x)
            totals[1] += count * distinct * expert_bytes.get(name, 0.0)
    return StepWork(*totals)


# rows of a matrix product, for its efficiency: 0 none (vector ops, communication), 1 tokens (linear), 2 sequences
# (LM head), 3 tokens (attention), 4 rows per expert; 5 and 6 the products of 1 and 2 over weight-only quantized
# (int8, int4) weights (``WEIGHT_ONLY_TILE_ROWS``)
_ROWS = {name: 1 for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
_ROWS.update({name: 1 for name in ("q_a_proj", "q_b_proj", "kv_a_proj", "q_absorb", "v_absorb", "router",
                                    "shared_gate_proj", "shared_up_proj", "shared_down_proj")})  # fmt: skip
_ROWS.update({"lm_head": 2, "attn_scores": 3, "attn_value": 3})
_ROWS.update({name: 4 for name in ("expert_gate_proj", "expert_up_proj", "expert_down_proj")})  # rows per expert
COMM_OPS = ("tp_all_reduce", "lm_head_gather", "pp_send", "moe_all_to_all")
# A weight-only quantized product (int8/int4 weights, bf16/fp16 activations: gpt-fast's tinygemm, Marlin, AWQ,
# exllama) is one kernel class whatever the rows: it streams each weight once, dequantises it in registers and feeds
# the tensor cores with the rows present in tiles of 16 (mma m16n8k16), so its compute ramps over one such tile, not
# over the tiles the GEMM library picks for a bf16 product (``linear_half_tokens``, fitted on prefills up to 64).
# Published: on an A10 (125 TFLOP/s FP16, 600 GB/s; FLOP/byte ~200) existing int4 kernels reach "relatively close to
# the optimal 3.87x" speedup over FP16 at batch size 1, and Marlin stays at it "up to batchsizes around 16-32"
# (IST-DASLab/marlin README, Benchmarks; Frantar et al. 2024, arXiv:2408.11743): memory-bound to ~16 rows, which a
# ramp of 64 rows (compute priced as 65 rows' at batch 1) contradicts. Its half-efficiency point is therefore at most
# this many rows.
WEIGHT_ONLY_TILE_ROWS = 16.0
WEIGHT_ONLY_QUANTIZATIONS = ("int8", "int4")


class RooflineModel:
    """Precomputed per-operation costs of one model on one GPU of a TP x PP group, with given dtypes.

    ``dtype``: activations (vLLM's ``--dtype``; 'fp8'/'int8' there are read as ``quantization`` for older callers);
    ``quantization``: the linear layers' weights (None, 'int8' or 'int4': weight-only, products at the activation
    peak; 'fp8': FP8 weights and products at the FP8 peak, an error on hardware without one); ``kv_dtype``: the KV
    cache ('auto' = activations, 'fp8', 'int8' with its per-token scales). ``calibration``: None or ``IDEAL`` is the
    ideal roofline, 'hardware' the spec's own (``accelerators.yaml``), or a ``Calibration``.

    A step's ``time_s`` is its wall time on the whole group: each operation of one GPU of the largest stage
    (sharded FLOPs and bytes), the tensor-parallel all-reduces after O and after down (ring, ``Interconnect``), the
    gather of the vocabulary-split logits, the activation sends between stages, and ``pipeline_bubble``: the time
    this GPU waits while the step's other stages run (a step is one batch through every stage in turn), plus the
    calibration's per-step host overhead.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        hw: HardwareSpec | str,
        dtype: str = "bf16",
        kv_dtype: str | None = None,
        act_dtype: str | None = None,
        quantization: str | None = None,
        group_size: int = DEFAULT_GROUP_SIZE,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        calibration: Calibration | str | None = None,
        expert_parallel_size: int = 1,
    ) -> None:
        self.cfg = cfg
        self.hw = get_hardware(hw)
        self.act_dtype, self.kv_dtype, self.quantization = resolve_dtypes(dtype, act_dtype, kv_dtype, quantization)
        self.dtype = self.quantization or self.act_dtype  # the weights' format, for reports
        self.group_size = group_size
        if self.quantization is not None:
            cfg.check_quantization(self.quantization, group_size)
        self.shard = shard = Shard.of(cfg, tensor_parallel_size, pipeline_parallel_size, expert_parallel_size)
        self.tensor_parallel_size = shard.tensor_parallel_size
        self.pipeline_parallel_size = shard.pipeline_parallel_size
        self.expert_parallel_size = ep = shard.expert_parallel_size
        if calibration is None:
            calibration = IDEAL
        elif isinstance(calibration, str):
            if calibration != "hardware":
                raise ConfigError(f"calibration must be None, 'hardware' or a Calibration, got {calibration!r}")
            calibration = self.hw.calibration
        self.calibration: Calibration = calibration
        if self.quantization == "fp8":
            if "fp8" not in self.hw.peak_flops:
                raise ConfigError(f"--quantization fp8 computes in FP8, and {self.hw.display_name or self.hw.name} has "
                                  "no FP8 tensor cores; use int8 or int4 (weight-only) there, or an FP8 part "
                                  "(h100-sxm, h200, l40s, ...)")  # fmt: skip
            self.matmul_peak = self.hw.peak_flops["fp8"]
        else:
            self.matmul_peak = self.hw.peak(self.act_dtype)
        self.vector_peak = self.hw.vector_flops
        self.bandwidth = self.hw.mem_bandwidth
        cal = self.calibration
        linear_max = cal.fp8_max if self.quantization == "fp8" else cal.linear_max
        self._curves = ((linear_max, cal.linear_half_tokens), (cal.attention_max, cal.attention_half_tokens))
        a = dtype_bytes(self.act_dtype)
        per_op, expert_bytes = _shard_coefficients(cfg, shard, self.act_dtype, self.kv_dtype, self.quantization,
                                                   group_size)  # fmt: skip
        self.op_names: tuple[str, ...] = tuple(per_op)
        layers, stage = cfg.num_layers, shard.num_layers
        self.stage_repeat = layers / stage  # wall time of a step = this many times a stage's layers
        counts = shard.layer_counts(cfg)
        self._moe_k = cfg.num_experts_per_tok
        bw = self.bandwidth * cal.memory_efficiency
        weight_eff = {"int8": cal.int8_weight_efficiency, "int4": cal.int4_weight_efficiency}.get(
            self.quantization or "", 1.0
        )
        quantized_ops = set(cfg.linear_shapes()) | {"lm_head"}  # a tied head: its quantized copy
        # (name, count, peak, flops coef, weight coef, kv coef, act coef, weight bytes per distinct expert),
        # coefficients already x count (ideal)
        self._ops: list[tuple[Any, ...]] = []
        # per term: (name, wall multiple, rows kind, flops/peak on the 5 stats, bytes/bandwidth on the 5 stats,
        # floor, bytes/bandwidth per distinct expert, fixed latency); a term's time is max(flops time x
        # 1/efficiency(rows), bytes time, floor) + latency, and the step's wall time the sum of multiple x time
        self._terms: list[tuple[str, float, int, tuple[float, ...], tuple[float, ...], float, float, float]] = []
        for name in self.op_names:
            kind = _op_kind(name)
            count, total = (1, 1) if kind == "model" else counts[kind]
            peak = self.matmul_peak if name in MATMUL_OPS else self.vector_peak
            fc, wc, kc, ac = (tuple(count * x for x in coef) for coef in per_op[name])
            ew = count * expert_bytes.get(name, 0.0)
            self._ops.append((name, count, peak, fc, wc, kc, ac, ew))
            bytes_coef = tuple(wc[i] + kc[i] + ac[i] for i in range(5))
            # no op's flops have a constant term and no op's bytes depend on pairs (see _op_coefficients)
            assert fc[0] == 0 and bytes_coef[3] == 0, name
            mult = total / count
            time_coef = tuple(x / bw for x in bytes_coef)
            if name in quantized_ops and weight_eff != 1.0:  # quantized weights stream slower
                time_coef = tuple((w / weight_eff + k + c) / bw for w, k, c in zip(wc, kc, ac))
            rows_kind = _ROWS.get(name, 0)
            if name in quantized_ops and self.quantization in WEIGHT_ONLY_QUANTIZATIONS and rows_kind in (1, 2):
                rows_kind += 4  # a weight-only kernel's tile (WEIGHT_ONLY_TILE_ROWS)
            self._terms.append((name, mult, rows_kind, tuple(x / peak for x in fc), time_coef,
                                count * cal.kernel_floor_s, ew / bw, count * cal.kernel_latency_s))  # fmt: skip
        # communication: times affine in the step's statistics (seconds on (1, tokens, seqs, pairs, context))
        self._comm: dict[str, tuple[int, float, tuple[float, ...], tuple[float, ...]]] = {}
        tp, pp = shard.tensor_parallel_size, shard.pipeline_parallel_size
        ic = self.hw.interconnect
        if (tp > 1 or pp > 1 or ep > 1) and ic is None:
            raise ConfigError(f"hardware {self.hw.name!r} has no interconnect in accelerators.yaml: it cannot run "
                              "tensor, pipeline or expert parallelism here")  # fmt: skip
        h = cfg.hidden_size
        if tp > 1:
            c0 = ic.all_reduce_s(0.0, tp)
            c1 = ic.all_reduce_s(1.0, tp) - c0  # seconds per byte
            count = 2 * stage  # after O and after down in each layer of the stage
            self._add_comm("tp_all_reduce", count, self.stage_repeat, (count * c0, count * c1 * h * a, 0, 0, 0),
                           (0, h * a * count, 0, 0, 0))  # fmt: skip
            g0 = ic.all_gather_s(0.0, tp)
            g1 = ic.all_gather_s(1.0, tp) - g0
            vocab = cfg.vocab_size * a
            self._add_comm("lm_head_gather", 1, 1.0, (g0, 0, g1 * vocab, 0, 0), (0, 0, vocab * (tp - 1) / tp, 0, 0))
        if pp > 1:
            cross = tp * pp > ic.gpus_per_node
            s0 = ic.send_s(0.0, cross)
            s1 = ic.send_s(1.0, cross) - s0
            self._add_comm("pp_send", pp - 1, 1.0, ((pp - 1) * s0, (pp - 1) * s1 * h * a, 0, 0, 0),
                           (0, (pp - 1) * h * a, 0, 0, 0))  # fmt: skip
        if ep > 1:
            # each MoE layer: dispatch each of this GPU's tokens' hidden states to its k experts' GPUs, and combine
            # their outputs back (two all-to-alls of tokens / ep x k x hidden values held per GPU)
            count, total = counts["moe"]
            t0 = ic.all_to_all_s(0.0, ep)
            t1 = ic.all_to_all_s(1.0, ep) - t0  # seconds per byte held
            held = self._moe_k * h * a / ep  # bytes per token of the step
            self._add_comm("moe_all_to_all", 2 * count, total / count, (2 * count * t0, 2 * count * t1 * held, 0, 0, 0),
                           (0, 2 * count * held * (ep - 1) / ep, 0, 0, 0))  # fmt: skip
        for name, (_count, mult, times, _bytes) in self._comm.items():
            self._terms.append((name, mult, 0, (0.0,) * 5, times, 0.0, 0.0, 0.0))
        if cal.step_overhead_s > 0:
            self._terms.append(("step_overhead", 1.0, 0, (0.0,) * 5, (cal.step_overhead_s, 0, 0, 0, 0), 0.0, 0.0, 0.0))
        self._fast = [(m, r, f[1], f[2], f[3], b[0], b[1], b[2], b[4], fl, be, lat)
                      for _n, m, r, f, b, fl, be, lat in self._terms]  # fmt: skip

    def _add_comm(
        self, name: str, count: int, mult: float, times: tuple[float, ...], link_bytes: tuple[float, ...]
    ) -> None:
        self._comm[name] = (count, mult, tuple(float(x) for x in times), tuple(float(x) for x in link_bytes))

    # ---- step statistics -------------------------------------------------------------------------------
    @property
    def stat_coefficients(self) -> list[tuple[tuple[float, ...], tuple[float, ...]]]:
        """Per operation of one GPU, its ideal compute and memory times (s) as coefficients on (1, tokens, seqs,
        pairs, context), no calibration and no communication (the ideal single-GPU roofline)."""
        return [(tuple(x / peak for x in fc), tuple((w + k + c) / self.bandwidth for w, k, c in zip(wc, kc, ac)))
                for _n, _c, peak, fc, wc, kc, ac, _ew in self._ops]  # fmt: skip

    def distinct_experts(self, tokens: float) -> float:
        """Expected distinct routed experts one GPU reads per MoE layer in a step of ``tokens`` new tokens (on the
        whole group: ``distinct_experts_per_gpu``)."""
        return distinct_experts_per_gpu(self.cfg, tokens, self.expert_parallel_size)

    def _factors(self, tokens: float, seqs: float, distinct: float = 0.0) -> tuple[float, ...]:
        """1 / efficiency of the products of a step, by rows kind (see ``_ROWS``): one GPU runs ``1 / ep`` of the
        tokens and sequences; a routed expert ``tokens * k / distinct experts`` rows (``distinct``: this GPU's); a
        weight-only quantized product ramps over at most ``WEIGHT_ONLY_TILE_ROWS``."""
        (lm, lh), (am, ah) = self._curves
        eff = Calibration.efficiency
        ep = self.expert_parallel_size
        t, s = tokens / ep, seqs / ep
        expert_rows = tokens * self._moe_k / (distinct * ep) if distinct > 0 else 1.0
        qh = min(lh, WEIGHT_ONLY_TILE_ROWS)
        return (1.0, 1.0 / eff(t, lm, lh), 1.0 / eff(s, lm, lh), 1.0 / eff(t, am, ah), 1.0 / eff(expert_rows, lm, lh),
                1.0 / eff(t, lm, qh), 1.0 / eff(s, lm, qh))  # fmt: skip

    @staticmethod
    def batch_stats(
        prefill_chunks: Iterable[tuple[int, int]] = (), decode_contexts: Iterable[int] = ()
    ) -> tuple[int, int, int, int]:
        """(tokens, seqs, pairs, context) of a step: prefill chunks are (num_new, num_cached); a decode at
        context length L is one new token with L - 1 cached (it attends to L keys)."""
        tokens = seqs = pairs = context = 0
        for chunk in prefill_chunks:
            n, p = int(chunk[0]), int(chunk[1])
            if n < 1 or p < 0:
                raise ConfigError(f"prefill chunk {tuple(chunk)!r}: need num_new >= 1 and num_cached >= 0")
            tokens += n
            seqs += 1
            pairs += attended_pairs(n, p)
            context += n + p
        decode = list(decode_contexts)
        if decode:
            if min(decode) < 1:
                raise ConfigError(f"decode context lengths must be >= 1, got {min(decode)}")
            total = sum(decode)
            tokens += len(decode)
            seqs += len(decode)
            pairs += total
            context += total
        return tokens, seqs, pairs, context

    def time_from_stats(self, tokens: float, seqs: float, pairs: float, context: float) -> float:
        """Predicted wall time of a step on the group from the four sums (the fast path: no per-op objects)."""
        if tokens <= 0:
            return 0.0
        d = self.distinct_experts(tokens)
        factors = self._factors(tokens, seqs, d)
        total = 0.0
        for mult, rows, f1, f2, f3, b0, b1, b2, b4, floor, be, lat in self._fast:
            tc = (f1 * tokens + f2 * seqs + f3 * pairs) * factors[rows]
            tb = b0 + b1 * tokens + b2 * seqs + b4 * context + be * d
            t = tc if tc > tb else tb
            total += mult * ((t if t > floor else floor) + lat)
        return total

    def decode_lines(self, num_seqs: int) -> list[tuple[float, tuple[tuple[float, float], ...]]]:
        """A pure-decode step of ``num_seqs`` sequences as a function of the context C it reads (pairs = context
        = C): per term ``(multiple, lines)`` with time ``multiple * max(a + b C for (a, b) in lines)`` (a kernel's
        fixed latency is in each line of its term)."""
        n = float(num_seqs)
        d = self.distinct_experts(n)
        factors = self._factors(n, n, d)
        out = []
        for mult, rows, f1, f2, f3, b0, b1, b2, b4, floor, be, lat in self._fast:
            lines = [((f1 + f2) * n * factors[rows] + lat, f3 * factors[rows]), (b0 + (b1 + b2) * n + be * d + lat, b4)]
            if floor > 0:
                lines.append((floor + lat, 0.0))
            out.append((mult, tuple(lines)))
        return out

    def step_time(self, prefill_chunks: Iterable[tuple[int, int]] = (), decode_contexts: Sequence[int] = ()) -> float:
        """Predicted time of a (possibly mixed) step, in seconds."""
        return self.time_from_stats(*self.batch_stats(prefill_chunks, decode_contexts))

    def step_cost(
        self,
        prefill_chunks: Iterable[tuple[int, int]] = (),
        decode_contexts: Sequence[int] = (),
        detailed: bool = True,
    ) -> StepCost:
        """FLOPs, bytes and time of a step, with the per-operation table when ``detailed``."""
        return self.cost_from_stats(*self.batch_stats(prefill_chunks, decode_contexts), detailed=detailed)

    def cost_from_stats(self, tokens: int, seqs: int, pairs: int, context: int, detailed: bool = True) -> StepCost:
        """One GPU's FLOPs and bytes (its stage, its shard) and the group's wall time, op by op."""
        x = (1.0, float(tokens), float(seqs), float(pairs), float(context))
        ops = []
        flops = wb = kb = ab = time_s = compute_s = bubble = link = 0.0
        if tokens > 0:
            d = self.distinct_experts(tokens)
            factors = self._factors(tokens, seqs, d)
            for (name, count, _peak, fc, wc, kc, ac, ew), term in zip(self._ops, self._terms):
                _n, mult, rows, ft, bt, floor, be, lat = term
                f, w_, k_, a_ = _dot(fc, x), _dot(wc, x) + ew * d, _dot(kc, x), _dot(ac, x)
                tc, tb = _dot(ft, x) * factors[rows], _dot(bt, x) + be * d
                t = max(tc, tb, floor) + lat
                bound = "floor" if floor > max(tc, tb) else ("compute" if tc >= tb else "memory")
                flops, wb, kb, ab = flops + f, wb + w_, kb + k_, ab + a_
                time_s += t
                bubble += (mult - 1.0) * t
                compute_s += f / _peak
                if detailed:
                    ops.append(OpCost(name, f, w_, k_, a_, t, bound, count))
            for name, (count, mult, times, link_bytes) in self._comm.items():
                t, lb = _dot(times, x), _dot(link_bytes, x)
                time_s += t
                bubble += (mult - 1.0) * t
                link += lb
                if detailed:
                    ops.append(OpCost(name, 0.0, 0.0, 0.0, 0.0, t, "link", count, link_bytes=lb))
            if self.pipeline_parallel_size > 1:
                time_s += bubble
                if detailed:
                    ops.append(OpCost("pipeline_bubble", 0.0, 0.0, 0.0, 0.0, bubble, "idle",
                                      self.pipeline_parallel_size - 1))  # fmt: skip
            overhead = self.calibration.step_overhead_s
            if overhead > 0:
                time_s += overhead
                if detailed:
                    ops.append(OpCost("step_overhead", 0.0, 0.0, 0.0, 0.0, overhead, "host"))
        return StepCost(
            flops=flops,
            weight_bytes=wb,
            kv_bytes=kb,
            act_bytes=ab,
            time_s=time_s,
            compute_time_s=compute_s,
            memory_time_s=(wb + kb + ab) / self.bandwidth,
            num_tokens=int(tokens),
            num_seqs=int(seqs),
            ops=tuple(ops) if detailed else None,
            link_bytes=link,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            expert_parallel_size=self.expert_parallel_size,
        )

    @property
    def num_kernels(self) -> int:
        """Kernels one GPU of the group runs in a step: every operation of every layer (a step passes through all
        the stages) and the model's own (embedding, final norm, LM head); collectives not counted. What a serving
        stack that launches each kernel from the host pays its per-kernel host time for."""
        return round(sum(count * mult for (_n, count, *_r), (_n2, mult, *_t) in zip(self._ops, self._terms)))

    # ---- memory -------------------------------------------------------------------------------------------
    def weight_bytes_per_gpu(self) -> int:
        """Weight bytes of the most loaded GPU of the group."""
        return self.shard.weight_bytes(self.cfg, self.act_dtype, self.quantization, self.group_size)

    def kv_bytes_per_token_per_gpu(self) -> int:
        """KV bytes one GPU caches per token (its layers, its KV heads, in the KV dtype)."""
        return self.shard.kv_bytes_per_token(self.cfg, self.kv_dtype)

    def check_memory(self, num_kv_tokens: int = 0, memory_utilization: float = 1.0) -> dict[str, float]:
        """Per-GPU weights + the KV of ``num_kv_tokens`` tokens (the group's: ``1 / expert_parallel_size`` of them
        on each GPU of an expert-parallel stage) against the GPU's memory; a ``ConfigError`` that names a
        tensor-parallel size that would fit when they do not."""
        weights = self.weight_bytes_per_gpu()
        kv = num_kv_tokens / self.expert_parallel_size * self.kv_bytes_per_token_per_gpu()
        capacity = self.hw.mem_capacity * memory_utilization
        report = {"weight_bytes_per_gpu": float(weights), "kv_bytes_per_gpu": float(kv),
                  "capacity_bytes": float(capacity), "free_bytes": float(capacity - weights - kv)}  # fmt: skip
        if weights + kv > capacity:
            gib = 2**30
            hint = ""
            for tp in (2, 4, 8, 16):
                if tp <= self.tensor_parallel_size:
                    continue
                try:
                    shard = Shard.of(self.cfg, tp, self.pipeline_parallel_size)
                except ConfigError:
                    continue
                need = (shard.weight_bytes(self.cfg, self.act_dtype, self.quantization, self.group_size)
                        + num_kv_tokens * shard.kv_bytes_per_token(self.cfg, self.kv_dtype))  # fmt: skip
                if need <= capacity:
                    hint = f"; --tensor-parallel-size {tp} would fit"
                    break
            raise ConfigError(
                f"{self.cfg.name} does not fit on {self.hw.name} at tensor_parallel_size {self.tensor_parallel_size},"
                f" pipeline_parallel_size {self.pipeline_parallel_size}, expert_parallel_size "
                f"{self.expert_parallel_size}: {weights / gib:.1f} GiB of weights "
                f"({self.dtype}) + {kv / gib:.2f} GiB of KV per GPU > {capacity / gib:.1f} GiB{hint}"
            )
        return report

    # ---- phases ---------------------------------------------------------------------------------------------
    def prefill(self, prompt_lens: Sequence[int], detailed: bool = True) -> StepCost:
        """Prefill of fresh prompts (nothing cached): the TTFT floor of this batch."""
        return self.step_cost([(n, 0) for n in prompt_lens], (), detailed=detailed)

    def decode(self, context_lens: Sequence[int], detailed: bool = True) -> StepCost:
        """One decode step, one new token per sequence at the given context lengths: the ITL floor."""
        return self.step_cost((), context_lens, detailed=detailed)

    def verify(self, context_lens: Sequence[int], num_spec_tokens: int, detailed: bool = True) -> StepCost:
        """A speculative decoding verify step: each sequence at context length ``L`` (as in ``decode``) runs its last
        token and ``num_spec_tokens`` (k) proposed ones, ``k + 1`` query tokens over its ``L - 1`` cached, through
        the same weights, with logits at all ``k + 1`` positions (the final norm and LM head on ``k + 1`` rows per
        sequence; ``num_seqs`` stays the sequences). ``k = 0`` is ``decode``."""
        if num_spec_tokens < 0:
            raise ConfigError(f"num_spec_tokens must be >= 0, got {num_spec_tokens}")
        lens = list(context_lens)
        n = num_spec_tokens + 1
        tokens, _, pairs, context = self.batch_stats([(n, L - 1) for L in lens], ())
        cost = self.cost_from_stats(tokens, tokens, pairs, context, detailed=detailed)  # logit rows = tokens
        return dataclasses.replace(cost, num_seqs=len(lens))

    def decode_compute_bound_batch(self, context_len: int) -> int | None:
        """Smallest batch at which a decode step at ``context_len`` is compute-bound in aggregate on one GPU
        (sum over ops of flops / peak >= total bytes / bandwidth, ideal ceilings); None if it never is (KV reads
        grow as fast as FLOPs, as happens with long contexts)."""
        if context_len < 1:
            raise ConfigError(f"context_len must be >= 1, got {context_len}")
        if self.cfg.is_moe:  # expert bytes grow with the distinct experts: search the batch where compute wins
            return self._moe_compute_bound_batch(context_len)
        # per-sequence costs are linear in the batch: tokens = seqs = B, pairs = context = B * L
        unit = (0.0, 1.0, 1.0, float(context_len), float(context_len))
        const = (1.0, 0.0, 0.0, 0.0, 0.0)
        compute_per_seq = mem_per_seq = mem_const = 0.0
        for _name, _count, peak, fc, wc, kc, ac, _ew in self._ops:
            compute_per_seq += _dot(fc, unit) / peak
            mem_per_seq += (_dot(wc, unit) + _dot(kc, unit) + _dot(ac, unit)) / self.bandwidth
            mem_const += (_dot(wc, const) + _dot(kc, const) + _dot(ac, const)) / self.bandwidth
        if compute_per_seq <= mem_per_seq:
            return None
        return max(1, math.ceil(mem_const / (compute_per_seq - mem_per_seq) - 1e-9))

    def _moe_compute_bound_batch(self, context_len: int, max_batch: int = 1 << 20) -> int | None:
        """``decode_compute_bound_batch`` of an MoE model: compute minus memory time is convex in the batch (the
        distinct experts are concave in it), so once positive it stays so; doubling, then bisection."""

        def compute_wins(batch: int) -> bool:
            x = (1.0, float(batch), float(batch), float(batch * context_len), float(batch * context_len))
            d = self.distinct_experts(batch)
            compute = sum(_dot(fc, x) / peak for _n, _c, peak, fc, _w, _k, _a, _e in self._ops)
            memory = sum(
                _dot(wc, x) + ew * d + _dot(kc, x) + _dot(ac, x) for _n, _c, _p, _f, wc, kc, ac, ew in self._ops
            )
            return compute >= memory / self.bandwidth

        hi = 1
        while not compute_wins(hi):
            if hi >= max_batch:
                return None
            hi *= 2
        lo = hi // 2  # compute does not win at lo (or lo is 0)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if compute_wins(mid) else (mid, hi)
        return hi

    def utilization(self, cost: StepCost, measured_time_s: float) -> Utilization:
        """MFU and MBU of a measured step whose work ``cost`` describes."""
        return utilization(cost, measured_time_s, self.hw, self.act_dtype)


def utilization(cost: StepCost, measured_time_s: float, hw: HardwareSpec | str, dtype: str = "bf16") -> Utilization:
    """Achieved FLOP/s and bytes/s of a step that took ``measured_time_s``, over the hardware's ceilings."""
    hw = get_hardware(hw)
    if not (measured_time_s > 0 and math.isfinite(measured_time_s)):
        raise ConfigError(f"measured_time_s must be a positive number, got {measured_time_s!r}")
    flops_per_s = cost.flops / measured_time_s
    read_bytes = cost.weight_bytes + cost.kv_bytes
    return Utilization(
        measured_time_s=measured_time_s,
        achieved_flops_per_s=flops_per_s,
        achieved_bytes_per_s=read_bytes / measured_time_s,
        mfu=flops_per_s / hw.peak(dtype),
        mbu=memory_bandwidth_utilization(read_bytes, measured_time_s, hw),
        predicted_time_s=cost.time_s,
    )


# ---- module-level conveniences (cached models) --------------------------------------------------------------
_MODELS: dict[tuple[Any, ...], RooflineModel] = {}


def _cfg_key(cfg: ModelConfig) -> tuple[Any, ...]:
    return (cfg.name, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias, cfg.tie_word_embeddings, cfg.num_experts,
            cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.router_scoring, cfg.shared_expert_intermediate_size,
            cfg.shared_expert_gated, cfg.dense_layers, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
            cfg.qk_nope_head_dim, cfg.v_head_dim)  # fmt: skip


def get_model(
    cfg: ModelConfig | str,
    hw: HardwareSpec | str,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    act_dtype: str | None = None,
    quantization: str | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    calibration: Calibration | str | None = None,
    expert_parallel_size: int = 1,
) -> RooflineModel:
    """A cached ``RooflineModel`` (model given as config or preset name/path, hardware as spec or name)."""
    if not isinstance(cfg, ModelConfig):
        cfg = ModelConfig.resolve(cfg)
    hw = get_hardware(hw)
    key = (_cfg_key(cfg), hw.name, tuple(sorted(hw.peak_flops.items())), hw.mem_bandwidth, dtype, kv_dtype,
           act_dtype, quantization, group_size, tensor_parallel_size, pipeline_parallel_size,
           calibration if not isinstance(calibration, str) else (calibration, hw.calibration),
           hw.interconnect, expert_parallel_size)  # fmt: skip
    model = _MODELS.get(key)
    if model is None:
        model = _MODELS[key] = RooflineModel(
            cfg, hw, dtype=dtype, kv_dtype=kv_dtype, act_dtype=act_dtype, quantization=quantization,
            group_size=group_size, tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size, calibration=calibration,
            expert_parallel_size=expert_parallel_size,
        )  # fmt: skip
    return model


def step_cost(
    model_cfg: ModelConfig | str,
    hw: HardwareSpec | str,
    prefill_chunks: Iterable[tuple[int, int]] = (),
    decode_contexts: Sequence[int] = (),
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    act_dtype: str | None = None,
    detailed: bool = True,
    **parallel: Any,
) -> StepCost:
    """Cost of one (possibly mixed) step: prefill chunks ``(num_new, num_cached)`` and decodes at context
    lengths ``L`` (attending to L keys, the new one included). See the module docstring for conventions;
    ``parallel``: ``quantization``, ``tensor_parallel_size``, ``pipeline_parallel_size``, ``expert_parallel_size``,
    ``calibration``."""
    model = get_model(model_cfg, hw, dtype=dtype, kv_dtype=kv_dtype, act_dtype=act_dtype, **parallel)
    return model.step_cost(prefill_chunks, decode_contexts, detailed=detailed)


def kv_transfer_op(sender: RooflineModel, num_tokens: int, receiver_gpus: int = 1) -> OpCost:
    """The KV of ``num_tokens`` prompt tokens moving from a prefill group to a decode group (disaggregation).

    Each GPU of the sending group sends its own shard (its layers, its KV heads) at once, over NVLink when both
    groups fit in one server and over its InfiniBand NIC otherwise: ``send_s(bytes per GPU)``."""
    ic = sender.hw.interconnect
    if ic is None:
        raise ConfigError(f"hardware {sender.hw.name!r} has no interconnect in accelerators.yaml for a KV transfer")
    per_gpu = num_tokens * sender.kv_bytes_per_token_per_gpu()
    cross = sender.shard.num_gpus + receiver_gpus > ic.gpus_per_node
    return OpCost("kv_transfer", 0.0, 0.0, 0.0, 0.0, ic.send_s(per_gpu, cross), "link", 1, link_bytes=per_gpu)


def with_op(cost: StepCost, op: OpCost) -> StepCost:
    """``cost`` with one more operation (its time added to the step's)."""
    from dataclasses import replace

    return replace(cost, time_s=cost.time_s + op.time_s, link_bytes=cost.link_bytes + op.link_bytes,
                   ops=(*(cost.ops or ()), op))  # fmt: skip


def phase_report(
    model_cfg: ModelConfig | str,
    hw: HardwareSpec | str,
    batch: int,
    prompt_len: int,
    context_len: int,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    quantization: str | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    calibration: Calibration | str | None = None,
    prefill_tp: int | None = None,
    decode_tp: int | None = None,
    disaggregate: bool = False,
    check_memory: bool = True,
    expert_parallel_size: int = 1,
) -> dict[str, Any]:
    """The ``workbench roofline --json`` object: ``prefill`` (``batch`` prompts of ``prompt_len`` tokens) and
    ``decode`` (``batch`` sequences at ``context_len`` producing one token each), plus a summary.

    Each phase runs on its own group: ``prefill_tp`` / ``decode_tp`` (default ``tensor_parallel_size``) x
    ``pipeline_parallel_size``; with ``disaggregate`` the prefill phase ends with the ``kv_transfer`` of its
    prompts' KV to the decode group. Each phase's ``time_s`` is the step's wall time on its whole group. With
    ``check_memory``, a group whose GPUs cannot hold their weights and the batch's KV is a ``ConfigError``."""
    for fname, value in (("batch", batch), ("prompt_len", prompt_len), ("context_len", context_len)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{fname} must be a positive integer, got {value!r}")
    common = dict(dtype=dtype, kv_dtype=kv_dtype, quantization=quantization, group_size=group_size,
                  pipeline_parallel_size=pipeline_parallel_size, calibration=calibration,
                  expert_parallel_size=expert_parallel_size)  # fmt: skip
    ptp = tensor_parallel_size if prefill_tp is None else prefill_tp
    dtp = tensor_parallel_size if decode_tp is None else decode_tp
    pm = get_model(model_cfg, hw, tensor_parallel_size=ptp, **common)
    dm = pm if dtp == ptp else get_model(pm.cfg, hw, tensor_parallel_size=dtp, **common)
    memory = {}
    if check_memory:
        memory["prefill"] = pm.check_memory(batch * prompt_len)
        memory["decode"] = dm.check_memory(batch * context_len)
    prefill = pm.prefill([prompt_len] * batch)
    if disaggregate:
        prefill = with_op(prefill, kv_transfer_op(pm, batch * prompt_len, dm.shard.num_gpus))
    decode = dm.decode([context_len] * batch)
    cfg, spec = pm.cfg, pm.hw
    return {
        "model": cfg.name,
        "hardware": spec.name,
        "dtype": pm.dtype,
        "act_dtype": pm.act_dtype,
        "kv_dtype": pm.kv_dtype,
        "quantization": pm.quantization,
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "expert_parallel_size": expert_parallel_size,
        "prefill_tp": ptp,
        "decode_tp": dtp,
        "disaggregate": bool(disaggregate),
        "calibration": pm.calibration.to_dict(),
        "batch": batch,
        "prompt_len": prompt_len,
        "context_len": context_len,
        "peak_flops": pm.matmul_peak,
        "mem_bandwidth": spec.mem_bandwidth,
        "balance_point": pm.matmul_peak / spec.mem_bandwidth,
        "ttft_floor_s": prefill.time_s,
        "itl_floor_s": decode.time_s,
        "decode_compute_bound_batch": dm.decode_compute_bound_batch(context_len),
        "weight_bytes": cfg.weight_bytes(pm.act_dtype, pm.quantization, group_size),
        "weight_bytes_per_gpu": {"prefill": pm.weight_bytes_per_gpu(), "decode": dm.weight_bytes_per_gpu()},
        "kv_bytes_per_token": cfg.kv_bytes_per_token(pm.kv_dtype),
        "memory": memory,
        "prefill": prefill.to_dict(),
        "decode": decode.to_dict(),
    }


# ---- slow reference -----------------------------------------------------------------------------------------
def reference_step_cost(
    cfg: ModelConfig,
    prefill_chunks: Iterable[tuple[int, int]] = (),
    decode_contexts: Sequence[int] = (),
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    act_dtype: str | None = None,
    quantization: str | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> dict[str, dict[str, float]]:
    """Per-operation flops and bytes on one GPU counted the long way: layer by layer, sequence by sequence, key by
    key, each weight matrix sized by ``quantized_matrix_bytes`` and each KV token by ``kv_bytes_per_token``.

    Returns ``{op: {"flops", "weight_bytes", "kv_bytes", "act_bytes"}}``. A check on the fast path, not for
    production use (it loops over every attended key).
    """
    if cfg.is_moe or cfg.is_mla:
        raise ConfigError(f"{cfg.name}: reference_step_cost counts dense Llama-family layers; an MoE / MLA model's "
                          "reference is moe_decode_cost")  # fmt: skip
    act, kvd, quant = resolve_dtypes(dtype, act_dtype, kv_dtype, quantization)
    a = dtype_bytes(act)
    kv_token_layer = cfg.kv_bytes_per_token(kvd) / (2 * cfg.num_layers)  # K (or V) of one token in one layer
    seqs = [(int(n), int(p)) for n, p in prefill_chunks] + [(1, int(L) - 1) for L in decode_contexts]
    h, q, kv, inter, v = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.vocab_size
    b = 1 if cfg.attention_bias else 0
    out = {name: {"flops": 0.0, "weight_bytes": 0.0, "kv_bytes": 0.0, "act_bytes": 0.0} for name in LAYER_OPS}
    out.update({name: {"flops": 0.0, "weight_bytes": 0.0, "kv_bytes": 0.0, "act_bytes": 0.0} for name in MODEL_OPS})

    def add(op: str, flops: float = 0, weight: float = 0, kvb: float = 0, actb: float = 0) -> None:
        out[op]["flops"] += flops
        out[op]["weight_bytes"] += weight
        out[op]["kv_bytes"] += kvb
        out[op]["act_bytes"] += actb

    def matrix(o: int, i: int) -> float:
        return quantized_matrix_bytes(o, i, quant, act, group_size)

    for _layer in range(cfg.num_layers):
        # weights: read once per layer, whatever the number of tokens
        for op, size in (("attn_norm", h * a), ("mlp_norm", h * a), ("q_proj", matrix(q, h) + b * q * a),
                         ("k_proj", matrix(kv, h) + b * kv * a), ("v_proj", matrix(kv, h) + b * kv * a),
                         ("o_proj", matrix(h, q)), ("gate_proj", matrix(inter, h)), ("up_proj", matrix(inter, h)),
                         ("down_proj", matrix(h, inter))):  # fmt: skip
            add(op, weight=size)
        for n, p in seqs:
            for op, fin, fout, bias_n in (("q_proj", h, q, b * q), ("k_proj", h, kv, b * kv), ("v_proj", h, kv, b * kv),
                                          ("o_proj", q, h, 0), ("gate_proj", h, inter, 0), ("up_proj", h, inter, 0),
                                          ("down_proj", inter, h, 0)):  # fmt: skip
                add(op, flops=linear_flops(fin, fout, n) + bias_n * n, actb=(fin + fout) * n * a)
            for op in ("attn_norm", "mlp_norm"):
                add(op, flops=NORM_FLOPS_PER_ELEMENT * h * n, actb=2 * h * n * a)
            for op in ("attn_residual", "mlp_residual"):
                add(op, flops=h * n, actb=3 * h * n * a)
            add("rope", flops=ROPE_FLOPS_PER_ELEMENT * (q + kv) * n, actb=2 * (q + kv) * n * a)
            add("kv_write", kvb=2 * kv_token_layer * n, actb=2 * kv * n * a)
            add("act_mul", flops=ACT_MUL_FLOPS_PER_ELEMENT * inter * n, actb=3 * inter * n * a)
            # attention: new token i (0-based) sees keys 0 .. p + i
            num_pairs = attended_pairs(n, p)
            for head in range(cfg.num_heads):
                add("attn_scores", flops=2 * cfg.head_dim * num_pairs)
                add("attn_value", flops=2 * cfg.head_dim * num_pairs)
                add("softmax", flops=SOFTMAX_FLOPS_PER_SCORE * num_pairs, actb=LSE_BYTES * n)
                del head
            add("attn_scores", kvb=(p + n) * kv_token_layer, actb=n * q * a)  # K of the whole context, Q of the new
            add("attn_value", kvb=(p + n) * kv_token_layer, actb=n * q * a)  # V of the whole context, output
    for n, _p in seqs:
        add("embedding", weight=n * h * a, actb=n * h * a)
        add("final_norm", flops=NORM_FLOPS_PER_ELEMENT * h, actb=2 * h * a)
        add("lm_head", flops=linear_flops(h, v, 1), actb=(h + v) * a)
    if seqs:
        add("final_norm", weight=h * a)
        add("lm_head", weight=v * h * a if cfg.tie_word_embeddings else matrix(v, h))
    return out


# ---- mixture of experts and MLA: decode cost from active parameters and distinct experts ------------------------
def expected_distinct_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected number of different experts ``num_tokens`` tokens route to, each choosing ``top_k`` of
    ``num_experts``, when every token's choice is a uniform random k-subset and tokens are independent:
    an expert is missed by one token with probability ``1 - k/E``, by all ``B`` with ``(1 - k/E)^B``, so

        E * (1 - (1 - k/E)^B)

    (``k`` at B = 1, tending to ``E``). Real routers are not uniform (load balancing pushes them towards it)."""
    if not (0 < top_k <= num_experts) or num_tokens < 0:
        raise ConfigError(
            f"need 0 < top_k <= num_experts and num_tokens >= 0, got {top_k}, {num_experts}, {num_tokens}"
        )
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def simulated_distinct_experts(
    num_experts: int, top_k: int, num_tokens: int, trials: int = 2000, seed: int = 0
) -> float:
    """The mean number of distinct experts over ``trials`` seeded draws of uniform top-k routing (the Monte-Carlo
    check of ``expected_distinct_experts``)."""
    import random

    rng = random.Random(seed)
    experts = range(num_experts)
    total = 0
    for _ in range(trials):
        hit: set[int] = set()
        for _ in range(num_tokens):
            hit.update(rng.sample(experts, top_k))
        total += len(hit)
    return total / trials


def check_expert_parallel(cfg: ModelConfig, expert_parallel_size: int) -> None:
    """ConfigError naming the constraint when ``cfg``'s experts cannot be spread over ``expert_parallel_size``
    GPUs: the size must be a positive integer, 1 for a dense model, and divide the number of routed experts."""
    ep = expert_parallel_size
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ConfigError(f"expert_parallel_size must be a positive integer, got {ep!r}")
    if ep > 1 and not cfg.is_moe:
        raise ConfigError(f"{cfg.name} is a dense model: expert_parallel_size {ep} needs a mixture of experts (use 1)")
    if cfg.is_moe and cfg.num_experts % ep:
        raise ConfigError(
            f"expert_parallel_size {ep} must divide {cfg.name}'s {cfg.num_experts} routed experts "
            f"(each GPU holds the same number of experts)"
        )


@dataclass(frozen=True)
class MoEDecodeCost:
    """One decode step of ``batch`` sequences at ``context_len`` tokens on one GPU of an expert-parallel group."""

    batch: int
    context_len: int
    expert_parallel_size: int
    distinct_experts: float  # expected experts read per MoE layer, on the whole group
    weight_bytes: float  # on one GPU: the non-expert weights plus its share of the distinct experts
    kv_bytes: float  # the cache read (context) and written (the new token)
    flops: float  # 2 x active parameters x tokens + attention
    all_to_all_bytes: float  # sent by one GPU per step: dispatch and combine of every MoE layer
    time_s: float | None  # max(compute, memory) + all-to-all, when a hardware spec is given

    @property
    def bytes_total(self) -> float:
        return self.weight_bytes + self.kv_bytes


def moe_decode_cost(
    cfg: ModelConfig,
    batch: int,
    context_len: int,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    expert_parallel_size: int = 1,
    hw: HardwareSpec | str | None = None,
) -> MoEDecodeCost:
    """Bytes, FLOPs and (with ``hw``) time of one decode step of an MoE and/or MLA model (a dense one too), on one
    GPU of an expert-parallel group of ``expert_parallel_size`` (the closed form ``RooflineModel`` is checked
    against: weights and KV bytes agree; FLOPs here count 2 per parameter, norms included).

    Weights read: every non-expert weight once (attention, norms, router, shared and dense MLPs, the LM head; one
    embedding row per token), and in each MoE layer only the experts the batch routes to,
    ``expected_distinct_experts(E, k, batch)`` of them, each ``3 * hidden * moe_intermediate_size`` values. With
    expert parallelism (attention data parallel) the ``batch`` sequences are spread evenly over the ``ep`` GPUs;
    each holds every non-expert weight and ``E / ep`` experts, and reads ``1 / ep`` of the distinct ones (its own).
    FLOPs: ``2 * batch / ep`` times the active parameters (the LM head included, the embedding table not) plus
    attention over ``context_len`` keys per sequence (MHA/GQA/MQA: ``4 * heads * head_dim`` per key; MLA absorbed:
    ``2 * heads * (2 r + dr)``). All-to-all: each of a GPU's ``batch / ep`` tokens goes to its ``k`` experts and
    comes back, ``(ep - 1) / ep`` of them on other GPUs: ``2 * batch / ep * k * hidden * bytes * (ep - 1) / ep``
    sent per MoE layer; timed as two ``Interconnect.all_to_all_s`` per layer.
    """
    check_expert_parallel(cfg, expert_parallel_size)
    if batch < 1 or context_len < 0:
        raise ConfigError(f"batch must be >= 1 and context_len >= 0, got {batch}, {context_len}")
    ep = expert_parallel_size
    a = dtype_bytes(dtype)
    kv_dtype = resolve_kv_cache_dtype(kv_dtype, dtype)
    h, v = cfg.hidden_size, cfg.vocab_size
    local = batch / ep  # sequences (tokens) per GPU
    expert_params = 3 * h * cfg.moe_intermediate_size if cfg.is_moe else 0
    moe_layers = cfg.num_moe_layers
    routed_total = moe_layers * cfg.num_experts * expert_params
    lm_head = v * h  # read whole (tied: the embedding table)
    non_expert = cfg.num_params(include_embeddings=False) - routed_total + lm_head + local * h
    distinct = expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, batch) if cfg.is_moe else 0.0
    weight_bytes = (non_expert + moe_layers * distinct / ep * expert_params) * a
    kv_bytes = local * (context_len + 1) * cfg.kv_bytes_per_token(kv_dtype)
    active_linear = cfg.num_params(include_embeddings=False, active=True) + lm_head
    if cfg.is_mla:
        per_key = 2 * cfg.num_heads * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    else:
        per_key = 4 * cfg.num_heads * cfg.head_dim
    flops = 2.0 * local * active_linear + cfg.num_layers * local * (context_len + 1) * per_key
    held = local * cfg.num_experts_per_tok * h * a  # one all-to-all's buffer on one GPU
    a2a = moe_layers * 2 * held * (ep - 1) / ep
    time_s = None
    if hw is not None:
        spec = get_hardware(hw)
        time_s = max(flops / spec.peak(dtype), (weight_bytes + kv_bytes) / spec.mem_bandwidth)
        if ep > 1:
            if spec.interconnect is None:
                raise ConfigError(f"hardware {spec.name!r} has no interconnect: expert parallelism cannot be timed")
            time_s += 2 * moe_layers * spec.interconnect.all_to_all_s(held, ep)
    return MoEDecodeCost(batch, context_len, ep, distinct, weight_bytes, kv_bytes, flops, a2a, time_s)


__all__ = [
    "LAYER_OPS",
    "MODEL_OPS",
    "COMM_OPS",
    "OpCost",
    "StepCost",
    "StepWork",
    "Shard",
    "Utilization",
    "RooflineModel",
    "linear_flops",
    "attended_pairs",
    "get_model",
    "kv_transfer_op",
    "resolve_dtypes",
    "step_cost",
    "step_work",
    "phase_report",
    "utilization",
    "reference_step_cost",
    "with_op",
    "expected_distinct_experts",
    "simulated_distinct_experts",
    "check_expert_parallel",
    "MoEDecodeCost",
    "moe_decode_cost",
    "distinct_experts_per_gpu",
    "MLA_OPS",
    "MOE_OPS",
]
