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
- Peaks: matmuls (projections, LM head, attention products) run at ``hw.peak(act_dtype)``; norms, rope,
  softmax, the activation and residual adds at the vector peak (``hw.vector_flops``, the fp32 figure).

The fast path (``RooflineModel.step_time``/``time_from_stats``) reduces a step to four sums (new tokens,
sequences, attended pairs, context tokens read) and evaluates precomputed per-operation coefficients, so the
serving simulator can call it hundreds of thousands of times; ``step_cost(..., detailed=True)`` builds the
per-operation table, and ``reference_step_cost`` recounts it sequence by sequence, operation by operation.
This module imports neither torch nor matplotlib.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from workbench.config import ModelConfig, canonical_dtype, dtype_bytes
from workbench.errors import ConfigError
from workbench.hardware import HardwareSpec, get_hardware

LAYER_OPS = (
    "attn_norm", "q_proj", "k_proj", "v_proj", "rope", "kv_write", "attn_scores", "softmax", "attn_value",
    "o_proj", "attn_residual", "mlp_norm", "gate_proj", "up_proj", "act_mul", "down_proj", "mlp_residual",
)  # fmt: skip
MODEL_OPS = ("embedding", "final_norm", "lm_head")
MATMUL_OPS = frozenset({"q_proj", "k_proj", "v_proj", "attn_scores", "attn_value", "o_proj", "gate_proj",
                        "up_proj", "down_proj", "lm_head"})  # fmt: skip
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
    bound: str  # "compute" or "memory"
    count: int = 1

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.act_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        return self.flops / self.bytes if self.bytes else math.inf

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


def _op_coefficients(cfg: ModelConfig, w: int, a: int, c: int) -> dict[str, tuple[tuple[float, ...], ...]]:
    """Per operation, for ONE layer (or once per model): coefficients on (1, tokens, seqs, pairs, context)
    of (flops, weight_bytes, kv_bytes, act_bytes).

    tokens: new tokens in the step; seqs: sequences; pairs: attended (query, key) pairs;
    context: tokens whose K and V are read (cached + new, per sequence).
    """
    h, q, kv, inter, v = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.vocab_size
    nh = cfg.num_heads
    bias = 1 if cfg.attention_bias else 0
    zero = (0, 0, 0, 0, 0)

    def per_token(x: float) -> tuple[float, ...]:
        return (0, x, 0, 0, 0)

    def const(x: float) -> tuple[float, ...]:
        return (x, 0, 0, 0, 0)

    def proj(in_f: int, out_f: int, has_bias: int) -> tuple[tuple[float, ...], ...]:
        flops = per_token(2 * in_f * out_f + has_bias * out_f)
        weights = const((in_f * out_f + has_bias * out_f) * w)
        return flops, weights, zero, per_token((in_f + out_f) * a)

    norm = (per_token(NORM_FLOPS_PER_ELEMENT * h), const(h * w), zero, per_token(2 * h * a))
    residual = (per_token(RESIDUAL_FLOPS_PER_ELEMENT * h), zero, zero, per_token(3 * h * a))
    layer = {
        "attn_norm": norm,
        "q_proj": proj(h, q, bias),
        "k_proj": proj(h, kv, bias),
        "v_proj": proj(h, kv, bias),
        "rope": (per_token(ROPE_FLOPS_PER_ELEMENT * (q + kv)), zero, zero, per_token(2 * (q + kv) * a)),
        "kv_write": (zero, zero, per_token(2 * kv * c), per_token(2 * kv * a)),
        "attn_scores": ((0, 0, 0, 2 * q, 0), zero, (0, 0, 0, 0, kv * c), per_token(q * a)),
        "softmax": ((0, 0, 0, SOFTMAX_FLOPS_PER_SCORE * nh, 0), zero, zero, per_token(LSE_BYTES * nh)),
        "attn_value": ((0, 0, 0, 2 * q, 0), zero, (0, 0, 0, 0, kv * c), per_token(q * a)),
        "o_proj": proj(q, h, 0),
        "attn_residual": residual,
        "mlp_norm": norm,
        "gate_proj": proj(h, inter, 0),
        "up_proj": proj(h, inter, 0),
        "act_mul": (per_token(ACT_MUL_FLOPS_PER_ELEMENT * inter), zero, zero, per_token(3 * inter * a)),
        "down_proj": proj(inter, h, 0),
        "mlp_residual": residual,
    }
    per_seq = lambda x: (0, 0, x, 0, 0)
    model = {
        "embedding": (zero, per_token(h * w), zero, per_token(h * a)),
        "final_norm": (per_seq(NORM_FLOPS_PER_ELEMENT * h), const(h * w), zero, per_seq(2 * h * a)),
        "lm_head": (per_seq(2 * h * v), const(h * v * w), zero, per_seq((h + v) * a)),
    }
    return {**layer, **model}


def _dot(coef: tuple[float, ...], x: tuple[float, ...]) -> float:
    return coef[0] * x[0] + coef[1] * x[1] + coef[2] * x[2] + coef[3] * x[3] + coef[4] * x[4]


def _dtypes(dtype: str, act_dtype: str | None, kv_dtype: str | None) -> tuple[str, str, str]:
    """(weights, activations, KV) dtypes: activations default to the weights' (bf16 under a quantized format),
    the KV cache to the activations'."""
    dtype = canonical_dtype(dtype)
    act = canonical_dtype(act_dtype) if act_dtype is not None else (dtype if dtype in ("fp32", "fp16", "bf16")
                                                                    else "bf16")  # fmt: skip
    return dtype, act, canonical_dtype(kv_dtype) if kv_dtype is not None else act


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


def step_work(
    cfg: ModelConfig,
    dtype: str = "bf16",
    prefill_chunks: Iterable[tuple[int, int]] = (),
    decode_contexts: Sequence[int] = (),
    kv_dtype: str | None = None,
    act_dtype: str | None = None,
) -> StepWork:
    """FLOPs and bytes of a step (prefill chunks ``(num_new, num_cached)``, decodes at context lengths), counted
    without any hardware spec: the same operation table ``RooflineModel`` prices."""
    w, a, c = (dtype_bytes(d) for d in _dtypes(dtype, act_dtype, kv_dtype))
    x = (1.0, *(float(v) for v in RooflineModel.batch_stats(prefill_chunks, decode_contexts)))
    totals = [0.0, 0.0, 0.0, 0.0]
    if x[1] > 0:
        for name, coefs in _op_coefficients(cfg, w, a, c).items():
            count = cfg.num_layers if name in LAYER_OPS else 1
            for i, coef in enumerate(coefs):
                totals[i] += count * _dot(coef, x)
    return StepWork(*totals)


class RooflineModel:
    """Precomputed per-operation costs of one model on one hardware with given dtypes.

    ``dtype``: weights; ``act_dtype``: activations and matmul compute (default: ``dtype``, or bf16 when the
    weights are fp8/int8); ``kv_dtype``: the KV cache (default: the activation dtype).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        hw: HardwareSpec | str,
        dtype: str = "bf16",
        kv_dtype: str | None = None,
        act_dtype: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.hw = get_hardware(hw)
        self.dtype, self.act_dtype, self.kv_dtype = _dtypes(dtype, act_dtype, kv_dtype)
        self.matmul_peak = self.hw.peak(self.act_dtype)
        self.vector_peak = self.hw.vector_flops
        self.bandwidth = self.hw.mem_bandwidth
        w, a, c = dtype_bytes(self.dtype), dtype_bytes(self.act_dtype), dtype_bytes(self.kv_dtype)
        per_op = _op_coefficients(cfg, w, a, c)
        self.op_names: tuple[str, ...] = LAYER_OPS + MODEL_OPS
        # (name, count, peak, flops coef, weight coef, kv coef, act coef), coefficients already x count
        self._ops: list[tuple[str, int, float, tuple[float, ...], ...]] = []
        # fast path: per op, time coefficients (flops/peak on the 5 stats, bytes/bandwidth on the 5 stats)
        self._fast: list[tuple[tuple[float, ...], tuple[float, ...]]] = []
        for name in self.op_names:
            count = cfg.num_layers if name in LAYER_OPS else 1
            peak = self.matmul_peak if name in MATMUL_OPS else self.vector_peak
            fc, wc, kc, ac = (tuple(count * x for x in coef) for coef in per_op[name])
            self._ops.append((name, count, peak, fc, wc, kc, ac))
            bytes_coef = tuple(wc[i] + kc[i] + ac[i] for i in range(5))
            self._fast.append((tuple(x / peak for x in fc), tuple(x / self.bandwidth for x in bytes_coef)))
            # no op's flops have a constant term and no op's bytes depend on pairs (see _op_coefficients)
            assert fc[0] == 0 and bytes_coef[3] == 0, name

    # ---- step statistics -------------------------------------------------------------------------------
    @property
    def stat_coefficients(self) -> list[tuple[tuple[float, ...], tuple[float, ...]]]:
        """Per operation, its compute and memory times (s) as coefficients on (1, tokens, seqs, pairs, context)."""
        return self._fast

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
        """Predicted step time from the four sums (the fast path: no per-op objects)."""
        if tokens <= 0:
            return 0.0
        total = 0.0
        for fc, bc in self._fast:
            tc = fc[1] * tokens + fc[2] * seqs + fc[3] * pairs
            tb = bc[0] + bc[1] * tokens + bc[2] * seqs + bc[4] * context
            total += tc if tc > tb else tb
        return total

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
        x = (1.0, float(tokens), float(seqs), float(pairs), float(context))
        ops = []
        flops = wb = kb = ab = time_s = compute_s = 0.0
        for name, count, peak, fc, wc, kc, ac in self._ops:
            if tokens <= 0:
                break
            f, w_, k_, a_ = _dot(fc, x), _dot(wc, x), _dot(kc, x), _dot(ac, x)
            tc, tb = f / peak, (w_ + k_ + a_) / self.bandwidth
            flops, wb, kb, ab = flops + f, wb + w_, kb + k_, ab + a_
            time_s += max(tc, tb)
            compute_s += tc
            if detailed:
                ops.append(OpCost(name, f, w_, k_, a_, max(tc, tb), "compute" if tc >= tb else "memory", count))
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
        )

    # ---- phases ---------------------------------------------------------------------------------------------
    def prefill(self, prompt_lens: Sequence[int], detailed: bool = True) -> StepCost:
        """Prefill of fresh prompts (nothing cached): the TTFT floor of this batch."""
        return self.step_cost([(n, 0) for n in prompt_lens], (), detailed=detailed)

    def decode(self, context_lens: Sequence[int], detailed: bool = True) -> StepCost:
        """One decode step, one new token per sequence at the given context lengths: the ITL floor."""
        return self.step_cost((), context_lens, detailed=detailed)

    def decode_compute_bound_batch(self, context_len: int) -> int | None:
        """Smallest batch at which a decode step at ``context_len`` is compute-bound in aggregate
        (sum over ops of flops / peak >= total bytes / bandwidth); None if it never is (KV reads grow as
        fast as FLOPs, as happens with long contexts)."""
        if context_len < 1:
            raise ConfigError(f"context_len must be >= 1, got {context_len}")
        # per-sequence costs are linear in the batch: tokens = seqs = B, pairs = context = B * L
        unit = (0.0, 1.0, 1.0, float(context_len), float(context_len))
        const = (1.0, 0.0, 0.0, 0.0, 0.0)
        compute_per_seq = mem_per_seq = mem_const = 0.0
        for _name, _count, peak, fc, wc, kc, ac in self._ops:
            compute_per_seq += _dot(fc, unit) / peak
            mem_per_seq += (_dot(wc, unit) + _dot(kc, unit) + _dot(ac, unit)) / self.bandwidth
            mem_const += (_dot(wc, const) + _dot(kc, const) + _dot(ac, const)) / self.bandwidth
        if compute_per_seq <= mem_per_seq:
            return None
        return max(1, math.ceil(mem_const / (compute_per_seq - mem_per_seq) - 1e-9))

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
            cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias, cfg.tie_word_embeddings)  # fmt: skip


def get_model(
    cfg: ModelConfig | str,
    hw: HardwareSpec | str,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
    act_dtype: str | None = None,
) -> RooflineModel:
    """A cached ``RooflineModel`` (model given as config or preset name/path, hardware as spec or name)."""
    if not isinstance(cfg, ModelConfig):
        cfg = ModelConfig.resolve(cfg)
    hw = get_hardware(hw)
    key = (_cfg_key(cfg), hw.name, tuple(sorted(hw.peak_flops.items())), hw.mem_bandwidth, dtype, kv_dtype,
           act_dtype)  # fmt: skip
    model = _MODELS.get(key)
    if model is None:
        model = _MODELS[key] = RooflineModel(cfg, hw, dtype=dtype, kv_dtype=kv_dtype, act_dtype=act_dtype)
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
) -> StepCost:
    """Cost of one (possibly mixed) step: prefill chunks ``(num_new, num_cached)`` and decodes at context
    lengths ``L`` (attending to L keys, the new one included). See the module docstring for conventions."""
    model = get_model(model_cfg, hw, dtype=dtype, kv_dtype=kv_dtype, act_dtype=act_dtype)
    return model.step_cost(prefill_chunks, decode_contexts, detailed=detailed)


def phase_report(
    model_cfg: ModelConfig | str,
    hw: HardwareSpec | str,
    batch: int,
    prompt_len: int,
    context_len: int,
    dtype: str = "bf16",
    kv_dtype: str | None = None,
) -> dict[str, Any]:
    """The ``workbench roofline --json`` object: ``prefill`` (``batch`` prompts of ``prompt_len`` tokens) and
    ``decode`` (``batch`` sequences at ``context_len`` producing one token each), plus a summary."""
    for fname, value in (("batch", batch), ("prompt_len", prompt_len), ("context_len", context_len)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{fname} must be a positive integer, got {value!r}")
    model = get_model(model_cfg, hw, dtype=dtype, kv_dtype=kv_dtype)
    prefill = model.prefill([prompt_len] * batch)
    decode = model.decode([context_len] * batch)
    cfg, spec = model.cfg, model.hw
    return {
        "model": cfg.name,
        "hardware": spec.name,
        "dtype": model.dtype,
        "act_dtype": model.act_dtype,
        "kv_dtype": model.kv_dtype,
        "batch": batch,
        "prompt_len": prompt_len,
        "context_len": context_len,
        "peak_flops": model.matmul_peak,
        "mem_bandwidth": spec.mem_bandwidth,
        "balance_point": spec.balance_point(model.act_dtype),
        "ttft_floor_s": prefill.time_s,
        "itl_floor_s": decode.time_s,
        "decode_compute_bound_batch": model.decode_compute_bound_batch(context_len),
        "weight_bytes": cfg.weight_bytes(model.dtype),
        "kv_bytes_per_token": cfg.kv_bytes_per_token(model.kv_dtype),
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
) -> dict[str, dict[str, float]]:
    """Per-operation flops and bytes counted the long way: layer by layer, sequence by sequence, key by key.

    Returns ``{op: {"flops", "weight_bytes", "kv_bytes", "act_bytes"}}``. A check on the fast path, not for
    production use (it loops over every attended key).
    """
    w = dtype_bytes(dtype)
    act = canonical_dtype(act_dtype) if act_dtype else (canonical_dtype(dtype) if w >= 2 else "bf16")
    a = dtype_bytes(act)
    c = dtype_bytes(kv_dtype) if kv_dtype else a
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

    for _layer in range(cfg.num_layers):
        # weights: read once per layer, whatever the number of tokens
        for op, size in (("attn_norm", h), ("mlp_norm", h), ("q_proj", h * q + b * q), ("k_proj", h * kv + b * kv),
                         ("v_proj", h * kv + b * kv), ("o_proj", q * h), ("gate_proj", h * inter),
                         ("up_proj", h * inter), ("down_proj", inter * h)):  # fmt: skip
            add(op, weight=size * w)
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
            add("kv_write", kvb=2 * kv * n * c, actb=2 * kv * n * a)
            add("act_mul", flops=ACT_MUL_FLOPS_PER_ELEMENT * inter * n, actb=3 * inter * n * a)
            # attention: new token i (0-based) sees keys 0 .. p + i
            num_pairs = attended_pairs(n, p)
            for head in range(cfg.num_heads):
                add("attn_scores", flops=2 * cfg.head_dim * num_pairs)
                add("attn_value", flops=2 * cfg.head_dim * num_pairs)
                add("softmax", flops=SOFTMAX_FLOPS_PER_SCORE * num_pairs, actb=LSE_BYTES * n)
                del head
            add("attn_scores", kvb=(p + n) * kv * c, actb=n * q * a)  # K of the whole context, Q of the new
            add("attn_value", kvb=(p + n) * kv * c, actb=n * q * a)  # V of the whole context, output
    for n, _p in seqs:
        add("embedding", weight=n * h * w, actb=n * h * a)
        add("final_norm", flops=NORM_FLOPS_PER_ELEMENT * h, actb=2 * h * a)
        add("lm_head", flops=linear_flops(h, v, 1), actb=(h + v) * a)
    if seqs:
        add("final_norm", weight=h * w)
        add("lm_head", weight=h * v * w)
    return out


__all__ = [
    "LAYER_OPS",
    "MODEL_OPS",
    "OpCost",
    "StepCost",
    "StepWork",
    "Utilization",
    "RooflineModel",
    "linear_flops",
    "attended_pairs",
    "get_model",
    "step_cost",
    "step_work",
    "phase_report",
    "utilization",
    "reference_step_cost",
]
