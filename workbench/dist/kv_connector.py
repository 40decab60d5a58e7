"""The KV connector of prefill/decode disaggregation: moving a request's KV over torch.distributed.

This is the worker side of vLLM v1's KV connector (the scheduler side, holding blocks, backpressure, retries and
recomputation, is ``workbench.cluster.disagg``'s). ``KVSender.start`` packs the prompt's token slots of every layer
into one byte buffer per piece (``pack``: an int8 pool's fp32 scales, then K and V) and posts it with ``isend``;
``KVReceiver.receive`` posts the matching ``irecv`` (tagged by request and attempt), waits up to a timeout, checks
the checksum and scatters the tokens into its own slots (``unpack``). A transfer is exactly
``num_tokens * ModelConfig.kv_bytes_per_token(kv dtype)`` bytes; an fp8 pool's per-layer scales are announced and
checked equal, not sent.

Under tensor parallelism on either side a request's KV moves as **pieces** (``transfer_plan``), one per (prefill
rank, decode rank) pair whose KV heads overlap: each decode rank receives the heads it holds from the first prefill
rank holding them (equal TP: rank i to rank i; each replica of a replicated KV head receives its copy).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workbench.config import ModelConfig
from workbench.kv.cache import KVCache, as_bits
from workbench.model.sharding import TensorParallelShard
from workbench.timing import now

ATTEMPT_BITS = 4  # tags are request_id << ATTEMPT_BITS | attempt


@dataclass(frozen=True)
class Piece:
    """One piece of a request's KV: the full model's KV heads ``[head_lo, head_hi)`` from prefill rank ``src`` to
    decode rank ``dst`` (global ranks), ``num_bytes`` of them, with the sender's checksum."""

    src: int
    dst: int
    head_lo: int
    head_hi: int
    num_bytes: int = 0
    checksum: int = 0


@dataclass(frozen=True)
class KVTransfer:
    """What the prefill side announces for one request's KV (sent on the control channel)."""

    request_id: int
    src_rank: int  # the prefill engine's first rank (its driver), which the acknowledgement goes to
    num_tokens: int
    pieces: tuple[Piece, ...]
    attempt: int
    sent_at: float  # on the run's shared clock
    layer_scales: tuple[float, ...] = ()  # fp8: the sender's per-layer K then V scales (checked, not sent)

    @property
    def num_bytes(self) -> int:
        return sum(p.num_bytes for p in self.pieces)

    @property
    def tag(self) -> int:
        return (self.request_id << ATTEMPT_BITS) | self.attempt


def head_range(cfg: ModelConfig, rank: int, tp: int) -> tuple[int, int]:
    """[first, end) of the full model's KV heads that rank ``rank`` of ``tp`` holds."""
    shard = TensorParallelShard(cfg, rank, tp)
    return shard.first_kv_head, shard.first_kv_head + shard.num_kv_heads


def transfer_plan(cfg: ModelConfig, prefill_tp: int, decode_tp: int) -> list[Piece]:
    """The pieces of one request's KV between a prefill engine of ``prefill_tp`` ranks and a decode engine of
    ``decode_tp`` ranks, as local ranks (0-based on each side): every decode rank gets each head it holds from the
    first prefill rank that holds it, consecutive heads from one rank in one piece."""
    holders = [head_range(cfg, r, prefill_tp) for r in range(prefill_tp)]
    pieces: list[Piece] = []
    for dst in range(decode_tp):
        lo, hi = head_range(cfg, dst, decode_tp)
        for head in range(lo, hi):
            src = next(r for r, (a, b) in enumerate(holders) if a <= head < b)
            last = pieces[-1] if pieces else None
            if last is not None and last.dst == dst and last.src == src and last.head_hi == head:
                pieces[-1] = dataclasses.replace(last, head_hi=head + 1)
            else:
                pieces.append(Piece(src, dst, head, head + 1))
    return pieces


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


def _pool_parts(cache: KVCache) -> list[torch.Tensor]:
    """What a token's KV is in this pool, each as a (layers, num_slots, kv_heads, ...) view of the pool's storage:
    an int8 pool's per-token K and V scales, then K and V (fp8 as their bytes)."""
    parts = []  # the int8 scales first: every part then starts at a multiple of its element size in the buffer
    if cache.kv_cache_dtype == "int8":
        parts += [s.view(s.shape[0], -1, s.shape[3]) for s in (cache.k_scale, cache.v_scale)]
    for pool in (cache.k, cache.v):
        bits = as_bits(pool)
        parts.append(bits.view(bits.shape[0], -1, *bits.shape[3:]))
    return parts


def pack(cache: KVCache, slots: torch.Tensor, heads: slice) -> torch.Tensor:
    """The bytes of ``slots``' KV in the pool's local heads ``heads``: one flat uint8 buffer, every part in turn."""
    return torch.cat([p[:, slots, heads].contiguous().view(torch.uint8).reshape(-1) for p in _pool_parts(cache)])


def packed_bytes(cache: KVCache, num_tokens: int, num_heads: int) -> int:
    """Bytes of ``pack`` for ``num_tokens`` tokens and ``num_heads`` heads."""
    return sum(p.shape[0] * num_tokens * num_heads * p[0, 0, 0].numel() * p.element_size() for p in _pool_parts(cache))


def unpack(cache: KVCache, slots: torch.Tensor, heads: slice, buffer: torch.Tensor) -> None:
    """Write a ``pack`` buffer into ``slots``' local heads ``heads`` of this pool."""
    offset, n, h = 0, slots.numel(), heads.stop - heads.start
    for part in _pool_parts(cache):
        shape = (part.shape[0], n, h, *part.shape[3:])
        size = part.element_size() * shape[0] * n * h * part[0, 0, 0].numel()
        part[:, slots, heads] = buffer[offset : offset + size].view(part.dtype).view(shape).to(part.device)
        offset += size


def layer_scales(cache: KVCache) -> tuple[float, ...]:
    """An fp8 pool's per-layer K then V scales (what ``KVTransfer.layer_scales`` announces); () otherwise."""
    if cache.kv_cache_dtype != "fp8":
        return ()
    return tuple(float(x) for x in torch.cat((cache.k_scale, cache.v_scale)).cpu())


class KVSender:
    """One prefill rank's half: gather its heads of a prompt's KV, post them, keep them until the receiver confirms.

    ``first_head``: the full model's index of this rank's first local KV head."""

    def __init__(self, cache: KVCache, first_head: int = 0) -> None:
        self.cache, self.first_head = cache, first_head
        self.in_flight: dict[int, dict[int, tuple[torch.Tensor, dist.Work | None]]] = {}  # rid -> piece -> (buf, work)

    def start(
        self, request_id: int, block_table: list[int], num_tokens: int, pieces: list[Piece], attempt: int = 0
    ) -> list[tuple[int, Piece]]:
        """Post this rank's ``pieces`` (those whose ``src`` is this rank); (index in ``pieces``, the piece with its
        bytes and checksum) for each. Attempt 0 gathers the KV; a later attempt sends the staged copy again."""
        rank, out = dist.get_rank(), []
        if attempt == 0:
            self.in_flight[request_id] = {}
        staged = self.in_flight[request_id]
        for index, piece in enumerate(pieces):
            if piece.src != rank:
                continue
            if attempt == 0:
                slots = token_slots(block_table, num_tokens, self.cache.block_size).to(self.cache.k.device)
                heads = slice(piece.head_lo - self.first_head, piece.head_hi - self.first_head)
                buffer = pack(self.cache, slots, heads)
            else:
                buffer, previous = staged[index]
                if previous is not None:
                    previous.wait()  # the damaged attempt was received: complete it before sending the copy again
            work = self.post(buffer, piece.dst, request_id, attempt)
            staged[index] = (buffer, work)
            out.append((index, dataclasses.replace(piece, num_bytes=buffer.numel(), checksum=checksum(buffer))))
        return out

    def post(self, buffer: torch.Tensor, dst: int, request_id: int, attempt: int) -> dist.Work:
        """Post one piece's bytes to decode rank ``dst``, tagged by request and attempt."""
        return dist.isend(buffer.to(_wire_device(buffer.device)), dst, tag=(request_id << ATTEMPT_BITS) | attempt)

    def finish(self, request_id: int) -> None:
        """The receiver has the KV (or gave up on it): drop the staging buffers."""
        for _, work in self.in_flight.pop(request_id, {}).values():
            if work is not None:
                work.wait()


class KVReceiver:
    """One decode rank's half: receive its heads of a prompt's KV into the slots of its own blocks."""

    def __init__(self, cache: KVCache, timeout_s: float, first_head: int = 0) -> None:
        self.cache, self.timeout_s, self.first_head = cache, timeout_s, first_head

    def receive(self, meta: KVTransfer, block_table: list[int]) -> tuple[bool, str]:
        """Receive this rank's pieces of one transfer into this sequence's blocks; (True, "") or (False, why) on a
        size or scale mismatch, a bad checksum or a timeout (the caller retries or recomputes)."""
        if layer_scales(self.cache) != meta.layer_scales:
            return False, f"the sender's fp8 layer scales {meta.layer_scales} differ from this pool's"
        rank, wire = dist.get_rank(), _wire_device(self.cache.k.device)
        posted = []
        for piece in meta.pieces:
            if piece.dst != rank:
                continue
            heads = slice(piece.head_lo - self.first_head, piece.head_hi - self.first_head)
            expected = packed_bytes(self.cache, meta.num_tokens, heads.stop - heads.start)
            if expected != piece.num_bytes or heads.start < 0 or heads.stop > self.cache.num_kv_heads:
                return False, f"announced {piece.num_bytes} bytes of heads {heads} where this pool holds {expected}"
            buffer = torch.empty(expected, dtype=torch.uint8, device=wire)
            posted.append((piece, heads, buffer, dist.irecv(buffer, piece.src, tag=meta.tag)))
        slots = token_slots(block_table, meta.num_tokens, self.cache.block_size).to(self.cache.k.device)
        for piece, heads, buffer, work in posted:
            try:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
            except RuntimeError as exc:
                return False, f"timed out after {self.timeout_s:g} s ({str(exc).splitlines()[0][:80]})"
            if checksum(buffer) != piece.checksum:
                return False, "checksum mismatch"
            unpack(self.cache, slots, heads, buffer)
        return True, ""


def _wire_device(device: torch.device) -> torch.device:
    """Where a transfer's bytes travel from: the pool's device under NCCL, host memory under gloo (which sends
    CPU tensors only: a CUDA pool is staged through the host, as when two processes share one GPU, which NCCL
    refuses)."""
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def wall_clock(t0: float) -> Callable[[], float]:
    """Seconds since ``t0`` on ``workbench.timing.now`` (CLOCK_MONOTONIC: one clock for every process of a machine)."""
    return lambda: now() - t0
