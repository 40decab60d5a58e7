"""The CPU runtime a process runs on: its memory allocator and OpenMP library, chosen by ``WORKBENCH_PRELOAD``.

vLLM's CPU launcher preloads tcmalloc and Intel's OpenMP runtime (``libiomp5``) before Python starts; the workbench
runs on glibc's malloc and GNU OpenMP (``libgomp``, what torch's wheels link) unless asked. ``WORKBENCH_PRELOAD``
names what to preload, comma-separated: ``jemalloc`` (the library the project's own ``ray`` dependency ships, or the
system's ``libjemalloc.so.2``), ``tcmalloc`` (the system's ``libtcmalloc_minimal.so.4`` / ``libtcmalloc.so.4``),
``iomp`` (``libiomp5.so`` of the ``intel-openmp`` wheel, ``pip install llm-workbench[cpu-runtime]``, which serves
torch's ``GOMP_*`` calls in place of ``libgomp``), or a library's path. A library must be loaded before the process
starts, so the ``workbench`` command re-executes itself once with ``LD_PRELOAD`` set (``reexec_with_preloads``); a
name whose library is not found is an error naming where it was looked for. ``runtime_state`` says what the running
process has mapped, which ``bench`` records in its JSON.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

from workbench.errors import ConfigError

PRELOAD_ENV = "WORKBENCH_PRELOAD"
_DONE_ENV = "WORKBENCH_PRELOADED"  # set in the re-executed process: never re-execute twice
SYSTEM_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib", "/lib/x86_64-linux-gnu")


def _candidates(name: str) -> list[Path]:
    """Where the library of ``name`` is looked for, in order."""
    site = Path(sysconfig.get_paths()["purelib"])
    prefixes = [Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib"]
    if name == "jemalloc":
        return [site / "ray" / "core" / "libjemalloc.so", *(Path(d) / "libjemalloc.so.2" for d in SYSTEM_LIB_DIRS)]
    if name == "tcmalloc":
        return [Path(d) / f for d in SYSTEM_LIB_DIRS for f in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")]
    if name == "iomp":
        return [p / "libiomp5.so" for p in prefixes] + [Path(d) / "libiomp5.so" for d in SYSTEM_LIB_DIRS]
    raise ConfigError(f"{PRELOAD_ENV}: unknown library {name!r}; expected jemalloc, tcmalloc or iomp")


def find_library(name: str) -> Path | None:
    """The first existing library of ``name`` ('jemalloc', 'tcmalloc', 'iomp'), or None."""
    return next((p for p in _candidates(name) if p.is_file()), None)


def preload_paths(spec: str) -> list[str]:
    """The libraries a ``WORKBENCH_PRELOAD`` value names (comma-separated names or paths; '' or 'none': none); one
    not found here is a ``ConfigError`` naming where it was looked for. At most one allocator by name."""
    names = [n.strip() if "/" in n else n.strip().lower() for n in spec.split(",")]
    names = [n for n in names if n and n != "none"]
    if sum(n in ("jemalloc", "tcmalloc") for n in names) > 1:
        raise ConfigError(f"{PRELOAD_ENV}={spec!r}: name one allocator (jemalloc or tcmalloc), not both")
    paths = []
    for name in names:
        if "/" in name:  # a path of its own
            if not Path(name).is_file():
                raise ConfigError(f"{PRELOAD_ENV}: no library at {name}")
            paths.append(name)
            continue
        found = find_library(name)
        if found is None:
            where = ", ".join(str(p) for p in _candidates(name))
            hint = " (pip install intel-openmp)" if name == "iomp" else ""
            raise ConfigError(f"{PRELOAD_ENV}: no {name} library on this machine{hint}; looked in {where}")
        paths.append(str(found))
    return paths


def reexec_with_preloads(argv: list[str]) -> None:
    """Re-execute this process (the ``workbench`` command with ``argv``) with the ``WORKBENCH_PRELOAD`` libraries in
    ``LD_PRELOAD``; returns without doing anything when the variable is unset or this process is the re-executed
    one."""
    spec = os.environ.get(PRELOAD_ENV, "")
    if not spec or os.environ.get(_DONE_ENV) or not sys.platform.startswith("linux"):
        return
    paths = preload_paths(spec)
    if not paths:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join([*paths, *filter(None, env.get("LD_PRELOAD", "").split(":"))])
    env[_DONE_ENV] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    code = "import sys; from workbench.cli import main; sys.exit(main())"
    os.execve(sys.executable, [sys.executable, "-c", code, *argv], env)


def runtime_state() -> dict[str, object]:
    """What this process runs on: the allocator and OpenMP libraries it has mapped (from ``/proc/self/maps``; glibc
    and GNU OpenMP when nothing else is), ``LD_PRELOAD`` and ``WORKBENCH_PRELOAD``."""
    mapped: set[str] = set()
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 6 and ".so" in parts[-1]:
                mapped.add(Path(parts[-1]).name)
    except OSError:
        pass

    def has(*stems: str) -> bool:
        return any(name.startswith(stem) for name in mapped for stem in stems)

    allocator = "jemalloc" if has("libjemalloc") else "tcmalloc" if has("libtcmalloc") else "glibc"
    openmp = [lib for lib, stems in (("iomp", ("libiomp5",)), ("gomp", ("libgomp",))) if has(*stems)]
    return {
        "allocator": allocator,
        "openmp": openmp,
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "workbench_preload": os.environ.get(PRELOAD_ENV, ""),
    }
