"""The command line's parsing and its honest outputs: no abbreviations, defaults in every --help, rejected requests
counted, goodput null without an SLO."""

from __future__ import annotations

import json

import pytest

from workbench import cli


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_parser_refuses_abbreviations_and_shows_defaults(command: str, capsys) -> None:
    parser = cli.build_parser(command)
    sub = parser._subparsers._group_actions[0].choices[command]  # the subcommand's own parser
    assert sub.allow_abbrev is False and parser.allow_abbrev is False
    assert issubclass(sub.formatter_class, cli.HelpFormatter)
    formatter = sub.formatter_class(prog=command)
    with_default = [a for a in sub._actions if a.default not in (None, False, "==SUPPRESS==") and a.help]
    for action in with_default:
        assert "default" in formatter._get_help_string(action).lower(), action.option_strings


def test_rate_is_not_taken_for_rate_scale(capsys) -> None:
    # `simulate --rate 4` used to mean --rate-scale 4 silently
    with pytest.raises(SystemExit) as exc:
        cli.main(["simulate", "--model", "Llama-3.1-8B", "--trace", "poisson:2", "--num-requests", "4", "--rate", "4"])
    assert exc.value.code == 2 and "unrecognized arguments: --rate 4" in capsys.readouterr().err


def test_simulate_says_its_max_model_len_and_has_no_goodput_without_slo(capsys) -> None:
    # fixed 240-token prompts and 8-token outputs fit max_model_len 256: none rejected (tests/test_request_ingest.py
    # has the rows that do not fit)
    argv = ["simulate", "--model", "Llama-3.1-8B", "--trace", "poisson:2", "--num-requests", "8",
            "--prompt-lens", "fixed:240", "--output-lens", "fixed:8", "--max-model-len", "256"]  # fmt: skip
    assert cli.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_rejected"] == 0 and out["first_rejected"] is None and out["max_model_len"] == 256
    assert out["metrics"]["goodput"] is None and out["metrics"]["slo_attainment"] is None
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "max_model_len 256, 0 request(s) rejected" in text and "n/a (no SLO given" in text
    assert "model Llama-3.1-8B" in text and "cost model roofline" in text and "output tok/s" in text
    assert cli.main([*argv, "--slo-ttft", "10", "--json"]) == 0
    m = json.loads(capsys.readouterr().out)["metrics"]
    assert m["slo_attainment"] == pytest.approx(100.0)  # a 10 s TTFT on an H100 for 8 short requests


def test_hardware_and_roofline_print_readable_units(capsys) -> None:
    assert cli.main(["roofline", "--model", "tiny-gqa", "--hardware", "h100-sxm"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "K params" in first and "0.00 B" not in first
    assert cli.main(["hardware"]) == 0
    assert "TFLOP/s" in capsys.readouterr().out


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_options_write_figures(tmp_path, capsys) -> None:
    roof, trace, sim = tmp_path / "roof.png", tmp_path / "trace.png", tmp_path / "sim.png"
    assert cli.main(["roofline", "--model", "tiny-gqa", "--hardware", "h100-sxm", "--plot", str(roof)]) == 0
    assert cli.main(["trace-stats", "azure-conv", "--limit", "50", "--plot", str(trace)]) == 0
    argv = ["simulate", "--model", "Llama-3.1-8B", "--trace", "poisson:4", "--num-requests", "20", "--plot", str(sim)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    for path in (roof, trace, sim, tmp_path / "sim-timeline.png"):
        assert path.read_bytes()[:8] == PNG_MAGIC and str(path) in out
