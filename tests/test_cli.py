"""The ``workbench`` command: checkpoint and generate, checked against transformers and for clear errors."""

import json
import subprocess
import sys

import pytest
import torch
import transformers

from workbench.cli import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench.cli", *args], capture_output=True, text=True, timeout=120)


def test_checkpoint_then_generate_json_matches_hf_greedy(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["checkpoint", "--model", "tiny-gqa", "--out", str(out), "--model-seed", "3"]) == 0
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    capsys.readouterr()
    rc = main(["generate", "--model", str(out), "--prompt-ids", "1,2,3,4", "--prompt-ids", "9,8",
               "--max-new-tokens", "6", "--ignore-eos", "--device", "cpu", "--json"])  # fmt: skip
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert [r["prompt_ids"] for r in data["requests"]] == [[1, 2, 3, 4], [9, 8]]
    for r in data["requests"]:
        p = r["prompt_ids"]
        expected = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)  # fmt: skip
        assert r["tokens"] == expected[0, len(p) :].tolist()
        assert r["ttft_s"] > 0 and len(r["itl_s"]) == 5 and all(x > 0 for x in r["itl_s"])


def test_generate_sampling_is_seeded(capsys):
    args = ["generate", "--model", "tiny-mha", "--prompt-ids", "5,6,7", "--max-new-tokens", "8", "--ignore-eos",
            "--temperature", "1.0", "--top-k", "50", "--top-p", "0.9", "--seed", "11", "--json"]  # fmt: skip
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)["requests"][0]["tokens"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["requests"][0]["tokens"] == first


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt-ids", "1,x"], "comma-separated integers"),
        (["--prompt-ids", ","], "empty"),
        (["--prompt-ids", "1", "--top-p", "0"], "top_p"),
        (["--prompt-ids", "1", "--dtype", "fp7"], "fp7"),
        (["--prompt-ids", "1", "--cache", "contiguous", "--enable-prefix-caching"], "enable_prefix_caching"),
    ],
)
def test_generate_errors_are_clear(args, message, capsys):
    assert main(["generate", "--model", "tiny-mha", "--max-new-tokens", "2", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("workbench generate: error:")


@pytest.mark.parametrize(
    "bad, message",
    [("1,999", "outside the vocabulary"), (",".join(["1"] * 300), "maximum context length is 256")],
)
def test_a_bad_request_is_rejected_and_the_others_are_served(bad, message, capsys):
    rc = main(["generate", "--model", "tiny-mha", "--max-new-tokens", "3", "--ignore-eos", "--json",
               "--prompt-ids", "5,6", "--prompt-ids", bad, "--prompt-ids", "7"])  # fmt: skip
    out = capsys.readouterr()
    assert rc == 1 and message in out.err
    reqs = json.loads(out.out)["requests"]
    assert [r["finish_reason"] for r in reqs] == ["length", "rejected", "length"]
    assert len(reqs[0]["tokens"]) == 3 and len(reqs[2]["tokens"]) == 3 and message in reqs[1]["reject_reason"]


def test_unknown_preset_lists_known_ones(capsys):
    assert main(["checkpoint", "--model", "gpt-5", "--out", "/tmp/never"]) == 2
    assert "tiny-gqa" in capsys.readouterr().err


def test_help_lists_commands():
    res = run_cli("--help")
    assert res.returncode == 0 and "generate" in res.stdout and "checkpoint" in res.stdout
