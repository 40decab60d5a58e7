"""One smoke run of the real experiment notebooks (``workbench report --profile smoke``), shared by the tests below:
each experiment's metrics.json against values computed by hand or by the contract, with tolerances (nbval compares
printed text only), the hygiene fields, and every image and link of every generated page."""

from __future__ import annotations

import json
import math
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from workbench import cli
from workbench.experiments.claims import VERDICTS

EXPERIMENTS = (
    "prefill_vs_decode",
    "kv_cache_variants",
    "batching",
    "chunked_prefill",
    "disaggregation",
    "parallelism_and_capacity",
    "simulator_validation",
    "decode_levers",
    "speculative_decoding",
)
ANALYTIC = ("parallelism_and_capacity",)  # measure nothing on this machine: no ceilings or reference steps to check


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("smoke-reports")
    code = cli.main(["report", "--profile", "smoke", "--out", str(out), "--no-progress"])
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    metrics = {name: json.loads((run_dir / name / "metrics.json").read_text()) for name in EXPERIMENTS}
    env = json.loads((run_dir / "environment.json").read_text())
    return {"code": code, "out": out, "run_dir": run_dir, "metrics": metrics, "env": env}


def test_all_experiments_ran(smoke: dict) -> None:
    manifest = json.loads((smoke["run_dir"] / "manifest.json").read_text())
    assert smoke["code"] == 0 and manifest["counts"] == {"ok": len(EXPERIMENTS), "failed": 0, "skipped": 0}


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_claims_and_anomalies_contract(smoke: dict, name: str) -> None:
    m = smoke["metrics"][name]
    assert m["claims"] and isinstance(m["anomalies"], list)
    for c in m["claims"]:
        assert set(c) >= {"claim", "verdict", "evidence"} and c["verdict"] in VERDICTS and c["evidence"]
        # every claim has its ratio and interval (exact: rounds 0, a zero-width interval), or says why it has none
        ev = c["evidence"]
        if ev.get("no_ratio"):
            assert isinstance(ev["no_ratio"], str) and "ratio" not in ev, c["claim"]
        else:
            assert set(ev) >= {"ratio", "ci_low", "ci_high", "rounds", "margin", "confidence"}, c["claim"]
            if ev["ratio"] is not None and ev["ci_low"] is not None:
                assert ev["ci_low"] <= ev["ratio"] * (1 + 1e-9) and ev["ratio"] <= ev["ci_high"] * (1 + 1e-9)
        # a claim resting on something an anomaly flagged is never stated as a finding, unless the flag is the
        # machine's drift alone and the claim's interval widened by it still gives its verdict (claims.drift_bound)
        flagged = [a for a in m["anomalies"] if a["affects"] in c["uses"]]
        if flagged and c.get("held_despite"):
            bound = ev["drift_bound"]
            assert all(a["check"] in ("reference_drift", "ceiling_moved") for a in flagged)
            assert bound["verdict"] == c["verdict"]
            factor = max(1 + a["value"] if a["value"] >= 0 else 1 / (1 + a["value"]) for a in flagged)
            assert bound["factor"] == pytest.approx(factor) and bound["ci_low"] == pytest.approx(ev["ci_low"] / factor)
            assert bound["ci_high"] == pytest.approx(ev["ci_high"] * factor) and not c.get("unreliable")
        elif flagged:
            assert c["verdict"] == "inconclusive" and c["unreliable"]
    if name in ANALYTIC:
        assert "hygiene" not in m and m["anomalies"] == []
        return
    h = m["hygiene"]
    assert h["num_threads"] == 1  # workbench report --threads defaults to 1 and the kernels got it
    for key in ("ceilings_start", "ceilings_end"):
        assert h[key]["peak_flops_dtype"] > 0 and h[key]["mem_bandwidth"] > 0
        assert len(h[key]["settle"]["readings"]) >= 2  # probed until two readings agree (hygiene.settled_ceilings)
    assert len(h["load_average_start"]) == 3 and len(h["load_average_end"]) == 3
    for phase in ("prefill", "decode"):
        start, end = h["reference_start"][phase], h["reference_end"][phase]
        assert start["min_s"] <= start["median_s"] <= start["max_s"]
        drift = end["median_s"] / start["median_s"] - 1
        assert h["reference_drift"][phase] == pytest.approx(drift)
        assert (abs(drift) > 0.25) == any(
            a["check"] == "reference_drift" and a["phase"] == phase for a in m["anomalies"]
        )


def test_utilization_above_one_is_flagged_not_stated(smoke: dict) -> None:
    m = smoke["metrics"]["prefill_vs_decode"]
    flagged = {a["check"] for a in m["anomalies"]}
    assert (m["prefill_mfu"] > 1.1) <= ("mfu_above_1" in flagged)
    assert (m["decode_mbu_batch1"] > 1.1) <= ("mbu_above_1" in flagged)
    assert m["measured_peak_flops_per_s"] == pytest.approx(m["hygiene"]["ceilings_start"]["peak_flops_dtype"])


def test_analytical_results_by_hand(smoke: dict) -> None:
    kv = smoke["metrics"]["kv_cache_variants"]
    # Llama-3.1-8B: 32 query heads; MQA keeps one KV head of 32
    assert kv["kv_bytes_ratio_mqa_to_mha"] == pytest.approx(1 / 32)
    # MHA 512 KiB/token x 4096 tokens = 2 GiB per sequence; GQA (8 KV heads) and MQA fit 4x and 32x as many
    # (floor after the same weights), so the counts grow with fewer heads
    assert kv["max_seqs_mha"] < kv["max_seqs_gqa"] < kv["max_seqs_mqa"]
    assert kv["max_seqs_gqa"] >= 4 * kv["max_seqs_mha"] and kv["max_seqs_mqa"] >= 32 * kv["max_seqs_mha"]
    assert 0 <= kv["paged_waste_block16"] < kv["contiguous_waste"] < 1
    verdicts = {c["claim"]: c["verdict"] for c in kv["claims"]}
    assert verdicts["Fewer KV heads mean fewer bytes per token and more sequences that fit"] == "confirmed"
    assert verdicts["Paged blocks waste less KV memory than contiguous slots"] == "confirmed"


def test_recorded_ratios_follow_their_parts(smoke: dict) -> None:
    b = smoke["metrics"]["batching"]
    gain = b["decode_tokens_per_s_max_batch"] / b["decode_tokens_per_s_batch1"]
    assert b["decode_throughput_gain"] == pytest.approx(gain, rel=1e-9)
    assert b["poisson_static_goodput"] is not None  # the notebook states SLOs, so goodput is defined
    c = smoke["metrics"]["chunked_prefill"]
    assert c["sweep_min_stall_budget"] in (16, 48)  # smoke budgets
    claim = next(x for x in c["claims"] if "TTFT" in x["claim"])
    assert claim["evidence"]["ratio"] == pytest.approx(c["paired_ratio_long_prompt_TTFT"])
    # every claim comparing the engine's timings is decided in paired rounds and says so with its numbers
    for name in ("prefill_vs_decode", "batching", "chunked_prefill", "decode_levers", "speculative_decoding"):
        paired = [x for x in smoke["metrics"][name]["claims"] if x["uses"] == ["paired"]]
        assert paired, name
        for x in paired:
            ev = x["evidence"]
            assert ev["ci_low"] <= ev["ratio"] <= ev["ci_high"] and ev["rounds"] >= 6 and ev["control"] is not None
            assert ev["margin"] in (0.05, 0.10) and ev["confidence"] == 0.95
            if x["verdict"] == "confirmed" and ev["control"]["failed"]:  # then beyond the margin + the A/A's deviation
                c = ev["control"]
                widened = math.log1p(ev["margin"]) + max(abs(math.log(c["ci_low"])), abs(math.log(c["ci_high"])))
                near = ev["ci_low"] if ev["direction"] == "higher" else 1.0 / ev["ci_high"]
                assert math.log(near) > widened, x
    v = smoke["metrics"]["simulator_validation"]  # smoke: two policies, no disaggregated pair
    fidelity = [x for x in v["claims"] if x["claim"].startswith("The simulator (")]
    assert len(fidelity) == 3 and all(x["evidence"]["num_statistics"] == 2 * 4 for x in fidelity)
    best = next(x["evidence"] for x in v["claims"] if x["claim"].startswith("The best cost model"))
    # one entry per cost model; runs_load joins them when the measured runs were loaded beyond the CPUs (a busy CI)
    counts = {k: e["num_within"] for k, e in best.items() if isinstance(e, dict) and k != "runs_load"}
    assert len(counts) == 4 and counts[best["best"]] == max(counts.values())  # op-profile, profiled, their noise
    worst = fidelity[0]["evidence"]["worst"]["rel_error"]
    assert abs(worst) == pytest.approx(v["max_abs_rel_error_op_profile"])
    assert v["disaggregated_max_abs_rel_error"] is None


def test_environment_json_hygiene(smoke: dict) -> None:
    env = smoke["env"]
    assert env["num_threads"] == 1
    for key in ("ceilings_start", "ceilings_end"):
        assert env[key]["available"] is True and env[key]["mem_bandwidth"] > 0
    assert len(env["load_average_start"]) == 3 and len(env["load_average_end"]) == 3


class _Refs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for key, value in attrs:
            if value and ((tag == "a" and key == "href") or (tag == "img" and key == "src")):
                self.refs.append(value)


def _broken(page: Path) -> list[str]:
    parser = _Refs()
    parser.feed(page.read_text(encoding="utf-8"))
    broken = []
    for ref in parser.refs:
        url = urlparse(ref)
        if url.scheme in ("http", "https", "data", "mailto") or ref.startswith("#"):
            continue
        if not (page.parent / unquote(url.path)).exists():
            broken.append(ref)
    return broken


def test_every_link_and_image_of_every_page_resolves(smoke: dict) -> None:
    run_dir = smoke["run_dir"]
    pages = [smoke["out"] / "index.html", run_dir / "index.html", *sorted(run_dir.glob("*/*.html"))]
    assert len(pages) == 2 + 2 * len(EXPERIMENTS)
    for page in pages:
        assert _broken(page) == [], page
    index = (run_dir / "index.html").read_text()
    assert "Claims tested" in index and "confirmed" in index
    for name in EXPERIMENTS:
        assert f'id="{name}"' in index
    # figures are shown in the index and embedded in each notebook's HTML (no PosixPath echo)
    for html in run_dir.glob("*/*.html"):
        assert "PosixPath" not in html.read_text()


def test_disaggregation_moved_exactly_the_prompts_kv(smoke: dict) -> None:
    m = smoke["metrics"]["disaggregation"]
    # the smoke profile's tiny-gqa: 2 layers x K and V x 2 KV heads x 16 dims x 4 bytes = 512 B per prompt token,
    # and the notebook checks each workload's bytes against its prompts; here: a whole number of tokens moved
    assert m["kv_bytes_moved"] > 0 and m["kv_bytes_moved"] % 512 == 0
    assert {c["claim"] for c in m["claims"]} == {
        "Disaggregation removes prefill-decode interference from ITL",
        "Disaggregation pays only under tight TTFT and TPOT SLOs",
        "A slow KV link erases disaggregation's gain",
        "Prefill and decode want different tensor-parallel sizes",
    }
