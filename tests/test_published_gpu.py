"""The published GPU measurements table and what the cost model predicts for its rows (by hand), and the
calibration in accelerators.yaml being what the fit chooses on the calibration rows."""

from __future__ import annotations

from dataclasses import replace

import pytest

from workbench.config import ModelConfig
from workbench.errors import ConfigError
from workbench.hardware import get_hardware
from workbench.roofline import RooflineModel
from workbench.sim.published import (
    PublishedRow,
    Stack,
    error_table,
    fit,
    load_published,
    load_stack_overheads,
    predict,
    summarize_errors,
)


def test_every_row_has_a_source_a_split_and_a_model_it_can_price() -> None:
    rows = load_published()
    assert len(rows) >= 20
    assert {r.split for r in rows} == {"calibration", "held_out"}
    stacks = load_stack_overheads()
    for r in rows:
        assert r.source in stacks and r.measured_s > 0
        assert 1 <= r.tp <= 8 and r.hardware in ("a100-80gb", "h100-sxm")
    # held-out rows cover 7B to 70B at TP 1 to 8
    held = [r for r in rows if r.split == "held_out"]
    assert {r.model for r in held} >= {"Llama-2-7B", "Llama-2-70B"} and {r.tp for r in held} >= {1, 2, 4, 8}


def test_units_and_bad_rows() -> None:
    base = dict(id="x", source="s", model="Llama-2-7B", hardware="a100-80gb", metric="decode_s", split="held_out")
    assert PublishedRow.from_dict({**base, "value": 50, "unit": "tok/s"}).measured_s == pytest.approx(0.02)
    assert PublishedRow.from_dict({**base, "value": 16, "unit": "ms"}).measured_s == pytest.approx(0.016)
    with pytest.raises(ConfigError, match="unit"):
        PublishedRow.from_dict({**base, "value": 1, "unit": "furlongs"})
    with pytest.raises(ConfigError, match="metric"):
        PublishedRow.from_dict({**base, "metric": "vibes", "value": 1, "unit": "ms"})


def test_a_whole_request_is_its_prefill_and_its_decodes_by_hand() -> None:
    row = PublishedRow(id="r", source="s", model="Llama-2-7B", hardware="h100-sxm", metric="e2e_s",
                       measured_s=0.1, split="held_out", tp=2, prompt_len=128, output_len=4)  # fmt: skip
    m = RooflineModel(ModelConfig.resolve("Llama-2-7B"), "h100-sxm", tensor_parallel_size=2, calibration="hardware")
    expected = m.prefill([128]).time_s + sum(m.decode([128 + i]).time_s for i in (1, 2, 3))
    assert predict(row) == pytest.approx(expected)
    # a stack's overheads: 4 steps x 1 ms and 10 ms once
    (entry,) = error_table([row], "hardware", stack_overheads={"s": Stack(per_step_s=1e-3, per_request_s=1e-2)})
    assert entry["predicted_s"] == pytest.approx(expected + 4e-3 + 1e-2)
    assert entry["error"] == pytest.approx(entry["predicted_s"] / 0.1 - 1)
    assert summarize_errors([{"error": -0.3}, {"error": 0.1}, {"error": 0.2}]) == {
        "n": 3, "median_abs_error": 0.2, "max_abs_error": 0.3}  # fmt: skip


def test_a_stack_adds_its_cost_to_every_collective_and_runs_at_its_setups_bandwidth_by_hand() -> None:
    row = PublishedRow(id="r", source="s", model="Llama-2-7B", hardware="a100-80gb", metric="decode_s",
                       measured_s=0.01, split="held_out", tp=2, context_len=100)  # fmt: skip
    cfg = ModelConfig.resolve("Llama-2-7B")
    base = RooflineModel(cfg, "a100-80gb", tensor_parallel_size=2).decode([100]).time_s
    (entry,) = error_table([row], None, stack_overheads={"s": Stack(per_collective_s=10e-6)})
    # 2 all-reduces in each of 32 layers and the LM head's gather: 65 collectives of 10 us more
    assert entry["predicted_s"] == pytest.approx(base + 65 * 10e-6)
    # the setup's bandwidth is the one the roofline's memory ceiling uses: a GPU with half the bandwidth
    spec = get_hardware("a100-80gb")
    (entry,) = error_table([row], None, stack_overheads={"s": Stack(mem_bandwidth=spec.mem_bandwidth / 2)})
    half = RooflineModel(cfg, replace(spec, mem_bandwidth=spec.mem_bandwidth / 2), tensor_parallel_size=2)
    assert entry["predicted_s"] == pytest.approx(half.decode([100]).time_s)
    assert entry["predicted_s"] > 1.8 * base  # batch-1 decode: nearly all of it streams memory


def test_collective_latency_is_nccls_ring_ll_tuning_model() -> None:
    # NVIDIA/nccl src/graph/tuning.cc: Ring LL base 6.6 us, 0.6 us per step over NVLink; 2 (n - 1) steps
    for hw in ("a100-80gb", "h100-sxm"):
        ic = get_hardware(hw).interconnect
        assert ic.all_reduce_s(0.0, 8) == pytest.approx((6.6 + 14 * 0.6) * 1e-6)
        assert ic.all_reduce_s(0.0, 2) == pytest.approx((6.6 + 2 * 0.6) * 1e-6)


def test_accelerators_yaml_holds_what_the_fit_chooses() -> None:
    rows = load_published()
    specs, stacks, _loss = fit(rows)
    for hw, spec in specs.items():
        table = get_hardware(hw)
        for key in ("linear_max", "linear_half_tokens", "memory_efficiency", "kernel_floor_s",
                    "int8_weight_efficiency", "int4_weight_efficiency"):  # fmt: skip
            assert getattr(table.calibration, key) == pytest.approx(getattr(spec.calibration, key)), (hw, key)
        if hw == "h100-sxm":
            assert table.calibration.fp8_max == pytest.approx(spec.calibration.fp8_max)
    # one kernel floor for every accelerator
    assert len({spec.calibration.kernel_floor_s for spec in specs.values()}) == 1
    table_stacks = load_stack_overheads()
    for source, stack in stacks.items():
        for key in ("per_step_s", "per_request_s", "per_collective_s"):
            assert getattr(stack, key) == pytest.approx(getattr(table_stacks[source], key)), (source, key)
        assert stack.mem_bandwidth == table_stacks[source].mem_bandwidth


def test_the_held_out_error_meets_the_acceptance() -> None:
    # the bar on rows the fit never saw: median |error| <= 15%, none beyond 30%
    table = error_table([r for r in load_published() if r.split == "held_out"], "hardware", None,
                        load_stack_overheads())  # fmt: skip
    s = summarize_errors(table)
    assert s["median_abs_error"] <= 0.15 and s["max_abs_error"] <= 0.30, s


def test_leave_one_source_out_never_sees_the_left_out_source() -> None:
    """A source's errors come from a fit on the other sources alone: doubling its own measured figures moves its
    errors exactly as the figures moved (its predictions do not change), and every row is priced once."""
    from dataclasses import replace

    from workbench.sim.published import leave_one_source_out

    keep = {"gptfast-7b-tp1", "gptfast-7b-tp8", "trtllm-a100-7b-128", "trtllm-a100-7b-2048"}
    rows = [r for r in load_published() if r.id in keep]
    table, summary = leave_one_source_out(rows, rounds=1)
    doubled = [replace(r, measured_s=2 * r.measured_s) if r.source == "gptfast" else r for r in rows]
    table2, _ = leave_one_source_out(doubled, rounds=1)
    assert sorted(r["id"] for r in table) == sorted(keep) and summary["n"] == 4
    for a, b in zip(table, table2):
        assert a["left_out"] == a["source"]
        if a["source"] == "gptfast":  # the other source's fold was fitted on the doubled rows: it may move
            assert b["predicted_s"] == pytest.approx(a["predicted_s"], rel=1e-12)
            assert b["error"] == pytest.approx((1 + a["error"]) / 2 - 1, rel=1e-9)
    with pytest.raises(ConfigError, match="two sources"):
        leave_one_source_out([r for r in rows if r.source == "gptfast"])
