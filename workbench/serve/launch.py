"""Start ``workbench serve`` as a child process on an ephemeral port and stop it, every wait bounded.

Used by the tests, the load test and the benchmark scripts:

    with ServerProcess(["--model", ckpt, "--num-blocks", "64"]) as server:
        ...  # server.base_url is http://127.0.0.1:PORT
    # the process is gone here: SIGTERM, then SIGKILL if it did not exit in time
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from typing import IO

from workbench.errors import WorkbenchError


class ServerProcess:
    """``workbench serve ARGS --host 127.0.0.1 --port 0`` in a child process."""

    def __init__(self, args: list[str], startup_timeout_s: float = 120.0, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "workbench.cli", "serve", *args, "--host", "127.0.0.1", "--port", "0"]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr_lines: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines), daemon=True).start()
        threading.Thread(target=self._collect, args=(self.proc.stderr,), daemon=True).start()
        try:
            line = self.lines.get(timeout=startup_timeout_s)
        except queue.Empty:
            self.kill()
            raise WorkbenchError(f"workbench serve did not start within {startup_timeout_s} s") from None
        if line is None:
            self.kill()
            raise WorkbenchError("workbench serve exited at startup: " + "".join(self.stderr_lines[-20:]))
        event = json.loads(line)
        self.port: int = event["port"]
        self.base_url = f"http://127.0.0.1:{self.port}"

    @staticmethod
    def _pump(stream: IO[str], out: queue.Queue[str | None]) -> None:
        for line in stream:
            out.put(line)
        out.put(None)

    def _collect(self, stream: IO[str]) -> None:
        for line in stream:
            self.stderr_lines.append(line)

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait up to ``timeout_s`` for the drain, and return the exit code (SIGKILL if it hangs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise WorkbenchError(f"workbench serve did not exit within {timeout_s} s of SIGTERM") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.terminate(timeout_s=15.0)
        finally:
            self.kill()
