"""``workbench profile-ops`` end to end on tiny-gqa (small grids): the file's contract, its round trip through
``simulate --cost-model op-profile``, and bad arguments. No test looks at how long anything took."""

from __future__ import annotations

import json

import pytest
import torch

from workbench import cli
from workbench.kernels import paged_decode_cpu
from workbench.model.attention import MAX_GATHER_KEY_SLOTS
from workbench.model.packed import packing_available
from workbench.sim.op_profile import OPS_1D, OPS_2D, OpProfileCostModel

SMALL = ["--tokens", "1", "4", "16", "--rows", "1", "4", "--prompt-lens", "4", "32", "--contexts", "4", "32",
         "--batch-sizes", "1", "4", "--max-repeats", "3", "--warmup", "1", "--passes", "2",
         "--no-progress"]  # fmt: skip


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("op-profile") / "op.json"
    code = cli.main(["profile-ops", "--model", "tiny-gqa", "--device", "cpu", "--out", str(path), *SMALL,
                     "--overhead-requests", "4"])  # fmt: skip
    assert code == 0
    return str(path)


def test_the_profile_holds_every_operation_at_the_requested_sizes(profile_file: str) -> None:
    data = json.loads(open(profile_file).read())
    assert data["model"] == "tiny-gqa" and data["num_layers"] == 2 and data["threads"] == 1
    assert set(data["ops"]) == set(OPS_1D) | set(OPS_2D)
    expected = {"tokens": [1, 4, 16], "rows": [1, 4], "prompt_len": [4, 32], "context": [4, 32]}
    for name in OPS_1D:
        op = data["ops"][name]
        assert op["values"] == expected[op["x"]], name
        assert all(lo <= mid <= hi for lo, mid, hi in zip(op["min_s"], op["median_s"], op["max_s"])), name
        assert all(r >= 2 * 3 for r in op["repeats"]), name  # two passes of at least 3 calls
    dec = data["ops"]["attention_decode"]
    assert dec["batch_sizes"] == [1, 4] and dec["contexts"] == [4, 32] and len(dec["median_s"]) == 2
    assert data["machine"]["name"] and len(data["load_average_start"]) == 3 and len(data["load_average_end"]) == 3
    over = data["overhead"]
    assert over["fit"]["num_steps"] > 0 and over["host_gap_s"] >= 0
    assert {c["policy"] for c in over["fit"]["engine_configs"]} == {"continuous", "chunked"}
    assert isinstance(OpProfileCostModel.load(profile_file), OpProfileCostModel)
    # the linears were timed as the engine runs them (EngineConfig.packed_linears' default): tiny-gqa's matrices
    # are all below PACKED_MIN_WEIGHT, so none was packed
    assert data["packed_linears"] is False and data["packed_products"] is None
    # and attention through the engine's default backend: the paged C++ decode where its op builds, else torch
    assert data["attention_backend"] == ("cpu" if paged_decode_cpu.available() else "torch")
    assert data["max_key_slots"] == (2**62 if paged_decode_cpu.available() else MAX_GATHER_KEY_SLOTS)


@pytest.mark.parametrize("name", ["auto", "cpu", "torch"])
def test_attention_is_timed_through_the_backend_the_engine_resolves(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--attention-backend`` takes the engine's names; every attention point of the profile goes through the
    backend an engine of that name runs ('auto' on a CPU: the paged C++ decode where it builds), the profile records
    that backend, and its overhead fit's engine is configured with it."""
    from workbench.model import cpu_backend
    from workbench.model.attention import TorchAttentionBackend
    from workbench.sim.op_timing import overhead_engine_configs, profile_ops

    built = paged_decode_cpu.available()
    if name == "cpu" and not built:
        pytest.skip("the C++ paged decode op does not build here")
    expected = "cpu" if name == "cpu" or (name == "auto" and built) else "torch"
    calls: list[str] = []
    for cls, label in ((cpu_backend.CpuAttentionBackend, "cpu"), (TorchAttentionBackend, "torch")):
        for method in ("forward", "decode"):
            original = getattr(cls, method)

            def spy(self, *a, original=original, label=label, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
                calls.append(label)
                return original(self, *a, **k)

            monkeypatch.setattr(cls, method, spy)
    grids = {"tokens": [1], "rows": [1], "prompt_lens": [4], "contexts": [4], "batch_sizes": [2]}
    profile = profile_ops("tiny-gqa", "cpu", "fp32", name, grids=grids, warmup=0, max_repeats=3, progress=False,
                          passes=1)  # fmt: skip
    assert calls and set(calls) == {expected}
    assert profile["attention_backend"] == expected
    assert overhead_engine_configs(profile)[0].attention_backend == expected


@pytest.mark.parametrize("packed", [True, False])
def test_linears_are_timed_and_replayed_as_the_engine_runs_them(
    packed: bool, monkeypatch: pytest.MonkeyPatch, pack_every_linear: None
) -> None:
    """With packed linears (the engine's default) the projections and the LM head are timed through
    ``PackedLinear`` at the row counts it packs (4 here), and the overhead fit's engine packs its linears too;
    without, neither does (an op profile of plain layers against a packed engine over-predicted its steps)."""
    from workbench.engine.engine import Engine
    from workbench.model import packed as packed_mod
    from workbench.sim.op_timing import measure_training_steps, profile_ops

    if not packing_available(torch.device("cpu"), torch.float32):
        pytest.skip("the blocked linear op did not build here")
    rows_seen: list[int] = []
    forward = packed_mod.PackedLinear.forward

    def spy(self, x):  # noqa: ANN001, ANN202
        rows_seen.append(x.numel() // x.shape[-1])
        return forward(self, x)

    monkeypatch.setattr(packed_mod.PackedLinear, "forward", spy)
    monkeypatch.setattr(packed_mod, "PACKED_MIN_ROWS", packed_mod.packed_min_rows("GenuineIntel"))  # 4, any CPU
    grids = {"tokens": [1, 4], "rows": [4], "prompt_lens": [4], "contexts": [4], "batch_sizes": [1]}
    profile = profile_ops("tiny-gqa", "cpu", "fp32", grids=grids, warmup=0, max_repeats=3, progress=False, passes=1,
                          packed_linears=packed)  # fmt: skip
    assert profile["packed_linears"] is packed
    # tiny-gqa's layer has 4 linears (QKV, O, gate/up, down) and an untied LM head: all packed, or none
    expected = {"min_rows": 4, "max_rows": None, "per_layer": 4, "head": True} if packed else None
    assert profile["packed_products"] == expected
    assert (4 in rows_seen) is packed and (1 in rows_seen) is packed  # 1 row: PackedLinear falls back to the plain
    configs: list[bool] = []
    init = Engine.__init__

    def engine_spy(self, model, config=None, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        configs.append(config.packed_linears)
        return init(self, model, config, *a, **k)

    monkeypatch.setattr(Engine, "__init__", engine_spy)
    samples, _ = measure_training_steps(profile, policies=("continuous",), num_requests=2, max_model_len=64)
    assert samples.stats and configs and set(configs) == {packed}


@pytest.mark.parametrize(
    "min_weight, expected",
    [
        (None, None),  # the default threshold: every matrix of tiny-gqa (20,480 elements at most) stays plain
        # 16,385: only gate/up (64 x 320 = 20,480) packs, not the LM head (64 x 256 = 16,384)
        (16_385, {"min_rows": 4, "max_rows": None, "per_layer": 1, "head": False}),
        (16_384, {"min_rows": 4, "max_rows": None, "per_layer": 1, "head": True}),  # the LM head too
    ],
)
def test_the_profile_records_the_linears_really_packed(min_weight, expected, monkeypatch: pytest.MonkeyPatch) -> None:
    """``packed_products`` counts the layers ``pack_linears`` packed (PACKED_MIN_WEIGHT), not every linear; with
    none packed the profile says so and its steps pay no packed product."""
    from workbench.model import packed as packed_mod
    from workbench.sim.op_timing import profile_ops
    from workbench.sim.stats import StepStats

    if not packing_available(torch.device("cpu"), torch.float32):
        pytest.skip("the blocked linear op did not build here")
    if min_weight is not None:
        monkeypatch.setattr(packed_mod, "PACKED_MIN_WEIGHT", min_weight)
    monkeypatch.setattr(packed_mod, "PACKED_MIN_ROWS", packed_mod.packed_min_rows("GenuineIntel"))  # 4, any CPU
    grids = {"tokens": [1, 4], "rows": [4], "prompt_lens": [4], "contexts": [4], "batch_sizes": [1]}
    profile = profile_ops("tiny-gqa", "cpu", "fp32", grids=grids, warmup=0, max_repeats=3, progress=False, passes=1)
    assert profile["packed_linears"] is (expected is not None) and profile["packed_products"] == expected
    cost = OpProfileCostModel.from_dict(profile)
    four = StepStats(decode_seqs=4, decode_context=80, decode_max_context=20)
    # 4 decodes: 1 packed product a layer x 2 layers, + the LM head's 4 rows when it is packed
    assert cost.packed_calls(four) == (0 if expected is None else 2 + expected["head"])


def test_simulate_reads_it_back(profile_file: str, capsys: pytest.CaptureFixture) -> None:
    args = ["simulate", "--model", "tiny-gqa", "--cost-model", "op-profile", "--profile", profile_file,
            "--trace", "poisson:20", "--num-requests", "10", "--prompt-lens", "uniform:4:32",
            "--output-lens", "uniform:2:8", "--max-model-len", "128", "--json"]  # fmt: skip
    capsys.readouterr()
    assert cli.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_finished"] == 10 and out["cost_model"]["name"] == "op-profile"
    assert out["hardware"].startswith("profile: ")
    # a profile of another model is refused unless forced
    assert cli.main([*args[:2], "tiny-mha", *args[3:]]) == 2
    assert "was fitted on model 'tiny-gqa', not 'tiny-mha'" in capsys.readouterr().err
    assert cli.main([*args[:2], "tiny-mha", *args[3:], "--force-profile"]) == 0


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max-tokens", "0"], "--max-tokens must be a positive integer"),
        (["--tokens", "0", "4"], "--tokens needs positive integers"),
        (["--out", "/nonexistent-folder/op.json"], "folder /nonexistent-folder does not exist"),
        (["--device", "tpu"], "unknown device 'tpu'"),
    ],
)
def test_bad_arguments_are_clear(extra: list, message: str, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["profile-ops", "--model", "tiny-gqa", "--no-overhead", "--no-progress", *extra]) == 2
    assert message in capsys.readouterr().err


def test_an_attention_backend_the_engine_does_not_know_is_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["profile-ops", "--model", "tiny-gqa", "--no-overhead", "--no-progress", "--attention-backend",
                  "flash"])  # fmt: skip
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'flash'" in err and "'auto', 'torch', 'triton', 'cpu'" in err
