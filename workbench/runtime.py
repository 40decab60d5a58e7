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

``retain_freed_memory`` tunes glibc's malloc (the default allocator) so that an engine's activations are reused
rather than handed back to the kernel after every step; the engine's CPU model runner calls it.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path

from workbench.errors import ConfigError

PRELOAD_ENV = "WORKBENCH_PRELOAD"
MALLOC_ENV = "WORKBENCH_MALLOC"  # 'default': leave glibc's malloc as it is (A/B of retain_freed_memory)
PRELOADED_ENV = "WORKBENCH_PRELOADED"  # set in the re-executed process: never re-execute twice
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


def own_ld_preload(env: Mapping[str, str]) -> list[str]:
    """The entries of ``env``'s ``LD_PRELOAD`` other than those the ``WORKBENCH_PRELOAD`` re-execution put there:
    what was set before the ``workbench`` command started (all of it in a process not re-executed)."""
    entries = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if env.get(PRELOADED_ENV) and env.get(PRELOAD_ENV):
        added = set(preload_paths(env[PRELOAD_ENV]))
        entries = [p for p in entries if p not in added]
    return entries


def reexec_with_preloads(argv: list[str]) -> None:
    """Re-execute this process (the ``workbench`` command with ``argv``) with the ``WORKBENCH_PRELOAD`` libraries in
    ``LD_PRELOAD``; returns without doing anything when the variable is unset or this process is the re-executed
    one."""
    spec = os.environ.get(PRELOAD_ENV, "")
    if not spec or os.environ.get(PRELOADED_ENV) or not sys.platform.startswith("linux"):
        return
    paths = preload_paths(spec)
    if not paths:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join([*paths, *own_ld_preload(env)])
    env[PRELOADED_ENV] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    code = "import sys; from workbench.cli import main; sys.exit(main())"
    os.execve(sys.executable, [sys.executable, "-c", code, *argv], env)


# glibc's mallopt parameters (malloc.h) and the values retain_freed_memory sets
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
RETAIN_MMAP_THRESHOLD = 256 << 20  # bytes: blocks up to this size come from the heap, not a fresh mmap
RETAIN_TRIM_THRESHOLD = 1 << 30  # bytes: free memory at the heap's top kept before any is handed back
_GLIBC_MMAP_THRESHOLD_MAX = 32 << 20  # the most some glibc releases accept (their largest dynamic threshold, 64-bit)
_malloc_settings: dict[str, int] | None = None


def _malloc_mode() -> str:
    """``WORKBENCH_MALLOC``: 'retain' (unset too) or 'default'; any other value is a ``ConfigError``."""
    mode = os.environ.get(MALLOC_ENV, "").strip().lower() or "retain"
    if mode not in ("retain", "default"):
        raise ConfigError(f"{MALLOC_ENV}={os.environ[MALLOC_ENV]!r}: expected 'retain' or 'default'")
    return mode


def retain_freed_memory() -> dict[str, int] | None:
    """Make glibc's malloc keep freed memory for reuse instead of returning it to the kernel (process-wide, once).

    By default glibc serves a block above its mmap threshold (dynamic, at most 32 MiB) with a fresh ``mmap`` and
    unmaps it when freed, and trims the heap's top once more than twice that threshold is free there. An engine
    step allocates and frees the same activations every layer (a 1,519-token prefill of ``bench-300m``: a 34 MB
    gate/up product per layer), so their pages went back to the kernel and were faulted in and zeroed again, step
    after step. With blocks up to ``RETAIN_MMAP_THRESHOLD`` from the heap and up to ``RETAIN_TRIM_THRESHOLD`` kept
    at its top, a step reuses the pages of the one before (as tcmalloc, which vLLM's CPU documentation preloads,
    keeps freed pages in its own heap). ``WORKBENCH_MALLOC=default`` leaves malloc alone, as does a process on
    another allocator (``WORKBENCH_PRELOAD``) or C library; ``retain`` (or unset) applies the settings above; any
    other value is a ``ConfigError``. Returns the settings applied (``mmap_threshold``, ``trim_threshold`` in
    bytes), or None.
    """
    global _malloc_settings
    mode = _malloc_mode()
    if _malloc_settings is not None:
        return _malloc_settings
    if mode == "default" or not sys.platform.startswith("linux"):
        return None
    if platform.libc_ver()[0] != "glibc" or runtime_state()["allocator"] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    mmap_threshold = RETAIN_MMAP_THRESHOLD
    if not mallopt(_M_MMAP_THRESHOLD, mmap_threshold):  # an older glibc caps the threshold
        mmap_threshold = _GLIBC_MMAP_THRESHOLD_MAX
        if not mallopt(_M_MMAP_THRESHOLD, mmap_threshold):
            return None
    if not mallopt(_M_TRIM_THRESHOLD, RETAIN_TRIM_THRESHOLD):
        return None
    _malloc_settings = {"mmap_threshold": mmap_threshold, "trim_threshold": RETAIN_TRIM_THRESHOLD}
    return _malloc_settings


def retain_tunables() -> str | None:
    """``retain_freed_memory``'s settings as a ``GLIBC_TUNABLES`` value, for a process of another program (the vLLM
    side of ``bench vllm``): None when ``WORKBENCH_MALLOC=default``."""
    if _malloc_mode() == "default":
        return None
    return f"glibc.malloc.mmap_threshold={RETAIN_MMAP_THRESHOLD}:glibc.malloc.trim_threshold={RETAIN_TRIM_THRESHOLD}"


def runtime_state() -> dict[str, object]:
    """What this process runs on: the allocator and OpenMP libraries it has mapped (from ``/proc/self/maps``; glibc
    and GNU OpenMP when nothing else is), ``LD_PRELOAD``, ``WORKBENCH_PRELOAD``, and ``malloc``: the settings
    ``retain_freed_memory`` applied, or "default"."""
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
        "malloc": dict(_malloc_settings) if _malloc_settings else "default",
    }
