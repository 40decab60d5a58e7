"""Executor: runs the engine's step plans on its workers, in this process (one device) or on N ranks; samples.

    Engine (scheduler) -> Executor.execute(plan): prepare_step(plan) -> StepInput, built once
      -> Worker.execute_model(step) on every rank (one broadcast under tensor parallelism, ``WorkerGroup.call``)
      -> the driver's logits (rank 0 gathers the vocabulary slices) -> Sampler / verification -> tokens

Every rank of a tensor-parallel engine holds a pool of the same number of blocks, addressed by the one block table
the driver's block manager keeps; a rank's blocks hold only its KV heads.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from workbench.config import DEFAULT_GROUP_SIZE
from workbench.dist.group import DistConfig, WorkerGroup, launched_by_torchrun, run_worker
from workbench.engine.config import EngineConfig
from workbench.engine.runner import ModelRunner, prepare_step
from workbench.engine.scheduler import StepPlan
from workbench.engine.spec_decode import verify
from workbench.engine.worker import Worker
from workbench.errors import ConfigError
from workbench.model.sampler import Sampler


class Executor:
    """The driver's side of an engine's workers: ``worker`` (rank 0, in this process) alone, or with ``workers``,
    the group of all ranks (``init_cache`` returns the driver's ``ModelRunner``); the sampler and
    speculative decoding's proposer state live here, on the driver, released with each request."""

    def __init__(self, worker: Worker, workers: WorkerGroup | None = None) -> None:
        self.worker, self.workers = worker, workers
        self.sampler = Sampler()
        self.speculator: Any = None

    def call(self, method: str, *args: Any) -> Any:
        """``Worker.method(*args)`` on every rank; the driver's result."""
        if self.workers is None:
            return getattr(self.worker, method)(*args)
        return self.workers.call(method, *args)

    def init_cache(self, config: EngineConfig, num_blocks: int, block_size: int, max_model_len: int) -> ModelRunner:
        """Every rank's runner for an engine of ``config`` (``Worker.init_cache``); returns the driver's."""
        self.call("init_cache", config, num_blocks, block_size, max_model_len)
        return self.worker.runner

    def execute(self, plan: StepPlan) -> dict[int, int | list[int]]:
        """Run one step on every rank; returns the sampled token of every chunk that samples (a speculating chunk:
        its accepted proposals and the target's token), by sequence id."""
        if plan.is_empty:
            return {}
        step = prepare_step(plan)
        logits = self.call("execute_model", step)
        if logits is None:
            return {}
        if plan.num_spec_tokens:
            return verify(plan, logits, self.sampler)
        seqs = [c.seq for c in plan.chunks if c.samples]
        tokens = self.sampler(logits, [s.sampling for s in seqs], [s.seq_id for s in seqs])
        return {s.seq_id: t for s, t in zip(seqs, tokens)}

    def release(self, seq_id: int) -> None:
        """Forget a finished or aborted request's sampling and proposal state."""
        self.sampler.release(seq_id)
        if self.speculator is not None:
            self.speculator.release(seq_id)

    def shutdown(self) -> None:
        """Stop the ranks of a tensor-parallel engine (nothing to do for one process). Safe to repeat."""
        if self.workers is not None:
            self.workers.shutdown()


def start_workers(
    source: str, tensor_parallel_size: int, dtype: str, device: str, seed: int, num_threads: int | None = None,
    quantization: str | None = None, group_size: int = DEFAULT_GROUP_SIZE,
) -> WorkerGroup:  # fmt: skip
    """Spawn the ranks of a tensor-parallel engine and load every shard (rank 0 in this process), quantized with
    ``quantization``.

    Under ``torchrun`` (multi-node use) nothing is spawned: every process torchrun started runs this, rank 0 becomes
    the driver and returns its group, and every other rank serves it until the run ends, then exits (0).
    """
    from workbench.model.checkpoint import check_model_source

    check_model_source(source)  # a bad checkpoint is one line here, not a traceback from every rank
    args = (str(source), dtype, device, seed, num_threads, None, quantization, group_size)
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != tensor_parallel_size:
            raise ConfigError(
                f"tensor_parallel_size {tensor_parallel_size}, but torchrun started {world} processes; they must match"
            )
        if int(os.environ["RANK"]) != 0:
            run_worker(Worker, *args, timeout_s=120.0)
            # a worker rank's whole life is serving the driver; leave without C++ static destructors, which can
            # abort after the group is destroyed ("terminate called without an active exception", under load)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        return WorkerGroup.from_env(Worker, args, timeout_s=120.0)
    return WorkerGroup(DistConfig(tensor_parallel_size, timeout_s=120.0), Worker, args)
