"""Decode levers: the same engine with fewer bytes per weight (fp32, bf16, int8, int4) and per cached token (KV in
the activation dtype, int8, fp8), timed against each other in one run, with what each costs in accuracy.

``bench decode --quantization none int8 int4`` and notebook 08 both call these:

- ``decode_schemes``: per batch size, one engine per scheme, each prefilled with the same random prompts, then
  decode steps taken in turn (scheme A, B, C, A, B, C, ...: a shared machine's drift hits every scheme alike);
  per scheme the median step (with min and max), tokens/s, the bytes a step moves in that format
  (``workbench.bench.decode_step_bytes``), bytes/s, MBU against the measured read bandwidth, arithmetic intensity
  and achieved FLOP/s (for the roofline), the speed-up over the first scheme, and ``times_s``, the timed steps in
  order (step i of every scheme ran in the same turn: paired repeats, ``claims.repeat_comparison``);
- ``prefill_schemes``: the step that prefills one fresh prompt (the TTFT of a request that waits for nothing), in
  the same interleaved way (``times_s`` the repeats in order, paired across schemes); fewer bytes per weight do
  not make a compute-bound step faster;
- ``accuracy_schemes``: logits against the unquantized model (``workbench.model.accuracy``);
- ``kv_capacity``: sequences of a context length that fit in a KV budget under each KV dtype (the one planner,
  ``workbench.kv.sizing.plan_num_blocks``, which counts int8's scales);
- ``weight_trials``: the claim "fewer bytes per weight make decode faster" in paired rounds
  (``workbench.experiments.trials``), each scheme against the next with fewer bytes per weight;
- ``kv_trials``: the claim "a quantized KV cache makes long-context decode faster" in paired rounds, each quantized
  KV dtype against the cache in the activation dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workbench.bench import decode_step_bytes, load_bench_model, prefill_until_decoding, track_contexts
from workbench.config import (
    DEFAULT_GROUP_SIZE,
    ModelConfig,
    canonical_dtype,
    canonical_quantization,
    ceil_div,
    resolve_kv_cache_dtype,
)
from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.engine.scheduler import blocks_over_watermark
from workbench.errors import ConfigError
from workbench.experiments.trials import THROUGHPUT_MARGIN, Comparison, DecisionRule, Rounds
from workbench.kv.sizing import plan_num_blocks
from workbench.model.accuracy import logit_agreement
from workbench.request import SamplingParams
from workbench.roofline import memory_bandwidth_utilization, step_work
from workbench.timing import median, random_prompts, spread_row, timed


@dataclass(frozen=True)
class Scheme:
    """One way to store a model: activation ``dtype``, weight ``quantization`` (None, int8, int4) and KV dtype."""

    dtype: str = "fp32"
    quantization: str | None = None
    group_size: int = DEFAULT_GROUP_SIZE
    kv_cache_dtype: str = "auto"

    @property
    def label(self) -> str:
        w = {None: self.dtype, "int4": f"int4-g{self.group_size}"}.get(self.quantization, self.quantization)
        kv = resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype)
        return w if kv == self.dtype else f"{w} kv-{kv}"

    @property
    def weights_key(self) -> tuple[str, str | None, int]:
        return self.dtype, self.quantization, self.group_size if self.quantization == "int4" else 0


def make_schemes(
    quantizations: Sequence[str | None] = (None,),
    group_sizes: Sequence[int] = (DEFAULT_GROUP_SIZE,),
    kv_cache_dtypes: Sequence[str] = ("auto",),
    dtypes: Sequence[str] = ("fp32",),
) -> list[Scheme]:
    """Every combination, in order (int4 once per group size; other formats ignore the group size)."""
    out: list[Scheme] = []
    for dtype in dtypes:
        for q in quantizations:
            qc = canonical_quantization(q)
            for g in group_sizes if qc == "int4" else (DEFAULT_GROUP_SIZE,):
                for kv in kv_cache_dtypes:
                    scheme = Scheme(canonical_dtype(dtype), qc, g, str(kv).lower())
                    if scheme not in out:
                        out.append(scheme)
    return out


def load_scheme_models(name_or_path: str, schemes: Sequence[Scheme], device: str = "auto", seed: int = 0) -> dict:
    """``weights_key`` -> model, one per distinct weight format, every check made before the first load."""
    cfg = ModelConfig.resolve(name_or_path)
    for s in schemes:
        cfg.check_quantization(s.quantization, s.group_size)
        resolve_kv_cache_dtype(s.kv_cache_dtype, s.dtype)
    models: dict[tuple, Any] = {}
    for s in schemes:
        if s.weights_key not in models:
            models[s.weights_key] = load_bench_model(name_or_path, s.dtype, device, seed, s.quantization, s.group_size)
    return models


def _engine(model: Any, scheme: Scheme, max_num_seqs: int, max_model_len: int, compile_decode: bool) -> Engine:
    """An engine of ``scheme`` whose pool admits ``max_num_seqs`` requests of ``max_model_len`` tokens together (over
    the admission watermark: ``blocks_over_watermark``)."""
    num_blocks = blocks_over_watermark(max_num_seqs, -(-max_model_len // EngineConfig.block_size))
    cfg = EngineConfig(
        max_num_seqs=max_num_seqs, max_model_len=max_model_len, num_blocks=num_blocks, dtype=scheme.dtype,
        device=str(model.device),
        quantization=scheme.quantization, group_size=scheme.group_size, kv_cache_dtype=scheme.kv_cache_dtype,
        compile_decode=compile_decode,
    )  # fmt: skip
    return Engine(model, cfg)


def decode_schemes(
    models: dict,
    schemes: Sequence[Scheme],
    batch_sizes: Sequence[int],
    prompt_len: int,
    hw: Any,
    steps: int = 8,
    warmup: int = 2,
    seed: int = 0,
    compile_decode: bool = False,
) -> list[dict[str, Any]]:
    """Decode steps of every scheme, interleaved, per batch size (see the module docstring). ``models`` from
    ``load_scheme_models``; ``hw`` a measured spec (its read bandwidth and peak divide)."""
    if steps < 1 or warmup < 0 or prompt_len < 1:
        raise ConfigError(f"need steps >= 1, warmup >= 0, prompt_len >= 1; got {steps}, {warmup}, {prompt_len}")
    if compile_decode:
        warmup = max(warmup, 1)  # the first decode step of each engine compiles
    rows = []
    for batch in batch_sizes:
        engines, live = {}, {}
        for s in schemes:
            model = models[s.weights_key]
            max_len = prompt_len + warmup + steps + 2
            if max_len > model.config.max_position_embeddings:
                raise ConfigError(f"prompt_len {prompt_len} + {warmup + steps} steps exceed the model's positions")
            engine = _engine(model, s, batch, max_len, compile_decode)
            for prompt in random_prompts(batch, prompt_len, model.config.vocab_size, seed):
                engine.add_request(prompt, SamplingParams(max_tokens=warmup + steps + 1, ignore_eos=True))
            live[s] = prefill_until_decoding(engine, batch)  # the next step is a pure decode of every sequence
            engines[s] = engine
        times: dict[Scheme, list[float]] = {s: [] for s in schemes}
        contexts: dict[Scheme, list[int]] = {s: [] for s in schemes}
        for i in range(warmup + steps):
            for s, engine in engines.items():  # A, B, C, A, B, C, ...
                context = list(live[s].values())
                t, outputs = timed(engine.step, engine.model.device)
                track_contexts(live[s], outputs)
                if i >= warmup:
                    times[s].append(t)
                    contexts[s] = context
        base = None
        for s in schemes:
            cfg = models[s.weights_key].config
            t = spread_row(times[s])
            moved = decode_step_bytes(cfg, s.dtype, contexts[s], s.quantization, s.group_size, s.kv_cache_dtype)
            flops = step_work(cfg, s.dtype, decode_contexts=contexts[s]).flops
            row = {
                "scheme": s.label, "dtype": s.dtype, "quantization": s.quantization or "none",
                "group_size": s.group_size if s.quantization == "int4" else None,
                "kv_cache_dtype": resolve_kv_cache_dtype(s.kv_cache_dtype, s.dtype), "batch": batch,
                "context_len": max(contexts[s]), **t, "tokens_per_s": batch / t["time_s"],
                "tokens_per_s_min": batch / t["time_max_s"], "tokens_per_s_max": batch / t["time_min_s"],
                "weight_bytes": moved["weight_bytes"], "kv_bytes": moved["kv_bytes"], "bytes_per_step": moved["bytes"],
                "bytes_per_token": moved["bytes"] / batch, "achieved_bytes_per_s": moved["bytes"] / t["time_s"],
                "mbu": memory_bandwidth_utilization(moved["bytes"], t["time_s"], hw), "flops": flops,
                "intensity": flops / moved["bytes"], "achieved_flops_per_s": flops / t["time_s"], "steps": steps,
                "compiled_decode": compile_decode, "times_s": list(times[s]),
            }  # fmt: skip
            base = base or row
            row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
            row["bytes_ratio"] = base["bytes_per_step"] / row["bytes_per_step"]
            rows.append(row)
        del engines
    return rows


def scheme_decode_arm(
    model: Any, scheme: Scheme, batch: int, prompt_len: int, steps: int, trials: int, seed: int = 0,
    compile_decode: bool = False,
) -> Any:  # fmt: skip
    """An arm of paired rounds: an engine of ``scheme`` on ``model`` with ``batch`` sequences prefilled from
    ``prompt_len``-token random prompts (``seed``), enough tokens left for ``trials`` trials; one trial times
    ``steps`` pure decode steps and returns tokens/s of the median step."""
    if steps < 1 or trials < 1 or prompt_len < 1:
        raise ConfigError(f"need steps, trials, prompt_len >= 1; got {steps}, {trials}, {prompt_len}")
    tokens = trials * steps + 1
    max_len = prompt_len + tokens + 1
    if max_len > model.config.max_position_embeddings:
        raise ConfigError(f"prompt_len {prompt_len} + {tokens} decode tokens exceed the model's positions")
    engine = _engine(model, scheme, batch, max_len, compile_decode)
    for prompt in random_prompts(batch, prompt_len, model.config.vocab_size, seed):
        engine.add_request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
    prefill_until_decoding(engine, batch)  # the next step is a pure decode of every sequence

    def trial(_round: int) -> float:
        times = []
        for _ in range(steps):
            if not engine.has_unfinished():
                raise ConfigError(f"the {scheme.label} arm ran out of decode steps (more trials than {trials})")
            times.append(timed(engine.step, engine.model.device)[0])
        return batch / median(times)

    return trial


def weight_trials(
    models: dict, schemes: Sequence[Scheme], batch: int, prompt_len: int, rounds: Rounds, steps: int = 4,
    seed: int = 0, compile_decode: bool = False,
) -> list[Comparison]:  # fmt: skip
    """Decode tokens/s of each scheme against the next one with fewer bytes per weight (schemes sorted by their
    weight bytes, most first), in paired rounds: B (fewer bytes) higher by more than ``THROUGHPUT_MARGIN``. Each
    arm is an engine of its own; the A/A control is a second engine of A, so that no arm's sequences grow faster."""

    def weight_bytes(s: Scheme) -> float:
        return models[s.weights_key].config.weight_bytes(s.dtype, s.quantization, s.group_size)

    ordered = sorted(schemes, key=lambda s: -weight_bytes(s))
    out = []
    for a, b in zip(ordered, ordered[1:]):

        def arm(s: Scheme) -> Any:
            return scheme_decode_arm(models[s.weights_key], s, batch, prompt_len, steps, rounds.max_trials, seed,
                                     compile_decode)  # fmt: skip

        arms = {a.label: arm(a), b.label: arm(b)}
        out.append(rounds.run(arms, DecisionRule("higher", THROUGHPUT_MARGIN), control_arm=arm(a)))
    return out


def kv_trials(
    models: dict, schemes: Sequence[Scheme], batch: int, context: int, rounds: Rounds, steps: int = 4, seed: int = 0,
) -> list[Comparison]:  # fmt: skip
    """Decode tokens/s at a long context of each quantized KV scheme against the first of ``schemes`` (the KV cache
    in the activation dtype, same weights), in paired rounds: B (fewer bytes per cached token) higher by more than
    ``THROUGHPUT_MARGIN``. Every arm is an engine of its own with ``batch`` sequences prefilled from ``context``-token
    prompts (the same prompts in every arm), so both arms of a round decode at the same context; the A/A control is a
    second engine of the first scheme."""
    if len(schemes) < 2:
        raise ConfigError(f"kv_trials compares KV dtypes against the first: need 2 or more schemes, got {len(schemes)}")
    base = schemes[0]
    keys = {s.weights_key for s in schemes}
    if len(keys) > 1:
        raise ConfigError(f"kv_trials compares KV dtypes of the same weights, got {[s.label for s in schemes]}")

    def arm(s: Scheme) -> Any:
        return scheme_decode_arm(models[s.weights_key], s, batch, context, steps, rounds.max_trials, seed)

    return [
        rounds.run(
            {base.label: arm(base), s.label: arm(s)}, DecisionRule("higher", THROUGHPUT_MARGIN), control_arm=arm(base)
        )  # fmt: skip
        for s in schemes[1:]
    ]


def prefill_schemes(
    models: dict,
    schemes: Sequence[Scheme],
    prompt_lens: Sequence[int],
    repeats: int = 3,
    warmup: int = 1,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Per prompt length and scheme: the engine step that prefills one fresh prompt and samples its first token
    (median, min, max over ``repeats``, schemes interleaved), its FLOPs and FLOP/s, speed-up over the first scheme."""
    rows = []
    for n in prompt_lens:
        engines = {s: _engine(models[s.weights_key], s, 1, n + 1, False) for s in schemes}
        vocab = next(iter(models.values())).config.vocab_size
        prompts = random_prompts(warmup + repeats, n, vocab, seed)
        times: dict[Scheme, list[float]] = {s: [] for s in schemes}
        for i, prompt in enumerate(prompts):
            for s, engine in engines.items():
                engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
                t, _ = timed(engine.step, engine.model.device)
                if i >= warmup:
                    times[s].append(t)
        base = None
        for s in schemes:
            cfg = models[s.weights_key].config
            flops = step_work(cfg, s.dtype, prefill_chunks=[(n, 0)]).flops
            t = spread_row(times[s])
            row = {"scheme": s.label, "prompt_len": n, **t, "flops": flops, "achieved_flops_per_s": flops / t["time_s"],
                   "times_s": list(times[s])}  # fmt: skip
            base = base or row
            row["speedup"] = base["time_s"] / row["time_s"]
            rows.append(row)
    return rows


def accuracy_schemes(
    reference: Any, models: dict, schemes: Sequence[Scheme], prompts: list[list[int]]
) -> list[dict[str, Any]]:
    """Per scheme: cosine, KL and top-1 agreement of its logits against ``reference`` (the unquantized model in
    fp32 with a plain KV cache) over every position of ``prompts``."""
    rows = []
    for s in schemes:
        agree = logit_agreement(reference, models[s.weights_key], prompts, s.kv_cache_dtype)
        rows.append({"scheme": s.label, **agree})
    return rows


def kv_capacity(
    cfg: ModelConfig, dtype: str, kv_cache_dtypes: Sequence[str], context_len: int, budget_bytes: float,
    block_size: int = 16,
) -> list[dict[str, Any]]:  # fmt: skip
    """Per KV dtype: bytes per token (scales included) and how many sequences of ``context_len`` tokens fit in
    ``budget_bytes`` of KV pool."""
    rows = []
    per_seq = ceil_div(context_len, block_size)
    for kv in kv_cache_dtypes:
        resolved = resolve_kv_cache_dtype(kv, dtype)
        blocks = plan_num_blocks(cfg, block_size, resolved, budget_bytes)
        rows.append({
            "kv_cache_dtype": resolved, "bytes_per_token": cfg.kv_bytes_per_token(resolved),
            "context_len": context_len, "budget_bytes": budget_bytes, "sequences_that_fit": blocks // per_seq,
        })  # fmt: skip
    return rows
