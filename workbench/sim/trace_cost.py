"""``TraceCostModel``: replays the start and end times of a measured ``StepLog`` step by step (and checks that each
simulated step computes what the measured one did), so the simulator reproduces an engine run exactly."""

from __future__ import annotations

from typing import TYPE_CHECKING

from workbench.sim.stats import CostModel, StepStats

if TYPE_CHECKING:
    from workbench.engine.metrics import StepLog, StepRecord


class TraceCostModel(CostModel):
    """Replays a measured run: the i-th non-empty step starts and ends when the engine's i-th logged step did.

    Step i starts at ``max(now, start_i)`` and ends at ``end_i`` (absolute times, so no rounding creeps in);
    each step's prefill and decode token counts must match the log's, else the simulation has diverged from
    the engine's scheduling and a RuntimeError says where.
    """

    name = "trace"

    def __init__(self, step_log: StepLog | list[StepRecord]) -> None:
        steps = step_log.steps if hasattr(step_log, "steps") else step_log
        self.steps = list(steps)
        self.index = 0

    def _current(self) -> StepRecord:
        if self.index >= len(self.steps):
            raise RuntimeError(f"trace cost model: the simulation runs more steps than the {len(self.steps)} logged")
        return self.steps[self.index]

    def start_time(self, now: float) -> float:
        if self.index >= len(self.steps):
            return now
        return max(now, self.steps[self.index].start_s)

    def end_time(self, start: float, stats: StepStats) -> float:
        rec = self._current()
        if rec.num_prefill_tokens != stats.prefill_tokens or rec.num_decode_tokens != stats.decode_seqs:
            raise RuntimeError(
                f"trace cost model: step {self.index} computes {stats.prefill_tokens} prefill + {stats.decode_seqs} "
                f"decode tokens but the engine's computed {rec.num_prefill_tokens} + {rec.num_decode_tokens}"
            )
        self.index += 1
        return rec.end_s

    def step_time(self, stats: StepStats) -> float:
        rec = self._current()
        return rec.end_s - rec.start_s
