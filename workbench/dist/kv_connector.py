"""The KV connector of prefill/decode disaggregation: which KV to move, and moving it over torch.distributed.

Its shape follows vLLM v1's KV connector, split in the same two halves:

- the **scheduler side** decides. On the prefill engine, a request whose prefill has produced its first token is
  finished but keeps its blocks (``Scheduler.hold_finished``) until its KV has reached the decode engine
  (``KVSender.release_done``): a full decode pool therefore fills the prefill pool and stops its admissions
  (backpressure), and nothing is dropped. On the decode engine, ``Scheduler.admit_prefilled`` allocates blocks
  for the request's tokens, and the connector loads the prompt's KV into them before its first decode step.
- the **worker side** moves the bytes: ``KVSender.start`` gathers the K and V of the prompt's token slots from
  every layer into one buffer ``(2, layers, num_tokens, kv_heads, head_dim)`` and posts it with ``isend``;
  ``KVReceiver.receive`` posts the matching ``irecv`` (tagged by request and attempt, so transfers may complete
  in any order), waits up to a timeout, checks the checksum and scatters the tokens into its own slots.
  Exactly the prompt's tokens are sent, so a transfer is ``num_tokens * ModelConfig.kv_bytes_per_token`` bytes.

Completion is reported on the control channel (``ack``); a transfer whose checksum does not match is sent again
(``nack``, up to ``max_retries``), and one that still fails, or times out, is recomputed on the decode side from
the prompt. What overlaps: an ``isend`` is posted at the end of the prefill step that finished the prompt and the
prefill engine goes on with its next step while the bytes move (gloo sends from its own thread); the decode engine
receives between its steps, so a transfer delays the decode side's next step by its wire time only.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workbench.kv.cache import KVCache

ATTEMPT_BITS = 4  # tags are request_id << ATTEMPT_BITS | attempt


@dataclass(frozen=True)
class KVTransfer:
    """What the prefill side announces for one request's KV (sent on the control channel)."""

    request_id: int
    src_rank: int
    num_tokens: int
    num_bytes: int
    checksum: int
    attempt: int
    sent_at: float  # on the run's shared clock

    @property
    def tag(self) -> int:
        return (self.request_id << ATTEMPT_BITS) | self.attempt


def token_slots(block_table: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """Flat pool slots of a sequence's first ``num_tokens`` tokens, (num_tokens,) int64."""
    positions = torch.arange(num_tokens, dtype=torch.long)
    blocks = torch.tensor(block_table, dtype=torch.long)[positions // block_size]
    return blocks * block_size + positions % block_size


def checksum(buffer: torch.Tensor) -> int:
    """An exact integer checksum of a buffer's bytes (a sum of its 32-bit words)."""
    flat = buffer.contiguous().view(-1)
    if (flat.numel() * flat.element_size()) % 4:
        return int(flat.view(torch.uint8).sum(dtype=torch.int64))
    return int(flat.view(torch.int32).sum(dtype=torch.int64))


def _flat_pool(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's K and V as (layers, num_slots, kv_heads, head_dim) views."""
    k, v = cache.k, cache.v
    return k.view(k.shape[0], -1, *k.shape[3:]), v.view(v.shape[0], -1, *v.shape[3:])


class KVSender:
    """The prefill worker's half: gather a prompt's KV, post it, keep it until the receiver confirms."""

    def __init__(
        self,
        cache: KVCache,
        clock: Callable[[], float],
        corrupt_once: frozenset[int] = frozenset(),
        corrupt_always: frozenset[int] = frozenset(),
    ) -> None:
        self.cache, self.clock = cache, clock
        self.corrupt_once, self.corrupt_always = corrupt_once, corrupt_always  # fault injection, for tests
        self.in_flight: dict[int, tuple[torch.Tensor, dist.Work, int, int]] = {}  # rid -> (buffer, work, dst, n)

    def start(self, request_id: int, block_table: list[int], num_tokens: int, dst: int, attempt: int = 0) -> KVTransfer:
        if attempt == 0:
            k_flat, v_flat = _flat_pool(self.cache)
            slots = token_slots(block_table, num_tokens, self.cache.block_size).to(k_flat.device)
            buffer = torch.stack((k_flat[:, slots], v_flat[:, slots]))  # (2, layers, n, kv_heads, d)
        else:
            buffer, previous, _, _ = self.in_flight[request_id]
            previous.wait()  # the damaged attempt was received: complete it before sending the copy again
        meta = KVTransfer(
            request_id, dist.get_rank(), num_tokens, buffer.numel() * buffer.element_size(), checksum(buffer),
            attempt, self.clock(),
        )  # fmt: skip
        wire = buffer
        if (attempt == 0 and request_id in self.corrupt_once) or request_id in self.corrupt_always:
            wire = buffer.clone()
            wire.view(-1)[0] += 1.0  # the bytes on the wire differ from the announced checksum
        work = dist.isend(_on_wire_device(wire), dst, tag=meta.tag)
        self.in_flight[request_id] = (buffer, work, dst, num_tokens)
        return meta

    def finish(self, request_id: int) -> None:
        """The receiver has the KV (or gave up on it): drop the staging buffer."""
        _, work, _, _ = self.in_flight.pop(request_id)
        work.wait()


class KVReceiver:
    """The decode worker's half: receive a prompt's KV into the slots of its own blocks."""

    def __init__(self, cache: KVCache, timeout_s: float) -> None:
        self.cache, self.timeout_s = cache, timeout_s

    def receive(self, meta: KVTransfer, block_table: list[int]) -> tuple[bool, str]:
        """Receive one transfer into this sequence's blocks; (True, "") or (False, why) on a bad checksum or a
        timeout (the caller retries or recomputes)."""
        k_flat, v_flat = _flat_pool(self.cache)
        layers, _, kv_heads, head_dim = k_flat.shape
        wire = _wire_device(k_flat.device)
        buffer = torch.empty((2, layers, meta.num_tokens, kv_heads, head_dim), dtype=k_flat.dtype, device=wire)
        expected = buffer.numel() * buffer.element_size()
        if expected != meta.num_bytes:
            return False, f"announced {meta.num_bytes} bytes where this pool's layout holds {expected}"
        work = dist.irecv(buffer, meta.src_rank, tag=meta.tag)
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            return False, f"timed out after {self.timeout_s:g} s ({str(exc).splitlines()[0][:80]})"
        if checksum(buffer) != meta.checksum:
            return False, "checksum mismatch"
        slots = token_slots(block_table, meta.num_tokens, self.cache.block_size).to(k_flat.device)
        buffer = buffer.to(k_flat.device)
        k_flat[:, slots] = buffer[0]
        v_flat[:, slots] = buffer[1]
        return True, ""


def _wire_device(device: torch.device) -> torch.device:
    """Where a transfer's bytes travel from: the pool's device under NCCL, host memory under gloo (which sends
    CPU tensors only: a CUDA pool is staged through the host, as when two processes share one GPU, which NCCL
    refuses)."""
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def _on_wire_device(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(_wire_device(tensor.device))


def wall_clock(t0: float) -> Callable[[], float]:
    """Seconds since ``t0`` on ``time.perf_counter`` (CLOCK_MONOTONIC: one clock for every process of a machine)."""
    return lambda: time.perf_counter() - t0
