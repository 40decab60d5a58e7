"""How a report reads, rendered from hand-made manifests and metrics (no notebook runs): one verdict label per claim
beside its ratio and interval, the claims summary at the top of the run page and of each notebook's page, key results
with unit, spread and conditions, the CSV downloads, and the page comparing runs."""

from __future__ import annotations

import csv
import io
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from workbench import record
from workbench.pipeline.index import render_notebook_summary, render_run_index, write_reports_index, write_run_index
from workbench.pipeline.summary import claim_row

PAIRED = {
    "claim": "Batching raises decode throughput",
    "verdict": "confirmed",
    "evidence": {"arms": ["batch 1", "batch 32"], "ratio": 5.87, "ci_low": 5.21, "ci_high": 6.6, "rounds": 12,
                 "margin": 0.05, "confidence": 0.95, "direction": "higher",
                 "control": {"ratio": 1.01, "ci_low": 0.97, "ci_high": 1.05, "failed": False}},
    "detail": "decode tokens/s at context 128",
    "uses": ["paired"],
}  # fmt: skip
STRADDLES = {
    "claim": "Chunked prefill raises the long prompt's TTFT",
    "verdict": "inconclusive",
    "evidence": {"ratio": 1.04, "ci_low": 0.98, "ci_high": 1.11, "rounds": 8, "margin": 0.1, "confidence": 0.95,
                 "direction": "higher", "control": None},
    "detail": "the long prompt's TTFT",
    "uses": ["paired"],
}  # fmt: skip
VOIDED = {
    "claim": "Prefill is compute-bound",
    "verdict": "inconclusive",
    "verdict_from_numbers": "confirmed",
    "unreliable": True,
    "unreliable_because": ["the peak FLOP/s ceiling moved by +31% between start and end"],
    "evidence": {"mfu": 0.61},
    "detail": "MFU 0.61 against MBU 0.02",
    "uses": ["timing", "ceilings"],
}
ANALYTIC = {
    "claim": "Fewer KV heads, fewer bytes",
    "verdict": "confirmed",
    "evidence": {"mha_bytes": 1024, "gqa_bytes": 256},
    "detail": "GQA stores 4x fewer bytes per token",
    "uses": [],
}
METRICS = {
    "claims": [PAIRED, STRADDLES, VOIDED, ANALYTIC],
    "anomalies": [{"check": "ceiling_drift", "affects": "ceilings", "message": "the peak FLOP/s ceiling moved"}],
    "measured_peak_flops_per_s": 5.874e10,
    "decode_step_ms_batch1": 12.345,
    "decode_tokens_per_s": {"value": 68.6, "unit": "tok/s", "low": 62.3, "high": 77.3,
                            "conditions": {"batch": 32, "context_len": 128}},
    "label": "cpu",
}  # fmt: skip


def _manifest(run_id: str, verdict: str = "confirmed", ratio: float = 5.87) -> dict:
    first = {**PAIRED, "verdict": verdict, "evidence": {**PAIRED["evidence"], "ratio": ratio}}
    claims = [first, *METRICS["claims"][1:]]
    return {
        "run_id": run_id,
        "profile": "cpu",
        "started_at": "2026-12-03T08:00:00+00:00",
        "complete": True,
        "experiments": [
            {"name": "batching", "status": "ok", "duration_s": 3.0, "metrics": {**METRICS, "claims": claims},
             "params": {"seed": 0, "batch_sizes": [1, 32]}, "tables": ["batching/tables/decode_sweep.csv"]},
            {"name": "kv_cache_variants", "status": "ok", "duration_s": 1.0,
             "metrics": {"claims": [ANALYTIC], "kv_bytes_ratio_mqa_to_mha": 0.125}},
        ],
    }  # fmt: skip


class Tables(HTMLParser):
    """The rows of every ``<table class="claims">``: per row, its cells' text and its verdict labels."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict] = []
        self._in_claims = 0
        self._row: dict | None = None
        self._label = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "table":
            self._in_claims += 1 if "claims" in (a.get("class") or "").split() else 0
        elif tag == "tr" and self._in_claims:
            self._row = {"text": "", "labels": []}
        elif tag == "span" and self._row is not None and "verdict" in (a.get("class") or "").split():
            self._row["labels"].append(a["class"].split()[1])
            self._label = True
        elif tag == "th" and self._row is not None:
            self._row["header"] = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr" and self._row is not None:
            if not self._row.get("header"):
                self.rows.append(self._row)
            self._row = None
        elif tag == "table" and self._in_claims:
            self._in_claims -= 1
        elif tag == "span":
            self._label = False

    def handle_data(self, data: str) -> None:
        if self._row is not None:
            self._row["text"] += data + " "


def claim_table_rows(page: str) -> list[dict]:
    parser = Tables()
    parser.feed(page)
    return parser.rows


def test_one_verdict_label_per_claim_beside_its_ratio_and_interval() -> None:
    page = render_run_index(_manifest("r1"), {})
    rows = claim_table_rows(page)
    # the run's summary (5 claims) and each experiment's own table (4 + 1)
    assert len(rows) == 10 and all(len(r["labels"]) == 1 for r in rows)
    paired = next(r for r in rows if "Batching raises" in r["text"])
    assert paired["labels"] == ["confirmed"]
    assert "batch 32 / batch 1: 5.87× [5.21, 6.6]" in paired["text"] and " 12 " in paired["text"]
    assert "+5% at 95%" in paired["text"] and "1.01× [0.97, 1.05]" in paired["text"]
    voided = next(r for r in rows if "compute-bound" in r["text"])
    assert voided["labels"] == ["inconclusive"]  # one label; why and what the numbers said are its note
    assert "unreliable: the peak FLOP/s ceiling moved by +31%" in voided["text"]
    assert "numbers alone: confirmed" in voided["text"] and "quieter machine" in voided["text"]
    straddles = next(r for r in rows if "TTFT" in r["text"])
    assert "more rounds" in straddles["text"] and "1.04× [0.98, 1.11]" in straddles["text"]
    analytic = next(r for r in rows if "KV heads" in r["text"])
    assert "no rounds" in analytic["text"] and "×" not in analytic["text"]
    assert "no rounds: GQA stores 4x fewer bytes" in rows[3]["text"]  # the summary shows the numbers it rests on


def test_the_claims_summary_opens_the_run_page() -> None:
    page = render_run_index(_manifest("r1"), {})
    assert page.index('id="claims"') < page.index('id="experiments"') < page.index('class="experiment"')
    assert "Claims (5: 3 confirmed, 2 inconclusive)" in page
    assert 'href="claims.csv"' in page and 'href="key_results.csv"' in page
    assert 'href="batching/tables/decode_sweep.csv"' in page


def test_key_results_carry_unit_spread_and_conditions() -> None:
    page = render_run_index(_manifest("r1"), {})
    assert "58.74 GFLOP/s" in page and "5.874e+10" not in page
    assert "12.35 ms" in page and "0.125×" in page
    assert "68.6 tok/s" in page and "62.3 .. 77.3 tok/s" in page and "batch 32, context len 128" in page
    assert ">cpu<" in page  # a string stays as it is


def test_claim_row_without_rounds_falls_back_cleanly() -> None:
    row = claim_row({"claim": "x", "verdict": "not_confirmed", "evidence": {"ratio": "n/a"}})
    assert row["ratio"] is None and row["ratio_text"] == "" and row["verdict_text"] == "not confirmed"
    assert row["note"] == "" and row["rounds"] is None
    assert claim_row({"claim": "y", "verdict": "inconclusive"})["note"].startswith("the numbers overlap")


def test_a_claim_on_exact_figures_shows_its_ratio_as_exact_and_its_margin() -> None:
    import pandas as pd

    from workbench.experiments.disaggregation import pays_under_tight_slos

    def best(split: float, colocated: float) -> pd.DataFrame:
        return pd.DataFrame([{"rate": 80.0, "colocated_goodput_per_gpu": colocated, "best_split": "4:4",
                              "split_goodput_per_gpu": split}])  # fmt: skip

    row = claim_row(pays_under_tight_slos(best(5.34, 4.97), best(5.61, 5.73)), "disaggregation")
    assert row["verdict_text"] == "not confirmed" and row["note"] == ""  # decided: nothing left to do
    assert row["ratio_text"] == "split 4:4 / colocated: 1.07× exact" and row["margin_text"] == "+10%"
    # exact figures: a zero-width interval (the ratio itself), no rounds
    assert row["ci_low"] == row["ci_high"] == pytest.approx(5.34 / 4.97) and row["rounds"] == 0


def test_a_claim_with_no_natural_ratio_says_why_in_its_place() -> None:
    import pandas as pd

    from workbench.experiments.parallelism import plan_has_a_tradeoff

    rows = pd.DataFrame([{"name": "a", "goodput_per_gpu": 2.0}, {"name": "b", "goodput_per_gpu": 1.0}])
    row = claim_row(plan_has_a_tradeoff(rows, rows), "parallelism")
    assert row["ratio"] is None and row["ratio_text"].startswith("no ratio: a count of deployments")


def test_run_tables_download_as_csv(tmp_path: Path) -> None:
    write_run_index(tmp_path, _manifest("r1"))
    claims = list(csv.DictReader(io.StringIO((tmp_path / "claims.csv").read_text())))
    assert len(claims) == 5 and claims[0]["experiment"] == "batching"
    assert float(claims[0]["ratio"]) == 5.87 and float(claims[0]["ci_low"]) == 5.21 and claims[0]["rounds"] == "12"
    assert float(claims[0]["control_ratio"]) == 1.01 and claims[0]["verdict"] == "confirmed"
    assert claims[3]["ratio"] == "" and claims[3]["verdict"] == "confirmed"  # analytic: no rounds
    results = {r["key"]: r for r in csv.DictReader(io.StringIO((tmp_path / "key_results.csv").read_text()))}
    assert results["measured_peak_flops_per_s"]["unit"] == "FLOP/s"
    assert float(results["measured_peak_flops_per_s"]["value"]) == 5.874e10
    tps = results["decode_tokens_per_s"]
    assert (float(tps["value"]), tps["unit"], float(tps["low"]), float(tps["high"])) == (68.6, "tok/s", 62.3, 77.3)
    assert tps["conditions"] == "batch=32; context_len=128"
    assert "claims" not in results and "anomalies" not in results


def _run(root: Path, run_id: str, machine: str, commit: str, **kwargs) -> None:
    (root / run_id).mkdir()
    (root / run_id / "manifest.json").write_text(json.dumps(_manifest(run_id, **kwargs)))
    env = {"cpu": {"model": machine}, "torch": {"device_name": machine}, "git": {"commit": commit}, "num_threads": 1}
    (root / run_id / "environment.json").write_text(json.dumps(env))


def test_runs_compared_side_by_side(tmp_path: Path) -> None:
    _run(tmp_path, "20261203T080000Z-aaaa", "AMD EPYC 7B13", "a" * 40)
    write_reports_index(tmp_path)
    assert not (tmp_path / "compare.html").exists()  # one run: nothing to compare
    _run(tmp_path, "20261203T090000Z-bbbb", "Intel Xeon 8481C", "b" * 40, verdict="inconclusive", ratio=1.02)
    top = write_reports_index(tmp_path).read_text()
    assert 'href="compare.html"' in top
    page = (tmp_path / "compare.html").read_text()
    # newest first: a column each, with its machine and commit
    assert page.index("20261203T090000Z-bbbb") < page.index("20261203T080000Z-aaaa")
    assert "Intel Xeon 8481C" in page and "AMD EPYC 7B13" in page and "b" * 12 in page and "a" * 12 in page
    batching = page[page.index("Batching raises decode throughput") :].split("</tr>")[0]
    assert batching.index("inconclusive") < batching.index("confirmed")  # the newer run's verdict first
    assert "1.02×" in batching and "5.87×" in batching
    peak = page[page.index("measured_peak_flops_per_s") :].split("</tr>")[0]
    assert peak.count("58.74 GFLOP/s") == 2


def test_notebook_page_opens_with_its_summary_and_parameters(tmp_path: Path) -> None:
    import nbformat

    from workbench.pipeline.export import export_html

    entry = _manifest("r1")["experiments"][0]
    summary = render_notebook_summary(entry)
    rows = claim_table_rows(summary)
    assert len(rows) == 4 and all(len(r["labels"]) == 1 for r in rows)
    assert "batch_sizes" in summary and "[1, 32]" in summary and "62.3 .. 77.3 tok/s" in summary
    assert 'href="tables/decode_sweep.csv"' in summary  # relative to the notebook's own folder
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# The notebook's own title")])
    page = export_html(nb, tmp_path / "n.html", hide_input=True, summary_html=summary).read_text()
    summary = page[page.index('<div class="workbench-summary">') : page.index("own title")]
    assert "<h2>batching: summary</h2>" in summary and "&lt;" not in summary  # as HTML, not escaped text
    assert len(nb.cells) == 1  # the notebook itself is not changed


def test_record_result_and_table(tmp_path: Path) -> None:
    import pandas as pd

    record.reset()
    record.set_output_dir(tmp_path)
    try:
        stored = record.result("ttft_s", 0.2, unit="s", low=0.15, high=0.3, prompt_len=1024, show=False)
        assert stored == {"value": 0.2, "unit": "s", "low": 0.15, "high": 0.3, "conditions": {"prompt_len": 1024}}
        assert json.loads((tmp_path / "metrics.json").read_text())["ttft_s"] == stored
        with pytest.raises(TypeError, match="both low and high"):
            record.result("x", 1.0, low=0.5)
        path = record.table(pd.DataFrame({"batch": [1, 32], "tokens_per_s": [11.5, 68.6]}), "sweep", show=False)
        assert path == tmp_path / "tables" / "sweep.csv"
        assert path.read_text().splitlines() == ["batch,tokens_per_s", "1,11.5", "32,68.6"]
    finally:
        record.reset()


def test_malformed_metrics_render_without_error() -> None:
    manifest = {
        "run_id": "r2",
        "experiments": [
            {"name": "odd", "status": "ok", "metrics": {"claims": "not a list", "anomalies": None, "x": [1, 2]}},
            {"name": "odder", "status": "ok", "metrics": {"claims": [{"verdict": "confirmed", "evidence": [1, 2]},
             {"claim": "<script>", "verdict": "inconclusive", "evidence": {"ratio": 1.1, "control": "bad"}}]}},
        ],
    }  # fmt: skip
    page = render_run_index(manifest, {})
    rows = claim_table_rows(page)
    assert len(rows) == 4 and all(len(r["labels"]) == 1 for r in rows)  # the summary's 2 and odder's own 2
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "1.1×" in page and "[1, 2]" in page
