"""The one way every workbench parser is built (the ``workbench`` command, ``python -m workbench.kernels.bench``, the
scripts): no abbreviations, and every option's default in its ``--help``. Plain argparse, at the bottom layer so
that any module with a command line can use it."""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import NoReturn


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default (unless its help already states one; 'none' for an option that is unset by
    default, nothing for a switch) and keeps the help's line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower() or any(action.default is v for v in (False, argparse.SUPPRESS)):
            return text
        if action.default is None and action.option_strings:
            return f"{text} (default: none)" if text else "(default: none)"
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``prog: error: message`` and nothing else (no usage block), the exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def nearest_options(typed: str, parser: argparse.ArgumentParser) -> list[str]:
    """The options of ``parser`` closest to ``typed`` (``difflib``), best first: the hint of a mistyped flag."""
    flag = typed.split("=", 1)[0]
    longer = sorted(o for o in parser._option_string_actions if o.startswith(flag + "-"))  # --rate: --rate-scale
    return longer[:1] or difflib.get_close_matches(flag, list(parser._option_string_actions), n=1, cutoff=0.6)


def unrecognized(parser: argparse.ArgumentParser, extras: list[str], hint: str = "") -> NoReturn:
    """Exit 2 with one line naming the unrecognized arguments ``extras`` and the nearest option of ``parser`` (or
    ``hint``, e.g. the command that owns the flag)."""
    flags = [a for a in extras if a.startswith("-")]
    if not hint and flags:
        near = nearest_options(flags[0], parser)
        hint = f"; did you mean {near[0]}?" if near else ""
    sys.stderr.write(f"{parser.prog}: error: unrecognized arguments: {' '.join(extras)}{hint}\n")
    sys.exit(2)


# the one set of options every workbench parser is built with: no abbreviations (argparse would otherwise take
# `--rate 4` for `--rate-scale 4`, silently), and defaults shown in every --help
PARSER_OPTIONS = {"allow_abbrev": False, "formatter_class": HelpFormatter}


def make_parser(**kwargs: object) -> argparse.ArgumentParser:
    """A ``Parser`` (one-line errors) with the workbench's options (``PARSER_OPTIONS``): use it for any parser."""
    return Parser(**{**PARSER_OPTIONS, **kwargs})  # type: ignore[arg-type]
