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
    # a stack's overheads: 4 steps x (32 layers x 17 kernels + embedding, final norm, LM head = 547 kernels) x 1 us,
    # and 10 ms once
    assert m.num_kernels == 547
    (entry,) = error_table([row], "hardware", stack_overheads={"s": Stack(per_kernel_s=1e-6, per_request_s=1e-2)})
    assert entry["predicted_s"] == pytest.approx(expected + 4 * 547e-6 + 1e-2)
    # a host per accelerator: this row's H100 system at 2 us a kernel, elsewhere 1 us
    both = Stack(per_kernel_s=1e-6, per_kernel_by_hardware=(("h100-sxm", 2e-6),))
    (entry,) = error_table([row], "hardware", stack_overheads={"s": both})
    assert entry["predicted_s"] == pytest.approx(expected + 4 * 547 * 2e-6)
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
        for key in ("linear_max", "linear_half_tokens", "memory_efficiency", "kernel_floor_s", "kernel_latency_s",
                    "int8_weight_efficiency", "int4_weight_efficiency"):  # fmt: skip
            assert getattr(table.calibration, key) == pytest.approx(getattr(spec.calibration, key)), (hw, key)
        if hw == "h100-sxm":
            assert table.calibration.fp8_max == pytest.approx(spec.calibration.fp8_max)
    # one kernel latency and one GEMM efficiency for every accelerator
    assert len({spec.calibration.kernel_latency_s for spec in specs.values()}) == 1
    assert len({spec.calibration.linear_max for spec in specs.values()}) == 1
    table_stacks = load_stack_overheads()
    for source, stack in stacks.items():
        for key in ("per_kernel_s", "per_request_s", "per_collective_s", "cuda_graphs"):
            assert getattr(stack, key) == pytest.approx(getattr(table_stacks[source], key)), (source, key)
        assert stack.mem_bandwidth == table_stacks[source].mem_bandwidth
        assert dict(stack.per_kernel_by_hardware) == pytest.approx(dict(table_stacks[source].per_kernel_by_hardware))


@pytest.fixture(scope="module")
def loso() -> tuple[list[dict], dict[str, float]]:
    from workbench.sim.published import leave_one_source_out

    return leave_one_source_out(load_published())


@pytest.mark.slow  # three fits of the calibration: ~30 s on 2 busy cores
def test_leave_one_source_out_error_meets_the_median_target(loso) -> None:
    # the bar on sources the fit never saw: median |error| <= 15%
    table, s = loso
    assert s["n"] == len(load_published()) and s["median_abs_error"] <= 0.15, s


@pytest.mark.slow
def test_leave_one_source_out_error_meets_the_max_target(loso) -> None:
    # the bar: no row of a source the fit never saw off by more than 30%
    table, s = loso
    assert s["max_abs_error"] <= 0.30, max(table, key=lambda r: abs(r["error"]))


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


def test_a_new_stack_is_priced_as_the_median_of_the_stacks_whose_rows_determined_each_overhead() -> None:
    from workbench.sim.published import informed_fields, typical_stack

    base = dict(model="Llama-2-7B", hardware="a100-80gb", measured_s=0.01, split="calibration")
    decode1 = PublishedRow(id="d1", source="a", metric="decode_s", **base)
    decode8 = PublishedRow(id="d8", source="b", metric="decode_s", tp=8, **base)
    whole = PublishedRow(id="w", source="c", metric="e2e_s", prompt_len=8, output_len=4, **base)
    graphs = Stack(cuda_graphs=True)
    assert informed_fields([decode1], Stack()) == ("per_kernel_s",)
    assert informed_fields([decode8, whole], Stack()) == ("per_kernel_s", "per_request_s", "per_collective_s")
    assert informed_fields([decode8, whole], graphs) == ("per_request_s",)  # a graph's host launches nothing
    stacks = {"a": Stack(per_kernel_s=1e-6), "b": Stack(per_kernel_s=3e-6, per_collective_s=8e-6),
              "c": Stack(per_kernel_by_hardware=(("a100-80gb", 5e-6), ("h100-sxm", 2e-6)), per_request_s=0.04),
              "g": graphs}  # fmt: skip
    informed = {"a": ("per_kernel_s",), "b": ("per_kernel_s", "per_collective_s"),
                "c": ("per_kernel_s", "per_request_s"), "g": ()}  # fmt: skip
    # per kernel: median of 1, 3 and c's two systems' 5 and 2 us = 2.5 us (the graph stack determined none); per
    # request: c's alone; per collective: b's
    new = typical_stack(stacks, informed, Stack(mem_bandwidth=1.5e12))
    assert new.per_kernel_s == pytest.approx(2.5e-6)
    assert new == Stack(per_kernel_s=new.per_kernel_s, per_request_s=0.04, per_collective_s=8e-6, mem_bandwidth=1.5e12)
    # a new source that states CUDA graphs keeps no host overheads but a typical request's
    assert typical_stack(stacks, informed, graphs) == Stack(per_request_s=0.04, cuda_graphs=True)
    assert typical_stack({}, {}) == Stack()
    with pytest.raises(ConfigError, match="CUDA graphs"):
        Stack(per_kernel_s=1e-6, cuda_graphs=True)
    # the table's gpt-fast stack states CUDA graphs (torch.compile mode="reduce-overhead")
    assert load_stack_overheads()["gptfast"].cuda_graphs
