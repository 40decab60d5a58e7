"""One vocabulary for the user (issue 34): every command's options of the shared serving fields come from the one
``ServingConfig`` (vLLM's names, one default per config), old spellings warn, defaults show in every --help, the
README's commands (and those of reports/PERFORMANCE.md) parse with today's names, and the usual mistakes get a
one-line error naming the fix.

Parse-only where possible: nothing here loads a model."""

from __future__ import annotations

import argparse
import re
import shlex
import socket
from dataclasses import fields, replace
from pathlib import Path

import pytest

from tests.conftest import one_line_error
from workbench import cli
from workbench.commands.generate import engine_config_from_args
from workbench.config import ModelConfig
from workbench.engine.config import EngineConfig, ServingConfig
from workbench.sim.cluster import SimConfig

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PERFORMANCE = ROOT / "reports" / "PERFORMANCE.md"  # the measured figures, each with the command that measured it
ENGINE_COMMANDS = ("generate", "serve", "replay", "bench", "checkpoint", "fit-profile", "profile-ops", "fidelity")
SIM_COMMANDS = ("simulate", "roofline", "plan")  # the simulator's (a GPU server's) defaults
# the profiles' commands measure (and fidelity compares) the engine at the settings of the committed profiles
# (16 sequences, 256 tokens): the same names, those defaults, the same in the three
OWN_DEFAULTS = {"fidelity", "fit-profile", "profile-ops"}
SHARED = {f.name: f for f in fields(ServingConfig) if f.metadata}


def command_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """(name, parser) of every command, and of each ``bench`` mode as 'bench MODE'."""
    out = []
    for name in sorted(cli.COMMANDS):
        parser = cli.build_parser(name)
        sub = parser._subparsers._group_actions[0].choices[name]
        if sub._subparsers is not None:
            modes = sub._subparsers._group_actions[0].choices
            out += [(f"{name} {mode}", p) for mode, p in modes.items() if p.prog.endswith(mode)]
        else:
            out.append((name, sub))
    return out


PARSERS = command_parsers()


def test_every_command_and_bench_mode_is_walked() -> None:
    names = [n for n, _ in PARSERS]
    assert {"bench decode", "bench prefill", "bench offline", "bench hf", "bench serve"} <= set(names)
    assert set(cli.COMMANDS) - {"bench"} <= set(names)


@pytest.mark.parametrize("name, parser", PARSERS, ids=[n for n, _ in PARSERS])
def test_every_option_help_shows_its_default(name: str, parser: argparse.ArgumentParser) -> None:
    formatter = parser.formatter_class(prog=name)
    for action in parser._actions:
        flags = action.option_strings
        if not flags or action.required or action.default is argparse.SUPPRESS:
            continue  # positionals, required options, --help
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            continue  # a switch: off unless given
        text = formatter._get_help_string(action) or ""
        assert "default" in text.lower(), f"{name} {flags[0]}: help {text!r} does not show its default"


@pytest.mark.parametrize("name, parser", PARSERS, ids=[n for n, _ in PARSERS])
def test_shared_fields_have_one_name_and_the_configs_default(name: str, parser: argparse.ArgumentParser) -> None:
    command = name.split()[0]
    config = EngineConfig if command in ENGINE_COMMANDS else SimConfig
    defaults = {f.name: f.default for f in fields(config)}
    for action in parser._actions:
        field = SHARED.get(action.dest)
        if field is None or not action.option_strings:
            continue
        assert action.option_strings[0] == field.metadata["flag"], (name, action.option_strings)
        assert set(action.option_strings[1:]) <= set(field.metadata["aliases"]), (name, action.option_strings)
        if command in OWN_DEFAULTS:
            continue
        want = defaults[action.dest]
        want = "none" if action.dest == "quantization" and want is None else want
        got = action.default[0] if action.nargs == "+" else action.default
        assert got == want, f"{name} {action.option_strings[0]}: default {got!r}, {config.__name__} says {want!r}"
    if command in ENGINE_COMMANDS + SIM_COMMANDS:  # the flags of one field: none spelled another way
        for flag, action in parser._option_string_actions.items():
            if action.dest in SHARED and flag.startswith("--"):
                assert flag == SHARED[action.dest].metadata["flag"] or flag in SHARED[action.dest].metadata["aliases"]


def test_the_profile_commands_agree_with_each_other() -> None:
    seen = {}
    for name, parser in PARSERS:
        if name in OWN_DEFAULTS:
            seen[name] = {a.dest: a.default for a in parser._actions if a.dest in ("max_num_seqs", "max_model_len")}
    assert list(seen.values()) == [{"max_num_seqs": 16, "max_model_len": 256}] * 3, seen


def test_the_shared_fields_are_declared_once() -> None:
    # EngineConfig and SimConfig inherit them; each redeclares only the two defaults that differ, with its reason
    for config in (EngineConfig, SimConfig):
        redeclared = set(config.__dict__.get("__annotations__", {})) & set(SHARED)
        assert redeclared <= {"max_num_seqs", "dtype"}, (config.__name__, redeclared)
    engine = {f.name: f.default for f in fields(EngineConfig)}
    sim = {f.name: f.default for f in fields(SimConfig)}
    differ = {n for n in SHARED if engine[n] != sim[n]}
    assert differ == {"max_num_seqs", "dtype"}
    assert (engine["max_num_seqs"], sim["max_num_seqs"]) == (32, 256)  # the CPU engine's, vLLM's on a GPU


def test_the_kv_dtype_is_resolved_once_the_same_way() -> None:
    assert EngineConfig(dtype="bf16").kv_cache_dtype == "bf16" == SimConfig().kv_cache_dtype
    assert EngineConfig().kv_cache_dtype == "fp32" == SimConfig(dtype="fp32").kv_cache_dtype
    assert (
        EngineConfig(kv_cache_dtype="INT8").kv_cache_dtype == "int8" == SimConfig(kv_cache_dtype="int8").kv_cache_dtype
    )
    assert replace(EngineConfig(), max_num_seqs=4).kv_cache_dtype == "fp32"  # a resolved config copies
    assert EngineConfig(token_budget=64).max_num_batched_tokens == 64  # vLLM's name reads the same field


def parse(argv: list[str]) -> argparse.Namespace:
    return cli.build_parser(argv[0]).parse_args(argv)


VLLM_FLAGS = ["--enable-prefix-caching", "--max-num-batched-tokens", "64", "--max-num-seqs", "3", "--max-model-len",
              "128", "--kv-cache-dtype", "int8", "--quantization", "int8", "--tensor-parallel-size", "1"]  # fmt: skip
OLD_FLAGS = ["--prefix-caching", "--token-budget", "64", "--max-num-seqs", "3", "--max-model-len", "128",
             "--kv-dtype", "int8", "--quantization", "int8", "--tensor-parallel-size", "1"]  # fmt: skip


@pytest.mark.parametrize("command", ["generate", "serve", "replay"])
def test_vllm_named_flags_work_and_old_names_warn(command: str, capsys) -> None:
    extra = ["--trace", "poisson:1"] if command == "replay" else []
    new = parse([command, "--model", "tiny-gqa", *extra, *VLLM_FLAGS])
    assert capsys.readouterr().err == ""
    config = engine_config_from_args(new)
    assert (config.enable_prefix_caching, config.token_budget, config.max_num_seqs, config.max_model_len) == (
        True,
        64,
        3,
        128,
    )
    assert (config.kv_cache_dtype, config.quantization, config.tensor_parallel_size) == ("int8", "int8", 1)
    old = parse([command, "--model", "tiny-gqa", *extra, *OLD_FLAGS])
    err = capsys.readouterr().err.splitlines()
    assert engine_config_from_args(old) == config
    assert err == [
        "warning: --prefix-caching is deprecated and will be removed; use --enable-prefix-caching",
        "warning: --token-budget is deprecated and will be removed; use --max-num-batched-tokens",
        "warning: --kv-dtype is deprecated and will be removed; use --kv-cache-dtype",
    ]


def test_bench_offline_takes_vllm_bench_throughputs_names(capsys) -> None:
    new = parse(["bench", "throughput", "--model", "tiny-gqa", "--enable-prefix-caching", "--max-num-batched-tokens",
                 "512", "--max-num-seqs", "3", "--quantization", "int8", "--seed", "1"])  # fmt: skip
    assert (new.enable_prefix_caching, new.token_budget, new.max_num_seqs, new.quantization, new.seed) == (
        True,
        512,
        3,
        ["int8"],
        1,
    )
    assert capsys.readouterr().err == ""
    old = parse(["bench", "offline", "--prefix-caching", "--token-budget", "512"])
    assert (old.enable_prefix_caching, old.token_budget) == (True, 512)
    assert capsys.readouterr().err.count("is deprecated") == 2


def test_simulate_takes_the_same_flags_and_seed_means_sampling(capsys) -> None:
    args = parse(["simulate", "--model", "tiny-gqa", "--trace", "poisson:1", *VLLM_FLAGS, "--link-latency-s", "0.002"])
    assert (args.token_budget, args.enable_prefix_caching, args.max_num_seqs, args.link_latency_s) == (
        64,
        True,
        3,
        0.002,
    )
    gen = parse(["generate", "--model", "tiny-gqa", "--seed", "5", "--model-seed", "2"])
    assert (gen.seed, gen.model_seed) == (5, 2)  # --seed: sampling; --model-seed: the random weights
    ckpt = parse(["checkpoint", "--model", "tiny-gqa", "--out", "/tmp/x", "--model-seed", "4"])
    assert (ckpt.preset, ckpt.seed) == ("tiny-gqa", 4) and capsys.readouterr().err == ""
    old = parse(["checkpoint", "--preset", "tiny-gqa", "--out", "/tmp/x", "--seed", "4"])
    assert (old.preset, old.seed) == ("tiny-gqa", 4)
    assert capsys.readouterr().err.count("deprecated") == 2


def test_policy_is_ours_not_vllms_scheduling_policy() -> None:
    # vLLM's --scheduling-policy (fcfs | priority) orders a queue; --policy picks the batching policy: the help says so
    help_text = cli.build_parser("generate")._subparsers._group_actions[0].choices["generate"].format_help()
    assert "--scheduling-policy" in help_text and "--policy" in help_text


def test_an_unknown_flag_names_the_nearest_in_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["simulate", "--model", "tiny-gqa", "--trace", "poisson:1", "--max-num-seq", "4"])
    one_line_error(capsys, exc.value.code, "unrecognized arguments: --max-num-seq 4", "did you mean --max-num-seqs?")
    with pytest.raises(SystemExit) as exc:  # before argparse asks for the --model it replaced
        cli.main(["generate", "--modle", "tiny-gqa"])
    one_line_error(capsys, exc.value.code, "--modle", "did you mean --model?")


def test_a_flag_of_another_bench_mode_is_an_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:  # used to run and ignore them
        cli.main(["bench", "decode", "--request-rate", "4", "--num-prompts", "5", "--goodput", "ttft:100"])
    one_line_error(capsys, exc.value.code, "--request-rate", "an option of bench serve, not of bench decode")
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "serve", "--batch", "64"])
    one_line_error(capsys, exc.value.code, "--batch is an option of bench decode")
    assert parse(["bench", "throughput", "--num-requests", "4"]).kind == "throughput"  # vLLM's name of offline


def test_a_missing_checkpoint_is_named_and_a_hub_id_is_its_preset(capsys, tmp_path) -> None:
    missing = tmp_path / "no-such-ckpt"
    rc = cli.main(["generate", "--model", str(missing), "--prompt-ids", "1,2"])
    one_line_error(capsys, rc, str(missing), "no such checkpoint directory")
    assert "unknown model preset" not in capsys.readouterr().err
    assert ModelConfig.resolve("meta-llama/Llama-3.1-8B") == ModelConfig.from_name("Llama-3.1-8B")
    assert ModelConfig.resolve("meta-llama/Meta-Llama-3.1-8B").name == "Llama-3.1-8B"
    rc = cli.main(["roofline", "--model", "meta-llama/Llama-3.1-8B", "--json"])
    assert rc == 0 and '"model": "Llama-3.1-8B"' in capsys.readouterr().out
    rc = cli.main(["roofline", "--model", "tiny-gqq"])
    one_line_error(capsys, rc, "unknown model preset 'tiny-gqq'", "did you mean tiny-gqa?")


def test_bench_serve_against_a_dead_server_names_the_connection_error(capsys) -> None:
    with socket.socket() as s:  # a port nothing listens on (bound, then closed)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = cli.main(["bench", "serve", "--port", str(port), "--num-prompts", "1"])
    one_line_error(capsys, rc, f"http://127.0.0.1:{port}", "ConnectionRefusedError", "workbench serve")


def test_a_long_real_time_replay_states_its_duration_and_asks_for_yes(capsys) -> None:
    rc = cli.main(["replay", "--model", "tiny-gqa", "--trace", "azure-conv"])  # 58 minutes of arrivals
    one_line_error(capsys, rc, "58 min", "pass --yes", "--time-scale")


def test_slo_units_are_named_and_an_implausible_one_warns(capsys) -> None:
    parse(["simulate", "--model", "tiny-gqa", "--trace", "poisson:1", "--slo-ttft", "500", "--slo-tpot", "0.05"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--slo-ttft 500 is 500 s, an implausible TTFT SLO" in err and "give 0.5" in err
    from workbench.commands.common import warn_implausible_slo

    warn_implausible_slo("--goodput ttft:0.5", "ttft", 0.5e-3, "ms")  # bench serve's --goodput is milliseconds
    assert "give 500 (milliseconds)" in capsys.readouterr().err
    for name, parser in PARSERS:
        for action in parser._actions:
            if "slo" in action.dest or action.dest == "goodput":
                assert re.search(r"seconds|milliseconds", action.help or ""), (name, action.dest)


# the commands that print no result of their own: a server (its HTTP responses are the results) and the report
# runner (it writes reports/<run-id>/ and prints where)
NO_RESULTS = {"serve", "report"}


def test_every_command_that_prints_results_takes_json() -> None:
    for name, parser in PARSERS:
        if name not in NO_RESULTS:
            assert "--json" in parser._option_string_actions, f"{name} prints results but takes no --json"


@pytest.mark.parametrize(
    "argv, message",
    [
        # 250 + (2 warm-up + 8 steps + 1) generated + 1 spare = 262 > tiny-gqa's 256; 256 - 12 = 244
        (["decode", "--prompt-len", "250"], "bench decode needs max_model_len 262 (--prompt-len 250 + 11 generated "
         "tokens: --warmup 2 + --steps 8 + 1, and 1 spare), but tiny-gqa has 256 positions"),
        (["decode", "--prompt-len", "16", "--steps", "300"], "lower --steps or --warmup"),  # 304 > 256 alone
        (["prefill"], "bench prefill needs max_model_len 513 (--prompt-len 512 + 1 generated token)"),  # the default
        (["offline", "--context", "300"], "the offline set needs max_model_len 300 (--context 300)"),
        (["hf", "--prompt-len", "200", "--new-tokens", "64", "--no-offline"], "needs max_model_len 264 (--prompt-len "
         "200 + --new-tokens 64)"),
    ],
    ids=["decode", "decode-steps", "prefill", "offline", "hf"],
)  # fmt: skip
def test_bench_lengths_beyond_the_model_are_refused_before_anything_loads(argv, message, capsys, monkeypatch) -> None:
    # each benchmark sizes the engine's max_model_len to its requests (as vLLM's bench latency needs max_model_len >=
    # input + output), so the model's positions are the limit: refused in one line before the ceilings are measured
    # or a weight loads (used to run the whole decode benchmark first)
    import workbench.bench
    import workbench.hardware

    def never(*_args, **_kwargs):
        raise AssertionError("loaded or measured before the lengths were checked")

    monkeypatch.setattr(workbench.hardware, "measured_spec", never)
    for name in ("load_bench_model", "bench_hf"):
        monkeypatch.setattr(workbench.bench, name, never)
    rc = cli.main(["bench", argv[0], "--model", "tiny-gqa", "--threads", "1", *argv[1:]])
    one_line_error(capsys, rc, message, "max_position_embeddings", "lower --")


def test_version(capsys) -> None:
    from workbench import __version__

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"workbench {__version__}"


def readme_commands(path: Path = README) -> list[list[str]]:
    """The argv of every ``.venv/bin/workbench`` command in the fenced blocks of ``path`` (the README by default;
    continuations joined)."""
    text = path.read_text()
    out = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if "bin/workbench" not in line:
                continue
            tokens = shlex.split(line, comments=True)
            for i, tok in enumerate(tokens):
                if tok.endswith("bin/workbench"):
                    argv = []
                    for t in tokens[i + 1 :]:
                        if t in ("|", "&&", ";", ">", "&", "||") or t.startswith((">", "2>")):
                            break
                        argv.append(t)
                    out.append(argv)
    return out


README_COMMANDS = readme_commands()
PERFORMANCE_COMMANDS = readme_commands(PERFORMANCE)
# the README's and the performance page's commands, each once (a command both show is run once)
DOC_COMMANDS = [list(a) for a in dict.fromkeys(tuple(a) for a in README_COMMANDS + PERFORMANCE_COMMANDS)]


@pytest.mark.parametrize("argv", DOC_COMMANDS, ids=[" ".join(a[:2]) for a in DOC_COMMANDS])
def test_readme_commands_parse_with_todays_names(argv: list[str], capsys) -> None:
    # parsed as written (tests/test_readme_commands.py runs them, some on smaller models and sizes)
    command = argv[0]
    assert command in cli.COMMANDS, argv
    parser = cli.build_parser(command)
    cli._check_flags(parser, argv, command)  # exits on an unknown flag
    parser.parse_args(argv)
    assert "deprecated" not in capsys.readouterr().err, argv


def test_readme_has_workbench_commands() -> None:
    # the README shows the commands of every part of the design; the performance page, the benchmarks behind its figures
    assert len(README_COMMANDS) >= 30 and any(a[0] == "simulate" for a in README_COMMANDS)
    assert len(PERFORMANCE_COMMANDS) >= 10 and any(a[:2] == ["bench", "hf"] for a in PERFORMANCE_COMMANDS)
    assert len(DOC_COMMANDS) >= 45


def test_serve_takes_vllms_seed_and_refuses_a_bad_one_before_loading(capsys) -> None:
    assert parse(["serve", "--model", "tiny-gqa", "--seed", "3"]).seed == 3
    assert parse(["serve", "--model", "tiny-gqa"]).seed is None
    rc = cli.main(["serve", "--model", "tiny-gqa", "--port", "0", "--seed", "-1"])
    one_line_error(capsys, rc, "seed must be in [0, 2**64)")
