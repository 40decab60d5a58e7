"""ModelRunner: one rank's model, KV pool and step executors; the only place that turns a step into tensors.

Two named paths, as in the seed's pseudocode (the driver's ``Executor`` builds each step's ``StepInput`` once):

- ``run_prefill``: a step with any prefill chunk (or a pure decode the decode executor refuses) as one flat ragged
  batch, positions and cache slots from each sequence's block table, through the one ragged-step executor
  (``workbench.engine.prefill_step``), then the LM head on the rows that need logits;
- ``run_decode``: a pure decode through the one decode executor (``workbench.engine.decode_step``: eager, compiled
  or CUDA graphs).

``prepare_step`` builds the ``StepInput`` both take.

A tensor-parallel rank runs the same code on its shard; ``run`` gathers the vocabulary slices of the logits on the
driver (``workbench.model.sharding``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from workbench.engine.decode_step import DecodeStep
from workbench.engine.prefill_step import PrefillStep
from workbench.engine.scheduler import StepPlan
from workbench.errors import ConfigError
from workbench.kv.cache import KVCache
from workbench.model.attention import AttentionBackend, TorchAttentionBackend, build_metadata
from workbench.model.sharding import gather_logits
from workbench.model.transformer import Transformer
from workbench.runtime import retain_freed_memory
from workbench.timing import timed


def make_backend(name: str, device_type: str) -> AttentionBackend:
    """The attention backend called ``name`` (``EngineConfig.attention_backend``) for a model on ``device_type``.
    'auto': the paged C++ decode (``kernels/paged_decode_cpu.py``) on a CPU where it builds, else torch
    (``cpu_backend.default_backend``)."""
    if name == "auto":
        from workbench.model.cpu_backend import default_backend

        return default_backend(device_type)
    if name == "triton":
        from workbench.model.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "cpu":
        if device_type != "cpu":
            raise ConfigError(f"attention_backend 'cpu' runs on the CPU, the model is on {device_type}; use 'auto'")
        from workbench.model.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    return TorchAttentionBackend()


def check_triton_backend(device: Any) -> None:
    """ConfigError unless the Triton kernels can run on ``device``: CUDA, or the interpreter (``TRITON_INTERPRET=1``
    in the environment before start)."""
    try:
        from workbench.kernels._common import INTERPRET
    except ImportError as exc:
        raise ConfigError(f"attention_backend 'triton' needs the triton package ({exc}); use attention_backend "
                          "'torch'") from None  # fmt: skip
    if device.type != "cuda" and not INTERPRET:
        raise ConfigError(
            f"attention_backend 'triton' needs a CUDA device (the model is on {device}); on the CPU set "
            "TRITON_INTERPRET=1 in the environment (the slow interpreter) or use attention_backend 'torch'"
        )


@dataclass
class StepInput:
    """One step as plain lists: what every rank executes (one broadcast under tensor parallelism).

    ``tokens``: the flat new token ids of every sequence in order; per sequence its ``query_lens`` (new tokens),
    ``seq_lens`` (length after the step) and block table (``tables``); ``rows``: the flat token indices whose logits
    are wanted (the last token of each chunk that samples; all k + 1 positions of a speculating chunk); ``decode``:
    a pure decode (one token each, every one sampling), which the decode executor may take."""

    tokens: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    rows: list[int]
    decode: bool


def prepare_step(plan: StepPlan) -> StepInput:
    """A non-empty plan as one step: every chunk's tokens (a speculating chunk's proposals after its last token),
    its new tokens, length after the step and block table, and the rows that need logits; ``decode`` for a pure
    decode without proposals."""
    ids: list[int] = []
    query_lens, seq_lens, tables, rows = [], [], [], []
    for chunk in plan.chunks:
        seq, start, n = chunk.seq, chunk.start, chunk.num_new_tokens
        ids.extend(seq.token_slice(start, start + n - len(chunk.spec_token_ids)))
        ids.extend(chunk.spec_token_ids)  # speculative decoding: the proposed tokens after the last one
        query_lens.append(n)
        seq_lens.append(start + n)
        tables.append(seq.block_table)
        if chunk.samples:  # the last token, and before it every proposal's position (verification)
            rows.extend(range(len(ids) - 1 - len(chunk.spec_token_ids), len(ids)))
    decode = plan.is_pure_decode and not plan.num_spec_tokens
    return StepInput(ids, query_lens, seq_lens, tables, rows, decode)


class ModelRunner:
    """One rank's model over its KV pool: ``run`` executes a ``StepInput`` through the decode or the ragged step.

    ``shard`` / ``group``: a tensor-parallel rank's place (``model.tp_shard``) and its process group (None: the
    world); the logits of its vocabulary slice are then gathered on the group's first rank."""

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        backend: AttentionBackend,
        decode: DecodeStep,
        prefill: PrefillStep,
        group: Any = None,
    ) -> None:
        self.model, self.cache, self.backend, self.decode, self.prefill = model, cache, backend, decode, prefill
        if model.device.type == "cpu":
            retain_freed_memory()  # steps reuse the pages of the one before (workbench.runtime)
        self.shard, self.group = getattr(model, "tp_shard", None), group
        # when set, each run() records the model's share of the step (forward + LM head + the logits' gather,
        # synchronised) in last_model_s: what is left of a step's time is engine overhead (scheduling, tensors,
        # sampling)
        self.time_model = False
        self.last_model_s = 0.0

    def run(self, step: StepInput) -> torch.Tensor | None:
        """One step on this rank: writes its K/V into the cache; returns the (len(rows), vocab) fp32 logits of
        ``step.rows`` on the driver (None on the other ranks, and when no row needs logits). Every rank takes the
        same path: the decode executor's choice depends only on the step's lengths and limits."""
        if step.decode and self.decode.supports(step.seq_lens):
            return self._timed(self.run_decode, step)
        return self.run_prefill(step)

    def run_decode(self, step: StepInput) -> torch.Tensor | None:
        """A pure decode through ``DecodeStep.run``: the logits of every sequence."""
        return self._gather(self.decode.run(step.tokens, step.seq_lens, step.tables))

    def run_prefill(self, step: StepInput) -> torch.Tensor | None:
        """The ragged step through ``PrefillStep.run`` (``Transformer.forward``), then the LM head on ``rows``."""
        dev = self.model.device
        meta = build_metadata(step.query_lens, step.seq_lens, step.tables, self.cache.block_size, dev)
        input_ids = torch.tensor(step.tokens, dtype=torch.long, device=dev)
        rows = torch.tensor(step.rows, dtype=torch.long, device=dev)

        def model() -> torch.Tensor | None:
            hidden = self.prefill.run(input_ids, meta)  # (num_tokens, hidden)
            if not step.rows:
                return None
            return self._gather(self.model.compute_logits(hidden[rows]))  # (num_rows, vocab), fp32

        return self._timed(model)

    def _gather(self, local: torch.Tensor) -> torch.Tensor | None:
        return local if self.shard is None else gather_logits(local, self.shard, self.group)

    def _timed(self, fn, *args):  # noqa: ANN001, ANN002, ANN202
        if not self.time_model:
            return fn(*args)
        self.last_model_s, out = timed(lambda: fn(*args), self.model.device)
        return out
