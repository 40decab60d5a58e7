"""``RooflineCostModel``: the roofline prediction of ``workbench.roofline`` divided by a per-phase efficiency.

The roofline is that of one GPU of a tensor-parallel x pipeline-parallel (x expert-parallel: attention data-parallel,
the MoE layers' all-to-all) group, its communication included (the step's wall time on the group), with an optional
calibration (per-kernel floor, memory efficiency, matrix-product efficiency against the token count); the calibration's
per-step host overhead is the gap between steps.

A mixed step blends the efficiencies in proportion to each phase's own roofline time. Pure decode runs use an
exact piecewise-linear form of the roofline in the context length (cached per batch size), evaluated in
O(log ops) per step; ``step_time`` is the reference it is tested against.
"""

from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING, Any

from workbench.config import DEFAULT_GROUP_SIZE, ModelConfig
from workbench.errors import ConfigError
from workbench.hardware import Calibration
from workbench.sim.stats import CostModel, StepStats, check_gap

if TYPE_CHECKING:
    from workbench.roofline import RooflineModel


class RooflineCostModel(CostModel):
    """The roofline prediction of ``workbench.roofline`` divided by a per-phase efficiency (1.0: the floor)."""

    name = "roofline"

    def __init__(
        self,
        model: ModelConfig | str,
        hardware: Any,
        dtype: str = "bf16",
        prefill_efficiency: float = 1.0,
        decode_efficiency: float = 1.0,
        host_gap_s: float | None = 0.0,
        *,
        quantization: str | None = None,
        group_size: int = DEFAULT_GROUP_SIZE,
        kv_cache_dtype: str | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        calibration: Calibration | str | None = None,
        expert_parallel_size: int = 1,
    ) -> None:
        """``calibration``: None (the ideal roofline, the default), 'hardware' (the spec's own from
        ``accelerators.yaml``) or a ``Calibration``; its per-step host overhead becomes ``host_gap_s`` unless
        ``host_gap_s`` is given (None: take the calibration's)."""
        from workbench.roofline import get_model

        for fname, value in (("prefill_efficiency", prefill_efficiency), ("decode_efficiency", decode_efficiency)):
            if not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
                raise ConfigError(f"{fname} must be in (0, 1], got {value!r}")
        full = get_model(model, hardware, dtype=dtype, kv_dtype=kv_cache_dtype, quantization=quantization,
                         group_size=group_size, tensor_parallel_size=tensor_parallel_size,
                         pipeline_parallel_size=pipeline_parallel_size, calibration=calibration,
                         expert_parallel_size=expert_parallel_size)  # fmt: skip
        self.calibration = full.calibration
        if host_gap_s is None:
            host_gap_s = full.calibration.step_overhead_s
        check_gap(host_gap_s)
        # the device's time only: the host's share of a step is the gap between steps
        self.roofline: RooflineModel = (
            full if full.calibration.step_overhead_s == 0 else get_model(
                model, hardware, dtype=dtype, kv_dtype=kv_cache_dtype, quantization=quantization,
                group_size=group_size, tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size, expert_parallel_size=expert_parallel_size,
                calibration=full.calibration.replace(step_overhead_s=0.0),
            )
        )  # fmt: skip
        self.prefill_efficiency = float(prefill_efficiency)
        self.decode_efficiency = float(decode_efficiency)
        self.host_gap_s = float(host_gap_s)
        self._segments: dict[int, tuple[list[float], list[float], list[float]]] = {}

    def step_time(self, stats: StepStats) -> float:
        pt, ps, pp, pc, ds, dc = stats[:6]
        rows = ps + ds + stats.spec_tokens  # logit rows: one per sampling chunk, k + 1 per verify
        time_from_stats = self.roofline.time_from_stats
        t = time_from_stats(pt + ds, rows, pp + dc, pc + dc)
        ep, ed = self.prefill_efficiency, self.decode_efficiency
        if ep == 1.0 and ed == 1.0:
            return t
        if not ds:
            return t / ep
        if not pt:
            return t / ed
        tp, td = time_from_stats(pt, ps + stats.spec_tokens, pp, pc), time_from_stats(ds, ds, dc, dc)
        return t * (tp / ep + td / ed) / (tp + td)

    def _decode_segments(self, n: int) -> tuple[list[float], list[float], list[float]]:
        """The roofline time of a decode step of ``n`` sequences as a piecewise-linear function of the context
        C (pairs = context = C): per term ``multiple * max(a_i + b_i C)`` over its lines (compute, memory, kernel
        floor); returns (breakpoints, alpha, beta) with ``time = alpha[i] + beta[i] * C`` for ``C`` in segment
        ``i = bisect(breakpoints, C)``."""
        seg = self._segments.get(n)
        if seg is not None:
            return seg
        terms = self.roofline.decode_lines(n)
        breaks: set[float] = set()
        for _mult, lines in terms:
            for i, (a1, b1) in enumerate(lines):
                for a2, b2 in lines[i + 1 :]:
                    if b1 != b2:
                        x = (a2 - a1) / (b1 - b2)
                        if x > 0:
                            breaks.add(x)
        points = sorted(breaks)
        alphas, betas = [], []
        for i in range(len(points) + 1):
            lo = points[i - 1] if i > 0 else 0.0
            hi = points[i] if i < len(points) else 2.0 * lo + 1.0
            mid = (lo + hi) / 2
            alpha = beta = 0.0
            for mult, lines in terms:
                a_best, b_best = max(lines, key=lambda line: line[0] + line[1] * mid)
                alpha, beta = alpha + mult * a_best, beta + mult * b_best
            alphas.append(alpha / self.decode_efficiency)
            betas.append(beta / self.decode_efficiency)
        seg = self._segments[n] = (points, alphas, betas)
        return seg

    def decode_time(self, num_seqs: int, context: int) -> float:
        """The fast path's time of one pure-decode step (equal to ``step_time`` up to rounding)."""
        points, alphas, betas = self._decode_segments(num_seqs)
        i = bisect.bisect_right(points, context)
        return alphas[i] + betas[i] * context

    def decode_run(
        self, now: float, num_seqs: int, context: int, max_steps: int, before: float
    ) -> tuple[list[float], list[float]]:
        points, alphas, betas = self._decode_segments(num_seqs)
        gap = self.host_gap_s
        starts: list[float] = []
        ends: list[float] = []
        t = now
        i = bisect.bisect_right(points, context)
        limit = points[i] if i < len(points) else math.inf
        for _ in range(max_steps):
            s = t + gap
            if s >= before:
                break
            while context >= limit:
                i += 1
                limit = points[i] if i < len(points) else math.inf
            t = s + alphas[i] + betas[i] * context
            starts.append(s)
            ends.append(t)
            context += num_seqs
        return starts, ends

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.roofline.cfg.name,
            "hardware": self.roofline.hw.name,
            "dtype": self.roofline.act_dtype,
            "quantization": self.roofline.quantization,
            "kv_cache_dtype": self.roofline.kv_dtype,
            "tensor_parallel_size": self.roofline.tensor_parallel_size,
            "pipeline_parallel_size": self.roofline.pipeline_parallel_size,
            "expert_parallel_size": self.roofline.expert_parallel_size,
            "calibration": self.calibration.to_dict(),
            "prefill_efficiency": self.prefill_efficiency,
            "decode_efficiency": self.decode_efficiency,
            "host_gap_s": self.host_gap_s,
        }
