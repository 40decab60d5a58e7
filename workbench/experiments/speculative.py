"""Speculative decoding's speed-up, measured: the same engine with and without a proposer on the same prompts.

``measure_speedup`` serves ``batch`` random prompts greedily (EOS ignored, ``max_tokens`` each) on two engines over one
model, one without speculation and one with ``spec`` (``workbench.engine.speculative.SpeculativeConfig``), in
interleaved rounds (A B, B A, A B, ...: a shared machine's drift hits both arms alike). The first run of each arm is
an untimed warm-up; the baseline's warm-up tokens are the oracle's references (``OracleProposer.add_reference``: the
target's greedy continuation, from the run without speculation). Every timed run must give the baseline's tokens.
Returned: each arm's median run time and tokens/s (generated tokens over the whole run, prefill included), the
speed-up (ratio of the medians and the per-round ratios), the speculative counters of the timed runs, and for the
oracle the speed-up's ceiling ``expected_tokens_per_step(acceptance, k)`` (a verify step as cheap as a decode).

``predict_speedup`` is the simulator's answer to the same question: the same requests (all at t = 0, ``prompt_len``
tokens, ``max_tokens`` each) on a simulated replica that runs the engine's scheduler with the same settings, priced
by a cost model (``workbench.sim``: a profile of this machine, or the roofline), with and without speculation
(``workbench.sim.speculation``: acceptances drawn with the config's, or a measured run's, per-position acceptance,
averaged over ``num_seeds`` seeded runs). ``speedup_against_batch`` measures and predicts side by side for each batch
size: the simulator's error is a number.

Notebook 09's claims, each decided in paired rounds (``workbench.experiments.trials``): ``speculation_trial`` (an
engine without speculation against one with it, tokens/s, an A/A control), ``ngram_output_trial`` (the n-gram
speed-up when the output repeats itself, greedy, against when it does not, sampled; the prompt from
``text_prompts``, the tokenizer's public-domain text), ``roofline_speedups`` (the expected speed-up per batch on the
roofline and the predicted crossover batch) and the claim functions ``speculation_raises_throughput``,
``speculation_gain_falls``, ``ngram_pays_on_repeating_output``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workbench.config import ModelConfig, canonical_dtype, ceil_div
from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.engine.speculative import SpecStats, SpeculativeConfig, expected_speedup, expected_tokens_per_step
from workbench.errors import ConfigError
from workbench.experiments.claims import PAIRED, make_claim, paired_claim
from workbench.experiments.trials import (
    THROUGHPUT_MARGIN,
    Comparison,
    DecisionRule,
    Rounds,
    contrast,
    control_deviation,
)
from workbench.model.transformer import Transformer
from workbench.request import SamplingParams
from workbench.sim.cluster import SimConfig, simulate
from workbench.sim.speculation import conditional_acceptance
from workbench.sim.stats import CostModel
from workbench.timing import median, random_prompts, timed
from workbench.workloads import Request


def measure_speedup(
    model: Transformer,
    spec: SpeculativeConfig | dict[str, Any] | str,
    batch: int = 1,
    prompt_len: int = 32,
    max_tokens: int = 64,
    rounds: int = 3,
    seed: int = 0,
    prompts: list[list[int]] | None = None,
    **engine: Any,
) -> dict[str, Any]:
    """Tokens/s of ``batch`` greedy requests with ``spec`` over without, in ``rounds`` interleaved rounds (module
    docstring); ``prompts``: these instead of ``batch`` random ones of ``prompt_len`` tokens (e.g. repetitive text,
    where n-gram lookup finds matches); ``engine``: further ``EngineConfig`` fields of both arms."""
    spec = SpeculativeConfig.parse(spec)
    if rounds < 1:
        raise ConfigError(f"rounds must be >= 1, got {rounds}")
    if prompts is not None:
        if not prompts or any(not p for p in prompts):
            raise ConfigError("measure_speedup: prompts must be a non-empty list of non-empty token-id lists")
        batch, prompt_len = len(prompts), max(len(p) for p in prompts)
    else:
        prompts = random_prompts(batch, prompt_len, model.config.vocab_size, seed)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    max_len = prompt_len + max_tokens + 1
    engine = {"max_model_len": max_len, "max_num_seqs": max(batch, 1), **engine}
    arms = {
        "base": Engine(model, EngineConfig(**engine)),
        "spec": Engine(model, EngineConfig(**engine, speculative_config=spec)),
    }
    reference = [r.tokens for r in arms["base"].generate(prompts, params).requests]
    if spec.method == "oracle":
        for p, tokens in zip(prompts, reference):
            arms["spec"].speculator.proposer.add_reference(p, tokens)
    arms["spec"].generate(prompts, params)  # warm-up
    arms["spec"].scheduler.spec_stats = SpecStats()  # count the timed runs only
    times: dict[str, list[float]] = {"base": [], "spec": []}
    for r in range(rounds):
        for name in ("base", "spec") if r % 2 == 0 else ("spec", "base"):
            eng = arms[name]
            seconds, result = timed(lambda eng=eng: eng.generate(prompts, params), model.device)
            if [q.tokens for q in result.requests] != reference:
                raise RuntimeError(f"measure_speedup: the {name} arm's greedy tokens differ from the baseline's")
            times[name].append(seconds)
    num_tokens = batch * max_tokens
    out: dict[str, Any] = {
        "batch": batch, "prompt_len": prompt_len, "max_tokens": max_tokens, "rounds": rounds,
        "spec_config": vars(spec).copy(),
    }  # fmt: skip
    for name, ts in times.items():
        out[name] = {"median_s": median(ts), "times_s": ts, "tokens_per_s": num_tokens / median(ts)}
    out["speedup"] = out["base"]["median_s"] / out["spec"]["median_s"]
    out["speedup_per_round"] = [b / s for b, s in zip(times["base"], times["spec"])]
    out["speculative"] = arms["spec"].scheduler.spec_stats.to_dict()
    if spec.method == "oracle":
        out["expected_tokens_per_step"] = expected_tokens_per_step(spec.acceptance, spec.num_speculative_tokens)
    return out


def predict_speedup(
    cost: CostModel,
    model: ModelConfig | str,
    spec: SpeculativeConfig | dict[str, Any] | str,
    batch: int = 1,
    prompt_len: int = 32,
    max_tokens: int = 64,
    acceptance: float | list[float] | None = None,
    num_seeds: int = 16,
    block_size: int = 16,
    dtype: str = "fp32",
    draft_cost: CostModel | None = None,
) -> dict[str, Any]:
    """The simulator's speed-up of ``measure_speedup``'s run: ``batch`` requests at t = 0 of ``prompt_len`` tokens
    generating ``max_tokens`` each, on one replica with the engine's defaults and ``measure_speedup``'s batch limit
    and context (policy continuous, ``max_num_seqs = batch``, ``max_model_len = prompt_len + max_tokens + 1``, a pool
    that holds them all), priced by ``cost``; speculation's acceptances drawn with ``acceptance`` (None: the
    oracle's) in ``num_seeds`` seeded runs. Returns the simulated run times, the speed-up (the run without over the
    mean run with) and the mean tokens per verify step."""
    spec = SpeculativeConfig.parse(spec)
    cfg = model if isinstance(model, ModelConfig) else ModelConfig.resolve(model)
    if num_seeds < 1:
        raise ConfigError(f"num_seeds must be >= 1, got {num_seeds}")
    max_len = prompt_len + max_tokens + 1
    requests = [Request(i, 0.0, prompt_len, max_tokens) for i in range(batch)]
    common = {"num_blocks": batch * (ceil_div(max_len, block_size) + 1) + 1, "block_size": block_size,
              "max_num_seqs": max(batch, 1), "max_model_len": max_len, "dtype": dtype}  # fmt: skip

    def fresh() -> CostModel:  # a profile keeps idle state across steps: each run starts from a copy
        copy = getattr(cost, "with_noise", None)
        return copy(None) if copy is not None else cost

    base_s = simulate(requests, cfg, fresh(), SimConfig(**common)).duration_s
    spec_cfg = SimConfig(**common, speculative_config=spec, spec_acceptance=acceptance)
    runs = [simulate(requests, cfg, fresh(), spec_cfg, seed=s, draft_cost_model=draft_cost) for s in range(num_seeds)]
    spec_s = [r.duration_s for r in runs]
    drafts = sum(r.speculative["num_drafts"] for r in runs)
    accepted = sum(r.speculative["num_accepted_tokens"] for r in runs)
    return {
        "base_s": base_s, "spec_s": sum(spec_s) / len(spec_s), "spec_s_per_seed": spec_s,
        "speedup": base_s * len(spec_s) / sum(spec_s),
        "tokens_per_verify": 1.0 + accepted / drafts if drafts else None,
    }  # fmt: skip


def speedup_against_batch(
    model: Transformer,
    spec: SpeculativeConfig | dict[str, Any] | str,
    cost: CostModel,
    batches: list[int],
    prompt_len: int = 32,
    max_tokens: int = 64,
    rounds: int = 3,
    seed: int = 0,
    num_seeds: int = 16,
    progress: Any = None,
) -> list[dict[str, Any]]:
    """Per batch size, ``measure_speedup``'s measurement beside ``predict_speedup``'s prediction on ``cost`` for
    the same run: ``predicted`` at the config's acceptance (the oracle's; other methods: the measured one), and
    ``predicted_at_measured`` at the run's own per-position acceptance (what the cost model alone gets wrong), each
    with its ``error`` (predicted / measured - 1). ``progress``: a tqdm-like object updated once per batch size."""
    spec = SpeculativeConfig.parse(spec)
    dtype = canonical_dtype(str(model.dtype))
    rows = []
    for batch in batches:
        measured = measure_speedup(model, spec, batch, prompt_len, max_tokens, rounds, seed)
        stats = measured["speculative"]
        at_measured = conditional_acceptance(stats["per_position_acceptance"]) or None
        kwargs = {"batch": batch, "prompt_len": prompt_len, "max_tokens": max_tokens, "num_seeds": num_seeds,
                  "dtype": dtype}  # fmt: skip
        predicted = predict_speedup(cost, model.config, spec, acceptance=None if spec.method == "oracle" else
                                    at_measured, **kwargs)  # fmt: skip
        predicted_m = predict_speedup(cost, model.config, spec, acceptance=at_measured, **kwargs)
        rows.append({
            "batch": batch,
            "measured_speedup": measured["speedup"],
            "speedup_per_round": measured["speedup_per_round"],
            "base_tokens_per_s": measured["base"]["tokens_per_s"],
            "spec_tokens_per_s": measured["spec"]["tokens_per_s"],
            "predicted_speedup": predicted["speedup"],
            "error": predicted["speedup"] / measured["speedup"] - 1.0,
            "predicted_at_measured_acceptance": predicted_m["speedup"],
            "error_at_measured_acceptance": predicted_m["speedup"] / measured["speedup"] - 1.0,
            "predicted_base_s": predicted["base_s"], "measured_base_s": measured["base"]["median_s"],
            "predicted_spec_s": predicted["spec_s"], "measured_spec_s": measured["spec"]["median_s"],
            "acceptance_rate": stats["acceptance_rate"],
            "mean_accepted_length": stats["mean_accepted_length"],
            "per_position_acceptance": stats["per_position_acceptance"],
            "expected_tokens_per_step": measured.get("expected_tokens_per_step"),
        })  # fmt: skip
        if progress is not None:
            progress.update(1)
    return rows


# ---- paired rounds and claims (notebook 09) ------------------------------------------------------------------------
def _generation_arm(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, reference: list[list[int]] | None
) -> Any:
    """A trial of ``engine``: generate ``prompts`` with ``params``; returns output tokens/s. A greedy run is checked
    against ``reference``, the run without speculation (speculation must not change a greedy token); a sampled run
    (``reference`` None) is not: rejection sampling keeps each token's distribution, not the random stream."""

    def arm(_round: int) -> float:
        seconds, result = timed(lambda: engine.generate(prompts, params), engine.model.device)
        if reference is not None and [q.tokens for q in result.requests] != reference:
            raise RuntimeError("a speculative arm's greedy tokens differ from the run without speculation")
        return sum(len(q.tokens) for q in result.requests) / seconds

    return arm


def _arm_engines(
    model: Transformer, spec: SpeculativeConfig, prompts: list[list[int]], params: SamplingParams, max_len: int
) -> tuple[Engine, Engine, Engine, list[list[int]]]:
    """(baseline, A/A baseline, speculating) engines for ``prompts``, and the baseline's greedy tokens (the
    oracle's references)."""
    cfg = {"max_model_len": max_len, "max_num_seqs": max(len(prompts), 1)}
    base, control = Engine(model, EngineConfig(**cfg)), Engine(model, EngineConfig(**cfg))
    speculating = Engine(model, EngineConfig(**cfg, speculative_config=spec))
    reference = [r.tokens for r in base.generate(prompts, params).requests]
    if spec.method == "oracle":
        for p, tokens in zip(prompts, reference):
            speculating.speculator.proposer.add_reference(p, tokens)
    return base, control, speculating, reference


def speculation_trial(
    model: Transformer,
    spec: SpeculativeConfig | dict[str, Any] | str,
    rounds: Rounds,
    batch: int = 1,
    prompt_len: int = 32,
    max_tokens: int = 32,
    seed: int = 0,
    prompts: list[list[int]] | None = None,
) -> tuple[Comparison, dict[str, Any]]:
    """Output tokens/s of ``batch`` greedy requests without (A) and with ``spec`` (B) in paired rounds (``rounds``),
    B claimed higher by more than ``THROUGHPUT_MARGIN``; the A/A control is a second engine without speculation.
    ``prompts`` (default: ``batch`` random ones of ``prompt_len`` tokens) are the same in every round. Returns the
    comparison and the speculating engine's acceptance counters over the rounds (``SpecStats.to_dict``)."""
    spec = SpeculativeConfig.parse(spec)
    if prompts is None:
        prompts = random_prompts(batch, prompt_len, model.config.vocab_size, seed)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    max_len = max(len(p) for p in prompts) + max_tokens + 1
    base, control, speculating, reference = _arm_engines(model, spec, prompts, params, max_len)
    speculating.scheduler.spec_stats = SpecStats()
    label = f"{spec.method} k={spec.num_speculative_tokens}"
    arms = {"no speculation": _generation_arm(base, prompts, params, reference),
            label: _generation_arm(speculating, prompts, params, reference)}  # fmt: skip
    comparison = rounds.run(arms, DecisionRule("higher", THROUGHPUT_MARGIN),
                            control_arm=_generation_arm(control, prompts, params, reference))  # fmt: skip
    return comparison, speculating.scheduler.spec_stats.to_dict()


def text_prompts(model: ModelConfig, prompt_len: int, period: int = 8) -> dict[str, list[int]]:
    """Two prompts of ``prompt_len`` tokens of the tokenizer's public-domain text (``workbench.model.tokenizer``,
    trained for ``model``'s vocabulary): ``repetitive``, its first ``period`` tokens over and over (what prompt
    lookup can find), and ``free``, the running text (it repeats only where the documents do)."""
    from workbench.model.tokenizer import TRAINING_TEXT, train_tokenizer

    ids = train_tokenizer(model).encode(TRAINING_TEXT.read_text(encoding="utf-8"), add_special_tokens=False)
    if len(ids) < prompt_len or period < 1:
        raise ConfigError(f"the public-domain text has {len(ids)} tokens; prompt_len must be <= that, period >= 1")
    return {"repetitive": (ids[:period] * (prompt_len // period + 1))[:prompt_len], "free": ids[:prompt_len]}


def repeated_ngram_share(prompt: list[int], tokens: list[int], n: int = 2) -> float:
    """The share of ``tokens`` (an output after ``prompt``) that complete an ``n``-gram already seen earlier in the
    prompt and output: what prompt lookup can find. 0.0 for an output shorter than ``n``."""
    if n < 1:
        raise ConfigError(f"repeated_ngram_share: n must be >= 1, got {n}")
    seq = list(prompt) + list(tokens)
    seen = {tuple(seq[i : i + n]) for i in range(len(prompt) - n + 1)}
    hits = 0
    for i in range(len(prompt), len(seq)):
        if i - n + 1 < 0:
            continue
        gram = tuple(seq[i - n + 1 : i + 1])
        hits += gram in seen
        seen.add(gram)
    return hits / len(tokens) if tokens else 0.0


def ngram_output_trial(
    model: Transformer,
    spec: SpeculativeConfig | dict[str, Any] | str,
    prompt: list[int],
    rounds: Rounds,
    max_tokens: int = 32,
    temperature: float = 1.0,
    seed: int = 0,
) -> tuple[Comparison, dict[str, dict[str, Any]]]:
    """The speed-up of ``spec`` (n-gram) over no speculation when the output does not repeat itself (A: sampled at
    ``temperature``, each request seeded with ``seed``) against when it does (B: greedy), on the same ``prompt``,
    in paired rounds: each trial generates without and with speculation and returns the ratio of the two tokens/s;
    B claimed higher by more than ``THROUGHPUT_MARGIN``; the A/A control repeats A on engines of its own.

    Why these arms: prompt lookup proposes the tokens that followed an earlier occurrence of the last n tokens, so
    it pays exactly when the output repeats what came before. With random weights the greedy output falls into a
    loop within a few tokens on any prompt (a repetitive and a free prompt both gave acceptance 1.00), while a
    sample at temperature 1 from the same model rarely repeats a bigram; each arm's ``repeated_bigram_share`` (of
    its reference output, ``repeated_ngram_share``) says how repetitive its output was. Returns the comparison and
    each arm's acceptance counters with that share."""
    spec = SpeculativeConfig.parse(spec)
    greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sampled = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature, seed=seed)
    stats: dict[str, SpecStats] = {}
    shares: dict[str, float] = {}

    def arm(name: str, params: SamplingParams) -> Any:
        prompts = [prompt]
        base, _, speculating, reference = _arm_engines(model, spec, prompts, params, len(prompt) + max_tokens + 1)
        speculating.scheduler.spec_stats = stats[name] = SpecStats()
        shares[name] = repeated_ngram_share(prompt, reference[0])
        check = reference if params.temperature == 0 else None
        plain = _generation_arm(base, prompts, params, check)
        fast = _generation_arm(speculating, prompts, params, check)
        return lambda r: fast(r) / plain(r)

    free, repeating = f"sampled (T={temperature:g})", "greedy (loops)"
    arms = {free: arm(free, sampled), repeating: arm(repeating, greedy)}
    comparison = rounds.run(arms, DecisionRule("higher", THROUGHPUT_MARGIN), control_arm=arm("control", sampled))
    return comparison, {
        name: {**s.to_dict(), "repeated_bigram_share": shares[name]} for name, s in stats.items() if name != "control"
    }


def roofline_speedups(
    rm: Any, alpha: float, k: int, batches: list[int], context_len: int
) -> tuple[list[dict[str, Any]], int | None]:
    """Per batch size, the roofline's decode and verify step times at ``context_len`` (``rm``: a
    ``RooflineModel``) and the expected speed-up ``expected_speedup(alpha, k, decode, verify)``; and the predicted
    crossover: the smallest batch (powers of two up to 4096) whose expected speed-up is below 1 (None: none)."""
    rows = []
    for b in batches:
        decode_s = rm.decode([context_len] * b, detailed=False).time_s
        verify_s = rm.verify([context_len] * b, k, detailed=False).time_s
        rows.append({"batch": b, "decode_s": decode_s, "verify_s": verify_s,
                     "speedup": expected_speedup(alpha, k, decode_s, verify_s)})  # fmt: skip
    crossover = None
    b = 1
    while b <= 4096:
        ctx = [context_len] * b
        s = expected_speedup(alpha, k, rm.decode(ctx, detailed=False).time_s, rm.verify(ctx, k, detailed=False).time_s)
        if s < 1.0:
            crossover = b
            break
        b *= 2
    return rows, crossover


def speculation_raises_throughput(comparison: Comparison, spec: Mapping[str, Any]) -> dict[str, Any]:
    """Claim: speculation raises batch-1 decode throughput when acceptance is high (paired rounds)."""
    return paired_claim("Speculative decoding raises batch-1 decode throughput when acceptance is high", comparison,
                        f"batch-1 output tokens/s, {spec.get('method')} acceptance {spec.get('acceptance')} "
                        f"k={spec.get('num_speculative_tokens')}")  # fmt: skip


def speculation_gain_falls(
    small: Comparison, large: Comparison, batch_small: int, batch_large: int,
    predicted_crossover: int | None, measured_crossover: int | None,
) -> dict[str, Any]:  # fmt: skip
    """Claim: speculation's gain falls as the batch grows: the speed-up at ``batch_small`` over the speed-up at
    ``batch_large``, with its interval (``trials.contrast``: Welch over the two comparisons' per-round log-ratios),
    claimed higher by more than ``THROUGHPUT_MARGIN``. The evidence holds that ratio, both comparisons (without
    their per-round values) under ``small`` and ``large``, the A/A control that widened the margin (else the one
    with the larger deviation) under ``control``, and the roofline's predicted crossover batch beside the measured
    one (the smallest measured batch with a speed-up below 1)."""
    rule = DecisionRule("higher", THROUGHPUT_MARGIN, small.rule.confidence)
    ratio, low, high, verdict, reason = contrast(small, large, rule)
    controls = [c.control for c in (small, large) if c.control]
    control = max(controls, key=lambda c: (c["failed"], control_deviation(c)), default=None)
    evidence = {"arms": [f"speed-up at batch {batch_large}", f"speed-up at batch {batch_small}"], "ratio": ratio,
                "ci_low": low, "ci_high": high, "rounds": min(small.rounds, large.rounds), "margin": rule.margin,
                "confidence": rule.confidence, "direction": rule.direction, "reason": reason, "control": control,
                "interval": "welch", "batch_small": batch_small, "batch_large": batch_large,
                **{name: {k: v for k, v in c.evidence().items() if k != "values"}
                   for name, c in (("small", small), ("large", large))},
                "predicted_crossover_batch": predicted_crossover,
                "measured_crossover_batch": measured_crossover}  # fmt: skip
    failed = "; an A/A control failed" if reason.startswith("control_failed") else ""
    detail = (f"speed-up at batch {batch_small} over the speed-up at batch {batch_large}: {ratio:.3g} "
              f"[{low:.3g}, {high:.3g}] ({rule.confidence:.0%} Welch interval over the rounds' log-ratios; claimed "
              f"higher by more than {THROUGHPUT_MARGIN:.0%}{failed}); "
              f"at batch {batch_small}: {small.summary()}; at batch {batch_large}: {large.summary()}; the roofline "
              f"predicts no gain from batch {predicted_crossover}, measured: "
              f"{'a gain at every batch measured' if measured_crossover is None else measured_crossover}")  # fmt: skip
    return make_claim("Speculation's gain falls as the batch grows", verdict, evidence, detail, (PAIRED,))


def ngram_pays_on_repeating_output(comparison: Comparison, acceptance: Mapping[str, Mapping[str, Any]]) -> dict:
    """Claim: n-gram speculation gains more when the output repeats itself than when it does not (paired rounds of
    the two speed-ups, ``ngram_output_trial``), with each arm's acceptance and repeated-bigram share in the
    evidence."""
    rates = {k: v.get("acceptance_rate") for k, v in acceptance.items()}
    shares = {k: v.get("repeated_bigram_share") for k, v in acceptance.items()}
    text = ", ".join(
        (f"{k}: acceptance {rates[k]:.2f}" if rates[k] is not None else f"{k}: none proposed")
        + f", {shares[k]:.0%} of its tokens repeat a bigram"
        for k in acceptance
    )
    return paired_claim("n-gram speculation gains more when the output repeats itself than when it does not",
                        comparison, f"speed-up of n-gram speculation ({text})", acceptance=rates,
                        repeated_bigram_share=shares)  # fmt: skip
