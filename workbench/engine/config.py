"""EngineConfig: how the engine lays out its KV cache and schedules, validated with errors that name the field.

Two cache layouts over the same pool type (``workbench.kv.cache.KVCache``):
- ``paged``: ``num_blocks`` blocks of ``block_size`` tokens shared by all requests (vLLM's PagedAttention);
  ``num_blocks`` is given, or derived from ``kv_cache_bytes``, or by default enough for ``max_num_seqs`` sequences of
  ``max_model_len`` tokens (capped at ``DEFAULT_KV_BUDGET_BYTES``).
- ``contiguous``: a static per-slot cache as in frameworks without paging: ``max_num_seqs`` slots, each reserving
  ``max_model_len`` tokens (one block of that size per sequence). No prefix caching.

Scheduler knobs (policy, max_num_seqs, token_budget, chunk_size, prefix caching) are passed to
``workbench.engine.scheduler.SchedulerConfig``, which documents each policy. They live, with the KV-pool sizes, in
``ServingConfig``, which the simulator's ``SimConfig`` extends too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workbench.config import (
    DEFAULT_GROUP_SIZE,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    ModelConfig,
    canonical_dtype,
    canonical_quantization,
    check_positive_ints,
    resolve_kv_cache_dtype,
)
from workbench.engine.scheduler import (
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_MAX_NUM_SEQS,
    POLICIES,
    SchedulerConfig,
    check_policy,
)
from workbench.engine.speculative import SpeculativeConfig
from workbench.errors import ConfigError
from workbench.kv.sizing import plan_num_blocks

CACHE_LAYOUTS = ("paged", "contiguous")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")  # auto: cpu on the CPU where it builds, else torch
ENGINE_DTYPES = ("fp32", "fp16", "bf16")  # int8/fp8 are roofline and simulator dtypes, not engine ones
DEFAULT_KV_BUDGET_BYTES = 2 * 1024**3


def option(flag: str, help: str, aliases: tuple[str, ...] = (), **argparse_kwargs: Any) -> dict[str, Any]:
    """The command-line face of a ``ServingConfig`` field (its ``dataclasses.field`` metadata): the flag (vLLM's name
    where vLLM has the concept), deprecated older spellings that still work with a warning, the help (which says
    the unit) and any extra argparse keywords (``choices``, ``metavar``). ``workbench.commands.common.
    add_serving_arguments`` builds every command's options from these, with the default of the config it builds."""
    return {"flag": flag, "help": help, "aliases": aliases, "argparse": argparse_kwargs}


@dataclass
class ServingConfig:
    """The serving fields shared by the engine (``EngineConfig``) and the simulator (``SimConfig``), declared once,
    validated once (``__post_init__``) and turned into every command's options once (each field's ``option``).

    ``max_model_len`` None: ``min(model's max positions, DEFAULT_MAX_MODEL_LEN)``. ``token_budget`` (vLLM's
    ``max_num_batched_tokens``) and ``chunk_size`` None: the scheduler's defaults (``default_token_budget``).
    ``num_blocks`` or ``kv_cache_bytes`` (at most one is used) size the KV pool; each subclass says what None means.
    ``kv_cache_dtype`` is resolved here, once: 'auto' becomes the activations' ``dtype`` (so a config always holds
    what its KV pool stores: 'fp32', 'fp16', 'bf16', 'int8' or 'fp8').

    Two defaults differ between the engine and the simulator, each written once in the subclass with its reason:
    ``max_num_seqs`` (the CPU engine's 32, the simulated GPU server's 256 = vLLM's) and ``dtype`` (fp32, bf16).
    """

    policy: str = field(default="continuous", metadata=option(
        "--policy", "batching policy (see workbench.engine.scheduler; not vLLM's --scheduling-policy, which orders "
        "a queue by priority)", choices=POLICIES))  # fmt: skip
    block_size: int = field(default=16, metadata=option("--block-size", "tokens per KV block (paged)"))
    num_blocks: int | None = field(default=None, metadata=option(
        "--num-blocks", "KV blocks in the pool (default: derived from the memory)"))  # fmt: skip
    kv_cache_bytes: int | None = None
    max_num_seqs: int = field(default=DEFAULT_MAX_NUM_SEQS, metadata=option(
        "--max-num-seqs", "most sequences in one step"))  # fmt: skip
    max_model_len: int | None = field(default=None, metadata=option(
        "--max-model-len", f"longest sequence in tokens, prompt + output (default: min(model, "
        f"{DEFAULT_MAX_MODEL_LEN}))"))  # fmt: skip
    token_budget: int | None = field(default=None, metadata=option(
        "--max-num-batched-tokens", "new tokens per step over all sequences (default: 2048 for policy chunked, "
        "else max(max_model_len, 2048))", aliases=("--token-budget",)))  # fmt: skip
    chunk_size: int | None = field(default=None, metadata=option(
        "--chunk-size", "largest prefill chunk in tokens, policy chunked (default: the token budget)"))  # fmt: skip
    enable_prefix_caching: bool = field(default=False, metadata=option(
        "--enable-prefix-caching", "reuse cached KV blocks of shared prompt prefixes",
        aliases=("--prefix-caching",)))  # fmt: skip
    dtype: str = field(default="fp32", metadata=option(
        "--dtype", "activations and unquantized weights: fp32 | fp16 | bf16"))  # fmt: skip
    quantization: str | None = field(default=None, metadata=option(
        "--quantization", "weights of the linear layers: none, int8 (per channel), int4 (group-wise) weight-only; "
        "fp8 computes in FP8 (roofline and simulator only)", metavar="|".join(("none", *QUANTIZATIONS))))  # fmt: skip
    group_size: int = field(default=DEFAULT_GROUP_SIZE, metadata=option(
        "--group-size", "int4: inputs per (scale, zero) pair"))  # fmt: skip
    kv_cache_dtype: str = field(default="auto", metadata=option(
        "--kv-cache-dtype", "what the KV cache stores: auto (= --dtype), int8 (a scale per token and head), fp8 "
        "(e4m3)", aliases=("--kv-dtype",), metavar="|".join(KV_CACHE_DTYPES)))  # fmt: skip
    tensor_parallel_size: int = field(default=1, metadata=option(
        "--tensor-parallel-size", "ranks (processes, or GPUs of a replica) one model is sharded over"))  # fmt: skip

    def __post_init__(self) -> None:
        check_policy(self.policy)
        check_positive_ints(self, ("block_size", "max_num_seqs", "tensor_parallel_size", "group_size"))
        check_positive_ints(self, ("num_blocks", "kv_cache_bytes", "max_model_len", "token_budget", "chunk_size"),
                            optional=True)  # fmt: skip
        self.dtype = canonical_dtype(self.dtype)
        self.quantization = canonical_quantization(self.quantization)
        self.kv_cache_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype)  # the one place 'auto' resolves
        if self.enable_prefix_caching is not True and self.enable_prefix_caching is not False:
            raise ConfigError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")

    @property
    def max_num_batched_tokens(self) -> int | None:
        """vLLM's name of ``token_budget``."""
        return self.token_budget

    @property
    def kv_cache_quantized(self) -> bool:
        """True when the KV cache stores int8 or fp8 (with scales), not the activations' dtype."""
        return self.kv_cache_dtype in ("int8", "fp8")

    def resolved_max_model_len(self, model: ModelConfig) -> int:
        """``max_model_len``, or its default for this model; raises if the model has fewer positions."""
        if self.max_model_len is None:
            return min(model.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > model.max_position_embeddings:
            raise ConfigError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"({model.max_position_embeddings})"
            )
        return self.max_model_len

    def scheduler_config(self, model: ModelConfig) -> SchedulerConfig:
        return SchedulerConfig(
            policy=self.policy,
            max_num_seqs=self.max_num_seqs,
            token_budget=self.token_budget,
            chunk_size=self.chunk_size,
            max_model_len=self.resolved_max_model_len(model),
            enable_prefix_caching=self.enable_prefix_caching,
        )


@dataclass
class EngineConfig(ServingConfig):
    """The engine's settings: the shared ``ServingConfig`` plus cache layout, attention backend and device.

    ``quantization`` / ``group_size`` are applied by ``Engine.from_model`` at load time, ``packed_linears`` by the
    engine to the model it is given; ``decode_mode`` says how pure decodes run.
    """

    cache: str = "paged"
    attention_backend: str = "auto"
    device: str = "auto"
    compile_decode: bool = False  # CPU: pure decodes as compiled graphs, one per batch bucket (engine.decode_step)
    compile_prefill: bool = False  # CPU: a ragged step as one compiled graph (engine.prefill_step)
    packed_linears: bool = True  # CPU fp32: packed copies of the large weights (model.packed)
    speculative_config: SpeculativeConfig | dict | str | None = None  # engine.speculative; dict / JSON; None: off

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dtype not in ENGINE_DTYPES:
            raise ConfigError(
                f"dtype must be one of {', '.join(ENGINE_DTYPES)} (what the engine computes and caches in), "
                f"got {self.dtype!r}"
            )
        if self.cache not in CACHE_LAYOUTS:
            raise ConfigError(f"cache must be one of {CACHE_LAYOUTS}, got {self.cache!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        for flag in ("compile_decode", "compile_prefill", "packed_linears"):
            if getattr(self, flag) is not True and getattr(self, flag) is not False:
                raise ConfigError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        if self.quantization == "fp8":
            raise ConfigError("quantization 'fp8' (weights) is for the roofline and the simulator; the engine runs "
                              "int8 and int4 weights (and --kv-cache-dtype fp8 for the cache)")  # fmt: skip
        if self.tensor_parallel_size > 1 and self.compile_prefill:
            raise ConfigError(
                "compile_prefill is not supported with tensor_parallel_size > 1 yet (its warm-up runs on one rank); "
                "turn one of them off"
            )
        if self.compile_prefill and self.device.startswith("cuda"):
            raise ConfigError(f"compile_prefill is for the CPU, got device {self.device!r}; turn it off")
        if self.tensor_parallel_size > 1 and self.cache != "paged":
            raise ConfigError("tensor_parallel_size > 1 needs cache='paged'")
        if self.compile_decode and self.attention_backend == "triton":
            raise ConfigError("compile_decode compiles the torch or cpu attention path; use attention_backend "
                              "'auto', 'torch' or 'cpu'")  # fmt: skip
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None and self.tensor_parallel_size > 1:
            raise ConfigError(
                "speculative decoding is not supported with tensor_parallel_size > 1: its proposers run on the driver "
                "alone (the oracle runs the target model there, of which the driver holds one shard), and verification "
                "under tensor parallelism is not tested yet; drop one of them"
            )
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise ConfigError("give num_blocks or kv_cache_bytes, not both")
        if self.cache == "contiguous" and self.enable_prefix_caching:
            raise ConfigError("enable_prefix_caching needs cache='paged' (a contiguous slot cannot share blocks)")
        if self.cache == "contiguous" and (self.num_blocks is not None or self.kv_cache_bytes is not None):
            raise ConfigError("cache='contiguous' reserves max_num_seqs x max_model_len; num_blocks does not apply")

    def decode_mode(self, device_type: str) -> str:
        """The ``DecodeStep`` mode of this engine on a device of this type: compile, graph (CUDA) or eager. Under
        tensor parallelism on CUDA decode runs eagerly: recording NCCL all-reduces into CUDA graphs is not
        verified yet."""
        if self.compile_decode:
            return "compile"
        return "graph" if device_type == "cuda" and self.tensor_parallel_size == 1 else "eager"

    def cache_shape(self, model: ModelConfig) -> tuple[int, int]:
        """(num_blocks, block_size) of the pool for this model."""
        max_len = self.resolved_max_model_len(model)
        if self.cache == "contiguous":
            return self.max_num_seqs, max_len
        if self.num_blocks is not None:
            return self.num_blocks, self.block_size
        wanted = None if self.kv_cache_bytes is not None else self.max_num_seqs * max_len
        budget = self.kv_cache_bytes or DEFAULT_KV_BUDGET_BYTES
        return plan_num_blocks(model, self.block_size, self.kv_cache_dtype, budget, wanted), self.block_size
