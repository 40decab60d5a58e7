"""ModelRunner: the only place that turns a ``StepPlan`` into tensors, runs the model and samples.

Two named paths, as in the seed's pseudocode:

- ``prepare_prefill`` / ``run_prefill``: a step with any prefill chunk (or a pure decode the decode executor
  refuses) lays every chunk's tokens into one flat ragged batch, with positions and cache slots from each
  sequence's block table, and runs ``Transformer.forward`` once for the whole mixed step, through the one
  ragged-step executor ``workbench.engine.prefill_step.PrefillStep`` (eager, or each layer's work around its
  attention compiled: ``EngineConfig.compile_prefill``);
- ``prepare_decode`` / ``run_decode``: a pure decode (``StepPlan.is_pure_decode``) goes to the one decode executor,
  ``workbench.engine.decode_step.DecodeStep`` (eager, compiled or CUDA graphs).

Either way a token is sampled for every chunk that ends at its sequence's last token.
"""

from __future__ import annotations

from typing import Any

import torch

from workbench.device import synchronize
from workbench.engine.decode_step import DecodeStep
from workbench.engine.prefill_step import PrefillStep
from workbench.engine.scheduler import StepPlan
from workbench.engine.spec_decode import logit_rows, verify
from workbench.errors import ConfigError
from workbench.kv.cache import KVCache
from workbench.model.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend, build_metadata
from workbench.model.sampler import Sampler
from workbench.model.transformer import Transformer
from workbench.timing import now


def resolve_attention_backend(name: str, device_type: str | None = None) -> str:
    """``name`` with 'auto' decided: 'cpu' (the paged C++ decode, ``kernels.paged_decode_cpu``) on a CPU where it
    builds, 'torch' otherwise (CUDA, or no compiler). ``device_type`` None: CUDA if present, else the CPU."""
    if name != "auto":
        return name
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    from workbench.model.cpu_backend import default_backend

    return default_backend(device_type).name


def make_backend(name: str, device_type: str | None = None) -> AttentionBackend:
    """The attention backend called ``name`` (``EngineConfig.attention_backend``; 'auto' by
    ``resolve_attention_backend``)."""
    name = resolve_attention_backend(name, device_type)
    if name == "triton":
        from workbench.model.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "cpu":
        if device_type not in (None, "cpu"):
            raise ConfigError(f"attention_backend 'cpu' runs on the CPU, the model is on {device_type}; use 'auto'")
        from workbench.model.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    return TorchAttentionBackend()


def check_triton_backend(device: Any) -> None:
    """ConfigError unless the Triton kernels can run on ``device``: CUDA, or the interpreter (``TRITON_INTERPRET=1``
    in the environment before start)."""
    try:
        from kernels._common import INTERPRET
    except ImportError as exc:
        raise ConfigError(f"attention_backend 'triton' needs the triton package ({exc}); use attention_backend "
                          "'torch'") from None  # fmt: skip
    if device.type != "cuda" and not INTERPRET:
        raise ConfigError(
            f"attention_backend 'triton' needs a CUDA device (the model is on {device}); on the CPU set "
            "TRITON_INTERPRET=1 in the environment (the slow interpreter) or use attention_backend 'torch'"
        )


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        backend: AttentionBackend,
        decode: DecodeStep,
        prefill: PrefillStep | None = None,
    ) -> None:
        self.model, self.cache, self.backend, self.decode = model, cache, backend, decode
        self.prefill = PrefillStep(model, cache, backend, compile=False) if prefill is None else prefill
        self.sampler = Sampler()
        self.speculator: Any = None  # speculative decoding's proposer state, released with each request
        # when set, each execute() records the model's share of it (forward + LM head, synchronised) in
        # last_model_s: what is left of a step's time is engine overhead (scheduling, tensors, sampling)
        self.time_model = False
        self.last_model_s = 0.0

    def prefill_inputs(self, plan: StepPlan) -> tuple[list[int], list[int], list[int], list[list[int]]]:
        """A ragged step as lists: flat token ids, and per chunk its new tokens, length after the step and
        block table."""
        ids: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        for chunk in plan.chunks:
            seq, start, n = chunk.seq, chunk.start, chunk.num_new_tokens
            ids.extend(seq.token_slice(start, start + n - len(chunk.spec_token_ids)))
            ids.extend(chunk.spec_token_ids)  # speculative decoding: the proposed tokens after the last one
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(seq.block_table)
        return ids, query_lens, seq_lens, tables

    def prepare_prefill(self, plan: StepPlan) -> tuple[torch.Tensor, AttentionMetadata]:
        """Flat input ids (num_tokens,) of every chunk and the ragged step's attention metadata."""
        ids, query_lens, seq_lens, tables = self.prefill_inputs(plan)
        meta = build_metadata(query_lens, seq_lens, tables, self.cache.block_size, self.model.device)
        return torch.tensor(ids, dtype=torch.long, device=self.model.device), meta

    def prepare_decode(self, plan: StepPlan) -> tuple[list[int], list[int], list[list[int]]]:
        """A pure decode's new token, length after the step and block table, per sequence."""
        tokens, seq_lens, tables = [], [], []
        for chunk in plan.chunks:
            tokens.append(chunk.seq.token_at(chunk.start))
            seq_lens.append(chunk.start + 1)
            tables.append(chunk.seq.block_table)
        return tokens, seq_lens, tables

    def execute(self, plan: StepPlan) -> dict[int, int]:
        """Run one step; returns the sampled token of every chunk that samples, by sequence id."""
        if plan.is_empty:
            return {}
        if plan.is_pure_decode and not plan.num_spec_tokens:
            tokens, seq_lens, tables = self.prepare_decode(plan)
            if self.decode.supports(seq_lens):
                return self._sample(plan, self._timed(self.decode.run, tokens, seq_lens, tables), range(len(tokens)))
        return self.run_prefill(plan)

    def run_prefill(self, plan: StepPlan) -> dict[int, int]:
        """The ragged step through ``PrefillStep.run`` (``Transformer.forward``), then the LM head on the chunks
        that sample."""
        input_ids, meta = self.prepare_prefill(plan)
        if plan.num_spec_tokens:  # speculative decoding: logits of all k + 1 positions, verified
            spec_rows = logit_rows(plan, meta)
            logits = self._timed(lambda: self.model.compute_logits(self.prefill.run(input_ids, meta)[spec_rows]))
            return verify(plan, logits, self.sampler)
        rows = [i for i, c in enumerate(plan.chunks) if c.samples]

        def model() -> torch.Tensor | None:
            hidden = self.prefill.run(input_ids, meta)  # (num_tokens, hidden)
            if not rows:
                return None
            last = meta.last_token_indices[rows] if len(rows) < len(plan.chunks) else meta.last_token_indices
            return self.model.compute_logits(hidden[last])  # (num_sampling, vocab), fp32

        logits = self._timed(model)
        return {} if logits is None else self._sample(plan, logits, rows)

    def _timed(self, fn, *args):  # noqa: ANN001, ANN002, ANN202
        if not self.time_model:
            return fn(*args)
        synchronize(self.model.device)
        t0 = now()
        out = fn(*args)
        synchronize(self.model.device)
        self.last_model_s = now() - t0
        return out

    def _sample(self, plan: StepPlan, logits: torch.Tensor, rows: range | list[int]) -> dict[int, int]:
        seqs = [plan.chunks[i].seq for i in rows]
        tokens = self.sampler(logits, [s.sampling for s in seqs], [s.seq_id for s in seqs])
        return {s.seq_id: t for s, t in zip(seqs, tokens)}

    def release(self, seq_id: int) -> None:
        self.sampler.release(seq_id)
        if self.speculator is not None:
            self.speculator.release(seq_id)
