"""Speculative decoding: the config, the proposers and the verification by hand; greedy output equal to HF's with
every proposer, model and policy (a pool that preempts, prefix caching on, the block manager's invariants after every
step); no leak after aborts; and the sampling law: speculation leaves the target's distribution unchanged."""

import json
import math
import random

import pytest
import torch

from tests.conftest import TINY_PRESETS, hf_greedy_tokens
from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.engine.spec_decode import greedy_verify, rejection_sample
from workbench.engine.speculative import NgramProposer, SpecStats, SpeculativeConfig, expected_tokens_per_step
from workbench.errors import ConfigError
from workbench.kv.block_manager import BlockManager
from workbench.model import load_checkpoint
from workbench.model.checkpoint import load_model
from workbench.request import SamplingParams, Sequence

MAX_TOKENS = 12
_rng = random.Random(1)
_SHARED = [5, 6, 7, 8] * 4  # 16 tokens: a full block of 16 shared by two prompts (prefix caching), and repetitive
PROMPTS = [
    _SHARED + [5, 6],
    [_rng.randrange(3, 256) for _ in range(23)],
    [9, 9, 9],
    _SHARED + [40, 41, 42, 40, 41],
    [_rng.randrange(3, 256) for _ in range(35)] + [10, 11, 12, 10, 11],
]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def spec_config(method: str, path) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if method == "oracle":
        return {"method": "oracle", "acceptance": 0.6, "num_speculative_tokens": 4, "seed": 0}
    return {"model": str(path), "num_speculative_tokens": 3}  # the target as its own draft: it should agree


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    """preset -> (checkpoint dir, model, HF's greedy tokens of PROMPTS)."""
    out = {}
    for preset in TINY_PRESETS:
        path = tiny_checkpoint(preset)
        out[preset] = (path, load_checkpoint(path), hf_greedy_tokens(path, PROMPTS, MAX_TOKENS))
    return out


def check_every_step(engine: Engine) -> None:
    """The block manager's invariants (ref counts against the live tables) after every step."""

    def hook(plan, record) -> None:  # noqa: ANN001
        engine.block_manager.check_invariants([s.block_table for s in engine.scheduler.running])

    engine.on_step = hook


# ---- config, proposers and verification by hand --------------------------------------------------------------------
def test_config_parses_vllm_shapes():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 4, 4)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)  # vLLM's default
    c = SpeculativeConfig.parse({"model": "DIR", "num_speculative_tokens": 4})
    assert (c.method, c.model) == ("draft", "DIR")
    c = SpeculativeConfig.parse(json.dumps({"method": "oracle", "acceptance": 0.7, "num_speculative_tokens": 4}))
    assert (c.method, c.acceptance) == ("oracle", 0.7)
    assert EngineConfig(speculative_config={"method": "draft_model", "model": "x", "num_speculative_tokens": 1})


@pytest.mark.parametrize(
    "value, needle",
    [
        ("{nope", "not valid JSON"),
        ("[1]", "JSON object"),
        ({"method": "ngram"}, "num_speculative_tokens must be a positive integer"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram, draft, oracle"),
        ({"num_speculative_tokens": 2}, "give 'method'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "<="),
        ({"method": "oracle", "num_speculative_tokens": 2}, "'acceptance' in [0, 1]"),
        ({"method": "oracle", "num_speculative_tokens": 2, "acceptance": 1.5}, "'acceptance' in [0, 1]"),
        ({"method": "ngram", "num_speculative_tokens": 2, "acceptance": 0.5}, "'acceptance' is for method 'oracle'"),
        ({"method": "draft", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown key(s) ['k']"),
    ],
)
def test_config_errors_name_the_field(value, needle):
    with pytest.raises(ConfigError, match=None) as exc:
        SpeculativeConfig.parse(value)
    assert needle in str(exc.value)


def test_tensor_parallel_and_disaggregation_are_refused():
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1"):
        EngineConfig(tensor_parallel_size=2, speculative_config=spec)
    from workbench.cluster.disagg import DisaggConfig

    with pytest.raises(ConfigError, match="not supported with disaggregation"):
        DisaggConfig(decode=EngineConfig(speculative_config=spec))


def test_ngram_proposer_by_hand():
    p = NgramProposer(1, 3)
    # last 3 tokens (1, 2, 3) occur first at 0: what followed them is proposed
    assert p.propose([1, 2, 3, 4, 5, 9, 1, 2, 3], 2) == [4, 5]
    # no 3- or 2-gram match; the 1-gram 3 occurs first at 2
    assert p.propose([7, 8, 3, 6, 5, 3], 4) == [6, 5, 3]
    assert p.propose([1, 2, 3, 4], 3) == []  # no earlier occurrence of any suffix
    assert NgramProposer(2, 2).propose([7, 8, 3, 6, 5, 3], 4) == []  # min_n 2: the 1-gram is not tried
    assert p.propose([4, 4, 4], 5) == [4]  # the 2-gram (4, 4) at 0 is followed by one token before the end


def test_expected_tokens_per_step_by_hand():
    assert expected_tokens_per_step(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)  # 3.3616
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 1) == 1.5


def test_spec_stats_by_hand():
    s = SpecStats()
    s.record(3, 3)
    s.record(3, 1)
    s.record(2, 0)
    d = s.to_dict()
    assert (d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]) == (3, 8, 4)
    assert d["acceptance_rate"] == 0.5 and d["mean_accepted_length"] == pytest.approx(4 / 3)
    assert d["per_position_acceptance"] == [2 / 3, 1 / 3, 1 / 2]


def test_greedy_verify_by_hand():
    assert greedy_verify([4, 5, 6], [4, 5, 7, 8]) == [4, 5, 7]  # d3 = 6 rejected: the target's 7 instead
    assert greedy_verify([4, 5, 6], [4, 5, 6, 8]) == [4, 5, 6, 8]  # all accepted plus the bonus token
    assert greedy_verify([1, 5], [4, 5, 6]) == [4]


def test_truncate_returns_rejected_blocks_and_never_a_cached_one():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    seq = Sequence(0, list(range(9)))
    assert bm.allocate(seq)  # 3 blocks for 9 tokens
    assert bm.append_slots(seq, 17)  # 5 blocks: positions up to 16 (a verify step's)
    seq.num_computed_tokens = 9
    bm.mark_computed(seq)  # blocks 0 and 1 are full and computed: registered
    bm.truncate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.check_invariants([seq.block_table])
    with pytest.raises(RuntimeError, match="cached block"):
        bm.truncate(seq, 4)


# ---- the engine: greedy parity with HF ----------------------------------------------------------------------------
def run(model, spec, **cfg) -> Engine:
    engine = Engine(model, EngineConfig(max_model_len=80, speculative_config=spec, **cfg))
    check_every_step(engine)
    engine.result = engine.generate(PROMPTS, GREEDY)
    return engine


EVERY_MODEL = [(preset, method) for preset in TINY_PRESETS for method in ("ngram", "oracle")] + [("tiny-gqa", "draft")]


@pytest.mark.parametrize("preset, method", EVERY_MODEL)
def test_greedy_equals_hf_on_every_model(models, preset, method):
    path, model, expected = models[preset]
    engine = run(model, spec_config(method, path), max_num_seqs=4)
    assert [r.tokens for r in engine.result.requests] == expected
    stats = engine.result.extra["speculative"]
    assert stats["num_drafts"] > 0
    if method == "draft":  # the target drafting for itself proposes its own greedy tokens; its pool is empty after
        assert stats["acceptance_rate"] >= 0.9
        draft = engine.speculator.proposer
        assert draft.block_manager.num_used_blocks == 0 and not draft._seqs
    if method == "oracle":
        assert 0 < stats["acceptance_rate"] < 1
    assert engine.block_manager.num_used_blocks == 0


POLICY_GRID = [(policy, "oracle") for policy in ("static", "continuous", "chunked", "decode-first")] + [
    ("chunked", "ngram"),
    ("chunked", "draft"),
]


@pytest.mark.parametrize("policy, method", POLICY_GRID)
def test_greedy_equals_hf_under_every_policy_with_preemption(models, policy, method):
    # the oracle rejects often: every policy rolls back rejected positions, in a pool that preempts, prefix caching on
    path, model, expected = models["tiny-gqa"]
    chunked = {"chunk_size": 8, "token_budget": 16} if policy == "chunked" else {}
    engine = run(model, spec_config(method, path), policy=policy, block_size=4, num_blocks=18, max_num_seqs=5,
                 enable_prefix_caching=True, **chunked)  # fmt: skip
    assert [r.tokens for r in engine.result.requests] == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.result.extra["speculative"]["num_drafts"] > 0
    log = engine.step_log.to_dataframe()
    if chunked:
        assert log.eval("num_prefill_tokens + num_decode_tokens").max() <= 16  # proposals count in the budget
    assert engine.block_manager.num_used_blocks == 0


def test_aborts_leak_no_block(models):
    path, model, _ = models["tiny-mqa"]
    engine = Engine(model, EngineConfig(max_model_len=80, block_size=4, num_blocks=40, enable_prefix_caching=True,
                                        speculative_config=spec_config("oracle", path)))  # fmt: skip
    check_every_step(engine)
    rng = random.Random(0)
    ids = [engine.add_request(PROMPTS[i % len(PROMPTS)], GREEDY) for i in range(20)]
    aborted = 0
    while engine.has_unfinished():
        engine.step()
        for rid in ids:
            if rng.random() < 0.03 and engine.abort(rid) is not None:
                aborted += 1
    assert aborted > 0
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants([])


# ---- the sampling law ---------------------------------------------------------------------------------------------
def chi2_critical_99(df: int) -> float:
    """The 99th percentile of chi-square with ``df`` degrees of freedom (Wilson & Hilferty, 1931)."""
    z = 2.326347874  # the standard normal's 99th percentile
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_chi2_critical_values_match_the_table():
    assert chi2_critical_99(10) == pytest.approx(23.209, rel=0.01)  # the printed tables' values
    assert chi2_critical_99(50) == pytest.approx(76.154, rel=0.01)


def chi2_statistic(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic over the cells with an expected count >= 5 (the rest pooled into one), and its df."""
    stat, df, rest_obs, rest_exp = 0.0, -1, 0, 0.0
    for cell, p in probs.items():
        e = n * p
        if e >= 5:
            stat += (counts.get(cell, 0) - e) ** 2 / e
            df += 1
        else:
            rest_obs += counts.get(cell, 0)
            rest_exp += e
    assert sum(v for c, v in counts.items() if c not in probs) == 0, "a draw outside the support"
    if rest_exp >= 5:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        df += 1
    return stat, df


def test_rejection_sampler_preserves_the_target_distribution():
    # 20,000 verifications of the proposal (2, 0) against hand-made target rows, half of them with only its first
    # token (k = 1: padding in the batch): the first emitted token must be distributed as row 0 and, when it is the
    # accepted proposal 2, the second as row 1 (the residual after rejecting 0, or the bonus row when k = 1)
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.25, 0.15], [0.5, 0.05, 0.05, 0.3, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]])
    n = 20_000
    gen = torch.Generator().manual_seed(0)
    num_draft = torch.tensor([2, 1] * (n // 2))
    padded = probs.clone()
    padded[2] = 0.0  # a k = 1 row has 2 rows of distributions; its third is padding
    rows = torch.stack([probs if k == 2 else padded for k in (2, 1)]).repeat(n // 2, 1, 1)
    accepted, tokens = rejection_sample(torch.tensor([[2, 0]] * n), num_draft, rows, torch.rand(n, 3, generator=gen))
    for k in (2, 1):
        mine = num_draft == k
        first = dict(zip(*torch.unique(tokens[mine, 0], return_counts=True)))
        first = {int(t): int(c) for t, c in first.items()}
        m = int(mine.sum())
        stat, df = chi2_statistic(first, dict(enumerate(probs[0].tolist())), m)
        assert stat < chi2_critical_99(df)
        took = mine & (tokens[:, 0] == 2)
        assert bool((accepted[took] >= 1).all()) and bool((accepted[mine & ~took] == 0).all())
        second = {int(t): int(c) for t, c in zip(*torch.unique(tokens[took, 1], return_counts=True))}
        stat, df = chi2_statistic(second, dict(enumerate(probs[1].tolist())), int(took.sum()))
        assert stat < chi2_critical_99(df)
        assert int(took.sum()) == pytest.approx(0.3 * m, rel=0.06)  # 2 is accepted with probability p0(2) = 0.3


SMALL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 5,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


SCALE = 8.0  # the LM head's weights times this: next-token distributions far from uniform (0.36 to 0.03 after PROMPT)


def test_engine_sampling_law_of_the_first_three_tokens(tmp_path):
    # a 5-token vocabulary and an LM head scaled up, so the target's distributions are far from uniform; the n-gram
    # proposer (repetitive prompt) proposes the second token (accepted, or replaced from the residual, then a bonus
    # or a plain third token); the first three tokens of n seeded requests are compared with the target's exact
    # joint law, computed from its next-token distributions over every prefix (the 20,000-draw check of the
    # verification itself is test_rejection_sampler_preserves_the_target_distribution)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL))
    model = load_model(str(path), seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(SCALE)
    prompt = [3, 4, 0, 3, 4, 0, 3, 4]
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)

    def next_probs(contexts: list[list[int]]) -> list[list[float]]:
        cache = model.new_cache(len(contexts), 16)
        with torch.no_grad():
            logits = model.prefill(contexts, cache, list(range(len(contexts))))
        return torch.softmax(logits, -1).tolist()

    v = SMALL["vocab_size"]
    p1 = next_probs([prompt])[0]
    p2 = next_probs([prompt + [a] for a in range(v)])
    p3 = next_probs([prompt + [a, b] for a in range(v) for b in range(v)])
    law = {(a, b, c): p1[a] * p2[a][b] * p3[a * v + b][c] for a in range(v) for b in range(v) for c in range(v)}
    n = 1500
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    engine = Engine(model, EngineConfig(max_model_len=32, max_num_seqs=256, speculative_config=spec))
    res = engine.generate([prompt] * n, [SamplingParams(**{**vars(params), "seed": i}) for i in range(n)])
    counts: dict = {}
    for r in res.requests:
        key = tuple(r.tokens[:3])
        counts[key] = counts.get(key, 0) + 1
    stats = res.extra["speculative"]
    assert stats["num_drafts"] > n / 2 and 0 < stats["acceptance_rate"] < 1  # both verification paths ran
    stat, df = chi2_statistic(counts, law, n)
    assert df >= 30 and stat < chi2_critical_99(df)


# ---- the command line ---------------------------------------------------------------------------------------------
def test_generate_with_speculative_config_reports_acceptance(models, capsys):
    from workbench.cli import main

    path, _, expected = models["tiny-gqa"]
    ids = ",".join(map(str, PROMPTS[0]))
    spec = json.dumps({"method": "oracle", "acceptance": 0.8, "num_speculative_tokens": 4})
    argv = ["generate", "--model", str(path), "--prompt-ids", ids, "--max-new-tokens", str(MAX_TOKENS), "--ignore-eos"]
    assert main([*argv, "--json", "--speculative-config", spec]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"][0]["tokens"] == expected[0]
    assert out["speculative"]["num_drafts"] > 0 and len(out["speculative"]["per_position_acceptance"]) == 4


def test_generate_refuses_a_bad_speculative_config(capsys):
    from tests.conftest import one_line_error
    from workbench.cli import main

    rc = main(["generate", "--model", "tiny-gqa", "--prompt-ids", "1,2", "--speculative-config", '{"method": "x"}'])
    one_line_error(capsys, rc, "method must be one of ngram, draft, oracle")


def test_measure_speedup_runs_both_arms_on_the_same_tokens(models):
    from workbench.experiments.speculative import measure_speedup

    _, model, _ = models["tiny-gqa"]
    spec = {"method": "oracle", "acceptance": 0.8, "num_speculative_tokens": 4}
    out = measure_speedup(model, spec, batch=2, prompt_len=8, max_tokens=16, rounds=2)
    assert len(out["base"]["times_s"]) == len(out["spec"]["times_s"]) == 2
    assert out["speedup"] == pytest.approx(out["base"]["median_s"] / out["spec"]["median_s"])
    assert out["expected_tokens_per_step"] == pytest.approx(3.3616)
    assert out["speculative"]["num_drafts"] > 0  # the timed runs' counters (tokens identical: checked inside)


# ---- the counters in the JSON and the server's /metrics, counted by hand --------------------------------------------
def _serve_in_process(engine, requests):
    """Requests (prompt, max_tokens) through the server's engine loop (``AsyncEngine``), every wait bounded; the
    metrics' text."""
    import asyncio

    from workbench.serve.async_engine import AsyncEngine
    from workbench.serve.prom import ServerMetrics

    metrics = ServerMetrics("m", engine.num_speculative_tokens)

    async def main():
        loop_engine = AsyncEngine(engine, metrics)
        task = asyncio.create_task(loop_engine.run())
        handles = [loop_engine.add(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in requests]
        for h in handles:
            while (await asyncio.wait_for(h.queue.get(), 60)).finish_reason is None:
                pass
        loop_engine.stop()
        await asyncio.wait_for(task, 60)

    asyncio.run(main())
    return metrics.render().decode()


def _spec_counters(text):
    from prometheus_client.parser import text_string_to_metric_families

    out = {"per_pos": {}}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "workbench:spec_decode_num_accepted_tokens_per_pos_total":
                out["per_pos"][int(s.labels["position"])] = s.value
            elif s.name.startswith("workbench:spec_decode_") and s.name.endswith("_total"):
                out[s.name.removeprefix("workbench:spec_decode_").removesuffix("_total")] = s.value
    return out


@pytest.mark.parametrize("acceptance", [1.0, 0.0])
def test_counters_in_json_and_metrics_by_hand(models, acceptance):
    pytest.importorskip("prometheus_client")
    _, model, expected = models["tiny-gqa"]
    engine = Engine(model, EngineConfig(max_model_len=80, speculative_config={
        "method": "oracle", "acceptance": acceptance, "num_speculative_tokens": 4}))  # fmt: skip
    for prompt, tokens in zip(PROMPTS, expected):  # the target's greedy tokens (HF's: the engine's, tested above)
        engine.speculator.proposer.add_reference(prompt, tokens)
    # k = 4, at most max_tokens - outputs - 1 per verify (the step's own token is the last one). max_tokens 10:
    # acceptance 1: the prefill's token, a verify of 4 (5 tokens: 6), a verify of 3 (4 tokens: 10); max_tokens 3:
    # the prefill's, a verify of 1 (2 tokens). Drafts 3, proposed 8, all accepted; through position 0..3: 3, 2, 2, 1.
    # acceptance 0 (every proposal wrong): max_tokens 10 verifies after 1..8 outputs, proposing 4, 4, 4, 4, 4, 3,
    # 2, 1 (after 9: nothing left to propose); max_tokens 3 verifies once, 1 token. Drafts 9, proposed 27, none.
    text = _serve_in_process(engine, [(PROMPTS[1], 10), (PROMPTS[2], 3)])
    got = _spec_counters(text)
    if acceptance == 1.0:
        want = {"num_drafts": 3, "num_draft_tokens": 8, "num_accepted_tokens": 8, "per_pos": {0: 3, 1: 2, 2: 2, 3: 1}}
    else:
        want = {"num_drafts": 9, "num_draft_tokens": 27, "num_accepted_tokens": 0, "per_pos": {0: 0, 1: 0, 2: 0, 3: 0}}
    assert got == want
    stats = engine.speculative_stats()
    assert stats["num_accepted_tokens_per_pos"] == [want["per_pos"][i] for i in range(4)]
    assert stats["acceptance_rate"] == want["num_accepted_tokens"] / want["num_draft_tokens"]
    assert stats["mean_accepted_length"] == pytest.approx(want["num_accepted_tokens"] / want["num_drafts"])
    # per position: accepted through it over the proposals that reached it (1 each at acceptance 1, 0 at 0)
    assert stats["per_position_acceptance"] == [acceptance] * 4
    assert sum(engine.request_state().values()) == 0  # the loop's engine holds no finished request


def test_gpu_check_speculative_step_runs_on_the_cpu(tmp_path):
    # scripts/gpu_check.py's step 6 on the CPU (its dry run): fp32, so the tokens with speculation must equal those
    # without; the speed-up is reported, not checked
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = gpu_check.spec_check(tmp_path, "cpu", new_tokens=12, rounds=1)
    assert out["ok"] and json.loads((tmp_path / "spec_check.json").read_text()) == out
    (row,) = out["rows"]
    assert (row["dtype"], row["batch"], row["prompts_identical"]) == ("fp32", 1, 1) and row["speedup"] > 0


def test_measure_speedup_takes_given_prompts(models):
    from workbench.experiments.speculative import measure_speedup

    _, model, _ = models["tiny-gqa"]
    spec = {"method": "oracle", "acceptance": 0.8, "num_speculative_tokens": 3}
    out = measure_speedup(model, spec, max_tokens=8, rounds=1, prompts=[[5, 6, 7, 8] * 4, [9, 10] * 3])
    assert (out["batch"], out["prompt_len"], out["max_tokens"]) == (2, 16, 8)
    assert out["speculative"]["num_drafts"] > 0  # both arms ran on these prompts (their tokens are checked inside)
