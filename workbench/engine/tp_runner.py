"""Tensor-parallel execution of the engine's steps: the driver schedules and samples, every rank runs its shard.

    Engine (rank 0: scheduler, block manager, sampler)
      -> TensorParallelRunner.execute(plan): the step's flat input ids and attention metadata, built once on the
         driver (``ModelRunner.prepare``), go to every rank in one broadcast (``WorkerGroup.call``)
      -> ShardWorker.run on each rank: its model shard (``workbench.model.sharding``) over its shard of the paged
         KV pool (the same blocks, its own KV heads), two all-reduces per layer, its slice of the logits
      -> rank 0 gathers the logits and samples.

Every rank holds a pool of the same number of blocks, and the one block table the driver's block manager keeps
addresses all of them; a rank's blocks hold only its KV heads, so a rank's pool is ``1 / tp`` of the whole (or a
replicated KV head's share when ``tp`` exceeds ``num_kv_heads``).

Pure decodes go through each rank's ``DecodeStep`` in its eager mode, other steps through the ragged ``forward``
(the compiled and CUDA-graph modes are not used under tensor parallelism yet; ``EngineConfig`` says so). Each
rank times its all-reduces when asked (``comm_stats``), which is how ``bench decode`` reports the share of a step
spent communicating.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from workbench.device import resolve_device, synchronize, torch_dtype
from workbench.dist.group import DistConfig, WorkerGroup, launched_by_torchrun, run_worker
from workbench.engine.config import EngineConfig
from workbench.engine.decode_step import DecodeStep
from workbench.engine.prefill_step import PrefillStep
from workbench.engine.runner import ModelRunner, make_backend
from workbench.engine.scheduler import StepPlan
from workbench.errors import ConfigError
from workbench.kv.cache import KVCache
from workbench.model.attention import TORCH_BACKEND, build_metadata
from workbench.model.sharding import all_reduce, gather_logits
from workbench.timing import now, set_threads


class ShardWorker:
    """One rank of a tensor-parallel engine: a model shard and its shard of the KV pool. ``group``: the ranks'
    process group when they are a subgroup of a larger world (a disaggregated pool); None: the whole world."""

    def __init__(
        self, rank: int, world_size: int, source: str, dtype: str, device: str, seed: int, num_threads: int | None,
        group: Any = None,
    ) -> None:  # fmt: skip
        if num_threads is not None:
            set_threads(num_threads)
        self.rank, self.world_size, self.group = rank, world_size, group
        self.load(source, dtype, device, seed)

    def load(self, source: str, dtype: str, device: str, seed: int) -> None:
        """Load this rank's shard of ``source`` (a checkpoint directory or a preset); drops any earlier one."""
        from workbench.model.checkpoint import load_model

        self.device = resolve_device(device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        tp = (self.rank, self.world_size)
        self.model = load_model(source, torch_dtype(dtype), self.device, seed, tensor_parallel=tp)
        self.shard = self.model.tp_shard
        self.cache: KVCache | None = None
        self.backend: Any = TORCH_BACKEND
        self.comm_s, self.num_all_reduces, self._timing = 0.0, 0, False
        for layer in self.model.layers:
            layer.self_attn.reduce = layer.mlp.reduce = self._all_reduce

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._timing:
            return all_reduce(tensor, self.group)
        synchronize(self.device)
        start = now()
        all_reduce(tensor, self.group)
        synchronize(self.device)
        self.comm_s += now() - start
        self.num_all_reduces += 1
        return tensor

    def setup_cache(
        self, num_blocks: int, block_size: int, attention_backend: str, max_num_seqs: int, max_model_len: int
    ) -> None:
        """Allocate this rank's shard of a pool of ``num_blocks`` blocks, its backend and its decode step."""
        self.cache = KVCache(self.model.config, num_blocks, block_size, dtype=self.model.dtype, device=self.device)
        self.backend = make_backend(attention_backend)
        self.decode = DecodeStep(self.model, self.cache, self.backend, "eager", max_num_seqs, max_model_len)
        self.prefill = PrefillStep(self.model, self.cache, self.backend, compile=False)

    def run(self, step: dict[str, Any]) -> torch.Tensor | None:
        """One step on this rank from the driver's plain lists; rank 0 returns the full logits of the sampling
        rows (None when no token samples, and on the other ranks). A pure decode the decode step takes goes
        through it (every rank decides alike: the same lengths and limits); anything else is one ragged forward."""
        if step["decode"] and self.decode.supports(step["seq_lens"]):
            local = self.decode.run(step["tokens"], step["seq_lens"], step["tables"])
        else:
            meta = build_metadata(step["query_lens"], step["seq_lens"], step["tables"], self.cache.block_size,
                                  self.device)  # fmt: skip
            ids = torch.tensor(step["tokens"], dtype=torch.long, device=self.device)
            hidden = self.prefill.run(ids, meta)
            if not step["rows"]:
                return None
            local = self.model.compute_logits(hidden[meta.last_token_indices[step["rows"]]])
        return gather_logits(local, self.shard, self.group)

    def comm_stats(self, reset: bool = True, enable: bool = True) -> dict[str, float]:
        """All-reduce seconds and count since the last call on this rank (the driver reports rank 0's)."""
        out = {"all_reduce_s": self.comm_s, "num_all_reduces": self.num_all_reduces}
        if reset:
            self.comm_s, self.num_all_reduces = 0.0, 0
        self._timing = enable
        return out


class TensorParallelRunner(ModelRunner):
    """The driver's runner over a ``WorkerGroup`` of ``ShardWorker`` ranks (rank 0 is this process): it makes
    the step's lists once (``prefill_inputs`` / ``prepare_decode``), every rank runs them, rank 0 samples."""

    def __init__(
        self, group: WorkerGroup, num_blocks: int, block_size: int, config: EngineConfig, max_model_len: int
    ) -> None:
        group.call("setup_cache", num_blocks, block_size, config.attention_backend, config.max_num_seqs,
                   max_model_len)  # fmt: skip
        worker: ShardWorker = group.worker
        super().__init__(worker.model, worker.cache, worker.backend, worker.decode, worker.prefill)
        self.group = group

    def execute(self, plan: StepPlan) -> dict[int, int]:
        if plan.is_empty:
            return {}
        rows = [i for i, c in enumerate(plan.chunks) if c.samples]
        if plan.is_pure_decode:
            tokens, seq_lens, tables = self.prepare_decode(plan)
            step = {"decode": True, "tokens": tokens, "query_lens": [1] * len(tokens)}
        else:
            tokens, query_lens, seq_lens, tables = self.prefill_inputs(plan)
            step = {"decode": False, "tokens": tokens, "query_lens": query_lens}
        step |= {"seq_lens": seq_lens, "tables": [list(t) for t in tables], "rows": rows}
        logits = self._timed(self.group.call, "run", step)
        return {} if logits is None else self._sample(plan, logits, rows)


def start_workers(
    source: str, tensor_parallel_size: int, dtype: str, device: str, seed: int, num_threads: int | None = None
) -> WorkerGroup:
    """Spawn the ranks of a tensor-parallel engine and load every shard (rank 0 in this process).

    Under ``torchrun`` (multi-node use) nothing is spawned: every process torchrun started runs this, rank 0 becomes
    the driver and returns its group, and every other rank serves it until the run ends, then exits (0).
    """
    from workbench.model.checkpoint import check_model_source

    check_model_source(source)  # a bad checkpoint is one line here, not a traceback from every rank
    args = (str(source), dtype, device, seed, num_threads)
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != tensor_parallel_size:
            raise ConfigError(
                f"tensor_parallel_size {tensor_parallel_size}, but torchrun started {world} processes; they must match"
            )
        if int(os.environ["RANK"]) != 0:
            run_worker(ShardWorker, *args, timeout_s=120.0)
            # a worker rank's whole life is serving the driver; leave without C++ static destructors, which can
            # abort after the group is destroyed ("terminate called without an active exception", under load)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        return WorkerGroup.from_env(ShardWorker, args, timeout_s=120.0)
    return WorkerGroup(DistConfig(tensor_parallel_size, timeout_s=120.0), ShardWorker, args)
