"""The ``workbench`` command.

Each subcommand lives in its own module, which defines ``add_arguments(parser)`` and ``run(args) -> int``.
Only the chosen subcommand's module is imported, so ``workbench roofline`` starts without importing torch.
To add a subcommand, add one line to ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from workbench.errors import WorkbenchError
from workbench.parsing import PARSER_OPTIONS, HelpFormatter, make_parser  # noqa: F401  (re-exported)

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "checkpoint": ("workbench.commands.checkpoint", "write a randomly initialised HF checkpoint of a preset"),
    "generate": ("workbench.commands.generate", "generate tokens for prompts of token ids"),
    "replay": ("workbench.commands.replay", "serve a workload trace on the real engine in real time"),
    "trace-stats": ("workbench.commands.trace_stats", "size, rate, lengths and prefix sharing of a trace"),
    "simulate": ("workbench.commands.simulate", "simulate serving a trace on replicas with the engine's scheduler"),
    "fit-profile": ("workbench.commands.fit_profile", "measure the engine's step times here and fit a cost profile"),
    "profile-ops": ("workbench.commands.profile_ops", "time every operation of a model here into an op profile"),
    "roofline": ("workbench.commands.roofline", "per-operation roofline of prefill and decode on a hardware"),
    "fidelity": ("workbench.commands.fidelity", "the simulator against the real engine here, per policy, with spreads"),
    "plan": ("workbench.commands.plan", "search deployments (replicas, TP, PP, P:D, policy) for goodput per GPU"),
    "hardware": ("workbench.commands.hardware", "accelerator table and this machine's measured ceilings"),
    "bench": ("workbench.commands.bench", "benchmark decode, prefill, an offline set and HF transformers"),
    "serve": ("workbench.commands.serve", "serve a model over an OpenAI-compatible HTTP API"),
    "report": ("workbench.commands.report", "run the experiment notebooks into a report (reports/<run-id>/)"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``workbench`` parser; only ``command``'s options are added (its module is imported)."""
    from workbench import __version__

    parser = make_parser(
        prog="workbench",
        description="LLM inference workbench: prefill and decode, measured and modelled.",
    )
    parser.add_argument("--version", action="version", version=f"workbench {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, **PARSER_OPTIONS)  # type: ignore[arg-type]
        if name == command:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if os.environ.get("WORKBENCH_PRELOAD"):  # allocator / OpenMP libraries: a re-execution with LD_PRELOAD
        from workbench.runtime import reexec_with_preloads

        try:
            reexec_with_preloads(argv)
        except WorkbenchError as exc:
            print(f"workbench: error: {exc}", file=sys.stderr)
            return 2
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    _check_flags(parser, argv, command)  # a mistyped flag first, before argparse asks for the one it replaced
    args, extras = parser.parse_known_args(argv)
    if extras:
        _unrecognized(parser, args, extras)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        code = int(module.run(args) or 0)
    except WorkbenchError as exc:
        print(f"workbench {args.command}: error: {exc}", file=sys.stderr)
        code = 2
    except BrokenPipeError:  # stdout closed by its reader (``| head``): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes it
        code = 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it
    except KeyboardInterrupt as exc:  # Ctrl-C (or a SIGTERM a command turned into one): one line, not a traceback
        how = f" ({exc})" if str(exc) else ""
        print(f"workbench {args.command}: interrupted{how}", file=sys.stderr)
        code = 130
    from workbench.dist.group import launched_by_torchrun

    if launched_by_torchrun():  # a rank torchrun started: its process group is gone by now
        _exit_now(code)
    return code


def _check_flags(parser: argparse.ArgumentParser, argv: list[str], command: str | None) -> None:
    """Every ``--flag`` of ``argv`` exists in the command (or bench mode) it was given to, else one line naming it
    and its nearest option (``_unrecognized``)."""
    if command not in COMMANDS:
        return
    sub = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    rest = argv[argv.index(command) + 1 :]
    kind = None
    if sub._subparsers is not None:  # bench MODE
        kind = next((a for a in rest if not a.startswith("-")), None)
        modes = sub._subparsers._group_actions[0].choices
        if kind not in modes:
            return  # argparse names the missing or unknown mode
        sub = modes[kind]
    known = set(sub._option_string_actions)
    for i, arg in enumerate(rest):
        if arg.startswith("--") and arg.split("=", 1)[0] not in known:
            value = rest[i + 1 : i + 2] if "=" not in arg and rest[i + 1 : i + 2] != [] else []
            extras = [arg] + [v for v in value if not v.startswith("-")]
            _unrecognized(parser, argparse.Namespace(command=command, kind=kind), extras)


def _unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> None:
    """One line and exit 2: the unrecognized arguments, with the nearest option of the command (``difflib``) or,
    for ``bench``, the mode that owns the flag."""
    from workbench.parsing import unrecognized

    if args.command is None:
        unrecognized(parser, extras)
    sub = parser._subparsers._group_actions[0].choices[args.command]  # type: ignore[union-attr]
    hint = ""
    if args.command == "bench" and getattr(args, "kind", None):
        from workbench.commands.bench import ALIASES, mode_of_option

        sub = sub._subparsers._group_actions[0].choices[args.kind]  # type: ignore[union-attr]
        owners = mode_of_option(extras[0].split("=", 1)[0]) if extras[0].startswith("-") else []
        if owners:
            kind = ALIASES.get(args.kind, args.kind)
            hint = f"; {extras[0].split('=', 1)[0]} is an option of bench {' and '.join(owners)}, not of bench {kind}"
    unrecognized(sub, extras, hint)


def _exit_now(code: int) -> None:
    """Flush and leave without C++ static destructors: a torchrun rank whose process group is already destroyed
    can still abort in them ("terminate called without an active exception", seen under load on 2 cores)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
