"""Issue 35, cases 12 and 16: the multi-process commands under a bad checkpoint and under Ctrl-C.

- A damaged checkpoint under tensor parallelism or disaggregation is refused by the driver before any rank starts
  (one line; no process spawned); a fault only a rank can find (a NaN weight, read with its shard) is still one line,
  the rank's traceback kept for the driver's error, not printed.
- Ctrl-C on ``replay`` (colocated, TP 2, disaggregated 1:1) ends with the finished requests' results on stdout,
  one line on stderr, exit code 130 and no process of the run left. The run's stderr is a terminal (a pty), so
  its progress bar says when the first requests have finished; SIGINT then goes to the whole process group, as the
  terminal's Ctrl-C does. Every wait is bounded.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import one_line_error
from workbench.cli import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def ckpt(tiny_checkpoint, tmp_path):
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("tiny-gqa"), out)
    return out


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test if any rank process is started."""
    from workbench.dist import group

    def refuse(*args, **kwargs):
        raise AssertionError("a rank was spawned before the checkpoint was checked")

    monkeypatch.setattr(group.ProcessSet, "__init__", refuse)


def _rewrite(ckpt: Path, name: str, value: torch.Tensor) -> None:
    file = ckpt / "model.safetensors"
    tensors = load_file(str(file))
    tensors[name] = value
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize("layout", [["--tensor-parallel-size", "2"], ["--disaggregate", "1:1"]])
def test_a_cut_checkpoint_is_refused_before_any_rank_starts(ckpt, layout, no_spawn, capsys):
    file = ckpt / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    one_line_error(capsys, main(["generate", "--model", str(ckpt), "--prompt-ids", "1,2", *layout]), str(file))


@pytest.mark.parametrize(
    "name, value, needle",
    [
        ("model.layers.0.mlp.down_proj.weight", torch.zeros(3, 5), "has shape (3, 5)"),
        ("model.norm.weight", torch.ones(64, dtype=torch.int32), "dtype I32"),
    ],
)
def test_a_wrong_shape_or_dtype_is_refused_before_any_rank_starts(ckpt, name, value, needle, no_spawn, capsys):
    _rewrite(ckpt, name, value)
    args = ["generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--disaggregate", "1:1"]
    one_line_error(capsys, main(args), name, needle)


def test_a_fault_found_by_a_rank_is_one_line_not_its_traceback(ckpt, capfd):
    # a NaN passes the driver's check (it reads no weight): rank 1 finds it in its shard and fails, quietly
    weight = load_file(str(ckpt / "model.safetensors"))["model.layers.0.self_attn.o_proj.weight"]
    weight[:, -1] = float("nan")  # the last input column: rank 1's half of o_proj's inputs
    _rewrite(ckpt, "model.layers.0.self_attn.o_proj.weight", weight)
    rc = main(["generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--tensor-parallel-size", "2"])
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and "Traceback" not in err and len(lines) == 1, err
    assert "rank 1" in lines[0] and "NaN" in lines[0]


# ---- Ctrl-C on replay ---------------------------------------------------------------------------------------------
def _group_members(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry))
    return pids


@pytest.mark.parametrize(
    "layout", [[], ["--tensor-parallel-size", "2"], ["--disaggregate", "1:1"]], ids=["colocated", "tp2", "disagg"]
)
def test_ctrl_c_on_replay_prints_the_finished_requests_and_leaves_nothing(tmp_path, layout):
    # requests at 0 s and 1 s (a second apart, so the bar, which redraws at most every 0.1 s, shows the second
    # finish) and one at +600 s: the run is waiting for the third when it is interrupted
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,8,2\n2023-11-16 18:00:01.0,6,3\n"
                     "2023-11-16 18:10:00.0,5,2\n")  # fmt: skip
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a bar needs a width
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "workbench.cli", "replay", "--model", "tiny-gqa", "--trace", str(trace), "--json",
           *layout]  # fmt: skip
    # a terminal's foreground job takes SIGINT by default; a suite started in the background (`cmd &` in a script,
    # nohup) hands SIGINT down ignored, and Python then never raises KeyboardInterrupt: restore the default
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=env, cwd=ROOT,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    os.close(slave)
    err = b""
    try:
        deadline = time.monotonic() + 180
        while b"2/3" not in err:  # the progress bar: both early requests have finished
            assert time.monotonic() < deadline and proc.poll() is None, err.decode(errors="replace")
            if select.select([master], [], [], 1.0)[0]:
                err += os.read(master, 65536)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal's Ctrl-C does: the whole foreground group
        out, _ = proc.communicate(timeout=60)
        while select.select([master], [], [], 0.5)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal's other side is closed: everything was read
                break
            if not chunk:
                break
            err += chunk
    finally:
        os.close(master)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    text = err.decode(errors="replace").replace("\r", "\n")
    lines = [line for line in text.splitlines() if line.strip() and "replay" in line and "%|" not in line]
    assert proc.returncode == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert lines[-1].strip() == "workbench replay: interrupted", text
    summary = json.loads(out)
    assert summary["interrupted"] is True and summary["num_requests"] == 3
    assert summary["num_finished"] == 2 and summary["finished_request_ids"] == [0, 1]
    assert summary["metrics"]["ttft_s"]["mean"] > 0
    deadline = time.monotonic() + 20  # the ranks were stopped by the driver before it exited; give the kernel a moment
    while _group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _group_members(proc.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the run left behind: {left}"
