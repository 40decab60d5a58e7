"""Benchmarks of the engine: decode bandwidth, prefill FLOP/s, an offline request set, and HF transformers.

Every figure is a median of timed repetitions after warm-up, and every ratio is taken between measurements
interleaved in the same run (this machine is shared, so absolute times drift; ratios drift much less).

- ``bench_decode``: per batch size, decode steps of the engine. Bytes per step are the roofline's weight bytes
  plus KV-cache bytes (``workbench.roofline``: every weight read once, each sequence's K and V read once and
  the new K/V written); ``mbu`` is ``workbench.roofline.memory_bandwidth_utilization``, the one MBU: those bytes
  per second over the machine's measured read bandwidth (``workbench.hardware.measured_spec``). ``gemv_ratio``
  divides it by the bandwidth that plain ``nn.Linear`` layers of the model's own weight shapes (qkv, o, gate_up,
  down per layer, and the LM head) reach on the same batch, timed between the engine's steps. ``overhead_share``
  is the part of a step spent outside the model's forward and LM head (scheduling, batch preparation, sampling),
  from ``ModelRunner.time_model``.
- ``bench_prefill``: per prompt length, one engine step that prefills a fresh prompt and samples its first
  token; FLOPs from the roofline (causal attention pairs, LM head on the last position), ``mfu`` over the
  measured matmul peak of the dtype.
- ``bench_offline``: a fixed, seeded set of requests whose lengths are drawn from the Azure conversation trace
  and scaled so that the longest fits ``context`` tokens, served by the engine at once.
- ``bench_hf``: the same checkpoint, dtype and greedy prompts through ``transformers``' ``generate`` and through
  the engine: batch-1 decode tokens/s (``(N - 1) / (t(N tokens) - t(1 token))`` for both) and the offline set
  (transformers in static batches of ``max_num_seqs`` with left padding, as its ``generate`` does).
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from workbench.config import (
    DEFAULT_GROUP_SIZE,
    ModelConfig,
    canonical_dtype,
    canonical_quantization,
    resolve_kv_cache_dtype,
)
from workbench.device import resolve_device, torch_dtype
from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.engine.scheduler import blocks_over_watermark
from workbench.errors import ConfigError
from workbench.hardware import HardwareSpec, measured_spec
from workbench.model.transformer import Transformer
from workbench.request import SamplingParams
from workbench.roofline import memory_bandwidth_utilization, step_work
from workbench.timing import (
    median,
    now,
    random_prompts,
    set_threads,  # noqa: F401  (the one thread setter, re-exported: scripts import it here)
    timed,
)

DEFAULT_MODEL = "bench-300m"
OFFLINE_TRACE = "azure-conv"


# ---- settings and helpers ------------------------------------------------------------------------------------
def linear_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(in_features, out_features) of every weight matrix a decode step multiplies by, in model order.

    Per layer the fused qkv, o, fused gate_up and down projections; then the LM head (tied or not, it is read).
    """
    h = cfg.hidden_size
    per_layer = [(h, cfg.q_size + 2 * cfg.kv_size), (cfg.q_size, h), (h, 2 * cfg.intermediate_size),
                 (cfg.intermediate_size, h)]  # fmt: skip
    return per_layer * cfg.num_layers + [(h, cfg.vocab_size)]


def decode_step_bytes(
    cfg: ModelConfig,
    dtype: str,
    context_lens: Sequence[int],
    quantization: str | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
    kv_cache_dtype: str | None = "auto",
) -> dict[str, float]:
    """Bytes a decode step moves per the roofline: weights read once, K/V read (and the new K/V written).

    ``context_lens``: each sequence's length after the step (it attends to that many keys). Under a weight
    ``quantization`` every linear matrix and the LM head (a tied one: its quantized copy) are read in the format,
    scales included (the roofline's ``step_work``); a quantized KV cache scales the KV bytes by
    ``kv_bytes_per_token`` (int8's scales included).
    """
    work = step_work(cfg, dtype, decode_contexts=list(context_lens), quantization=quantization, group_size=group_size)
    weight = work.weight_bytes
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
    kv = work.kv_bytes * cfg.kv_bytes_per_token(kv_dtype) / cfg.kv_bytes_per_token(dtype)
    return {"weight_bytes": weight, "kv_bytes": kv, "bytes": weight + kv}


def prefill_flops(cfg: ModelConfig, dtype: str, prompt_len: int) -> float:
    """FLOPs of prefilling one fresh prompt per the roofline (causal pairs only, LM head on the last token)."""
    return step_work(cfg, dtype, prefill_chunks=[(prompt_len, 0)]).flops


class LinearSweep:
    """Plain ``nn.Linear`` layers of the model's weight shapes: the bandwidth torch itself reaches on them."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        self.layers: list[nn.Linear] = []
        for fan_in, fan_out in linear_shapes(cfg):
            layer = nn.Linear(fan_in, fan_out, bias=False, device="meta")
            # drawn on the device itself: a GPU model's worth of weights is not generated on the host
            weight = torch.empty(fan_out, fan_in, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
            layer.weight = nn.Parameter(weight, requires_grad=False)
            self.layers.append(layer)
        self.weight_bytes = sum(layer.weight.numel() * layer.weight.element_size() for layer in self.layers)
        self.dtype, self.device = dtype, device
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}

    @torch.inference_mode()
    def run(self, batch: int) -> float:
        """Multiply a (batch, in) activation through every layer once; returns the synchronised wall time."""
        xs = self._inputs
        for layer in self.layers:
            key = (batch, layer.in_features)
            if key not in xs:
                xs[key] = torch.randn(batch, layer.in_features).to(dtype=self.dtype, device=self.device)
        seconds, _ = timed(lambda: [layer(xs[(batch, layer.in_features)]) for layer in self.layers], self.device)
        return seconds


def load_bench_model(
    name_or_path: str,
    dtype: str = "fp32",
    device: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> Transformer:
    """A checkpoint directory, or a preset with random weights (seeded), on the device in the dtype; with
    ``quantization``, its linear layers quantized (``workbench.model.quant``; checked before the load)."""
    from workbench.model.checkpoint import load_model
    from workbench.model.quant import check_engine_quantization, quantize_model

    dev = resolve_device(device)
    if canonical_quantization(quantization) is not None:
        ModelConfig.resolve(name_or_path).check_quantization(quantization, group_size)
        check_engine_quantization(quantization, group_size, torch_dtype(dtype), dev)
    model = load_model(name_or_path, dtype=torch_dtype(dtype), device=dev, seed=seed)
    return quantize_model(model, quantization, group_size)


def bench_engine(
    model: Transformer, max_num_seqs: int, max_model_len: int, workers: Any = None, **kwargs: Any
) -> Engine:
    """An engine on ``model`` (with ``workers``: rank 0's shard of a tensor-parallel model on those ranks) whose pool
    holds ``max_num_seqs`` requests of ``max_model_len`` tokens at once, each in whole blocks, over the scheduler's
    admission watermark (``blocks_over_watermark``): all are admitted together, none is preempted."""
    max_model_len = min(max_model_len, model.config.max_position_embeddings)
    if "kv_cache_bytes" not in kwargs:
        block_size = kwargs.get("block_size", EngineConfig.block_size)
        kwargs.setdefault("num_blocks", blocks_over_watermark(max_num_seqs, -(-max_model_len // block_size)))
    config = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        quantization=getattr(model, "quantization", None),
        group_size=getattr(model, "group_size", DEFAULT_GROUP_SIZE),
        dtype=canonical_dtype(str(model.dtype).replace("torch.", "")),
        device=str(model.device),
        tensor_parallel_size=1 if workers is None else workers.world_size,
        **kwargs,
    )
    return Engine(model, config, workers=workers)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def prefill_until_decoding(engine: Engine, num_requests: int) -> dict[int, int]:
    """Step an engine holding ``num_requests`` new requests until each has its first token, so that its next step is
    a pure decode of all; returns each request's ``num_tokens`` (the keys its next decode attends to), which
    ``track_contexts`` keeps current. ConfigError when one is rejected or finishes before all decode: then the engine
    did not take every prompt before the first ones ran out of tokens (a token budget or a pool too small for all the
    prompts at once, or a policy that decodes while it prefills); the message gives its budget and pool."""
    contexts: dict[int, int] = {}
    while len(contexts) < num_requests:
        outputs = engine.step()
        track_contexts(contexts, outputs)
        done = [o for o in outputs if o.finished]
        if done or not engine.has_unfinished():
            first = done[0] if done else None
            if first is not None and first.reject_reason:
                raise ConfigError(f"decode benchmark requests were not served: {first.reject_reason}")
            s = engine.stats()
            early = f"request {first.request_id} finished ({first.finish_reason})" if first else "the engine stopped"
            raise ConfigError(
                f"decode benchmark requests were not served: {early} while {num_requests - len(contexts)} of "
                f"{num_requests} had no first token yet ({s['num_waiting']} waiting): the engine must take all "
                f"{num_requests} prompts before the first ones run out of tokens, but its policy "
                f"{engine.config.policy!r} with a token budget of {engine.token_budget} tokens a step and a pool of "
                f"{s['num_blocks']} blocks of {s['block_size']} ({s['num_used_blocks']} in use) did not; size the "
                f"engine as bench_engine does (the default policy, a pool over the admission watermark)"
            )
    return contexts


def track_contexts(contexts: dict[int, int], outputs: list[Any]) -> None:
    """Update ``contexts`` (request id -> ``num_tokens``) from a step's ``RequestOutput`` list."""
    for out in outputs:
        contexts[out.request_id] = out.num_tokens


# ---- lengths, checked before anything loads -----------------------------------------------------------------------
def decode_max_model_len(prompt_len: int, warmup: int, steps: int) -> int:
    """The engine's ``max_model_len`` in a decode benchmark: the prompt, ``warmup + steps + 1`` generated tokens (the
    prefill's token, then one per step) and one spare. The engine is sized to the request, as vLLM's ``bench
    latency`` wants ``max_model_len >= input_len + output_len``; only the model's positions bound it."""
    return prompt_len + warmup + steps + 2


def check_bench_lengths(
    cfg: ModelConfig,
    kind: str,
    prompt_lens: Sequence[int],
    warmup: int = 2,
    steps: int = 8,
    new_tokens: int = 32,
    context: int | None = None,
) -> None:
    """ConfigError, one line naming the numbers and the flag to change, unless every request of ``bench kind``
    (decode, prefill, offline, hf) fits ``cfg``'s positions: each benchmark sizes its engine's ``max_model_len`` to
    its requests, so the model's ``max_position_embeddings`` is the only limit. Cheap (no model loaded): the command
    calls it before measuring ceilings or loading weights, and the benchmark functions again on their own."""
    limit = cfg.max_position_embeddings
    where = f"{cfg.name} has {limit} positions (max_position_embeddings; the engine's max_model_len is sized to the "
    for n in prompt_lens:
        if n < 1:
            raise ConfigError(f"--prompt-len must be >= 1, got {n}")
        if kind == "decode" and decode_max_model_len(n, warmup, steps) > limit:
            need = decode_max_model_len(n, warmup, steps)
            room = limit - (need - n)  # the longest prompt these steps leave room for
            fix = f"lower --prompt-len to at most {room}" if room >= 1 else "lower --steps or --warmup"
            raise ConfigError(
                f"bench decode needs max_model_len {need} (--prompt-len {n} + {warmup + steps + 1} generated tokens: "
                f"--warmup {warmup} + --steps {steps} + 1, and 1 spare), but {where}request): {fix}"
            )
        if kind == "prefill" and n + 1 > limit:
            raise ConfigError(f"bench prefill needs max_model_len {n + 1} (--prompt-len {n} + 1 generated token), but "
                              f"{where}request): lower --prompt-len to at most {limit - 1}")  # fmt: skip
        if kind == "hf" and n + new_tokens > limit:
            raise ConfigError(f"bench hf needs max_model_len {n + new_tokens} (--prompt-len {n} + --new-tokens "
                              f"{new_tokens}), but {where}request): lower --prompt-len or --new-tokens")  # fmt: skip
    if context is not None and context > limit:
        raise ConfigError(f"bench {kind}: the offline set needs max_model_len {context} (--context {context}), but "
                          f"{where}request): lower --context to at most {limit}")  # fmt: skip


# ---- decode ----------------------------------------------------------------------------------------------------
def bench_decode(
    model: Transformer,
    batches: Sequence[int] = (1, 8, 32),
    prompt_len: int = 128,
    steps: int = 8,
    warmup: int = 2,
    hw: HardwareSpec | None = None,
    sweep: LinearSweep | None = None,
    seed: int = 0,
    attention_backend: str = "auto",
    compile_decode: bool = False,
    workers: Any = None,
    kv_cache_dtype: str = "auto",
) -> list[dict[str, Any]]:
    """Per batch size: median decode step time, tokens/s, bytes/s, MBU, gemv_ratio and engine overhead share.

    A quantized ``model`` (``load_bench_model(..., quantization=...)``) and ``kv_cache_dtype`` count the bytes
    their formats move (``decode_step_bytes``); ``gemv_ratio`` stays against the unquantized linear sweep.

    ``workers``: the ranks of a tensor-parallel model (``workbench.engine.executor.start_workers``; ``model`` is
    rank 0's shard): each row then adds the share of a step rank 0 spent in all-reduces and their bandwidth
    (bytes of the reduced tensors over the time spent in them, the slower rank's wait included). Bytes per step
    and MBU count the whole model, read by all ranks together out of one machine's memory.

    ``batch`` requests of ``prompt_len`` random tokens are prefilled, then ``warmup + steps`` decode steps run;
    the last ``steps`` are timed, each followed by a ``LinearSweep`` of the same batch (the gemv reference).
    ``compile_decode``: the engine's compiled decode step (``EngineConfig.compile_decode``); its compilation is
    the first warm-up step, reported as ``first_step_s``.
    """
    if steps < 1 or warmup < 0 or prompt_len < 1:
        raise ConfigError(f"need steps >= 1, warmup >= 0, prompt_len >= 1; got {steps}, {warmup}, {prompt_len}")
    cfg = model.config
    if compile_decode:
        warmup = max(warmup, 1)  # the first decode step compiles
    check_bench_lengths(cfg, "decode", [prompt_len], warmup, steps)
    dtype = canonical_dtype(str(model.dtype).replace("torch.", ""))
    hw = hw or measured_spec(model.device.type)
    sweep = sweep or LinearSweep(cfg, model.dtype, model.device, seed=seed)
    quantization, group_size = getattr(model, "quantization", None), getattr(model, "group_size", DEFAULT_GROUP_SIZE)

    def step_bytes(contexts: list[int]) -> dict[str, float]:
        return decode_step_bytes(cfg, dtype, contexts, quantization, group_size, kv_cache_dtype)

    rows = []
    for batch in batches:
        engine = bench_engine(
            model,
            batch,
            decode_max_model_len(prompt_len, warmup, steps),
            workers,
            attention_backend=attention_backend,
            compile_decode=compile_decode,
            kv_cache_dtype=kv_cache_dtype,
        )
        for prompt in random_prompts(batch, prompt_len, cfg.vocab_size, seed):
            engine.add_request(prompt, _greedy(warmup + steps + 1))
        contexts_now = prefill_until_decoding(engine, batch)
        engine.runner.time_model = True
        step_s, model_s, sweep_s, bytes_per_s, contexts = [], [], [], [], []
        first_step_s = 0.0
        for i in range(warmup + steps):
            if workers is not None and i == warmup:
                workers.call("comm_stats", True)  # time the all-reduces of the measured steps
            context = list(contexts_now.values())  # each decode attends to this many keys
            t, outputs = timed(engine.step, model.device)
            track_contexts(contexts_now, outputs)
            s = sweep.run(batch)
            if i == 0:
                first_step_s = t
            if i < warmup:
                continue
            step_s.append(t)
            model_s.append(engine.runner.last_model_s)
            sweep_s.append(s)
            bytes_per_s.append(step_bytes(context)["bytes"] / t)
            contexts.append(sum(context) / len(context))
        t_step = median(step_s)
        comm: dict[str, Any] = {}
        if workers is not None:
            stats = workers.call("comm_stats", False)
            reduced = stats["num_all_reduces"] * batch * cfg.hidden_size * model.dtype.itemsize
            comm = {
                "tensor_parallel_size": workers.world_size,
                "all_reduce_share": stats["all_reduce_s"] / sum(step_s),
                "all_reduces_per_step": stats["num_all_reduces"] / len(step_s),
                "all_reduce_bytes_per_s": reduced / stats["all_reduce_s"] if stats["all_reduce_s"] else None,
            }
        achieved = median(bytes_per_s)
        gemv = sweep.weight_bytes / median(sweep_s)
        mid = step_bytes([round(median(contexts))] * batch)
        rows.append({
            "batch": batch,
            "prompt_len": prompt_len,
            "mean_context": median(contexts),
            "step_s": t_step,
            "tokens_per_s": batch / t_step,
            "bytes_per_step": mid["bytes"],
            "kv_bytes_per_step": mid["kv_bytes"],
            "achieved_bytes_per_s": achieved,
            "mbu": memory_bandwidth_utilization(achieved, 1.0, hw),
            "gemv_bytes_per_s": gemv,
            "gemv_ratio": achieved / gemv,
            "model_s": median(model_s),
            "overhead_share": median([(a - b) / a for a, b in zip(step_s, model_s)]),
            "steps": steps,
            "attention_backend": engine.backend.name,  # the one that ran ('auto' decided)
            "cuda_graphs": engine.decode.num_graphs > 0,  # the timed steps replayed a recorded graph
            "compiled_decode": compile_decode,
            "first_step_s": first_step_s,
            "quantization": quantization,
            "kv_cache_dtype": resolve_kv_cache_dtype(kv_cache_dtype, dtype),
            **comm,
        })  # fmt: skip
        del engine
    return rows


# ---- prefill -----------------------------------------------------------------------------------------------------
def bench_prefill(
    model: Transformer,
    prompt_lens: Sequence[int] = (128, 512, 1024),
    repeats: int = 3,
    warmup: int = 1,
    hw: HardwareSpec | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Per prompt length: median time of the engine step that prefills one fresh prompt, FLOP/s and MFU."""
    cfg = model.config
    check_bench_lengths(cfg, "prefill", prompt_lens)
    dtype = canonical_dtype(str(model.dtype).replace("torch.", ""))
    hw = hw or measured_spec(model.device.type)
    rows = []
    for n in prompt_lens:
        engine = bench_engine(model, 1, n + 1)  # the default token budget holds the whole prompt
        engine.runner.time_model = True
        prompts = random_prompts(warmup + repeats, n, cfg.vocab_size, seed)
        times, model_times = [], []
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, _greedy(1))
            t, _ = timed(engine.step, model.device)
            if i >= warmup:
                times.append(t)
                model_times.append(engine.runner.last_model_s)
        flops = prefill_flops(cfg, dtype, n)
        t = median(times)
        rows.append({
            "prompt_len": n,
            "time_s": t,
            "flops": flops,
            "achieved_flops_per_s": flops / t,
            "mfu": flops / t / hw.peak(dtype),
            "model_mfu": flops / median(model_times) / hw.peak(dtype),
            "tokens_per_s": n / t,
        })  # fmt: skip
        del engine
    return rows


# ---- the offline request set -----------------------------------------------------------------------------------
def offline_requests(
    vocab_size: int, num_requests: int = 64, context: int = 256, seed: int = 0, trace: str = OFFLINE_TRACE
) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) of ``num_requests`` rows drawn (seeded) from a trace, lengths scaled so that
    the longest prompt + output of the draw is ``context`` tokens (each at least 1 prompt and 1 output token)."""
    from workbench.workloads import TRACE_FILES, load_trace_file

    if num_requests < 1 or context < 2:
        raise ConfigError(f"need num_requests >= 1 and context >= 2, got {num_requests}, {context}")
    rows = load_trace_file(TRACE_FILES[trace])
    rng = random.Random(seed)
    drawn = [rows[rng.randrange(len(rows))] for _ in range(num_requests)]
    scale = context / max(r.prompt_len + r.output_len for r in drawn)
    out = []
    for r in drawn:
        prompt_len = max(1, min(context - 1, round(r.prompt_len * scale)))
        output_len = max(1, min(context - prompt_len, round(r.output_len * scale)))
        out.append((random_prompts(1, prompt_len, vocab_size, rng.randrange(1 << 30))[0], output_len))
    return out


def run_engine_offline(
    model: Transformer, requests: list[tuple[list[int], int]], max_num_seqs: int = 32, engine: Engine | None = None
) -> tuple[float, list[list[int]]]:
    """Serve the requests at once through ``engine`` (default: a fresh one); (wall seconds, tokens per request)."""
    if engine is None:
        engine = bench_engine(model, max_num_seqs, max(len(p) + n for p, n in requests))
    seconds, result = timed(lambda: engine.generate([p for p, _ in requests], [_greedy(n) for _, n in requests]),
                            model.device)  # fmt: skip
    return seconds, [r.tokens for r in result.requests]


def step_kind(num_prefill_tokens: int, num_decode_tokens: int) -> str:
    """'prefill', 'mixed', or 'decode b=1' / 'decode b<=8' / 'decode b<=16' / 'decode b<=32' / 'decode b>32'."""
    if num_prefill_tokens and num_decode_tokens:
        return "mixed"
    if num_prefill_tokens:
        return "prefill"
    for top in (1, 8, 16, 32):
        if num_decode_tokens <= top:
            return f"decode b<={top}" if top > 1 else "decode b=1"
    return "decode b>32"


def offline_breakdown(
    model: Transformer, engine: Engine, requests: list[tuple[list[int], int]], top_ops: int = 12
) -> dict[str, Any]:
    """Where the offline set's time goes: one more run of ``requests`` through ``engine`` (warmed up) with every step
    timed (``ModelRunner.time_model``: the model's forward and LM head, synchronised) and sorted by ``step_kind``;
    what is left of a step outside the model is engine overhead (scheduling, batch preparation, sampling), and the
    wall time minus the steps is the time between steps. ``wall_s``, ``steps``, ``between_steps_s`` and ``by_kind``
    (per kind: ``steps``, ``wall_s``, ``model_s``, ``overhead_s``, ``share`` of the wall time). With ``top_ops`` > 0
    the set runs again under ``torch.profiler`` (CPU ops, self time): ``profiler_top_ops`` (``op``, ``self_share``,
    ``calls``; the profiler slows the run, so only shares are reported)."""
    n = engine.config.max_num_seqs
    rows: list[tuple[str, float, float]] = []
    engine.runner.time_model = True
    engine.on_step = lambda plan, rec: rows.append(
        (step_kind(rec.num_prefill_tokens, rec.num_decode_tokens), rec.duration_s, engine.runner.last_model_s)
    )
    try:
        wall, _ = run_engine_offline(model, requests, n, engine)
    finally:
        engine.on_step, engine.runner.time_model = None, False
    kinds: dict[str, dict[str, float]] = {}
    for kind, dur, model_s in rows:
        k = kinds.setdefault(kind, {"steps": 0, "wall_s": 0.0, "model_s": 0.0})
        k["steps"] += 1
        k["wall_s"] += dur
        k["model_s"] += model_s
    out: dict[str, Any] = {
        "wall_s": wall,
        "steps": len(rows),
        "between_steps_s": wall - sum(r[1] for r in rows),
        "by_kind": {kind: {**v, "overhead_s": v["wall_s"] - v["model_s"], "share": v["wall_s"] / wall}
                    for kind, v in sorted(kinds.items())},
    }  # fmt: skip
    if top_ops > 0:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run_engine_offline(model, requests, n, engine)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events) or 1.0
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top_ops]
        out["profiler_top_ops"] = [{"op": e.key, "self_share": e.self_cpu_time_total / total, "calls": e.count}
                                   for e in top]  # fmt: skip
    return out


def bench_offline(
    model: Transformer,
    num_requests: int = 64,
    context: int = 256,
    max_num_seqs: int = 32,
    repeats: int = 2,
    seed: int = 0,
    compile_decode: bool = False,
    compile_prefill: bool = False,
    breakdown_top_ops: int | None = None,
    engine_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Output and total tokens/s of the engine on the offline set (median of ``repeats``, after a small warm-up).
    ``engine_options``: more ``EngineConfig`` fields of the engine (``policy``, ``token_budget``,
    ``enable_prefix_caching``); the result names the engine's ``policy`` and ``token_budget``.

    ``compile_decode``: pure decodes run compiled (``EngineConfig.compile_decode``), every batch bucket compiled
    before the timing; ``compile_s`` reports the seconds of each. ``compile_prefill``: prefill and mixed steps run
    compiled (``EngineConfig.compile_prefill``), every token-count range compiled before the timing;
    ``prefill_compile_s`` reports the seconds of each. ``warmup_s``: the seconds from the engine's start to its first
    timed request (compilations and the untimed run), the figure to set against vLLM's start-up; ``compile_cache``:
    inductor's on-disk caches and their hits during it (``workbench.engine.compile_cache``: a second process
    should only hit). ``breakdown_top_ops`` (not None): then ``breakdown``, the set once more by kind
    of step (``offline_breakdown``, with that many profiler operators)."""
    from workbench.engine.compile_cache import cache_counts, cache_state

    requests = offline_requests(model.config.vocab_size, num_requests, context, seed)
    counts, t0 = cache_counts(), now()
    engine = bench_engine(model, max_num_seqs, max(len(p) + n for p, n in requests), compile_decode=compile_decode,
                          compile_prefill=compile_prefill, **(engine_options or {}))  # fmt: skip
    compile_s = engine.warmup_decode()
    prefill_compile_s = engine.prefill.warmup(engine.token_budget)
    run_engine_offline(model, requests[: min(4, len(requests))], max_num_seqs, engine)  # warm-up
    warmup_s = now() - t0
    times = [run_engine_offline(model, requests, max_num_seqs, engine)[0] for _ in range(repeats)]
    out_tokens = sum(n for _, n in requests)
    all_tokens = out_tokens + sum(len(p) for p, _ in requests)
    t = median(times)
    extra = {}
    if breakdown_top_ops is not None:
        extra["breakdown"] = offline_breakdown(model, engine, requests, breakdown_top_ops)
    return {
        "num_requests": len(requests),
        "context": context,
        "max_num_seqs": max_num_seqs,
        "output_tokens": out_tokens,
        "total_tokens": all_tokens,
        "time_s": t,
        "output_tokens_per_s": out_tokens / t,
        "total_tokens_per_s": all_tokens / t,
        "repeats": repeats,
        "policy": engine.config.policy,
        "token_budget": engine.token_budget,
        "compiled_decode": compile_decode,
        "compile_s": compile_s,
        "compiled_prefill": compile_prefill,
        "prefill_compile_s": prefill_compile_s,
        "warmup_s": warmup_s,
        "compile_cache": cache_state(counts),
    } | extra


# ---- against transformers ------------------------------------------------------------------------------------
def load_hf_model(path: str | Path, dtype: str, device: torch.device) -> Any:
    """The checkpoint through ``transformers.AutoModelForCausalLM`` (eager, eval mode)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(dtype))
    # EOS must not stop it (the engine runs with ignore_eos): without an EOS id generate() never stops early,
    # and, unlike min_new_tokens, nothing masks the EOS logit, so greedy picks stay comparable
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    return model.to(device).eval()


def hf_generate(hf_model: Any, prompts: list[list[int]], max_new_tokens: int, pad_id: int = 0) -> list[list[int]]:
    """Greedy ``generate`` of a static batch, prompts left-padded (``load_hf_model`` turns EOS off). New tokens."""
    device = next(hf_model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        out = hf_model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return out[:, width:].tolist()


def decode_rate(generate: Any, new_tokens: int, device: Any = None) -> tuple[float, list[int]]:
    """Batch-1 decode tokens/s of ``generate(n) -> tokens``: ``(N - 1) / (t(N new tokens) - t(1 new token))``, so
    that prefill cancels out (``workbench/experiments/vllm_worker.py`` writes the same formula); and the N tokens."""
    t1, _ = timed(lambda: generate(1), device)
    tn, tokens = timed(lambda: generate(new_tokens), device)
    return (new_tokens - 1) / max(tn - t1, 1e-9), tokens


def compare_decode(
    model: Transformer,
    hf_model: Any,
    prompt_len: int = 32,
    new_tokens: int = 32,
    repeats: int = 3,
    seed: int = 0,
    compile_decode: bool = False,
) -> dict[str, Any]:
    """Batch-1 greedy decode tokens/s of the engine and of HF ``generate``, interleaved, same prompt.

    Decode rate for both: ``(N - 1) / (t(N new tokens) - t(1 new token))``, so prefill cancels out. With
    ``compile_decode`` the engine's decode step is compiled (during the warm-up run).
    """
    if new_tokens < 2:
        raise ConfigError(f"new_tokens must be >= 2 to time decode steps, got {new_tokens}")
    prompt = random_prompts(1, prompt_len, model.config.vocab_size, seed)[0]
    device = model.device

    # one engine: its cache (and CUDA graphs or compiled step) persist
    engine = bench_engine(model, 1, prompt_len + new_tokens + 1, compile_decode=compile_decode)

    def ours(n: int) -> list[int]:
        return engine.generate([prompt], _greedy(n)).requests[0].tokens

    def theirs(n: int) -> list[int]:
        return hf_generate(hf_model, [prompt], n)[0]

    ours(2), theirs(2)  # warm-up
    rates: dict[str, list[float]] = {"ours": [], "hf": []}
    tokens: dict[str, list[int]] = {}
    for _ in range(repeats):
        for name, fn in (("ours", ours), ("hf", theirs)):
            rate, tokens[name] = decode_rate(fn, new_tokens, device)
            rates[name].append(rate)
    ours_rate, hf_rate = median(rates["ours"]), median(rates["hf"])
    return {
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "ours_tokens_per_s": ours_rate,
        "hf_tokens_per_s": hf_rate,
        "ratio": ours_rate / hf_rate,
        "identical_tokens": tokens["ours"] == tokens["hf"],
        "repeats": repeats,
        "compiled_decode": compile_decode,
    }


def compare_offline(
    model: Transformer,
    hf_model: Any,
    num_requests: int = 64,
    context: int = 256,
    max_num_seqs: int = 32,
    seed: int = 0,
    compile_decode: bool = False,
) -> dict[str, Any]:
    """The offline set through the engine and through HF ``generate`` in static batches of ``max_num_seqs``.

    HF generates each batch up to its longest output (static batching); only each request's own output tokens
    count as output for both. Tokens are compared request by request. ``compile_decode``: the engine's pure decodes
    run compiled, every batch bucket compiled before the timing (``compile_s``).
    """
    requests = offline_requests(model.config.vocab_size, num_requests, context, seed)
    device = model.device
    engine = bench_engine(model, max_num_seqs, max(len(p) + n for p, n in requests), compile_decode=compile_decode)
    compile_s = engine.warmup_decode()
    run_engine_offline(model, requests[:2], max_num_seqs, engine)  # warm-up
    hf_generate(hf_model, [requests[0][0]], 2)

    def hf_all() -> list[list[int]]:
        outs: list[list[int]] = []
        for i in range(0, len(requests), max_num_seqs):
            batch = requests[i : i + max_num_seqs]
            gen = hf_generate(hf_model, [p for p, _ in batch], max(n for _, n in batch))
            outs += [g[:n] for g, (_, n) in zip(gen, batch)]
        return outs

    t_ours, ours_tokens = run_engine_offline(model, requests, max_num_seqs, engine)
    t_hf, hf_tokens = timed(hf_all, device)
    out_tokens = sum(n for _, n in requests)
    mismatched = [i for i, (a, b) in enumerate(zip(ours_tokens, hf_tokens)) if a != b]
    return {
        "num_requests": len(requests),
        "context": context,
        "max_num_seqs": max_num_seqs,
        "output_tokens": out_tokens,
        "ours_time_s": t_ours,
        "hf_time_s": t_hf,
        "ours_tokens_per_s": out_tokens / t_ours,
        "hf_tokens_per_s": out_tokens / t_hf,
        "ratio": t_hf / t_ours,
        "identical_tokens": not mismatched,
        "mismatched_requests": mismatched,
        "compiled_decode": compile_decode,
        "compile_s": compile_s,
    }


def hf_checkpoint(name_or_path: str, dtype: str, seed: int, workdir: str | Path | None = None) -> Path:
    """A checkpoint directory for both models: the path itself, or a random HF checkpoint of a preset."""
    from workbench.model.checkpoint import save_random_checkpoint

    path = Path(name_or_path)
    if path.is_dir():
        return path
    out = Path(workdir or tempfile.mkdtemp(prefix="workbench-bench-")) / "checkpoint"
    return save_random_checkpoint(name_or_path, out, seed=seed, dtype=dtype)


def bench_hf(
    name_or_path: str = DEFAULT_MODEL,
    dtype: str = "fp32",
    device: str = "auto",
    prompt_len: int = 32,
    new_tokens: int = 32,
    repeats: int = 3,
    num_requests: int = 64,
    context: int = 256,
    max_num_seqs: int = 32,
    seed: int = 0,
    offline: bool = True,
    workdir: str | Path | None = None,
    compile_decode: bool = False,
) -> dict[str, Any]:
    """Batch-1 decode and (optionally) the offline set, ours against transformers on one checkpoint.

    ``compile_decode`` applies to both: the batch-1 engine's decode step, and the offline set's pure decodes in
    every batch bucket (compiled before the timing).
    """
    dev = resolve_device(device)
    with tempfile.TemporaryDirectory(prefix="workbench-bench-") as tmp:
        ckpt = hf_checkpoint(name_or_path, dtype, seed, workdir or tmp)
        from workbench.model.checkpoint import load_checkpoint

        model = load_checkpoint(ckpt, dtype=dtype, device=dev)
        hf_model = load_hf_model(ckpt, dtype, dev)
    out: dict[str, Any] = {
        "decode": compare_decode(model, hf_model, prompt_len, new_tokens, repeats, seed, compile_decode)
    }
    if offline:
        out["offline"] = compare_offline(model, hf_model, num_requests, context, max_num_seqs, seed, compile_decode)
    return out
