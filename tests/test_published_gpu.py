"""The published GPU measurements table and what the cost model predicts for its rows (by hand), and the
calibration in accelerators.yaml being what the fit chooses on the calibration rows."""

from __future__ import annotations

import pytest

from workbench.config import ModelConfig
from workbench.errors import ConfigError
from workbench.hardware import get_hardware
from workbench.roofline import RooflineModel
from workbench.sim.published import (
    PublishedRow,
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
    (entry,) = error_table([row], "hardware", stack_overheads={"s": (1e-3, 1e-2)})
    assert entry["predicted_s"] == pytest.approx(expected + 4e-3 + 1e-2)
    assert entry["error"] == pytest.approx(entry["predicted_s"] / 0.1 - 1)
    assert summarize_errors([{"error": -0.3}, {"error": 0.1}, {"error": 0.2}]) == {
        "n": 3, "median_abs_error": 0.2, "max_abs_error": 0.3}  # fmt: skip


def test_accelerators_yaml_holds_what_the_fit_chooses() -> None:
    rows = load_published()
    specs, stacks, _loss = fit(rows)
    for hw, spec in specs.items():
        table = get_hardware(hw)
        for key in ("linear_max", "linear_half_tokens", "memory_efficiency", "kernel_floor_s"):
            assert getattr(table.calibration, key) == pytest.approx(getattr(spec.calibration, key)), (hw, key)
        if hw == "h100-sxm":
            assert table.calibration.fp8_max == pytest.approx(spec.calibration.fp8_max)
        assert table.interconnect.base_latency_s == pytest.approx(spec.interconnect.base_latency_s)
    table_stacks = load_stack_overheads()
    for source, pair in stacks.items():
        assert pair == pytest.approx(table_stacks[source])
