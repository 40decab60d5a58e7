"""Worker: one rank of an engine, holding its model (whole, or its tensor-parallel shard) and, once the engine has
sized the pool, its ``ModelRunner``.

The driver's ``Executor`` calls the same methods on every worker (``init_cache`` once per engine, ``execute_model``
once per step), so every rank runs the one-device code on its shard with the engine's settings. A rank's
row-parallel layers sum their partial products with one all-reduce each (after O, after down), as one opaque
operator (``workbench.model.sharding.traced_reduce``) that compiled graphs call like any other; ``comm_stats`` times
them when asked (how ``bench decode`` reports a step's share of them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from workbench.config import DEFAULT_GROUP_SIZE
from workbench.device import resolve_device, torch_dtype
from workbench.engine.config import EngineConfig
from workbench.engine.decode_step import DecodeStep
from workbench.engine.prefill_step import PrefillStep
from workbench.engine.runner import ModelRunner, StepInput, make_backend
from workbench.kv.cache import KVCache
from workbench.model.packed import pack_linears, unpack_linears
from workbench.model.sharding import all_reduce, traced_reduce
from workbench.model.transformer import Transformer
from workbench.timing import set_threads, timed


class Worker:
    """One rank: ``load`` its model (a checkpoint directory or a preset, sharded over ``world_size`` ranks),
    ``init_cache`` its runner for an engine, ``execute_model`` each step. ``group``: the ranks' process group when
    they are a subgroup of a larger world (a disaggregated pool); None: the whole world."""

    def __init__(
        self, rank: int, world_size: int, source: str, dtype: str, device: str, seed: int,
        num_threads: int | None = None, group: Any = None, quantization: str | None = None,
        group_size: int = DEFAULT_GROUP_SIZE,
    ) -> None:  # fmt: skip
        if num_threads is not None:
            set_threads(num_threads)
        self._setup(rank, world_size, group)
        self.load(source, dtype, device, seed, quantization, group_size)

    @classmethod
    def for_model(cls, model: Transformer) -> Worker:
        """The one worker of a one-device engine, on a model already loaded (and quantized) in this process."""
        worker = cls.__new__(cls)
        worker._setup(0, 1, None)
        worker.model = model
        return worker

    def _setup(self, rank: int, world_size: int, group: Any) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        self.runner: ModelRunner | None = None
        self.comm_s, self.num_all_reduces, self._timing = 0.0, 0, False
        self._reduce = traced_reduce(self._all_reduce) if world_size > 1 else None

    def load(
        self, source: str, dtype: str, device: str, seed: int, quantization: str | None = None,
        group_size: int = DEFAULT_GROUP_SIZE,
    ) -> None:  # fmt: skip
        """Load this rank's shard of ``source`` (quantized with ``quantization``); drops any earlier one."""
        from workbench.model.checkpoint import load_model
        from workbench.model.quant import quantize_model

        dev = resolve_device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", torch.cuda.current_device())
        self.runner = None
        self.model = load_model(source, torch_dtype(dtype), dev, seed, tensor_parallel=(self.rank, self.world_size))
        for layer in self.model.layers:
            layer.self_attn.reduce = layer.mlp.reduce = self._reduce
        if quantization is not None:
            quantize_model(
                self.model, quantization, group_size, lambda amax: all_reduce(amax, self.group, dist.ReduceOp.MAX)
            )

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._timing:
            return all_reduce(tensor, self.group)
        self.comm_s += timed(lambda: all_reduce(tensor, self.group), tensor.device)[0]
        self.num_all_reduces += 1
        return tensor

    def init_cache(self, config: EngineConfig, num_blocks: int, block_size: int, max_model_len: int) -> None:
        """Build this rank's runner for an engine of ``config``: its share of a pool of ``num_blocks`` blocks (its
        KV heads), its attention backend, decode step and ragged step. Replaces the runner of an earlier engine."""
        model = self.model
        (pack_linears if config.packed_linears else unpack_linears)(model)
        kv_dtype = config.kv_cache_dtype if config.kv_cache_quantized else "auto"
        cache = KVCache(model.config, num_blocks, block_size, dtype=model.dtype, device=model.device,
                        kv_cache_dtype=kv_dtype)  # fmt: skip
        backend = make_backend(config.attention_backend, model.device.type)  # never set on the model
        mode = config.decode_mode(model.device.type)
        decode = DecodeStep(model, cache, backend, mode, config.max_num_seqs, max_model_len)
        prefill = PrefillStep(model, cache, backend, config.compile_prefill)
        self.runner = ModelRunner(model, cache, backend, decode, prefill, self.group)

    def execute_model(self, step: StepInput) -> torch.Tensor | None:
        """One step on this rank (``ModelRunner.run``): the driver's logits, None on the other ranks."""
        return self.runner.run(step)

    def warmup_decode(self) -> dict[int, float]:
        """Compile every decode bucket not compiled yet (compile mode; nothing to do in the others), on every rank
        at once under tensor parallelism (the compiled graphs meet in their all-reduces). Returns ``compile_s``."""
        return self.runner.decode.warmup()

    def comm_stats(self, enable: bool = True) -> dict[str, float]:
        """All-reduce seconds and count since the last call on this rank (the driver reports rank 0's); ``enable``:
        whether to time them from now on."""
        out = {"all_reduce_s": self.comm_s, "num_all_reduces": self.num_all_reduces}
        self.comm_s, self.num_all_reduces = 0.0, 0
        self._timing = enable
        return out
