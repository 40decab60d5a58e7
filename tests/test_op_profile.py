"""The op-profile cost model: interpolation, summed operations and the fitted overhead against hand computations on a
synthetic profile, a simulation priced by hand, and bad profile files (each a ConfigError naming the problem)."""

from __future__ import annotations

import copy
import json

import pytest

from workbench.config import ModelConfig
from workbench.errors import ConfigError
from workbench.sim.cluster import SimConfig, simulate
from workbench.sim.costmodel import make_cost_model
from workbench.sim.op_profile import (
    OP_PROFILE_FORMAT,
    OVERHEAD_FEATURES,
    TOKEN_OPS,
    OpProfileCostModel,
    fit_overhead,
    interp1,
    interp2,
)
from workbench.sim.stats import StepStats
from workbench.workloads import Request

US = 1e-6


def synthetic_profile(num_layers: int = 2, overhead: dict | None = None, max_key_slots: int = 1 << 16) -> dict:
    """Every token operation 1 us per token, the row operations 2 us per row, prefill attention 1 us per (query,
    key) pair, a lone decode 1 us per context token, a gathered decode 1 us per batch row x context token."""
    ops: dict = {op: {"values": [1, 100], "median_s": [1 * US, 100 * US]} for op in TOKEN_OPS}
    for op in ("lm_head", "sample", "decode_kv_write"):
        ops[op] = {"values": [1, 10], "median_s": [2 * US, 20 * US]}
    ops["attention_prefill"] = {"values": [1, 10], "median_s": [1 * US, 55 * US]}  # pairs 1 and 55
    ops["attention_decode_looped"] = {"values": [1, 101], "median_s": [1 * US, 101 * US]}
    ops["attention_decode"] = {"batch_sizes": [1, 2], "contexts": [1, 101],
                               "median_s": [[1 * US, 101 * US], [2 * US, 202 * US]]}  # fmt: skip
    return {"format": OP_PROFILE_FORMAT, "model": "tiny-gqa", "num_layers": num_layers, "ops": ops,
            "max_key_slots": max_key_slots, "overhead": overhead, "machine": {"name": "test machine"}}  # fmt: skip


# ---- interpolation -------------------------------------------------------------------------------------------
def test_interp1_between_below_and_above_the_grid() -> None:
    xs, ys = [1.0, 2.0, 4.0], [10.0, 20.0, 30.0]
    assert interp1(xs, ys, 0.5) == 10.0  # below: the smallest size's time (the per-kernel floor)
    assert interp1(xs, ys, 1.0) == 10.0
    assert interp1(xs, ys, 1.5) == pytest.approx(15.0)
    assert interp1(xs, ys, 3.0) == pytest.approx(25.0)
    assert interp1(xs, ys, 8.0) == pytest.approx(50.0)  # above: last slope (30 - 20) / 2 = 5 per unit
    assert interp1([1.0, 2.0, 4.0], [10.0, 30.0, 20.0], 8.0) == 20.0  # a falling last segment: held flat
    assert interp1([5.0], [7.0], 100.0) == 7.0


def test_interp2_along_context_then_batch() -> None:
    rows, cols, table = [1.0, 4.0], [10.0, 20.0], [[1.0, 2.0], [4.0, 8.0]]
    # at context 15: row 1 gives 1.5, row 4 gives 6; at batch 2, a third of the way: 1.5 + 4.5 / 3 = 3
    assert interp2(rows, cols, table, 2.0, 15.0) == pytest.approx(3.0)
    assert interp2(rows, cols, table, 1.0, 30.0) == pytest.approx(3.0)  # context beyond: slope 0.1 per token
    assert interp2(rows, cols, table, 7.0, 10.0) == pytest.approx(7.0)  # batch beyond: slope 1 per row


# ---- the cost model against hand sums ------------------------------------------------------------------------
def test_pure_decode_step_is_the_hand_sum() -> None:
    cost = OpProfileCostModel.from_dict(synthetic_profile())
    stats = StepStats(decode_seqs=2, decode_context=30, decode_max_context=20)
    ops = cost.op_times(stats)
    # per layer at 2 tokens: 2 norms, qkv, rotary, o, 2 adds, gate/up, activation, down = 10 ops x 2 us = 20 us
    layers = 2 * 20
    expected = {"attention_decode": 2 * 40, "decode_kv_write": 4, "lm_head": 4, "sample": 4, "embedding": 2,
                "rotary_table": 2}  # fmt: skip
    assert sum(ops.values()) == pytest.approx((layers + 2 + sum(expected.values())) * US)  # + 2: final norm
    for op, us in expected.items():
        assert ops[op] == pytest.approx(us * US)
    assert "kv_write" not in ops and "attention_decode_looped" not in ops
    assert cost.step_time(stats) == pytest.approx(138 * US)


def test_ragged_step_is_the_hand_sum() -> None:
    cost = OpProfileCostModel.from_dict(synthetic_profile())
    # a 10-token prefill (55 pairs) and one decode at context 30: 11 tokens, 2 rows sampled
    stats = StepStats(prefill_tokens=10, prefill_seqs=1, prefill_pairs=55, prefill_context=10, decode_seqs=1,
                      decode_context=30, decode_max_context=30)  # fmt: skip
    ops = cost.op_times(stats)
    assert ops["attention_prefill"] == pytest.approx(2 * 55 * US)
    assert ops["attention_decode_looped"] == pytest.approx(2 * 30 * US)
    assert ops["kv_write"] == pytest.approx(2 * 11 * US)
    # 2 layers x 10 ops x 11 us + final norm 11 + embedding 11 + rotary table 11 + kv 22 + head 4 + sample 4
    # + prefill attention 110 + lone decode 60
    assert cost.step_time(stats) == pytest.approx(453 * US)
    # two prefills of 10 tokens: priced as two sequences of the mean pairs
    two = StepStats(prefill_tokens=20, prefill_seqs=2, prefill_pairs=110, prefill_context=20)
    assert cost.op_times(two)["attention_prefill"] == pytest.approx(2 * 2 * 55 * US)


def test_overhead_terms_by_step_kind() -> None:
    over = {"coefficients": {"ops_scale": 0.5, "decode_step_s": 10 * US, "decode_seq_s": 1 * US,
                             "ragged_step_s": 20 * US, "ragged_seq_s": 3 * US, "token_s": 0.5 * US}}  # fmt: skip
    cost = OpProfileCostModel.from_dict(synthetic_profile(overhead=over))
    decode = StepStats(decode_seqs=2, decode_context=30, decode_max_context=20)
    assert cost.step_time(decode) == pytest.approx((1.5 * 138 + 10 + 2 * 1 + 2 * 0.5) * US)
    ragged = StepStats(10, 1, 55, 10, 1, 30, 30)
    assert cost.step_time(ragged) == pytest.approx((1.5 * 453 + 20 + 2 * 3 + 11 * 0.5) * US)


def test_a_decode_too_long_to_gather_is_attended_alone() -> None:
    cost = OpProfileCostModel.from_dict(synthetic_profile(max_key_slots=30))
    stats = StepStats(decode_seqs=2, decode_context=30, decode_max_context=20)  # 2 x 20 > 30 key slots
    assert not cost.is_batched_decode(stats)
    ops = cost.op_times(stats)
    assert ops["attention_decode_looped"] == pytest.approx(2 * 2 * 15 * US)  # 2 layers x 2 seqs x mean context 15
    assert ops["kv_write"] == pytest.approx(2 * 2 * US) and "decode_kv_write" not in ops


def test_a_profile_of_a_backend_that_does_not_gather_prices_every_pure_decode_batched() -> None:
    """The paged C++ decode (attention backend 'cpu') attends a pure decode in place, whatever its key slots:
    profile-ops records no gather bound for it (2**62), so a batch of 2 x 20 keys, past a torch backend's bound of
    30, is still priced from the batched table, as the engine runs it."""
    cost = OpProfileCostModel.from_dict(synthetic_profile(max_key_slots=2**62))
    stats = StepStats(decode_seqs=2, decode_context=30, decode_max_context=20)
    assert cost.is_batched_decode(stats)
    ops = cost.op_times(stats)
    # batch 2 at context 20: 2 + (202 - 2) * 19 / 100 = 40 us a layer, 2 layers
    assert ops["attention_decode"] == pytest.approx(2 * 40 * US) and "attention_decode_looped" not in ops
    assert ops["decode_kv_write"] == pytest.approx(4 * US) and "kv_write" not in ops


PACKED = {"min_rows": 4, "max_rows": 256, "per_layer": 4, "head": True}  # as profile-ops recorded tiny-gqa's (oneDNN)


def test_a_step_pays_each_packed_product_it_runs() -> None:
    """With packed linears (4 to 256 rows; 4 products a layer, 2 layers, and the LM head) a step of 3 decodes runs
    none, one of 4 decodes all 2 x 4 + 1 = 9, a ragged step of 10 prompt tokens and 2 decodes (12 tokens, 3 rows
    sampled) the 8 of the layers and not the head; each costs ``packed_call_s`` on top of the rest."""
    over = {"coefficients": {"ops_scale": 0.5, "decode_step_s": 10 * US, "packed_call_s": 40 * US}}
    cost = OpProfileCostModel.from_dict({**synthetic_profile(overhead=over), "packed_products": PACKED})
    plain = OpProfileCostModel.from_dict(synthetic_profile(overhead=over))  # a profile of plain linears
    three = StepStats(decode_seqs=3, decode_context=60, decode_max_context=20)
    four = StepStats(decode_seqs=4, decode_context=80, decode_max_context=20)
    ragged = StepStats(10, 1, 55, 10, 2, 40, 20)
    assert [cost.packed_calls(s) for s in (three, four, ragged)] == [0, 9, 8]
    # 600 tokens (598 prompt + 2 decodes, 3 rows sampled): each of the 8 products in calls of 512 and 88 rows; 512
    # tokens in one call each
    assert cost.packed_calls(StepStats(598, 1, 598 * 599 // 2, 598, 2, 40, 20)) == 8 * 2
    assert cost.packed_calls(StepStats(510, 1, 510 * 511 // 2, 510, 2, 40, 20)) == 8
    # a profile of the blocked op (``max_rows`` null): one call a product whatever its rows
    blocked = OpProfileCostModel.from_dict(
        {**synthetic_profile(overhead=over), "packed_products": {**PACKED, "max_rows": None}}
    )
    assert blocked.packed_calls(StepStats(598, 1, 598 * 599 // 2, 598, 2, 40, 20)) == 8
    assert [blocked.packed_calls(s) for s in (three, four, ragged)] == [0, 9, 8]
    assert [plain.packed_calls(s) for s in (three, four, ragged)] == [0, 0, 0]
    assert cost.step_time(three) == pytest.approx(plain.step_time(three))
    assert cost.step_time(four) - plain.step_time(four) == pytest.approx(9 * 40 * US)
    assert cost.step_time(ragged) - plain.step_time(ragged) == pytest.approx(8 * 40 * US)
    # the 4 decodes by hand: 10 ops of 4 us a layer x 2 + the final norm 4 + attention 2 layers x 80 (batch 4 at
    # context 20: 4 + (404 - 4) * 19 / 100) + decode_kv_write, lm_head and sample 8 each + embedding and rotary
    # table 4 each = 80 + 4 + 160 + 24 + 8 = 276 us; x 1.5, + 10 us, + 9 x 40 us
    assert cost.step_time(four) == pytest.approx((1.5 * 276 + 10 + 9 * 40) * US)


def test_a_profile_with_only_the_lm_head_packed_pays_one_product_per_step_in_range() -> None:
    """``per_layer`` 0 (no layer's matrix large enough to pack, PACKED_MIN_WEIGHT) and the head packed: a step of 4
    decodes runs 1 packed product (the head's 4 rows), 3 decodes none, the ragged step of 12 tokens and 3 sampled
    rows none; nothing packed at all (``per_layer`` 0, no head) is a profile of plain linears."""
    over = {"coefficients": {"decode_step_s": 10 * US, "packed_call_s": 40 * US}}
    head_only = OpProfileCostModel.from_dict(
        {**synthetic_profile(overhead=over), "packed_products": {**PACKED, "per_layer": 0}}
    )
    nothing = OpProfileCostModel.from_dict(
        {**synthetic_profile(overhead=over), "packed_products": {**PACKED, "per_layer": 0, "head": False}}
    )
    three = StepStats(decode_seqs=3, decode_context=60, decode_max_context=20)
    four = StepStats(decode_seqs=4, decode_context=80, decode_max_context=20)
    ragged = StepStats(10, 1, 55, 10, 2, 40, 20)
    assert [head_only.packed_calls(s) for s in (three, four, ragged)] == [0, 1, 0]
    assert [nothing.packed_calls(s) for s in (three, four, ragged)] == [0, 0, 0]


def test_fit_overhead_recovers_the_packed_product_term() -> None:
    """Steps made with 30 us a packed product (and the other terms) give back 30 us, and the profile of plain
    linears has no such term to fit (0)."""
    cost = OpProfileCostModel.from_dict({**synthetic_profile(), "packed_products": PACKED})
    stats, durations = [], []
    for b in (1, 2, 3, 4, 6, 8):
        for ctx in (10, 40, 90):
            s = StepStats(decode_seqs=b, decode_context=b * ctx, decode_max_context=ctx)
            stats.append(s)
            durations.append(
                1.2 * sum(cost.op_times(s).values()) + 50 * US + b * 5 * US + cost.packed_calls(s) * 30 * US
            )
    for n in (2, 10, 30, 60):
        for d in (0, 1, 3):
            s = StepStats(n, 1, n * (n + 1) // 2, n, d, 20 * d, 20 if d else 0)
            stats.append(s)
            durations.append(1.2 * sum(cost.op_times(s).values()) + 80 * US + cost.packed_calls(s) * 30 * US)
    coef = fit_overhead(cost, stats, durations)["coefficients"]
    assert coef["packed_call_s"] == pytest.approx(30 * US, rel=1e-6)
    assert coef["ops_scale"] == pytest.approx(0.2, rel=1e-6) and coef["decode_seq_s"] == pytest.approx(5 * US)
    assert fit_overhead(OpProfileCostModel.from_dict(synthetic_profile()), stats, durations)["coefficients"][
        "packed_call_s"] == 0.0  # fmt: skip


def test_fit_overhead_recovers_the_terms_that_made_the_steps() -> None:
    cost = OpProfileCostModel.from_dict(synthetic_profile())
    stats, durations = [], []
    for b in (1, 2, 3, 4, 6, 8):
        for ctx in (10, 40, 90):
            s = StepStats(decode_seqs=b, decode_context=b * ctx, decode_max_context=ctx)
            stats.append(s)
            durations.append(1.2 * sum(cost.op_times(s).values()) + 50 * US + b * 5 * US + b * 0.25 * US)
    for n in (4, 10, 30, 60):
        for d in (0, 1, 3):
            s = StepStats(n, 1, n * (n + 1) // 2, n, d, 20 * d, 20 if d else 0)
            stats.append(s)
            durations.append(1.2 * sum(cost.op_times(s).values()) + 80 * US + (1 + d) * 7 * US + (n + d) * 0.25 * US)
    over = fit_overhead(cost, stats, durations, gaps_s=[1e-5, 2e-5, 3e-5])
    coef = over["coefficients"]
    expected = {"ops_scale": 0.2, "decode_step_s": 50 * US, "decode_seq_s": 5 * US, "ragged_step_s": 80 * US,
                "ragged_seq_s": 7 * US, "token_s": 0.25 * US}  # fmt: skip
    assert set(coef) == set(OVERHEAD_FEATURES)
    for name, value in expected.items():
        assert coef[name] == pytest.approx(value, rel=1e-6, abs=1e-12), name
    assert over["host_gap_s"] == pytest.approx(2e-5)
    assert over["fit"]["median_rel_error"] == pytest.approx(0.0, abs=1e-9)
    refit = OpProfileCostModel.from_dict({**synthetic_profile(), "overhead": over})
    for s, y in zip(stats, durations):
        assert refit.step_time(s) == pytest.approx(y, rel=1e-6)


def test_simulated_ttft_of_one_request_is_one_priced_prefill() -> None:
    model = ModelConfig.resolve("tiny-gqa")
    cost = OpProfileCostModel.from_dict(synthetic_profile())
    config = SimConfig(max_num_seqs=4, max_model_len=128, num_blocks=64, block_size=16, dtype="fp32")
    result = simulate([Request(0, 0.0, 10, 1)], model, cost, config)
    # a 10-token prefill: 2 layers x 10 ops x 10 us + final norm, embedding and rotary table 10 each, KV writes 20,
    # head and sampler 2 each, attention 2 x 55 pairs
    assert result.records[0].first_token_time == pytest.approx(364 * US)


# ---- bad files -----------------------------------------------------------------------------------------------
def _write(tmp_path, data) -> str:  # noqa: ANN001
    path = tmp_path / "op.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _broken(change) -> dict:  # noqa: ANN001
    data = copy.deepcopy(synthetic_profile())
    change(data)
    return data


BAD_PROFILES = [
    (lambda d: d.update(format="workbench-profile-v2"), "not an op profile"),
    (lambda d: d["ops"].pop("lm_head"), "no measurement of lm_head"),
    (lambda d: d.pop("num_layers"), 'no "num_layers"'),
    (lambda d: d.update(num_layers=0), "num_layers"),
    (lambda d: d["ops"]["qkv_proj"].update(values=[4, 2]), r"ops.qkv_proj.values must be strictly increasing"),
    (lambda d: d["ops"]["qkv_proj"].update(median_s=[1e-6]), r"ops.qkv_proj.median_s has 1 values for 2 sizes"),
    (lambda d: d["ops"]["rmsnorm"].update(median_s=[1e-6, -1.0]), r"ops.rmsnorm.median_s must hold finite"),
    (lambda d: d["ops"]["rotary"].pop("median_s"), r'ops.rotary has no "median_s"'),
    (lambda d: d["ops"]["attention_decode"].update(median_s=[[1e-6, 2e-6]]), "one row per batch size"),
    (lambda d: d["ops"]["attention_decode"]["median_s"].__setitem__(1, [1e-6]), r"median_s\[1\] has 1 values"),
    (lambda d: d.update(overhead={"coefficients": {"per_moon_s": 1.0}}), "unknown overhead term"),
    (lambda d: d.update(overhead={"host_gap_s": -1}), "overhead.host_gap_s"),
    (lambda d: d.update(ops=[]), '"ops" must be an object'),
    (lambda d: d.update(packed_products={"min_rows": 4}), '"packed_products" must be null or an object'),
    (lambda d: d.update(packed_products={**PACKED, "min_rows": 0}), "1 <= min_rows <= max_rows"),
    (lambda d: d.update(packed_products={**PACKED, "max_rows": 2}), "1 <= min_rows <= max_rows"),
    (lambda d: d.update(packed_products={**PACKED, "head": 1}), "packed_products.head"),
]


@pytest.mark.parametrize("change, message", BAD_PROFILES)
def test_bad_profile_files_name_the_problem(tmp_path, change, message) -> None:  # noqa: ANN001
    path = _write(tmp_path, _broken(change))
    with pytest.raises(ConfigError, match=message) as info:
        OpProfileCostModel.load(path)
    assert str(path) in str(info.value)


def test_missing_or_unreadable_files(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match="op profile file not found"):
        OpProfileCostModel.load(tmp_path / "nothing.json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        OpProfileCostModel.load(_write(tmp_path, "{not json"))
    with pytest.raises(ConfigError, match="needs a profile file"):
        make_cost_model("op-profile", "tiny-gqa")


def test_the_factory_loads_an_op_profile_with_noise(tmp_path) -> None:  # noqa: ANN001
    over = {"coefficients": {}, "residual_quantiles_s": [-1e-6, 0.0, 1e-6]}
    path = _write(tmp_path, synthetic_profile(overhead=over))
    cost = make_cost_model("op-profile", "tiny-gqa", profile=path, noise_seed=3)
    assert isinstance(cost, OpProfileCostModel) and cost.meta["model"] == "tiny-gqa"
    stats = StepStats(decode_seqs=2, decode_context=30, decode_max_context=20)
    times = [cost.step_time(stats) for _ in range(50)]
    assert all(137 * US <= t <= 139 * US for t in times) and len(set(times)) > 1


def test_an_op_profile_names_the_machine_its_identity_records() -> None:
    # profile-ops records machine_identity() (cpu, cpu_count, cpu_capability), older files a "name": both are named
    data = {**synthetic_profile(), "machine": {"cpu": "AMD EPYC", "cpu_count": 2, "cpu_capability": "AVX512"}}
    meta = OpProfileCostModel.from_dict(data, "test").meta
    assert (meta["machine"], meta["cpu_count"], meta["cpu_capability"]) == ("AMD EPYC", 2, "AVX512")
    assert OpProfileCostModel.from_dict(synthetic_profile(), "test").meta["machine"] == "test machine"
    assert (
        OpProfileCostModel.from_dict({**synthetic_profile(), "machine": None}, "t").meta["machine"] == "unknown machine"
    )
