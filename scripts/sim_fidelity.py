"""Simulator fidelity on this machine: a thin caller of ``workbench fidelity`` (``workbench.commands.fidelity``),
kept for the commands the README records; the same flags.

    .venv/bin/python scripts/sim_fidelity.py [--model tiny-gqa] [--measure-profiles] [...]
"""

from __future__ import annotations

import sys

from workbench.cli import main

if __name__ == "__main__":
    sys.exit(main(["fidelity", *sys.argv[1:]]))
