"""Speculative decoding's speed-up, measured: the same engine with and without a proposer on the same prompts.

``measure_speedup`` serves ``batch`` random prompts greedily (EOS ignored, ``max_tokens`` each) on two engines over one
model, one without speculation and one with ``spec`` (``workbench.engine.speculative.SpeculativeConfig``), in
interleaved rounds (A B, B A, A B, ...: a shared machine's drift hits both arms alike). The first run of each arm is
an untimed warm-up; the baseline's warm-up tokens are the oracle's references (``OracleProposer.add_reference``: the
target's greedy continuation, from the run without speculation). Every timed run must give the baseline's tokens.
Returned: each arm's median run time and tokens/s (generated tokens over the whole run, prefill included), the
speed-up (ratio of the medians and the per-round ratios), the speculative counters of the timed runs, and for the
oracle the speed-up's ceiling ``expected_tokens_per_step(acceptance, k)`` (a verify step as cheap as a decode).
"""

from __future__ import annotations

from typing import Any

from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.engine.speculative import SpecStats, SpeculativeConfig, expected_tokens_per_step
from workbench.errors import ConfigError
from workbench.model.transformer import Transformer
from workbench.request import SamplingParams
from workbench.timing import median, random_prompts, timed


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
