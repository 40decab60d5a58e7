"""Model configuration: read from a Hugging Face ``config.json``, validated, with named presets.

``ModelConfig`` is the one description of a decoder-only Llama-family transformer that every room of the
workbench reads: the model code builds layers from it, the roofline model counts FLOPs and bytes from it,
the KV-cache calculator sizes caches from it. It understands the keys of Llama (1/2/3.x), Mistral and
Qwen2 configs, and of the mixture-of-experts / MLA ones of Mixtral, Qwen2-MoE, Qwen3-MoE (``qk_norm``: per-head q/k
RMSNorm) and DeepSeek-V3. Presets live
in ``data/models/<name>.json`` as plain HF config files (sources in ``data/models/README.md``);
``ModelConfig.from_name`` looks them up and ``ModelConfig.resolve`` accepts a preset name, a ``config.json``
path or a checkpoint directory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from workbench.errors import ConfigError, read_json_file

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
MODELS_DIR = DATA_DIR / "models"

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM",
)
# model_type as transformers writes it, per architecture
MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
ROUTER_SCORINGS = ("softmax", "sigmoid")  # softmax: Mixtral, Qwen-MoE; sigmoid (group-limited): DeepSeek-V3

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "fp32": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "fp16": "fp16",
    "bfloat16": "bf16",
    "bf16": "bf16",
    "fp8": "fp8",
    "float8": "fp8",
    "int8": "int8",
}


def check_positive_ints(obj: object, names: tuple[str, ...], optional: bool = False, where: str = "",
                        what: str = "") -> None:  # fmt: skip
    """ConfigError naming the first field of ``obj`` among ``names`` that is not a positive integer (None passes
    when ``optional``); ``where`` prefixes the message, ``what`` follows "positive integer"."""
    for name in names:
        value = getattr(obj, name)
        if optional and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            unset = " or unset" if optional else ""
            raise ConfigError(f"{where}{name} must be a positive integer{unset}{what}, got {value!r}")


def canonical_dtype(name: str) -> str:
    """Map 'float16', 'half', 'torch.float16', ... to the workbench's short names ('fp16', ...)."""
    key = str(name).lower().removeprefix("torch.")
    if key not in DTYPE_ALIASES:
        raise ConfigError(f"unknown dtype {name!r}; expected one of {sorted(set(DTYPE_ALIASES.values()))}")
    return DTYPE_ALIASES[key]


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype given by any accepted name."""
    return DTYPE_BYTES[canonical_dtype(name)]


# ---- quantization: one meaning of --quantization and --kv-cache-dtype everywhere (vLLM's flag names) ---------
QUANTIZATIONS = ("int8", "int4", "fp8")  # weight-only formats of the linear layers; None = unquantized
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # 'auto' = the activation dtype
DEFAULT_GROUP_SIZE = 128  # int4: input elements sharing one (scale, zero) pair
KV_INT8_SCALE_BYTES = 4  # int8 KV: one fp32 scale per (token, KV head), for K and for V
# fp8 (e4m3) KV keeps one fp32 scale per layer for K and one for V: 8 bytes per layer for the whole pool, not per
# token, so it is left out of per-token sizes.


def canonical_quantization(name: str | None) -> str | None:
    """None/'none' -> None; 'int8' | 'int4' | 'fp8' unchanged; anything else a ``ConfigError``."""
    if name is None or str(name).lower() in ("none", ""):
        return None
    key = str(name).lower()
    if key not in QUANTIZATIONS:
        raise ConfigError(f"unknown quantization {name!r}; expected one of none, {', '.join(QUANTIZATIONS)}")
    return key


def resolve_kv_cache_dtype(kv_cache_dtype: str | None, dtype: str) -> str:
    """The KV cache's element dtype: 'auto' (or None) is the activation ``dtype``; 'int8' and 'fp8' as given; the
    activation dtype itself (what 'auto' resolved to: a resolved config, copied with ``dataclasses.replace``,
    resolves again to the same)."""
    if kv_cache_dtype is None or str(kv_cache_dtype).lower() == "auto":
        return canonical_dtype(dtype)
    key = str(kv_cache_dtype).lower()
    if key == canonical_dtype(dtype):
        return key
    as_float = DTYPE_ALIASES.get(key.removeprefix("torch."))
    if as_float in ("fp16", "bf16", "fp32"):  # a float dtype other than the activations'
        raise ConfigError(
            f"kv cache dtype {kv_cache_dtype!r} differs from the activation dtype {canonical_dtype(dtype)!r}: a "
            f"floating-point KV cache is kept in the activation dtype; use 'auto' (= {canonical_dtype(dtype)}), "
            f"'int8' or 'fp8', or set --dtype {as_float}"
        )
    if key not in KV_CACHE_DTYPES:
        raise ConfigError(f"unknown kv cache dtype {kv_cache_dtype!r}; expected one of {', '.join(KV_CACHE_DTYPES)}")
    return key


def quantized_matrix_bytes(
    out_features: int, in_features: int, quantization: str | None, dtype: str, group_size: int = DEFAULT_GROUP_SIZE
) -> int:
    """Bytes of one ``out x in`` weight matrix stored under ``quantization``, scales included.

    - None: ``out * in * bytes(dtype)``;
    - int8, per output channel: ``out * in`` bytes + one scale per row in ``dtype``;
    - int4, group-wise along the input: ``out * in / 2`` bytes + a (scale, zero) pair in ``dtype`` per group per row;
    - fp8 (e4m3), per tensor: ``out * in`` bytes + one fp32 scale.
    """
    q = canonical_quantization(quantization)
    s = dtype_bytes(dtype)
    if q is None:
        return out_features * in_features * s
    if q == "int8":
        return out_features * in_features + out_features * s
    if q == "fp8":
        return out_features * in_features + 4
    if in_features % group_size:
        raise ConfigError(f"int4 group size {group_size} does not divide the input size {in_features}")
    return out_features * in_features // 2 + out_features * (in_features // group_size) * 2 * s


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder. Field names follow the workbench, not HF (see ``from_hf_config``).

    MHA, GQA and MQA are the same model with ``num_kv_heads`` equal to ``num_heads``, a divisor of it, or 1.

    Mixture of experts (``num_experts > 0``; ``workbench.model.moe``): every layer not in ``dense_layers`` replaces
    its MLP by ``num_experts`` SwiGLU experts of ``moe_intermediate_size``, of which a router picks
    ``num_experts_per_tok`` per token, plus an optional shared expert of ``shared_expert_intermediate_size``
    (behind a sigmoid gate when ``shared_expert_gated``, as in Qwen2-MoE). Multi-head latent attention
    (``kv_lora_rank > 0``; ``workbench.model.mla``, DeepSeek-V2/V3): ``head_dim`` is the query/key head size
    ``qk_nope_head_dim + qk_rope_head_dim`` and the cache holds one latent of ``kv_lora_rank`` plus one shared rotary
    key of ``qk_rope_head_dim`` per token and layer.
    """

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    torch_dtype: str = "bf16"
    # ---- mixture of experts (0 experts: a dense model) ----
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to 1 (Mixtral always; Qwen-MoE optional)
    router_scoring: str = "softmax"  # 'softmax' over all experts, or DeepSeek-V3's 'sigmoid' with expert groups
    n_group: int = 1  # sigmoid router: experts are split into n_group groups, of which topk_group are eligible
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights (DeepSeek-V3: 2.5)
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gated: bool = False  # Qwen2-MoE: sigmoid(shared_expert_gate(x)) scales the shared expert
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model that keep the dense MLP (intermediate_size)
    # ---- multi-head latent attention (kv_lora_rank 0: plain MHA/GQA/MQA) ----
    q_lora_rank: int | None = None  # None: a full-rank q_proj
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # HF DeepSeek: the checkpoint's rotary dims are interleaved pairs
    qk_norm: bool = False  # Qwen3: an RMSNorm over head_dim on every query and key head before rotary
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"{self.name}: unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for fname in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            check_positive_ints(self, (fname,), where=f"{self.name}: ")
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"{self.name}: num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ConfigError(f"{self.name}: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not (self.rms_norm_eps > 0):
            raise ConfigError(f"{self.name}: rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not (self.rope_theta > 0):
            raise ConfigError(f"{self.name}: rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            raise ConfigError(f"{self.name}: rope_scaling must be a dict or None, got {self.rope_scaling!r}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind == "yarn" and self.kv_lora_rank > 0:
                pass  # DeepSeek-V3's long-context rope: recorded for counting; the model refuses it (model.mla)
            elif kind == "llama3":
                for key in (
                    "factor",
                    "low_freq_factor",
                    "high_freq_factor",
                    "original_max_position_embeddings",
                ):
                    if key not in self.rope_scaling:
                        raise ConfigError(f"{self.name}: rope_scaling of type llama3 needs {key!r}")
            elif kind not in (None, "default"):
                raise ConfigError(
                    f"{self.name}: rope_scaling type {kind!r} is not supported; supported: llama3 (or none; yarn "
                    "recorded for MLA presets)"
                )
        for tok in self.eos_token_ids:
            if not 0 <= tok < self.vocab_size:
                raise ConfigError(f"{self.name}: eos token id {tok} outside the vocabulary [0, {self.vocab_size})")
        canonical_dtype(self.torch_dtype)
        self._check_moe()
        self._check_mla()

    def _check_moe(self) -> None:
        if self.num_experts == 0:
            return
        e, k = self.num_experts, self.num_experts_per_tok
        if not (isinstance(e, int) and e > 0 and isinstance(k, int) and 0 < k <= e):
            raise ConfigError(f"{self.name}: num_experts_per_tok must be in [1, num_experts={e}], got {k!r}")
        if not (isinstance(self.moe_intermediate_size, int) and self.moe_intermediate_size > 0):
            raise ConfigError(f"{self.name}: moe_intermediate_size must be a positive integer for an MoE model")
        if self.router_scoring not in ROUTER_SCORINGS:
            raise ConfigError(
                f"{self.name}: router_scoring {self.router_scoring!r}; expected one of {', '.join(ROUTER_SCORINGS)}"
            )
        if e % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ConfigError(
                f"{self.name}: n_group ({self.n_group}) must divide num_experts ({e}) and topk_group "
                f"({self.topk_group}) be in [1, n_group]"
            )
        if self.topk_group * (e // self.n_group) < k:
            raise ConfigError(f"{self.name}: topk_group groups of experts hold fewer than num_experts_per_tok ({k})")
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"{self.name}: dense_layers {bad} outside [0, num_layers={self.num_layers})")

    def _check_mla(self) -> None:
        if self.kv_lora_rank == 0:
            return
        names = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        check_positive_ints(self, names, where=f"{self.name}: ", what=" for MLA")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"{self.name}: qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ConfigError(
                f"{self.name}: MLA head_dim ({self.head_dim}) must be qk_nope_head_dim + qk_rope_head_dim "
                f"({self.qk_nope_head_dim} + {self.qk_rope_head_dim})"
            )
        if self.q_lora_rank is not None and not (isinstance(self.q_lora_rank, int) and self.q_lora_rank > 0):
            raise ConfigError(f"{self.name}: q_lora_rank must be a positive integer or null, got {self.q_lora_rank!r}")

    # ---- mixture of experts and MLA ----------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts (False for every layer of a dense model)."""
        return self.is_moe and layer not in self.dense_layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def rotary_dim(self) -> int:
        """Dimensions rotary embeddings rotate: the head for MHA/GQA/MQA, the decoupled rope part for MLA."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def cache_entry(self) -> tuple[int, int]:
        """(heads, dim) of one token's K in one layer's pool: (num_kv_heads, head_dim), or MLA's one compressed
        entry (1, kv_lora_rank + qk_rope_head_dim) whose first kv_lora_rank values serve as V."""
        if self.is_mla:
            return 1, self.kv_lora_rank + self.qk_rope_head_dim
        return self.num_kv_heads, self.head_dim

    # ---- derived sizes -------------------------------------------------------------------------------
    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_kind(self) -> str:
        """'MHA', 'MQA' or 'GQA' from the number of KV heads; 'MLA' for multi-head latent attention."""
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        if self.num_kv_heads == 1:
            return "MQA"
        return "GQA"

    def attention_params(self) -> int:
        """Parameters of one layer's attention (projections, biases, MLA's two latent norms)."""
        h = self.hidden_size
        if self.is_mla:
            qd, nh = self.head_dim, self.num_heads
            q = h * nh * qd if self.q_lora_rank is None else h * self.q_lora_rank + self.q_lora_rank * (1 + nh * qd)
            r = self.kv_lora_rank
            kv = h * (r + self.qk_rope_head_dim) + r + r * nh * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + nh * self.v_head_dim * h
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h + (2 * self.head_dim if self.qk_norm else 0)
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        return attn

    def mlp_params(self, layer: int, active: bool = False) -> int:
        """Parameters of one layer's MLP; ``active``: only the experts one token uses (top-k routed + shared)."""
        h = self.hidden_size
        if not self.is_moe_layer(layer):
            return 3 * h * self.intermediate_size
        e = self.num_experts_per_tok if active else self.num_experts
        router = h * self.num_experts + (self.num_experts if self.router_scoring == "sigmoid" else 0)
        shared = 3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_gated else 0)
        return e * 3 * h * self.moe_intermediate_size + router + shared

    def num_params(self, include_embeddings: bool = True, active: bool = False) -> int:
        """Number of parameters, counted from the shapes (biases and norms included). ``active``: an MoE model's
        parameters one token runs through (its top-k routed experts and the shared one; equal to the total for
        a dense model)."""
        h = self.hidden_size
        total = h  # final norm
        for layer in range(self.num_layers):  # attention + MLP + two RMSNorm weights
            total += self.attention_params() + self.mlp_params(layer, active) + 2 * h
        if include_embeddings:
            total += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total

    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> int:
        """Bytes of K and V cached per token over all layers: 2 * layers * kv_heads * (head_dim * bytes + scale).

        The scale term is ``KV_INT8_SCALE_BYTES`` for an int8 cache (one fp32 scale per token and KV head) and 0
        otherwise (fp8 keeps per-layer scales, not per-token ones). MLA: layers * (kv_lora_rank +
        qk_rope_head_dim) * bytes (DeepSeek-V2 paper, section 2.1.4: one compressed latent and one rotary key).
        """
        scale = KV_INT8_SCALE_BYTES if canonical_dtype(kv_dtype) == "int8" else 0
        if self.is_mla:  # one latent + one rotary key per token and layer, no separate V
            return self.num_layers * (self.cache_entry[1] * dtype_bytes(kv_dtype) + scale)
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * dtype_bytes(kv_dtype) + scale)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each weight matrix a quantization applies to, per layer: q, k, v, o, gate, up, down.

        The LM head is quantized with them only when it has its own weights; a tied head shares the embedding
        table, which stays in the activation dtype (a lookup table, read one row per token).
        """
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (self.q_size, h),
            "k_proj": (self.kv_size, h),
            "v_proj": (self.kv_size, h),
            "o_proj": (h, self.q_size),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
        }

    def check_quantization(self, quantization: str | None, group_size: int = DEFAULT_GROUP_SIZE) -> None:
        """A ``ConfigError`` naming the matrix when ``quantization`` cannot apply to this shape (before any load)."""
        q = canonical_quantization(quantization)
        if q is not None and (self.is_moe or self.is_mla):
            raise ConfigError(
                f"{self.name}: weight quantization of mixture-of-experts and MLA models is not implemented; "
                "run it unquantized (--quantization none)"
            )
        if q != "int4":
            return
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
            raise ConfigError(f"int4 group size must be a positive integer, got {group_size!r}")
        shapes = dict(self.linear_shapes())
        if not self.tie_word_embeddings:
            shapes["lm_head"] = (self.vocab_size, self.hidden_size)
        for name, (_, fan_in) in shapes.items():
            if fan_in % group_size:
                raise ConfigError(
                    f"{self.name}: int4 group size {group_size} does not divide {name}'s input size {fan_in}"
                )

    def weight_bytes(
        self, dtype: str = "bf16", quantization: str | None = None, group_size: int = DEFAULT_GROUP_SIZE
    ) -> int:
        """Bytes of all weights: the linear layers and the LM head under ``quantization`` with their scales,
        everything else (embedding, norms, biases) in ``dtype``. A tied head under a quantization is a quantized copy
        of the embedding table (the table stays in ``dtype`` for the lookup): both are held and counted."""
        q = canonical_quantization(quantization)
        if q is None:
            return self.num_params() * dtype_bytes(dtype)
        self.check_quantization(q, group_size)
        shapes = self.linear_shapes()
        quantized = self.num_layers * sum(
            quantized_matrix_bytes(o, i, q, dtype, group_size) for o, i in shapes.values()
        )
        plain = self.num_params() - self.num_layers * sum(o * i for o, i in shapes.values())
        quantized += quantized_matrix_bytes(self.vocab_size, self.hidden_size, q, dtype, group_size)
        if not self.tie_word_embeddings:
            plain -= self.vocab_size * self.hidden_size
        return quantized + plain * dtype_bytes(dtype)

    def with_overrides(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again), e.g. ``num_kv_heads=1`` for an MQA variant."""
        data = asdict(self)
        data.update(changes)
        return ModelConfig(**data)

    # ---- HF config.json ---------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], name: str | None = None) -> ModelConfig:
        """Build from the dict of an HF ``config.json`` (Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE, DeepSeek-V3)."""
        where = name or hf.get("_name_or_path") or "config.json"
        archs = hf.get("architectures") or []
        if not archs:
            model_type = hf.get("model_type")
            archs = [a for a, t in MODEL_TYPES.items() if t == model_type]
        if not archs:
            raise ConfigError(f"{where}: no 'architectures' or known 'model_type' in config")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"{where}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if k not in hf
        ]
        if missing:
            raise ConfigError(f"{where}: config is missing required key(s) {missing}")
        num_heads = hf["num_attention_heads"]
        num_kv_heads = hf.get("num_key_value_heads") or num_heads
        head_dim = hf.get("head_dim") or (hf["hidden_size"] // num_heads)
        if hf.get("head_dim") is None and hf["hidden_size"] % num_heads != 0:
            raise ConfigError(
                f"{where}: hidden_size ({hf['hidden_size']}) is not divisible by num_attention_heads "
                f"({num_heads}) and no head_dim is given"
            )
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        rope_params = hf.get("rope_parameters")  # transformers >= 5 folds theta and scaling into this dict
        for key, value in (("rope_scaling", rope_scaling), ("rope_parameters", rope_params)):
            if value is not None and not isinstance(value, dict):
                raise ConfigError(
                    f'{where}: {key} must be an object such as {{"rope_type": "llama3", "factor": 8.0, ...}} '
                    f"or null, got {value!r}"
                )
        if rope_params:
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        attention_bias = bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM"))
        if arch == "Qwen2MoeForCausalLM":
            attention_bias = bool(hf.get("qkv_bias", True))
        moe_mla = _moe_mla_fields(arch, hf, where)
        if moe_mla.get("kv_lora_rank"):
            head_dim = moe_mla["qk_nope_head_dim"] + moe_mla["qk_rope_head_dim"]
        sliding = hf.get("sliding_window") if hf.get("use_sliding_window", arch == "MistralForCausalLM") else None
        dtype = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
        known = {
            "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
            "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings", "attention_bias",
            "bos_token_id", "eos_token_id", "sliding_window", "torch_dtype", "dtype", "model_type",
        } | _MOE_MLA_KEYS  # fmt: skip
        return cls(
            name=name or str(hf.get("_name_or_path") or arch),
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=sliding,
            torch_dtype=canonical_dtype(dtype),
            extra={k: v for k, v in hf.items() if k not in known},
            **moe_mla,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The HF ``config.json`` dict for this shape (what ``transformers.AutoConfig.for_model`` takes)."""
        hf: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": MODEL_TYPES[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "torch_dtype": {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(self.torch_dtype),
        }
        if self.architecture == "LlamaForCausalLM":
            hf["attention_bias"] = self.attention_bias
            hf["mlp_bias"] = False
        if self.architecture == "MistralForCausalLM":
            hf["sliding_window"] = self.sliding_window
        if self.architecture == "Qwen2ForCausalLM":
            if not self.attention_bias:
                raise ConfigError(f"{self.name}: Qwen2 always has QKV bias; attention_bias=False is not Qwen2")
            hf["use_sliding_window"] = False
            hf["sliding_window"] = None
        hf |= self._moe_mla_hf_keys()
        return hf

    def _moe_mla_hf_keys(self) -> dict[str, Any]:
        """The HF keys of the MoE and MLA architectures (the inverse of ``_moe_mla_fields``)."""
        arch = self.architecture
        if arch == "MixtralForCausalLM":
            if self.intermediate_size != self.moe_intermediate_size or self.dense_layers or not self.norm_topk_prob:
                raise ConfigError(f"{self.name}: Mixtral has only MoE layers of intermediate_size, top-k renormalised")
            return {"num_local_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                    "sliding_window": self.sliding_window}  # fmt: skip
        if arch == "Qwen2MoeForCausalLM":
            return {
                "num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
                "decoder_sparse_step": 1, "mlp_only_layers": list(self.dense_layers), "qkv_bias": self.attention_bias,
                "use_sliding_window": False,
            }  # fmt: skip
        if arch == "Qwen3MoeForCausalLM":
            if self.shared_expert_intermediate_size or not self.qk_norm:
                raise ConfigError(f"{self.name}: Qwen3-MoE has no shared expert and always normalises q and k")
            return {
                "num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": 1, "mlp_only_layers": list(self.dense_layers),
                "attention_bias": self.attention_bias, "use_sliding_window": False,
            }  # fmt: skip
        if arch == "DeepseekV3ForCausalLM":
            first_dense = len(self.dense_layers)
            if tuple(range(first_dense)) != tuple(self.dense_layers):
                raise ConfigError(f"{self.name}: DeepSeek-V3's dense layers are the first k (first_k_dense_replace)")
            shared = self.shared_expert_intermediate_size // self.moe_intermediate_size
            return {
                "n_routed_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                "n_shared_experts": shared, "n_group": self.n_group, "topk_group": self.topk_group,
                "routed_scaling_factor": self.routed_scaling_factor, "first_k_dense_replace": first_dense,
                "q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
                "qk_rope_head_dim": self.qk_rope_head_dim, "qk_nope_head_dim": self.qk_nope_head_dim,
                "v_head_dim": self.v_head_dim, "rope_interleave": self.rope_interleave,
                "head_dim": self.qk_rope_head_dim, "attention_bias": False,
            }  # fmt: skip
        return {}

    @classmethod
    def from_json(cls, path: str | Path, name: str | None = None) -> ModelConfig:
        path = Path(path)
        hf = read_json_file(path, "config file")
        if not isinstance(hf, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls.from_hf_config(hf, name=name or (path.stem if path.name != "config.json" else path.parent.name))

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        """A preset from ``data/models/``, by file stem (case-insensitive), e.g. ``Llama-3.1-8B``, ``tiny-gqa``, or
        by the hub id of the model it describes (``meta-llama/Llama-3.1-8B``: ``preset_of_hub_id``)."""
        presets = {p.stem.lower(): p for p in MODELS_DIR.glob("*.json")}
        path = presets.get(name.lower()) or presets.get(str(preset_of_hub_id(name)).lower())
        if path is None:
            import difflib

            near = difflib.get_close_matches(name.lower(), list(presets), n=1)
            hint = f"did you mean {presets[near[0]].stem}? " if near else ""
            raise ConfigError(f"unknown model preset {name!r}; {hint}known presets: {', '.join(preset_names())}")
        return cls.from_json(path, name=path.stem)

    @classmethod
    def resolve(cls, name_or_path: str | Path) -> ModelConfig:
        """A preset name (or a preset's hub id), a ``config.json`` file, or a checkpoint directory containing one.
        A path that does not exist, and is no preset, is an error saying so."""
        path = Path(name_or_path)
        if path.is_dir():
            if not (path / "config.json").exists():
                raise ConfigError(f"{path}: directory has no config.json")
            return cls.from_json(path / "config.json", name=path.name)
        if path.suffix == ".json" and path.exists():
            return cls.from_json(path)
        text = str(name_or_path)
        if preset_of_hub_id(text) is None and (path.suffix == ".json" or looks_like_path(text)):
            hub = " nor the hub id of a preset (weights are not downloaded)" if text.count("/") == 1 else ""
            raise ConfigError(
                f"{text}: no such checkpoint directory or config.json, and not a preset{hub}; give an existing "
                f"path or a preset ({', '.join(preset_names())})"
            )
        return cls.from_name(text)

    def summary(self) -> dict[str, Any]:
        """A small table-friendly description."""
        return {
            "name": self.name,
            "architecture": self.architecture,
            "attention": f"{self.attention_kind} ({self.num_heads}q/{self.num_kv_heads}kv)",
            "layers": self.num_layers,
            "hidden": self.hidden_size,
            "head_dim": self.head_dim,
            "params_M": round(self.num_params() / 1e6, 1),
            "kv_bytes_per_token_bf16": self.kv_bytes_per_token("bf16"),
        }


_MOE_MLA_KEYS = {
    "num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
    "norm_topk_prob", "shared_expert_intermediate_size", "n_shared_experts", "decoder_sparse_step", "mlp_only_layers",
    "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor", "scoring_func", "topk_method",
    "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_interleave", "qkv_bias",
    "moe_layer_freq",
}  # fmt: skip


def _moe_mla_fields(arch: str, hf: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig's MoE and MLA fields from the HF keys of Mixtral, Qwen2-MoE and DeepSeek-V3 configs."""
    layers = hf["num_hidden_layers"]
    if arch == "MixtralForCausalLM":
        return {"num_experts": hf.get("num_local_experts", 8), "num_experts_per_tok": hf.get("num_experts_per_tok", 2),
                "moe_intermediate_size": hf["intermediate_size"], "norm_topk_prob": True}  # fmt: skip
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        qwen3 = arch == "Qwen3MoeForCausalLM"
        step = hf.get("decoder_sparse_step", 1)
        only = set(hf.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step != 0)
        return {
            # transformers 5 writes Qwen3-MoE's count as num_local_experts, the published config as num_experts
            "num_experts": hf.get("num_experts", hf.get("num_local_experts", 128 if qwen3 else 60)),
            "num_experts_per_tok": hf.get("num_experts_per_tok", 8 if qwen3 else 4),
            "moe_intermediate_size": hf.get("moe_intermediate_size", 768 if qwen3 else 1408),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "shared_expert_intermediate_size": 0 if qwen3 else hf.get("shared_expert_intermediate_size", 0),
            "shared_expert_gated": not qwen3,
            "dense_layers": dense,
            "qk_norm": qwen3,
        }
    if arch == "DeepseekV3ForCausalLM":
        if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ConfigError(f"{where}: DeepSeek-V3 routing is scoring_func 'sigmoid' with topk_method 'noaux_tc'")
        if hf.get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"{where}: moe_layer_freq {hf['moe_layer_freq']} is not supported (only 1)")
        moe_size = hf.get("moe_intermediate_size", 2048)
        return {
            "num_experts": hf.get("n_routed_experts", 256),
            "num_experts_per_tok": hf.get("num_experts_per_tok", 8),
            "moe_intermediate_size": moe_size,
            "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
            "router_scoring": "sigmoid",
            "n_group": hf.get("n_group", 8),
            "topk_group": hf.get("topk_group", 4),
            "routed_scaling_factor": float(hf.get("routed_scaling_factor", 2.5)),
            "shared_expert_intermediate_size": moe_size * hf.get("n_shared_experts", 1),
            "dense_layers": tuple(range(min(hf.get("first_k_dense_replace", 3), layers))),
            "q_lora_rank": hf.get("q_lora_rank", 1536),
            "kv_lora_rank": hf.get("kv_lora_rank", 512),
            "qk_rope_head_dim": hf.get("qk_rope_head_dim", 64),
            "qk_nope_head_dim": hf.get("qk_nope_head_dim", 128),
            "v_head_dim": hf.get("v_head_dim", 128),
            "rope_interleave": bool(hf.get("rope_interleave", True)),
        }
    return {}


def looks_like_path(text: str) -> bool:
    """True for what a user meant as a path: it has a slash, or starts with '.' or '~'."""
    return "/" in text or "\\" in text or text.startswith((".", "~"))


def preset_of_hub_id(text: str) -> str | None:
    """The preset describing the model of a Hugging Face hub id ``org/name`` (``meta-llama/Llama-3.1-8B`` ->
    ``Llama-3.1-8B``; ``meta-llama/Meta-Llama-3.1-8B`` too), or None. Only the shape is the model's: a preset's
    weights are random."""
    parts = str(text).split("/")
    if len(parts) != 2 or not all(parts) or Path(text).exists():
        return None
    presets = {name.lower(): name for name in preset_names()}
    name = parts[1].lower()
    return presets.get(name) or presets.get(name.removeprefix("meta-"))


def preset_names() -> list[str]:
    """Names of the presets in ``data/models/``, sorted."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = [
    "ModelConfig",
    "ConfigError",
    "canonical_dtype",
    "dtype_bytes",
    "preset_names",
    "ceil_div",
    "DTYPE_BYTES",
    "QUANTIZATIONS",
    "KV_CACHE_DTYPES",
    "DEFAULT_GROUP_SIZE",
    "canonical_quantization",
    "resolve_kv_cache_dtype",
    "quantized_matrix_bytes",
]


def parse_disaggregate(spec: str) -> tuple[int, int]:
    """'P:D' -> (P, D): prefill and decode engines or replicas (``--disaggregate`` of replay, generate, simulate)."""
    try:
        p, d = (int(x) for x in str(spec).split(":"))
    except ValueError:
        raise ConfigError(
            f"--disaggregate takes P:D (prefill : decode engines or replicas, e.g. 1:1), got {spec!r}"
        ) from None
    if p < 1 or d < 1:
        raise ConfigError(f"--disaggregate P:D needs at least one prefill and one decode, got {spec!r}")
    return p, d
