"""The handoff of a finished prefill to a decode engine (prefill/decode disaggregation): one object, with one
backpressure, for the real pair (``workbench.cluster.disagg``) and the simulator's (``workbench.sim.cluster``).

- Routing: request ``n`` of the arrival order goes to prefill engine ``n mod P`` and decode engine ``n mod D``.
- Prefill side (``hold``, ``release``): a finished prefill keeps its KV blocks (``Scheduler.hold_finished``) until
  the decode side has taken its KV; the pool then fills and admissions stop by themselves.
- Decode side (``arrive``, ``admit``): prefills whose KV arrived are admitted first come, first served
  (``prefilled_sequence``, ``Scheduler.admit_prefilled``); the first that does not fit stops the queue, its KV left
  held on the prefill side (backpressure, counted once per request in ``num_backpressure``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from workbench.engine.scheduler import Scheduler
from workbench.request import SamplingParams, Sequence

T = TypeVar("T")


def prefilled_sequence(
    request_id: int,
    prompt_ids: list[int],
    sampling: SamplingParams,
    arrival_time: float,
    first_token: int,
    first_token_time: float,
    eos_token_ids: tuple[int, ...] = (),
) -> Sequence:
    """The decode side's sequence of a request another engine prefilled: its prompt and the first token sampled
    there (at ``first_token_time``)."""
    seq = Sequence(request_id, prompt_ids, sampling, arrival_time, eos_token_ids=eos_token_ids)
    seq.output_token_ids = [first_token]
    seq.first_token_time, seq.token_times = first_token_time, [first_token_time]
    return seq


class Handoff(Generic[T]):
    """A disaggregated pair's handoff: the routing, the prefill side's holds and the decode side's queue of
    arrived prefills (items of any type ``T``, each with its request id)."""

    def __init__(self, num_prefill: int = 1, num_decode: int = 1) -> None:
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self._arrived: deque[tuple[int, T]] = deque()
        self._waited: set[int] = set()

    def route(self, n: int) -> tuple[int, int]:
        """(prefill engine, decode engine) of the ``n``-th request to arrive."""
        return n % self.num_prefill, n % self.num_decode

    # ---- the prefill side ------------------------------------------------------------------------------------
    @staticmethod
    def hold(scheduler: Scheduler, enabled: bool = True) -> None:
        """From now on ``scheduler``'s finished requests keep their KV blocks until ``release``."""
        scheduler.hold_finished = enabled

    @staticmethod
    def release(scheduler: Scheduler, request_id: int) -> bool:
        """Free the blocks of held request ``request_id`` (the decode side took its KV); False when not held."""
        return scheduler.release_held(request_id)

    # ---- the decode side -------------------------------------------------------------------------------------
    def arrive(self, request_id: int, item: T) -> None:
        """A prefill's KV (or its announcement) reached the decode side: queued for ``admit``."""
        self._arrived.append((request_id, item))

    def admit(self, take: Callable[[T], bool]) -> int:
        """Offer the queued prefills to ``take`` in arrival order; the first it refuses (no room now) stays at the
        head, the rest behind it (backpressure). Returns how many were taken."""
        taken = 0
        while self._arrived:
            rid, item = self._arrived[0]
            if not take(item):
                self._waited.add(rid)
                break
            self._arrived.popleft()
            taken += 1
        return taken

    @property
    def num_backpressure(self) -> int:
        """Requests that found the decode side full at least once."""
        return len(self._waited)

    def __len__(self) -> int:
        return len(self._arrived)

    def __iter__(self) -> Iterator[T]:
        return (item for _, item in self._arrived)
