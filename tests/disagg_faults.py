"""Fault injection for the disaggregation tests, kept out of the production path.

``FaultyCluster`` is a ``DisaggCluster`` whose engines are driven by ``FaultyLoop``: ``run(..., faults=Faults(...))``
sends the faults with each run's start. Transfers of the request ids in ``corrupt_once`` (their first attempt) and
``corrupt_always`` (every attempt) leave with one byte changed, so the receiver's checksum fails; a decode engine
dies by SIGKILL after reporting ``kill_decode_after`` finished requests. The spawned ranks import this module
(``tests.disagg_faults``) to unpickle the loop class, so it imports nothing from the test files.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from workbench.cluster.disagg import DisaggCluster, EngineLoop, KVPeer
from workbench.dist.kv_connector import KVSender


@dataclass(frozen=True)
class Faults:
    corrupt_once: tuple[int, ...] = ()
    corrupt_always: tuple[int, ...] = ()
    kill_decode_after: int | None = None


class CorruptingSender(KVSender):
    faults = Faults()

    def post(self, buffer: torch.Tensor, dst: int, request_id: int, attempt: int) -> dist.Work:
        f = self.faults
        if (attempt == 0 and request_id in f.corrupt_once) or request_id in f.corrupt_always:
            buffer = buffer.clone()
            buffer[0] += 1  # the bytes on the wire differ from the announced checksum
        return super().post(buffer, dst, request_id, attempt)


class FaultyPeer(KVPeer):
    sender_class = CorruptingSender


class FaultyLoop(EngineLoop):
    peer_class = FaultyPeer

    def begin(self, t0: float, faults: Faults = Faults()) -> None:  # noqa: B008
        super().begin(t0)
        self.kv.peer.sender.faults = faults
        self.faults, self.num_reported = faults, 0

    def report(self, result: Any, transfer: dict[str, Any]) -> None:
        super().report(result, transfer)
        self.num_reported += 1
        if self.role == "decode" and self.faults.kill_decode_after is not None:
            if self.num_reported >= self.faults.kill_decode_after:
                time.sleep(0.2)  # let the queue's feeder thread deliver, then die without a word
                os.kill(os.getpid(), signal.SIGKILL)


class FaultyCluster(DisaggCluster):
    loop_class = FaultyLoop

    def run(self, requests: list, online: bool = True, progress: Any = None, faults: Faults | None = None) -> Any:
        self._faults = faults or Faults()
        return super().run(requests, online=online, progress=progress)

    def _start_message(self, t0: float) -> tuple:
        return ("start", t0, self._faults)
