"""Megatron-style tensor parallelism of the Llama-family model: which slice of every weight a rank holds.

With ``tp`` ranks (Shoeybi et al., 2019, "Megatron-LM", section 3):
- attention is split by heads. The fused QKV projection is **column-parallel**: rank r holds the rows of its
  ``num_heads / tp`` query heads and of the KV heads they read; the output projection is **row-parallel**: rank r
  holds the columns of its query heads, and the partial products are summed by one all-reduce per layer.
  When ``tp`` exceeds ``num_kv_heads`` (MQA, or GQA with few KV heads), each KV head is **replicated** on the
  ``tp / num_kv_heads`` ranks whose query heads read it, as vLLM does;
- the MLP is split by the intermediate dimension: gate/up column-parallel, down row-parallel, one all-reduce;
- norms, rotary tables and the **token embedding are replicated**: a lookup reads only one row per token, so
  splitting it would save memory but cost a third all-reduce per step for nothing a step reads;
- the **LM head is vocabulary-parallel**: rank r computes the logits of its slice of the vocabulary and the
  driver gathers them (only the driver samples). The head is decode's largest single weight read on small models,
  so it is split; with tied embeddings the slice is a view of the replicated embedding, so it costs no memory.

Each rank's model is an ordinary ``Transformer`` built from ``local_config`` (fewer heads, a narrower MLP) whose
two row-parallel outputs call ``reduce`` (the all-reduce). ``TensorParallelShard.take`` cuts a rank's slice out
of a checkpoint tensor, so the loader reads only that slice from the safetensors file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from workbench.config import ModelConfig, ceil_div
from workbench.device import graph_op
from workbench.errors import ConfigError
from workbench.model.layers import RotaryEmbedding
from workbench.model.transformer import Transformer


def check_tensor_parallel_size(cfg: ModelConfig, tp: int) -> None:
    """ConfigError naming the constraint when ``cfg`` cannot be split over ``tp`` ranks."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    if tp > 1 and (cfg.is_moe or cfg.is_mla):
        raise ConfigError(
            f"{cfg.name}: tensor parallelism of mixture-of-experts and MLA models is not implemented in the engine; "
            "run it with tensor_parallel_size 1 (the simulator and the planner model expert parallelism)"
        )
    if cfg.num_heads % tp:
        raise ConfigError(
            f"tensor_parallel_size {tp} must divide {cfg.name}'s num_heads ({cfg.num_heads}): each rank holds "
            f"an equal share of the attention heads"
        )
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ConfigError(
            f"tensor_parallel_size {tp} must divide {cfg.name}'s num_kv_heads ({cfg.num_kv_heads}) or be a "
            f"multiple of it (KV heads are then replicated)"
        )
    if cfg.intermediate_size % tp:
        raise ConfigError(
            f"tensor_parallel_size {tp} must divide {cfg.name}'s intermediate_size ({cfg.intermediate_size})"
        )


@dataclass(frozen=True)
class TensorParallelShard:
    """Rank ``rank`` of ``tp``: the slices of the full model's weights it holds."""

    cfg: ModelConfig  # the full model
    rank: int
    tp: int

    def __post_init__(self) -> None:
        check_tensor_parallel_size(self.cfg, self.tp)
        if not 0 <= self.rank < self.tp:
            raise ConfigError(f"rank {self.rank} outside [0, {self.tp})")

    # ---- head and row ranges -------------------------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        return self.cfg.num_heads // self.tp

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.cfg.num_kv_heads // self.tp)

    @property
    def first_kv_head(self) -> int:
        """The first KV head this rank holds (with replication: the one its query heads read)."""
        first_q_head = self.rank * self.num_heads
        return first_q_head // self.cfg.num_queries_per_kv

    @property
    def vocab_range(self) -> tuple[int, int]:
        """[start, end) of this rank's slice of the vocabulary (the last slices may be one shorter)."""
        per = ceil_div(self.cfg.vocab_size, self.tp)
        start = min(self.rank * per, self.cfg.vocab_size)
        return start, min(start + per, self.cfg.vocab_size)

    def local_config(self) -> ModelConfig:
        """The shape of this rank's model: its heads and its share of the MLP; vocabulary and hidden size full."""
        return dataclasses.replace(
            self.cfg,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.cfg.intermediate_size // self.tp,
        )

    # ---- slicing checkpoint tensors ------------------------------------------------------------------------
    def rows(self, hf_name: str) -> slice | None:
        """The rows (dim 0) of ``hf_name`` this rank reads, or None for all of them."""
        d, i = self.cfg.head_dim, self.cfg.intermediate_size // self.tp
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            return slice(self.rank * self.num_heads * d, (self.rank + 1) * self.num_heads * d)
        if hf_name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            return slice(self.first_kv_head * d, (self.first_kv_head + self.num_kv_heads) * d)
        if hf_name.endswith(("gate_proj.weight", "up_proj.weight")):
            return slice(self.rank * i, (self.rank + 1) * i)
        if hf_name == "lm_head.weight":
            return slice(*self.vocab_range)
        return None

    def take(self, tensor_slice: object, hf_name: str) -> torch.Tensor:
        """This rank's slice of a tensor: ``tensor_slice`` is a safetensors slice (``get_slice``) or a tensor;
        indexing a safetensors slice reads only the selected bytes from the file."""
        d, i = self.cfg.head_dim, self.cfg.intermediate_size // self.tp
        if hf_name.endswith("o_proj.weight"):  # the row-parallel layers: this rank's columns
            return tensor_slice[:, self.rank * self.num_heads * d : (self.rank + 1) * self.num_heads * d]
        if hf_name.endswith("down_proj.weight"):
            return tensor_slice[:, self.rank * i : (self.rank + 1) * i]
        rows = self.rows(hf_name)
        return tensor_slice[:] if rows is None else tensor_slice[rows]


def empty_shard_model(shard: TensorParallelShard, device: torch.device | str = "cpu") -> Transformer:
    """This rank's model with uninitialised weights, allocated at the shard's sizes only (the LM head too)."""
    local = shard.local_config()
    with torch.device("meta"):
        model = Transformer(local)
        if not local.tie_word_embeddings:
            start, end = shard.vocab_range
            model.lm_head = nn.Linear(local.hidden_size, end - start, bias=False)
    model = model.to_empty(device=device)
    model.rotary = RotaryEmbedding(local).to(device)  # buffers are not parameters: rebuilt after to_empty
    return model


def shard_model(model: Transformer, shard: TensorParallelShard, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Make ``model`` (from ``empty_shard_model``, weights loaded) a tensor-parallel rank: the row-parallel outputs
    call ``reduce`` (the all-reduce), and a tied LM head becomes a view of this rank's rows of the embedding."""
    model.tp_shard = shard  # the full model's config and this rank's place in it
    for layer in model.layers:
        layer.self_attn.reduce = reduce
        layer.mlp.reduce = reduce
    if model.config.tie_word_embeddings:
        start, end = shard.vocab_range
        with torch.device("meta"):
            model.lm_head = nn.Linear(model.config.hidden_size, end - start, bias=False)
        model.lm_head.weight = nn.Parameter(model.embed_tokens.weight.data[start:end], requires_grad=False)


# the reduce functions of this process's ranks (one per ``Worker``), addressed by index from ``traced_reduce``'s op
_REDUCERS: list[Callable[[torch.Tensor], torch.Tensor]] = []


# a copy of ``tensor`` summed over the ranks by the registered reduce function ``reducer``
_tp_all_reduce = graph_op(
    "workbench::tp_all_reduce",
    "(Tensor tensor, int reducer) -> Tensor",
    lambda tensor, reducer: _REDUCERS[reducer](tensor.clone()),
    lambda tensor, reducer: torch.empty_like(tensor),
)


def traced_reduce(reduce: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``reduce`` (an in-place all-reduce) as one opaque operator (``workbench::tp_all_reduce``), for the row-parallel
    layers' ``reduce``: eagerly it is a call, and ``torch.compile`` (the compiled decode and prefill steps) keeps it
    as one call in the graph instead of tracing into torch.distributed (a CUDA graph records the collective)."""
    _REDUCERS.append(reduce)
    index = len(_REDUCERS) - 1
    return lambda tensor: _tp_all_reduce(tensor, index)


def all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> torch.Tensor:
    """Sum (or ``op``) ``tensor`` over the ranks of the running torch.distributed group (or of ``group``, a
    subgroup), in place (the row-parallel layers' one collective; a no-op without a group or with one rank)."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def gather_logits(
    local: torch.Tensor, shard: TensorParallelShard, group: dist.ProcessGroup | None = None
) -> torch.Tensor | None:
    """The full (N, vocab) logits on rank 0 (of the world, or of ``group``) from every rank's (N, vocab slice); None
    on the other ranks. Slices are padded to one length for ``dist.gather`` and trimmed again."""
    if shard.tp == 1:
        return local
    width = ceil_div(shard.cfg.vocab_size, shard.tp)  # the longest slice of any rank
    padded = torch.nn.functional.pad(local, (0, width - local.shape[-1]))
    parts = [torch.empty_like(padded) for _ in range(shard.tp)] if shard.rank == 0 else None
    dist.gather(padded, parts, group=group, group_dst=0)  # group None: the world, whose rank 0 is 0
    if parts is None:
        return None
    sizes = [TensorParallelShard(shard.cfg, r, shard.tp).vocab_range for r in range(shard.tp)]
    return torch.cat([p[:, : end - start] for p, (start, end) in zip(parts, sizes)], dim=-1)
