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
