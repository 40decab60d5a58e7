"""Every README command runs as written (issue 34): each fenced ``.venv/bin/workbench ...`` command of the README and
of the performance page, reports/PERFORMANCE.md (``tests.test_cli_vocabulary.DOC_COMMANDS``: the commands behind its
figures), is run in this process, on tiny models where the documents' would take minutes, and must exit 0 with its
JSON (``--json``) parsing.

What is changed, and why, is the table below and nothing else: a new command in either document runs with these
substitutions without any edit here. What is not run is ``SKIPS``, each with its reason (pytest -rs shows them).
Each command runs under a time limit (``LIMIT_S``): a command that hangs fails, it does not stall CI."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.test_cli_vocabulary import DOC_COMMANDS
from workbench import cli

ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = 120  # per command, a bound for a loaded machine (each takes seconds at most)
ENGINE_COMMANDS = {"generate", "replay", "bench", "serve", "profile-ops", "fit-profile", "fidelity"}
SIM_COMMANDS = {"simulate", "plan"}

# ---- substitutions (the documents' sizes would take minutes; CI gives each worker one core) ------------------------
# engine commands: real-size presets -> tiny ones (random weights either way); SmolLM2-135M -> tiny-gqa's config with
# 2048 positions (LONG_TINY, a config.json the module writes), so that the Azure rows the README replays fit
LONG_TINY = "tiny-gqa-2048"
ENGINE_MODELS = {"bench-300m": "tiny-gqa", "SmolLM2-135M": LONG_TINY}
CHECKPOINT_DIRS = {"/tmp/tiny-gqa", "DIR", "DRAFT_DIR"}  # -> the session's tiny-gqa checkpoint
# flag -> values, replacing the README's where it gives the flag, added where the command has it and the README
# does not (a default of minutes: bench offline's 64 requests)
ENGINE_SIZES = {
    "--threads": ["1"],  # one core per CI worker
    "--limit": ["1"],  # replay in real time: one trace row
    "--num-requests": ["4"],
    "--num-prompts": ["2"],
    "--repeats": ["1"],
    "--warmup": ["0"],
    "--steps": ["2"],
    "--batch": ["1", "2"],
    "--prompt-len": ["16"],
    "--new-tokens": ["4"],
    "--accuracy-prompts": ["1"],
    "--group-size": ["32"],  # int4 groups that divide tiny-gqa's 64-wide rows (bench-300m's default is 128)
    "--profile-max-tokens": ["64"],  # bench op-steps: the op profile it measures first, up to 64 tokens, not 1024
    "--overhead-requests": ["6"],  # ... and the two workloads it then replays, 6 requests each, not 24
}
SIM_SIZES = {"--limit": ["20"], "--num-requests": ["20"]}  # a simulated trace: 20 rows, not 19,366
EXTRA = {  # command -> flags added when absent (and the command or bench mode has them)
    # the machine's ceilings measured once, not by every bench command; no torch.compile of each batch bucket (tens
    # of seconds a process; tests/test_bench.py and tests/test_decode_step.py compile)
    "bench": [
        "--cached-ceilings",
        "--no-compile-decode",
        "--no-compile-prefill",
        # quant-ops: int4 in groups of 128 does not divide tiny-gqa's 64-wide rows; compiled: its default
        # ragged steps (64, 320, 1024 tokens) exceed tiny-gqa's 256 positions
        "--schemes",
        "fp32",
        "int8",
        "--tokens",
        "16",
        # soak --server: a warm-up round and two RSS readings after it (the default ten need more than the 4 requests)
        "--rss-samples",
        "2",
    ],
    "hardware": ["--cached"],  # measured once per machine (~/.cache/llm-workbench), as tests/test_hardware.py does
    "plan": ["--serial"],  # one process, not a local Ray cluster (~10 s to start)
    "profile-ops": [
        "--tokens",
        "1",
        "4",
        "--rows",
        "1",
        "--prompt-lens",
        "4",
        "--contexts",
        "4",
        "--batch-sizes",
        "1",
        "--max-repeats",
        "3",
        "--passes",
        "1",
        "--no-overhead",
        "--no-progress",
    ],  # fmt: skip
}
OUTPUTS = {"--out", "--plot", "--step-log"}  # -> a file or folder of the same name under tmp_path

# ---- not run, with the reason --------------------------------------------------------------------------------
SKIPS: list[tuple[str, Callable[[list[str]], bool]]] = [
    ("starts a server that runs until it is killed; tests/test_serve.py runs one",
     lambda a: a[0] == "serve"),
    ("needs a running server (the README starts one with serve &); tests/test_serve_metrics.py runs it",
     lambda a: a[:2] == ["bench", "serve"]),
    ("joins a running Ray cluster (--ray-address auto)", lambda a: "--ray-address" in a),
    ("starts workbench serve and 64 streaming clients; tests/test_bench_tools.py runs a small serve-load",
     lambda a: a[:2] == ["bench", "serve-load"]),
    ("runs vLLM's CPU build from its own virtual environment, on a head size vLLM takes (not tiny-gqa's 16); "
     "tests/test_bench_tools.py runs its workbench half and its worker against a stand-in",
     lambda a: a[:2] == ["bench", "vllm"]),
    ("runs a notebook through papermill (a minute or more); tests/test_pipeline.py runs the pipeline",
     lambda a: a[0] == "report"),
    ("starts worker processes (10-20 s on 2 cores); tests/test_engine_tp.py and tests/test_disagg.py run these layouts",
     lambda a: a[0] in ENGINE_COMMANDS and ("--disaggregate" in a or "--tensor-parallel-size" in a)),
]  # fmt: skip


def skip_reason(argv: list[str]) -> str | None:
    return next((reason for reason, applies in SKIPS if applies(argv)), None)


def options_of(argv: list[str]) -> dict[str, argparse.Action]:
    """The options the command (or bench mode) of ``argv`` accepts: flag -> action."""
    parser = cli.build_parser(argv[0])
    sub = parser._subparsers._group_actions[0].choices[argv[0]]
    if sub._subparsers is not None:
        sub = sub._subparsers._group_actions[0].choices[argv[1]]
    return {flag: action for action in sub._actions for flag in action.option_strings}


def _set(argv: list[str], flag: str, values: list[str], options: dict[str, argparse.Action]) -> list[str]:
    """``argv`` with ``flag``'s values replaced by ``values`` (added when absent and the command has it)."""
    if flag not in argv:
        return [*argv, flag, *values] if flag in options else argv
    i = argv.index(flag) + 1
    j = i
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    return [*argv[:i], *values, *argv[j:]]


def substitute(argv: list[str], checkpoint: str, tmp_path: Path, long_tiny: str = LONG_TINY) -> list[str]:
    """The README's ``argv`` with this file's substitutions (``long_tiny``: the path of LONG_TINY's config.json)."""
    options = options_of(argv)
    command = argv[0]
    out = []
    for i, a in enumerate(argv):
        if i and argv[i - 1] in OUTPUTS:
            a = str(tmp_path / Path(a).name)
        for name in CHECKPOINT_DIRS:  # also inside JSON: --speculative-config '{"model": "DRAFT_DIR", ...}'
            a = a.replace(f'"{name}"', json.dumps(checkpoint))
        out.append(checkpoint if a in CHECKPOINT_DIRS else a)
    if "--out" in options and "--out" not in out:  # a default inside the repository (profile-ops: data/profiles/)
        out += ["--out", str(tmp_path / "out.json")]
    if command in ENGINE_COMMANDS:
        models = {name: long_tiny if to == LONG_TINY else to for name, to in ENGINE_MODELS.items()}
        out = [models.get(a, a) if i and out[i - 1] == "--model" else a for i, a in enumerate(out)]
        model = options.get("--model")
        if "--model" not in out and model is not None and model.default in models:
            out += ["--model", models[model.default]]
        for flag, values in ENGINE_SIZES.items():
            out = _set(out, flag, values, options)
    if command in SIM_COMMANDS:
        for flag, values in SIM_SIZES.items():
            out = _set(out, flag, values, options)
    extra = EXTRA.get(command, [])
    for i, flag in enumerate(extra):
        if flag.startswith("--") and flag in options and flag not in out:
            values = list(itertools.takewhile(lambda v: not v.startswith("--"), extra[i + 1 :]))
            out += [flag, *values]
    return out


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """A TimeoutError in this (the main) thread after ``seconds``."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"the command ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("tiny-gqa"))


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory) -> str:
    """LONG_TINY: tiny-gqa's config.json with 2048 positions."""
    config = json.loads((ROOT / "data" / "models" / "tiny-gqa.json").read_text())
    config["max_position_embeddings"] = 2048
    path = tmp_path_factory.mktemp(LONG_TINY) / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(autouse=True)
def _keep_threads_and_cwd(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import torch

    monkeypatch.chdir(ROOT)  # the README's relative paths (data/profiles/...) are the repository's
    monkeypatch.setenv("MPLBACKEND", "agg")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_substitutions_are_what_the_table_says(tmp_path) -> None:
    argv = ["bench", "decode", "--threads", "2", "--batch", "1", "32", "--quantization", "none", "int8"]
    assert substitute(argv, "CKPT", tmp_path) == [
        "bench", "decode", "--threads", "1", "--batch", "1", "2", "--quantization", "none", "int8",
        "--model", "tiny-gqa", "--warmup", "0", "--steps", "2", "--prompt-len", "16", "--accuracy-prompts", "1",
        "--group-size", "32", "--cached-ceilings", "--no-compile-decode",
    ]  # fmt: skip
    argv = ["simulate", "--model", "Llama-3.1-8B", "--trace", "azure-conv", "--plot", "sim.png"]
    assert substitute(argv, "CKPT", tmp_path) == [
        "simulate", "--model", "Llama-3.1-8B", "--trace", "azure-conv", "--plot", str(tmp_path / "sim.png"),
        "--limit", "20", "--num-requests", "20",
    ]  # fmt: skip
    assert substitute(["generate", "--model", "DIR", "--prompt-ids", "1"], "CKPT", tmp_path)[:3] == [
        "generate", "--model", "CKPT"
    ]  # fmt: skip
    assert skip_reason(["serve", "--model", "x"]) and not skip_reason(["simulate", "--disaggregate", "1:1"])


@pytest.mark.parametrize("argv", DOC_COMMANDS, ids=[f"{i}-{' '.join(a[:2])}" for i, a in enumerate(DOC_COMMANDS)])
def test_readme_command_runs(argv: list[str], checkpoint: str, long_tiny: str, tmp_path: Path, capsys) -> None:
    reason = skip_reason(argv)
    if reason:
        pytest.skip(reason)
    run = substitute(argv, checkpoint, tmp_path, long_tiny)
    with time_limit(LIMIT_S):
        rc = cli.main(run)
    out = capsys.readouterr()
    assert rc == 0, f"{' '.join(run)}: exit {rc}\n{out.err[-3000:]}"
    if "--json" in run:
        json.loads(out.out)  # one JSON object, nothing else on stdout
    else:
        assert out.out.strip(), run


def test_most_readme_commands_run() -> None:
    # the skips stay the exceptions: a skip rule that grew to swallow the README or PERFORMANCE.md would fail here
    skipped = [a for a in DOC_COMMANDS if skip_reason(a)]
    assert len(skipped) <= len(DOC_COMMANDS) // 4, skipped
