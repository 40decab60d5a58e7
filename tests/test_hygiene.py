"""The measurement hygiene's reference step: how many steps one timed sample runs, and that the end of an experiment
times the same work as its start. Structure only: no assertion rests on a measured time's value."""

import pytest

from workbench.experiments import hygiene


@pytest.fixture(scope="module")
def model():
    from workbench.config import ModelConfig
    from workbench.model import Transformer

    return Transformer.from_config(ModelConfig.from_name("tiny-gqa"), seed=0)


def test_reference_step_counts_calls_per_sample_and_reports_per_step(model, monkeypatch):
    monkeypatch.setattr(hygiene, "REFERENCE_SAMPLE_S", 1e-9)  # any step outlasts it: one step per sample
    single = hygiene.reference_step(model, repeats=2)
    assert {p: single[p]["calls"] for p in ("prefill", "decode")} == {"prefill": 1, "decode": 1}
    monkeypatch.setattr(hygiene, "REFERENCE_MAX_CALLS", 3)  # a sample of 1e9 s is capped at 3 steps
    monkeypatch.setattr(hygiene, "REFERENCE_SAMPLE_S", 1e9)
    capped = hygiene.reference_step(model, repeats=2)
    assert capped["prefill"]["calls"] == 3 and capped["decode"]["calls"] == 3
    given = hygiene.reference_step(model, repeats=2, calls={"prefill": 2, "decode": 4})
    assert given["prefill"]["calls"] == 2 and given["decode"]["calls"] == 4
    for stats in given.values():
        assert 0 < stats["min_s"] <= stats["median_s"] <= stats["max_s"] and "times_s" not in stats


def test_end_checks_time_the_start_reference_calls(model, monkeypatch):
    seen = []

    def fake_reference(m, repeats=5, calls=None):
        seen.append(calls)
        return {
            p: {"min_s": 1.0, "median_s": 1.0, "max_s": 1.0, "spread": 0.0, "calls": 7} for p in ("prefill", "decode")
        }

    class Spec:
        peak_flops, mem_bandwidth, details = {"fp32": 1.0}, 1.0, {"repeatability": 0.0}

        def peak(self, dtype):
            return 1.0

    monkeypatch.setattr(hygiene, "reference_step", fake_reference)
    monkeypatch.setattr(hygiene, "settled_ceilings", lambda measure, dtype="fp32": Spec())
    reference_start = {"prefill": {"median_s": 1.0, "calls": 5}, "decode": {"median_s": 2.0, "calls": 9}}
    start = {"num_threads": 1, "state_start": hygiene.machine_state(),
             "ceilings_start": hygiene.ceilings_summary(Spec()), "reference_start": reference_start}  # fmt: skip
    end = hygiene.end_checks(start, model)
    assert seen == [{"prefill": 5, "decode": 9}]
    assert end["reference_drift"] == {"prefill": 0.0, "decode": -0.5}
    assert [a["phase"] for a in end["anomalies"] if a["check"] == "reference_drift"] == ["decode"]


def test_ceiling_readings_warm_the_probes_up_once(monkeypatch):
    import workbench.hardware

    seen = []
    monkeypatch.setattr(workbench.hardware, "measured_spec", lambda **kw: seen.append(kw) or len(seen))
    read = hygiene.ceiling_readings("cpu")
    assert [read(), read(), read()] == [1, 2, 3]
    fresh = {"device": "cpu", "refresh": True, "cache_dir": None}  # measured now, never a file cache
    assert seen == [fresh, {**fresh, "warmup_s": 0.0}, {**fresh, "warmup_s": 0.0}]  # the time warm-up once
    seen.clear()
    read = hygiene.ceiling_readings("cpu", warm=True)  # the end of an experiment: the machine computed until now
    read()
    assert seen == [{**fresh, "warmup_s": 0.0}]
    seen.clear()
    read = hygiene.ceiling_readings("cuda")  # measure_cuda warms up by calls only
    read(), read()
    assert seen == [{**fresh, "device": "cuda"}] * 2


def test_wait_until_quiet_waits_for_a_quiet_window(monkeypatch):
    # /proc/stat readings by hand, 2 CPUs at 100 jiffies/s: a 0.2 s window holds 40 jiffies. Both CPUs busy, then one
    # of them (busy share 0.5), then 1 jiffy busy of 40 (0.025 < 0.05): quiet after the third window
    readings = iter([
        {"total": 1000, "idle": 500, "steal": 0},
        {"total": 1040, "idle": 500, "steal": 0},  # 40 of 40 busy
        {"total": 1080, "idle": 520, "steal": 0},  # 20 of 40 busy
        {"total": 1120, "idle": 559, "steal": 0},  # 1 of 40 busy: quiet
        {"total": 1160, "idle": 560, "steal": 0},  # not read
    ])  # fmt: skip
    clock = iter(range(100))
    monkeypatch.setattr(hygiene, "cpu_times", lambda: next(readings))
    monkeypatch.setattr(hygiene, "now", lambda: float(next(clock)))
    monkeypatch.setattr(hygiene.time, "sleep", lambda s: None)
    waited = hygiene.wait_until_quiet(max_s=60, busy_share=0.05, window_s=0.2)
    assert next(readings)["total"] == 1160  # three windows read, then it returned
    assert waited == 3.0  # the fake clock: 0 at the start, one reading after each busy window (1, 2), then the return's


def test_wait_until_quiet_gives_up_after_max_s(monkeypatch):
    busy = iter({"total": 1000 + 40 * k, "idle": 0, "steal": 0} for k in range(100))
    clock = iter(float(k) for k in range(100))
    monkeypatch.setattr(hygiene, "cpu_times", lambda: next(busy))
    monkeypatch.setattr(hygiene, "now", lambda: next(clock))
    monkeypatch.setattr(hygiene.time, "sleep", lambda s: None)
    assert hygiene.wait_until_quiet(max_s=5, window_s=0.2) >= 5
    monkeypatch.setattr(hygiene, "cpu_times", lambda: None)  # not Linux: nothing to wait for
    assert hygiene.wait_until_quiet() == 0.0
