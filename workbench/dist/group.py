"""Worker processes over torch.distributed: launch, one process group, calls broadcast to every rank, shutdown.

The process machinery of tensor parallelism and disaggregation, shaped like vLLM's multiprocessing executor: gloo
on the CPU, NCCL on CUDA, the same code. The **driver** is rank 0, in the calling process; ranks 1..N-1 are
**workers** spawned by ``WorkerGroup`` itself, or started by ``torchrun`` (``WorkerGroup.from_env`` /
``run_worker``). Every rank builds its worker object with one picklable ``factory(rank, world_size, *args)``;
``WorkerGroup.call(method, *args)`` sends ``(method, args)`` to all ranks with one ``broadcast_object_list``, each
runs ``worker.method(*args)`` (their collectives meet across ranks) and the driver returns its own result.

Faults never hang the driver: every collective runs under the group's timeout (``timeout_s``); a worker that raises
reports its traceback on a side pipe and exits, which breaks the collective at once; a worker that dies is seen by
its exit code, one that stops beating by the liveness watchdog (``ProcessSet``). ``call`` then raises
``WorkerError`` naming the rank and the cause, and the group is shut down. A worker exits by itself when its driver
process disappears, so no orphan is left behind.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from workbench.config import check_positive_ints
from workbench.errors import ConfigError, WorkbenchError
from workbench.timing import now

BACKENDS = ("auto", "gloo", "nccl")
_SHUTDOWN = "__shutdown__"


class WorkerError(WorkbenchError, RuntimeError):
    """A worker rank died, hung past the timeout or raised; the message names the rank and the cause, and
    ``remote_traceback`` holds the worker's traceback when it reported one."""

    remote_traceback: str = ""


STARTUP_TIMEOUT_S = 60.0  # the least time the ranks get to meet: spawned ranks import torch first (seconds on 2 cores)
LIVENESS_ENV = "WORKBENCH_LIVENESS_TIMEOUT"  # seconds without a heartbeat before a spawned rank is given up on
LIVENESS_TIMEOUT_S = 8.0  # its default: a stopped (SIGSTOP) or frozen rank ends the run in seconds, not at a timeout
HEARTBEAT_S = 0.5  # how often a spawned rank's watcher thread beats


def liveness_timeout_s() -> float:
    """The liveness bound: ``$WORKBENCH_LIVENESS_TIMEOUT`` seconds when set, else ``LIVENESS_TIMEOUT_S``."""
    raw = os.environ.get(LIVENESS_ENV)
    if raw is None or not raw.strip():
        return LIVENESS_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 4 * HEARTBEAT_S or value == float("inf"):
        raise ConfigError(
            f"{LIVENESS_ENV}={raw!r}: the liveness bound must be a number of seconds, at least {4 * HEARTBEAT_S:g} "
            f"(a rank beats every {HEARTBEAT_S:g} s); unset it for the default {LIVENESS_TIMEOUT_S:g} s"
        )
    return value


@dataclass(frozen=True)
class DistConfig:
    """How to start one group of ranks.

    ``backend`` 'auto' is NCCL when CUDA is available and gloo otherwise. ``timeout_s`` bounds every collective:
    past it the driver raises instead of waiting for a hung rank. The start-up rendezvous gets
    ``max(timeout_s, STARTUP_TIMEOUT_S)``. ``init_method`` None: a TCP rendezvous on a free port of 127.0.0.1 (one
    node); else ``tcp://HOST:PORT`` or ``env://`` (torchrun's variables).
    """

    world_size: int
    backend: str = "auto"
    timeout_s: float = 60.0
    init_method: str | None = None

    def __post_init__(self) -> None:
        check_positive_ints(self, ("world_size",))
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {self.timeout_s!r}")
        if self.init_method is not None and self.init_method != "env://":
            host, _, port = self.init_method.removeprefix("tcp://").rpartition(":")
            if not self.init_method.startswith("tcp://") or not host or not port.isdigit() or int(port) > 65535:
                raise ConfigError(f"init_method must be 'tcp://HOST:PORT' or 'env://', got {self.init_method!r}")

    def resolved_backend(self) -> str:
        if self.backend == "auto":
            return "nccl" if torch.cuda.is_available() else "gloo"
        if self.backend == "nccl" and not dist.is_nccl_available():
            raise ConfigError("backend 'nccl' needs a CUDA build of torch with NCCL; use 'gloo' on the CPU")
        return self.backend


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init(backend: str, init_method: str, rank: int, world_size: int, timeout_s: float) -> None:
    """Join the default group: meet within ``max(timeout_s, STARTUP_TIMEOUT_S)``, then collectives within ``timeout_s``.

    ``init_process_group(init_method='tcp://...', timeout=t)`` uses ``t`` for the rendezvous too, so a short collective
    timeout (a test's 3 s hang check) failed whenever a spawned rank took longer than that to import torch on a busy
    machine. A ``tcp://`` rendezvous therefore goes through a ``TCPStore`` of our own with the longer timeout.
    """
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=timeout_s)
    if init_method.startswith("tcp://"):
        host, _, port = init_method[len("tcp://") :].rpartition(":")
        startup = datetime.timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S))
        store = dist.TCPStore(host.strip("[]"), int(port), world_size, rank == 0, timeout=startup)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        return
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)


def _exit_with_parent(parent_pid: int, heartbeat: Any) -> None:
    """A spawned rank's daemon thread: beat ``heartbeat`` (CLOCK_MONOTONIC, shared by a machine's processes) for the
    parent's liveness watchdog, and end the rank if its driver is gone (no orphans)."""
    while True:
        heartbeat.value = now()
        time.sleep(HEARTBEAT_S)
        if os.getppid() != parent_pid:
            os._exit(3)


def _serve(
    rank: int, size: int, report: Connection | None, factory: Callable[..., Any], args: tuple, group: Any = None
) -> None:
    """A worker rank: build its worker as ``factory(rank, size, *args)``, then run the calls broadcast by rank 0 of
    ``group`` (None: the world) until shutdown."""
    worker = factory(rank, size, *args)
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, group=group, group_src=0)
        method, call_args, kwargs = message[0]
        if method == _SHUTDOWN:
            return
        try:
            getattr(worker, method)(*call_args, **kwargs)
        except BaseException:
            if report is not None:
                report.send(_describe(f"rank {dist.get_rank()} raised in {method}()"))
            raise


def _describe(what: str) -> tuple[str, str]:
    """(one line naming the rank, the call and the exception; the full traceback) of the exception in flight."""
    exc = sys.exc_info()[1]
    return f"{what}: {type(exc).__name__}: {exc}", traceback.format_exc()


def _spawned_rank(
    rank: int,
    world_size: int,
    backend: str,
    init_method: str,
    timeout_s: float,
    parent_pid: int,
    entry: Callable[..., Any],
    entry_args: tuple[Any, ...],
    report: Connection,
    heartbeat: Any,
) -> None:
    """A spawned process: join the group and run ``entry(rank, world_size, report, *entry_args)``; a failure goes to
    the driver on the pipe and exits with code 1 unprinted, so the user sees one line, not a traceback per rank."""
    threading.Thread(target=_exit_with_parent, args=(parent_pid, heartbeat), daemon=True).start()
    try:
        _init(backend, init_method, rank, world_size, timeout_s)
    except BaseException:
        report.send(_describe(f"rank {rank} failed to join the group"))
        sys.exit(1)
    try:
        entry(rank, world_size, report, *entry_args)
    except BaseException:
        if not report.closed:
            report.send(_describe(f"rank {rank} failed"))
        sys.exit(1)
    finally:
        dist.destroy_process_group()


@contextmanager
def _sigint_ignored_by_children() -> Iterator[None]:
    """Children started inside inherit SIGINT ignored, so Ctrl-C reaches the driver alone, which stops its ranks;
    SIGINT is blocked meanwhile so it is not lost. Only the main thread can do this: elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class ProcessSet:
    """Spawned processes, each one rank of a torch.distributed group with a pipe to report why it failed.

    ``problem()`` polls without blocking; ``stop()`` joins, then terminates and kills: no process outlives the set.
    A watchdog kills a rank silent for ``liveness_s`` so that whatever waits on it fails at once.
    """

    def __init__(
        self,
        ranks: list[int],
        world_size: int,
        backend: str,
        init_method: str,
        timeout_s: float,
        entry: Callable[..., Any],
        entry_args: Callable[[int], tuple[Any, ...]],
        names: Callable[[int], str] = lambda rank: f"workbench-rank{rank}",
    ) -> None:
        context = mp.get_context("spawn")
        self.ranks = list(ranks)
        self.processes: list[mp.Process] = []
        self.reports: list[Connection] = []
        self.liveness_s = liveness_timeout_s()
        self._beats = [context.Value("d", 0.0, lock=False) for _ in self.ranks]
        self._first_problem: tuple[str, str] | None = None
        self._done = threading.Event()
        with _sigint_ignored_by_children():
            for rank, beat in zip(self.ranks, self._beats):
                receive, send = context.Pipe(duplex=False)
                process = context.Process(
                    target=_spawned_rank,
                    args=(rank, world_size, backend, init_method, timeout_s, os.getpid(), entry, entry_args(rank),
                          send, beat),
                    name=names(rank),
                    daemon=True,
                )  # fmt: skip
                process.start()
                send.close()
                self.processes.append(process)
                self.reports.append(receive)
        threading.Thread(target=self._watch, daemon=True, name="workbench-liveness").start()

    def _watch(self) -> None:
        """Kill the first rank that stops beating for ``liveness_s`` (and remember why, for ``problem()``)."""
        while not self._done.wait(HEARTBEAT_S / 2):
            at = now()
            for rank, process, beat in zip(self.ranks, self.processes, self._beats):
                last = beat.value
                if last > 0 and at - last > self.liveness_s and process.is_alive():
                    self._first_problem = (
                        f"rank {rank} ({process.name}, pid {process.pid}) gave no sign of life for "
                        f"{at - last:.1f} s (stopped or frozen) and was killed; the liveness bound is "
                        f"{self.liveness_s:g} s (${LIVENESS_ENV})",
                        "",
                    )
                    process.kill()
                    return

    @classmethod
    def none(cls) -> ProcessSet:
        """A set of no processes (the driver under torchrun, which spawns nothing)."""
        empty = cls.__new__(cls)
        empty.ranks, empty.processes, empty.reports, empty._beats = [], [], [], []
        empty._first_problem, empty._done, empty.liveness_s = None, threading.Event(), LIVENESS_TIMEOUT_S
        return empty

    def problem(self) -> tuple[str, str] | None:
        """(what went wrong with a process, its traceback), or None while all are alive and quiet."""
        if self._first_problem is not None:
            return self._first_problem
        for rank, process, report in zip(self.ranks, self.processes, self.reports):
            if report.poll():
                try:
                    self._first_problem = report.recv()  # kept: every later call names the same first cause
                    return self._first_problem
                except EOFError:
                    pass
            if not process.is_alive():
                return f"rank {rank} ({process.name}, pid {process.pid}) exited with code {process.exitcode}", ""
        return None

    def stop(self, grace_s: float = 5.0) -> None:
        self._done.set()
        deadline = now() + grace_s
        for process in self.processes:
            process.join(max(0.0, deadline - now()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join(2.0)

    def kill(self) -> None:
        self._done.set()
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join(2.0)


def run_worker(factory: Callable[..., Any], *factory_args: Any, timeout_s: float = 60.0) -> None:
    """Serve as a worker rank under ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): join the group,
    build this rank's worker and serve calls until the driver (rank 0) shuts the group down."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = DistConfig(world_size).resolved_backend()
    _init(backend, "env://", rank, world_size, timeout_s)
    try:
        _serve(rank, world_size, None, factory, factory_args)
    finally:
        dist.destroy_process_group()


def serve_subgroup(group: Any, factory: Callable[..., Any], factory_args: tuple[Any, ...] = ()) -> None:
    """Serve as a worker rank of ``group``, a subgroup (``dist.new_group``) of a world already joined: build this
    rank's worker as ``factory(group_rank, group_size, *factory_args)`` and serve the calls of the subgroup's rank 0
    (``WorkerGroup.on_subgroup``) until it shuts the subgroup down. The world stays up (its owner ends it)."""
    _serve(dist.get_rank(group), dist.get_world_size(group), None, factory, factory_args, group)


def launched_by_torchrun() -> bool:
    """True inside a process that torchrun started (it sets these variables)."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


class WorkerGroup:
    """Rank 0 (this process) and ``world_size - 1`` worker processes, one worker object per rank.

    Use as a context manager, or call ``shutdown()``; a group whose worker failed is shut down by ``call`` before it
    raises. Only one group can be alive in a process (torch.distributed has one default group per process).
    """

    def __init__(self, config: DistConfig, factory: Callable[..., Any], factory_args: tuple[Any, ...] = ()) -> None:
        if dist.is_initialized():
            raise ConfigError(
                "a torch.distributed group is already running in this process; shut the other engine down first"
            )
        self.config = config
        self.backend = config.resolved_backend()
        self.world_size = config.world_size
        self._closed = False
        init_method = config.init_method or f"tcp://127.0.0.1:{free_port()}"
        self._workers = ProcessSet(
            list(range(1, self.world_size)), self.world_size, self.backend, init_method, config.timeout_s,
            _serve, lambda rank: (factory, factory_args),
        )  # fmt: skip
        self.group, self._owns_world = None, True  # the default group: this group's ranks are the whole world
        try:
            _init(self.backend, init_method, 0, self.world_size, config.timeout_s)
            self.worker = factory(0, self.world_size, *factory_args)
        except Exception as exc:
            self._fail(exc, "starting the group")

    @classmethod
    def from_env(cls, factory: Callable[..., Any], factory_args: tuple[Any, ...] = (), timeout_s: float = 60.0):
        """The driver's side under torchrun: this process is rank 0, the other ranks run ``run_worker``."""
        config = DistConfig(int(os.environ["WORLD_SIZE"]), timeout_s=timeout_s)
        _init(config.resolved_backend(), "env://", 0, config.world_size, timeout_s)
        return cls._joined(config, None, factory, factory_args)

    @classmethod
    def on_subgroup(
        cls, group: Any, factory: Callable[..., Any], factory_args: tuple[Any, ...] = (), timeout_s: float = 60.0
    ) -> WorkerGroup:
        """The driver of ``group``, a subgroup of a world this process has joined already (the tensor-parallel
        ranks of one engine among the engines of a disaggregated run): this process is the subgroup's rank 0, the
        other ranks run ``serve_subgroup``. Nothing is spawned; ``shutdown`` ends the subgroup's workers' loops
        and leaves the world to its owner."""
        config = DistConfig(dist.get_world_size(group), backend=dist.get_backend(group), timeout_s=timeout_s)
        return cls._joined(config, group, factory, factory_args)

    @classmethod
    def _joined(cls, config: DistConfig, group: Any, factory: Callable[..., Any], factory_args: tuple) -> WorkerGroup:
        """Rank 0 of a group whose other ranks were started elsewhere (nothing spawned here); ``group`` None: the
        world."""
        out = cls.__new__(cls)
        out.config, out.backend, out.world_size = config, config.resolved_backend(), config.world_size
        out._workers, out._closed = ProcessSet.none(), False
        out.group, out._owns_world = group, group is None
        out.worker = factory(0, out.world_size, *factory_args)
        return out

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``worker.method(*args, **kwargs)`` on every rank; return rank 0's result."""
        if self._closed:
            raise WorkerError("the worker group has been shut down")
        if self._workers.problem() is not None:
            self._fail(None, "the previous call")
        try:
            dist.broadcast_object_list([(method, args, kwargs)], group=self.group, group_src=0)
            return getattr(self.worker, method)(*args, **kwargs)
        except KeyboardInterrupt:
            # Ctrl-C mid-call: the other ranks may be inside a collective rank 0 will never join, so a polite shutdown
            # (one more broadcast) could wait for the collective timeout; they hold nothing to save: stop them now
            self._kill_all()
            raise
        except Exception as exc:
            # the ranks may now disagree on where they are in the sequence of collectives: the group is unusable
            # (inputs are validated on the driver before a call, so this is a fault, not a bad request)
            self._fail(exc, f"{method}()")

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Stop every worker (politely, then by force) and leave the process group. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if dist.is_initialized():
            if self._workers.problem() is None:
                try:
                    dist.broadcast_object_list([(_SHUTDOWN, (), {})], group=self.group, group_src=0)
                except Exception:  # a worker went away meanwhile: it is reaped below
                    pass
            if self._owns_world:
                dist.destroy_process_group()
        self._workers.stop(grace_s)

    def _fail(self, exc: BaseException | None, during: str) -> None:
        # give a dying worker a moment (2 s) to report why, so the message says the cause and not just the symptom
        deadline, problem = now() + 2.0, self._workers.problem()
        while problem is None and now() < deadline:
            time.sleep(0.05)
            problem = self._workers.problem()
        if problem is None:
            problem = (
                f"rank 0: {type(exc).__name__}: {exc} (no worker reported an error; a hung rank is given up on "
                f"after the collective timeout, {self.config.timeout_s:g} s)",
                "",
            )
        self._kill_all()
        error = WorkerError(f"worker group failed during {during}: {problem[0]}")
        error.remote_traceback = problem[1]
        raise error from exc

    def _kill_all(self) -> None:
        """Kill the spawned ranks and leave the group without a last collective (the ranks are out of step)."""
        self._closed = True
        self._workers.kill()
        if dist.is_initialized() and self._owns_world:
            try:
                dist.destroy_process_group()
            except Exception:  # the group is broken already; nothing more to release
                pass
