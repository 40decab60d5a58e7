"""Hostile command lines (issue 14): each is one line on stderr naming what is wrong and what would be right, exit
code 2, and nothing written or run first; serving commands exit non-zero when every request was rejected."""

import json
import os
import shutil

import pytest

from tests.conftest import one_line_error
from workbench.cli import main


def test_generate_seed_at_the_top_of_64_bits_serves_both_requests(capsys):
    # the second request's seed wraps to 0 instead of overflowing: both requests keep their tokens
    rc = main(["generate", "--model", "tiny-gqa", "--temperature", "1", "--seed", str(2**64 - 1), "--prompt-ids",
               "1,2", "--prompt-ids", "3,4", "--max-new-tokens", "3", "--ignore-eos", "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and [len(r["tokens"]) for r in out["requests"]] == [3, 3]
    # request 1 got seed 0: the same tokens as a run that gives it seed 0 as request 0
    rc = main(["generate", "--model", "tiny-gqa", "--temperature", "1", "--seed", "0", "--prompt-ids", "3,4",
               "--max-new-tokens", "3", "--ignore-eos", "--json"])  # fmt: skip
    assert rc == 0 and json.loads(capsys.readouterr().out)["requests"][0]["tokens"] == out["requests"][1]["tokens"]


def test_generate_seed_of_2_64_is_refused(capsys):
    rc = main(["generate", "--model", "tiny-gqa", "--temperature", "1", "--seed", str(2**64), "--prompt-ids", "1"])
    one_line_error(capsys, rc, "seed must be in [0, 2**64)")


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_report_out_unwritable(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        rc = main(["report", "--profile", "smoke", "--no-ceilings", "--out", str(locked / "reports")])
        one_line_error(capsys, rc, "--out", "not writable")
    finally:
        locked.chmod(0o700)
    assert not (locked / "reports").exists()


def test_report_out_below_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    rc = main(["report", "--profile", "smoke", "--no-ceilings", "--out", str(tmp_path / "f" / "reports")])
    one_line_error(capsys, rc, "--out", "is not writable")


def test_report_out_onto_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    rc = main(["report", "--profile", "smoke", "--no-ceilings", "--out", str(tmp_path / "f")])
    one_line_error(capsys, rc, "--out", "is not a folder")


def test_checkpoint_out_onto_an_existing_file(tmp_path, capsys):
    target = tmp_path / "weights.bin"
    target.write_text("keep me")
    rc = main(["checkpoint", "--model", "tiny-gqa", "--out", str(target)])
    one_line_error(capsys, rc, str(target), "is not a folder")
    assert target.read_text() == "keep me"


def test_simulate_step_log_into_a_missing_folder_is_refused_before_it_runs(tmp_path, capsys):
    rc = main(["simulate", "--model", "tiny-gqa", "--trace", "poisson:1", "--num-requests", "2", "--num-blocks",
               "64", "--step-log", str(tmp_path / "missing" / "log.json"), "--json"])  # fmt: skip
    out = capsys.readouterr()
    assert out.out == ""  # no simulation result printed: nothing ran
    rc2 = 2 if "does not exist" in out.err else -1
    assert rc == rc2 == 2 and len(out.err.strip().splitlines()) == 1, out.err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_hardware_measure_cuda_without_cuda(capsys):
    rc = main(["hardware", "--measure", "--device", "cuda"])
    one_line_error(capsys, rc, "sees no CUDA device", "--device cpu")


@pytest.mark.parametrize("option", ["--num-requests", "--threads"])
def test_fit_profile_zero_counts(tmp_path, option, capsys):
    rc = main(["fit-profile", option, "0", "--out", str(tmp_path / "p.json")])
    one_line_error(capsys, rc, option, "positive integer")
    assert not (tmp_path / "p.json").exists()


def test_fit_profile_out_into_a_missing_folder(tmp_path, capsys):
    rc = main(["fit-profile", "--out", str(tmp_path / "nope" / "p.json")])
    one_line_error(capsys, rc, "--out", "does not exist")


def test_generate_triton_backend_without_cuda_or_interpreter(monkeypatch, capsys):
    import workbench.kernels._common

    monkeypatch.setattr(workbench.kernels._common, "INTERPRET", False)
    rc = main(["generate", "--model", "tiny-gqa", "--prompt-ids", "1,2", "--attention-backend", "triton"])
    one_line_error(capsys, rc, "TRITON_INTERPRET=1", "attention_backend 'torch'")


def test_generate_with_the_config_json_of_a_checkpoint_uses_its_weights(tiny_checkpoint, tmp_path, capsys):
    ckpt = tmp_path / "c"
    shutil.copytree(tiny_checkpoint("tiny-gqa"), ckpt)
    outs = []
    for model in (str(ckpt), str(ckpt / "config.json")):
        assert main(["generate", "--model", model, "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out)["requests"][0]["tokens"])
    assert outs[0] == outs[1]


def write_trace(path, rows):
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{t},{p},{o}\n" for t, p, o in rows))
    return path


@pytest.mark.parametrize("command", ["replay", "simulate"])
def test_every_request_rejected_exits_non_zero(tmp_path, command, capsys):
    trace = write_trace(tmp_path / "t.csv", [("2023-11-16 18:00:00.0", 8, 4), ("2023-11-16 18:00:00.1", 8, 4)])
    args = [command, "--model", "tiny-gqa", "--trace", str(trace), "--max-model-len", "32", "--max-num-seqs", "1",
            "--num-blocks", "1", "--block-size", "4", "--json"]  # fmt: skip
    rc = main(args)
    out = capsys.readouterr()
    summary = json.loads(out.out)
    assert rc == 1 and len(summary["rejected"]) == summary["num_requests"] == 2
    assert "all 2 requests were rejected" in out.err


def test_replay_with_a_one_year_gap_is_refused_before_it_waits(tmp_path, capsys):
    trace = write_trace(tmp_path / "gap.csv", [("2023-01-01 00:00:00.0", 8, 2), ("2024-01-01 00:00:00.0", 8, 2)])
    rc = main(["replay", "--model", "tiny-gqa", "--trace", str(trace), "--max-model-len", "32"])
    one_line_error(capsys, rc, "31536000 s", "--max-duration 3600", "--time-scale", "--limit")


def test_replay_prints_its_wall_clock_span_first(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.csv", [("2023-01-01 00:00:00.0", 8, 2), ("2023-01-01 00:00:00.2", 8, 2)])
    assert main(["replay", "--model", "tiny-gqa", "--trace", str(trace), "--max-model-len", "32", "--json"]) == 0
    out = capsys.readouterr()
    assert "2 requests arriving over 0.2 s of wall clock" in out.err
    assert json.loads(out.out)["num_finished"] == 2


def test_unsorted_trace_is_refused_by_every_command(tmp_path, capsys):
    trace = write_trace(
        tmp_path / "u.csv",
        [("2023-01-01 00:00:01.0", 8, 2), ("2023-01-01 00:00:03.0", 8, 2), ("2023-01-01 00:00:02.0", 8, 2)],
    )
    for args in (
        ["trace-stats", str(trace)],
        ["replay", "--model", "tiny-gqa", "--trace", str(trace), "--max-model-len", "32"],
        ["simulate", "--model", "tiny-gqa", "--trace", str(trace), "--num-blocks", "64"],
    ):
        rc = main(args)
        one_line_error(capsys, rc, f"{trace}:4:", "earlier than line 3", "sorted by arrival time")


def test_profile_of_another_model_is_refused_unless_forced(capsys):
    profile = "data/profiles/tiny-gqa-intel-r-xeon-r-processor.json"
    base = ["simulate", "--model", "Llama-3.1-8B", "--trace", "poisson:1", "--num-requests", "2", "--cost-model",
            "profiled", "--profile", profile, "--json"]  # fmt: skip
    one_line_error(capsys, main(base), "fitted on model 'tiny-gqa', not 'Llama-3.1-8B'", "--force-profile")
    assert main([*base, "--force-profile"]) == 0
    capsys.readouterr()


def test_profile_with_a_datasheet_accelerator_is_refused_unless_forced(capsys):
    profile = "data/profiles/tiny-gqa-intel-r-xeon-r-processor.json"
    base = ["simulate", "--model", "tiny-gqa", "--trace", "poisson:1", "--num-requests", "2", "--cost-model",
            "profiled", "--profile", profile, "--prompt-lens", "uniform:16:128", "--json"]  # fmt: skip
    assert main(base) == 0  # the profile's own machine, with the pool its engine had
    assert json.loads(capsys.readouterr().out)["hardware"].startswith("profile: ")
    one_line_error(capsys, main([*base, "--hardware", "h100-sxm"]), "not on h100-sxm", "--force-profile")
    assert main([*base, "--hardware", "h100-sxm", "--force-profile"]) == 0
    capsys.readouterr()


def test_simulate_pool_of_an_80_gb_accelerator_is_tracked_at_what_the_batch_can_fill(capsys):
    rc = main(["simulate", "--model", "tiny-gqa", "--hardware", "h100-sxm", "--trace", "poisson:1",
               "--num-requests", "2", "--prompt-lens", "fixed:40", "--output-lens", "fixed:9", "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    # at most 256 sequences (max_num_seqs) of max_model_len 256 tokens hold 16-token blocks, 16 + 1 each; over the
    # 1% watermark: ceil(256 * 17 / 0.99) + 1 (bounded by the batch, not by the trace, which is read as it runs)
    assert out["replicas"][0]["num_blocks"] == 4397
    # the pool the accelerator holds is still the one reported: (80 GB x 0.9 - weights) / block bytes
    assert out["engine"]["num_blocks"] > 10**6


@pytest.mark.parametrize(
    "stamp, message",
    [("2023-11-16 25:00:00.0", "time of day"), ("2023-11-16 18:60:00.0", "time of day"),
     ("2023-11-16 18:00:61.0", "time of day"), ("2023-13-16 18:00:00.0", "month must be in 1..12")],
)  # fmt: skip
def test_azure_timestamp_out_of_range_is_refused(tmp_path, stamp, message):
    from workbench.errors import TraceError
    from workbench.workloads import load_azure_csv

    trace = write_trace(tmp_path / "h.csv", [("2023-11-16 18:00:00.0", 8, 2), (stamp, 8, 2)])
    with pytest.raises(TraceError, match=f"h.csv:3: bad TIMESTAMP .*{message}"):
        load_azure_csv(trace)


def test_unsorted_mooncake_trace_is_refused_naming_the_line(tmp_path):
    from workbench.errors import TraceError
    from workbench.workloads import load_workload

    rows = [{"timestamp": t, "input_length": 8, "output_length": 2} for t in (0, 500, 499)]
    trace = tmp_path / "m.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(TraceError, match=r"m.jsonl:3: timestamp is 0.001 s earlier than line 2's"):
        load_workload(str(trace))


def test_output_into_a_closed_pipe_stops_quietly():
    # `workbench roofline --json | head -c 10`: the reader is gone before the command writes; no traceback
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "roofline", "--model", "tiny-gqa", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    proc.stdout.close()  # long before the child has imported its modules and written anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and "Broken pipe" not in err, err
