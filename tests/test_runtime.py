"""The CPU runtime a process asks for (``WORKBENCH_PRELOAD``): finding the libraries, the re-execution's
``LD_PRELOAD``, and what a process reports having mapped."""

import os
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
