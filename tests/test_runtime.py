"""The CPU runtime a process asks for (``WORKBENCH_PRELOAD``): finding the libraries, the re-execution's
``LD_PRELOAD``, and what a process reports having mapped."""

import os
import platform
import sys

import pytest

from workbench import runtime
from workbench.errors import ConfigError


def test_preload_names_and_their_errors(monkeypatch):
    assert runtime.preload_paths("") == [] and runtime.preload_paths("none") == []
    with pytest.raises(ConfigError, match="unknown library 'mimalloc'"):
        runtime.preload_paths("mimalloc")
    with pytest.raises(ConfigError, match="one allocator"):
        runtime.preload_paths("jemalloc,tcmalloc")
    with pytest.raises(ConfigError, match="no library at /nowhere/libx.so"):
        runtime.preload_paths("/nowhere/libx.so")
    monkeypatch.setattr(runtime, "find_library", lambda name: None)
    with pytest.raises(ConfigError, match=r"no iomp library on this machine \(pip install intel-openmp\)"):
        runtime.preload_paths("iomp")


def test_malloc_mode_must_be_retain_or_default(monkeypatch):
    monkeypatch.setenv("WORKBENCH_MALLOC", "jemalloc")
    with pytest.raises(ConfigError, match="WORKBENCH_MALLOC='jemalloc': expected 'retain' or 'default'"):
        runtime.retain_freed_memory()


def test_reexec_puts_the_libraries_first_in_ld_preload(monkeypatch, tmp_path):
    lib = tmp_path / "libjemalloc.so"
    lib.write_bytes(b"")
    monkeypatch.setattr(runtime, "find_library", lambda name: lib)
    monkeypatch.setenv("LD_PRELOAD", "/other/libx.so")
    monkeypatch.delenv("WORKBENCH_PRELOADED", raising=False)
    calls = []
    monkeypatch.setattr(os, "execve", lambda exe, args, env: calls.append((exe, args, env)))
    monkeypatch.setenv("WORKBENCH_PRELOAD", "jemalloc")
    runtime.reexec_with_preloads(["bench", "decode", "--json"])
    ((exe, args, env),) = calls
    assert exe == sys.executable and args[-3:] == ["bench", "decode", "--json"]
    assert env["LD_PRELOAD"] == f"{lib}:/other/libx.so" and env["WORKBENCH_PRELOADED"] == "1"
    monkeypatch.setenv("WORKBENCH_PRELOADED", "1")  # the re-executed process does not go round again
    runtime.reexec_with_preloads(["bench"])
    assert len(calls) == 1


def test_runtime_state_reads_the_mapped_libraries():
    import torch  # noqa: F401  (torch's CPU wheels link GNU OpenMP)

    state = runtime.runtime_state()
    assert state["allocator"] in ("glibc", "jemalloc", "tcmalloc")
    if sys.platform.startswith("linux") and not os.environ.get("LD_PRELOAD"):
        assert state["allocator"] == "glibc" and "gomp" in state["openmp"]


_RETAIN_PROBE = """
import ctypes, json, os
from workbench import runtime
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
applied = runtime.retain_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, (ctypes.c_size_t,), (ctypes.c_void_p,)
size = 24 << 20  # above glibc's mmap threshold in a new process (128 KiB): an mmap of its own by default
block = libc.malloc(size)
ctypes.memset(block, 1, size)  # every page touched: resident
held = rss()
libc.free(block)
print(json.dumps({"applied": applied, "returned": held - rss(), "state": runtime.runtime_state()["malloc"]}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or bool(os.environ.get("LD_PRELOAD")), reason="glibc's malloc")
@pytest.mark.parametrize("mode", ["retain", "default"])
def test_retain_freed_memory_keeps_a_freed_block_resident(mode):
    """A freed 24 MiB block: with retain_freed_memory its pages stay with the process (the next step's activations
    reuse them); with WORKBENCH_MALLOC=default glibc unmaps it and the resident set drops by its size."""
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "WORKBENCH_MALLOC"}
    if mode == "default":
        env["WORKBENCH_MALLOC"] = "default"
    proc = subprocess.run([sys.executable, "-c", _RETAIN_PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    size = 24 << 20
    if mode == "default":
        assert out["applied"] is None and out["state"] == "default"
        assert out["returned"] >= 0.9 * size
    else:
        assert out["applied"]["trim_threshold"] == runtime.RETAIN_TRIM_THRESHOLD == out["state"]["trim_threshold"]
        assert out["applied"]["mmap_threshold"] >= 32 << 20
        assert out["returned"] < 0.1 * size


def test_vllm_worker_gets_the_engines_malloc_settings(monkeypatch):
    """bench vllm's worker runs on the glibc settings the workbench's engine applies (retain_freed_memory), written
    as GLIBC_TUNABLES, unless WORKBENCH_MALLOC=default or GLIBC_TUNABLES is set already."""
    from workbench.experiments.vs_vllm import vllm_env

    monkeypatch.delenv("WORKBENCH_MALLOC", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = vllm_env(2)
    assert env["GLIBC_TUNABLES"] == (f"glibc.malloc.mmap_threshold={256 * 2**20}:glibc.malloc.trim_threshold={2**30}")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and "PYTHONPATH" not in env
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=1")
    assert vllm_env(2)["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=1"
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv("WORKBENCH_MALLOC", "default")
    assert "GLIBC_TUNABLES" not in vllm_env(2)


def test_vllm_worker_preloads_what_vllms_cpu_docs_preload(monkeypatch, tmp_path):
    """--vllm-preload docs: tcmalloc (the system's) and the libiomp5 of vLLM's venv, in that order, ahead of the
    LD_PRELOAD set before the workbench started (not the workbench's own WORKBENCH_PRELOAD); with a tcmalloc preloaded
    the glibc malloc settings are not passed (tcmalloc is the allocator then); each library not found is named, with
    how to get it or where it was looked for."""
    from workbench import runtime
    from workbench.experiments.vs_vllm import vllm_env, vllm_preloads

    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    tc = tmp_path / "libtcmalloc_minimal.so.4"
    tc.write_bytes(b"")
    monkeypatch.setattr(runtime, "find_library", lambda name: tc if name == "tcmalloc" else None)
    assert vllm_preloads(venv) == ([str(tc)], [f"libiomp5.so (not in {venv / 'lib'})"])
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    found, missing = vllm_preloads(venv)
    assert found == [str(tc), str(venv / "lib" / "libiomp5.so")] and missing == []

    monkeypatch.delenv("WORKBENCH_MALLOC", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/opt/mine.so")
    env = vllm_env(2, found)
    assert env["LD_PRELOAD"] == f"{tc}:{venv / 'lib' / 'libiomp5.so'}:/opt/mine.so"
    assert "GLIBC_TUNABLES" not in env
    only_iomp = vllm_env(2, found[1:])
    assert only_iomp["LD_PRELOAD"] == f"{venv / 'lib' / 'libiomp5.so'}:/opt/mine.so" and "GLIBC_TUNABLES" in only_iomp

    # a workbench re-executed with its own WORKBENCH_PRELOAD: vLLM gets its docs' libraries and what was in
    # LD_PRELOAD before the workbench started, not the workbench's own preloads
    monkeypatch.setenv("WORKBENCH_PRELOAD", "tcmalloc")
    monkeypatch.setenv("WORKBENCH_PRELOADED", "1")
    monkeypatch.setenv("LD_PRELOAD", f"{tc}:/opt/mine.so")
    iomp_only = vllm_env(2, found[1:])
    assert iomp_only["LD_PRELOAD"] == f"{venv / 'lib' / 'libiomp5.so'}:/opt/mine.so"
    assert "WORKBENCH_PRELOAD" not in iomp_only and "WORKBENCH_PRELOADED" not in iomp_only
    monkeypatch.setenv("LD_PRELOAD", str(tc))
    assert "LD_PRELOAD" not in vllm_env(2)  # --vllm-preload none: nothing preloaded

    monkeypatch.setattr(runtime, "find_library", lambda name: None)
    assert vllm_preloads(venv)[1] == ["tcmalloc (apt-get install libtcmalloc-minimal4)"]
