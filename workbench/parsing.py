"""The one way every workbench parser is built (the ``workbench`` command, ``python -m kernels.bench``, the
scripts): no abbreviations, and every option's default in its ``--help``. Plain argparse, at the bottom layer so
that any module with a command line can use it."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default (unless its help already states one) and keeps the help's line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


# the one set of options every workbench parser is built with: no abbreviations (argparse would otherwise take
# `--rate 4` for `--rate-scale 4`, silently), and defaults shown in every --help
PARSER_OPTIONS = {"allow_abbrev": False, "formatter_class": HelpFormatter}


def make_parser(**kwargs: object) -> argparse.ArgumentParser:
    """An ``argparse.ArgumentParser`` with the workbench's options (``PARSER_OPTIONS``): use it for any parser."""
    return argparse.ArgumentParser(**{**PARSER_OPTIONS, **kwargs})  # type: ignore[arg-type]
