"""Hostile files and empty traces (issue 35): a damaged tokenizer, an integer weight, an output that cannot be
written after its pre-check passed, an empty trace, Ray arguments that would hang; each one line on stderr, exit 2."""

import json
import shutil

import pytest

from tests.conftest import one_line_error
from workbench.cli import main


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("tiny-gqa")


@pytest.mark.parametrize("damage", ["truncated", "empty", "random"])
@pytest.mark.parametrize("prompt", [["--prompt", "Four score"], ["--prompt-ids", "1,2,3"]])
def test_a_damaged_tokenizer_is_a_checkpoint_error_naming_the_file(ckpt, tmp_path, capsys, damage, prompt):
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    tok = bad / "tokenizer.json"
    data = tok.read_bytes()
    tok.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "random": bytes(range(256)) * 8}[damage])
    rc = main(["generate", "--model", str(bad), "--max-new-tokens", "2", *prompt])
    one_line_error(capsys, rc, str(tok), "not a readable tokenizer file")


def test_serve_with_a_damaged_tokenizer_fails_at_start(ckpt, tmp_path, capsys):
    pytest.importorskip("aiohttp")
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    (bad / "tokenizer.json").write_bytes(b'{"version": ')
    rc = main(["serve", "--model", str(bad), "--port", "0"])
    one_line_error(capsys, rc, str(bad / "tokenizer.json"))


def test_an_integer_weight_is_refused_not_cast(ckpt, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    weights = bad / "model.safetensors"
    tensors = load_file(str(weights))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].round().to(dtype=__import__("torch").int32)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    rc = main(["generate", "--model", str(bad), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"])
    one_line_error(capsys, rc, name, "dtype I32", "floating point")


def test_checkpoint_out_that_cannot_be_written(tmp_path, capsys):
    out = tmp_path / "ckpt"
    (out / "config.json").mkdir(parents=True)  # a folder where the file goes: the folder check passes
    rc = main(["checkpoint", "--model", "tiny-gqa", "--out", str(out), "--no-tokenizer"])
    one_line_error(capsys, rc, f"--out {out}: cannot be written")


# lengths within tiny-gqa's 256 positions (a longer request is rejected, workbench.request.validate_request)
SIM = ["simulate", "--model", "tiny-gqa", "--trace", "poisson:50", "--num-requests", "4", "--num-blocks", "64",
       "--hardware", "a100-80gb", "--prompt-lens", "uniform:16:128", "--output-lens", "uniform:8:64",
       "--json"]  # fmt: skip


def test_simulate_prints_its_result_before_a_step_log_that_cannot_be_written(capsys):
    rc = main([*SIM, "--step-log", "/dev/full"])  # passes the check (as root), fails on write: the disk is full
    out = capsys.readouterr()
    assert rc == 2 and json.loads(out.out)["num_finished"] == 4
    assert "--step-log /dev/full: cannot be written" in out.err and "Traceback" not in out.err


def test_simulate_prints_its_result_before_a_plot_that_cannot_be_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rc = main([*SIM, "--plot", str(tmp_path / "fig.nosuchformat")])
    out = capsys.readouterr()
    assert rc == 2 and json.loads(out.out)["num_finished"] == 4
    assert "--plot" in out.err and "cannot be written" in out.err and "Traceback" not in out.err


def _empty_traces(tmp_path):
    csv = tmp_path / "h.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    jsonl = tmp_path / "e.jsonl"
    jsonl.write_text("")
    return [[str(csv)], [str(jsonl)], ["azure-conv", "--limit", "0"]]


@pytest.mark.parametrize("command", ["simulate", "replay", "plan"])
def test_an_empty_trace_is_an_error_not_zeros(tmp_path, capsys, command):
    extra = {
        "simulate": ["--num-blocks", "64"],
        "replay": ["--max-model-len", "32"],
        "plan": ["--hardware", "a100-80gb", "--num-gpus", "1", "--serial", "--slo-ttft", "1", "--slo-tpot", "0.1"],
    }[command]
    for trace in _empty_traces(tmp_path):
        rc = main([command, "--model", "tiny-gqa", "--trace", *trace, *extra])
        one_line_error(capsys, rc, "the trace has no requests")


def test_plan_refuses_ray_arguments_that_would_hang(capsys):
    base = [
        "plan",
        "--model",
        "tiny-gqa",
        "--hardware",
        "a100-80gb",
        "--trace",
        "poisson:5",
        "--num-requests",
        "4",
        "--num-gpus",
        "1",
        "--slo-ttft",
        "1",
        "--slo-tpot",
        "0.1",
    ]
    one_line_error(capsys, main([*base, "--num-cpus", "0"]), "--num-cpus must be >= 1")
    one_line_error(capsys, main([*base, "--ray-address", "127.0.0.1:1"]), "--ray-address 127.0.0.1:1")


def test_bench_decode_schemes_with_no_accuracy_prompts():
    """``bench decode --quantization none int8 --accuracy-prompts 0`` decodes both schemes and skips the accuracy
    check (it was a torch.cat error after the benchmark had run); a negative count is refused first."""
    from workbench.cli import build_parser
    from workbench.commands.bench import _check_schemes, _schemes, compare_schemes, format_table
    from workbench.errors import ConfigError

    argv = ["bench", "decode", "--model", "tiny-gqa", "--quantization", "none", "int8", "--accuracy-prompts", "0",
            "--batch", "1", "--steps", "2", "--warmup", "1", "--prompt-len", "8"]  # fmt: skip
    args = build_parser("bench").parse_args(argv)
    schemes = _schemes(args)
    _check_schemes(args, schemes)
    from workbench.hardware import get_hardware

    out = compare_schemes(args, schemes, get_hardware("a100-80gb"), "cpu", False)
    assert out["accuracy"] == [] and [r["scheme"] for r in out["results"]] == ["fp32", "int8"]
    table = format_table({"bench": "decode", "model": "tiny-gqa", "dtype": "fp32", "num_threads": 1, **out})
    assert "not measured (--accuracy-prompts 0)" in table
    args.accuracy_prompts = -1
    with pytest.raises(ConfigError, match="--accuracy-prompts must be >= 0"):
        _check_schemes(args, schemes)


def test_a_float_kv_cache_dtype_other_than_the_activations_names_both(capsys):
    from workbench.config import resolve_kv_cache_dtype

    assert resolve_kv_cache_dtype("fp16", "fp16") == "fp16"
    assert resolve_kv_cache_dtype("int8", "bf16") == "int8"
    rc = main(["generate", "--model", "tiny-gqa", "--dtype", "bf16", "--kv-cache-dtype", "fp16", "--prompt-ids", "1"])
    one_line_error(capsys, rc, "'fp16' differs from the activation dtype 'bf16'", "--dtype fp16", warnings_too=True)


@pytest.mark.parametrize(
    "argv, needles",
    [(["generate", "--prompt-ids", "1", "--disaggregate", "100:100"], ["starts 200 processes", "--max-processes"]),
     (["generate", "--prompt-ids", "1", "--disaggregate", "1:1", "--prefill-tp", "4"], ["starts 5 processes"]),
     (["generate", "--prompt-ids", "1", "--disaggregate", "1:1", "--prefill-tp", "0"], ["--prefill-tp must be >= 1"]),
     (["replay", "--trace", "poisson:5", "--disaggregate", "1:1", "--decode-tp", "3"], ["--decode-tp 3", "num_heads"]),
     (["bench", "decode", "--tensor-parallel-size", "64"], ["--tensor-parallel-size 64", "num_heads (4)"]),
     (["bench", "decode", "--tensor-parallel-size", "0"], ["--tensor-parallel-size must be >= 1"]),
     (["bench", "decode", "--tensor-parallel-size", "-1"], ["--tensor-parallel-size must be >= 1"]),
     (["bench", "decode", "--tensor-parallel-size", "3"], ["--tensor-parallel-size 3", "num_heads (4)"]),
     (["bench", "decode", "--tensor-parallel-size", "4", "--max-processes", "2"], ["starts 4 processes"])],
)  # fmt: skip
def test_parallel_layouts_are_checked_before_any_process_starts(capsys, argv, needles):
    import os

    if "starts 5 processes" in needles and (os.cpu_count() or 1) >= 5:
        pytest.skip("this case assumes fewer than 5 cores")
    rc = main([*argv, "--model", "tiny-gqa"])
    one_line_error(capsys, rc, *needles)


def test_ctrl_c_ends_a_command_with_one_line(monkeypatch, capsys):
    import workbench.commands.trace_stats as trace_stats

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(trace_stats, "run", interrupted)
    assert main(["trace-stats", "azure-conv"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "workbench trace-stats: interrupted" and "Traceback" not in err
