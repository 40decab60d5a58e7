"""Cost models: how long one scheduler step takes, behind one interface, so the simulator never touches a device.

The interface and what a step computes: ``workbench.sim.stats`` (``CostModel``, ``StepStats``). The models, one per
file: ``RooflineCostModel`` (``roofline_cost``: the roofline on a hardware spec, with per-phase efficiencies),
``ProfiledCostModel`` (``profiled``: linear features and a token curve fitted to this machine's engine steps by
``fit.fit_profile``), ``OpProfileCostModel`` (``op_profile``: the sum of the step's operations, each measured alone by
``workbench profile-ops``, plus a fitted per-step overhead; imported when asked for), ``TraceCostModel``
(``trace_cost``: replays a measured step log). This module is the factory, ``make_cost_model``, and the one place the
simulator's callers import them from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench.config import ModelConfig
from workbench.errors import ConfigError
from workbench.sim.fit import CURVE_FEATURES, fit_profile, nnls, token_knots
from workbench.sim.profiled import PROFILE_FORMAT, PROFILE_FORMATS, ProfiledCostModel
from workbench.sim.roofline_cost import RooflineCostModel
from workbench.sim.stats import FEATURES, CostModel, StepStats, decode_stats, plan_stats
from workbench.sim.trace_cost import TraceCostModel

COST_MODELS = ("roofline", "profiled", "op-profile")

__all__ = [
    "COST_MODELS", "CURVE_FEATURES", "FEATURES", "PROFILE_FORMAT", "PROFILE_FORMATS", "CostModel", "ProfiledCostModel",
    "RooflineCostModel", "StepStats", "TraceCostModel", "decode_stats", "fit_profile", "make_cost_model", "nnls",
    "plan_stats", "token_knots",
]  # fmt: skip


def make_cost_model(
    name: str,
    model: ModelConfig | str,
    hardware: str = "h100-sxm",
    dtype: str = "bf16",
    profile: str | Path | None = None,
    prefill_efficiency: float = 1.0,
    decode_efficiency: float = 1.0,
    noise_seed: int | None = None,
    **roofline: Any,
) -> CostModel:
    """A cost model by name: ``roofline`` (model on hardware; ``roofline`` keywords: ``quantization``,
    ``group_size``, ``kv_cache_dtype``, ``tensor_parallel_size``, ``pipeline_parallel_size``,
    ``expert_parallel_size``, ``calibration``,
    ``host_gap_s``, as ``RooflineCostModel``), ``profiled`` or ``op-profile`` (a profile file; ``noise_seed`` draws
    its measured residuals into each step)."""
    if name == "roofline":
        return RooflineCostModel(model, hardware, dtype, prefill_efficiency, decode_efficiency, **roofline)
    if name == "profiled":
        if profile is None:
            raise ConfigError("cost model 'profiled' needs a profile file (--profile PATH)")
        return ProfiledCostModel.load(profile).with_noise(noise_seed)
    if name == "op-profile":  # workbench.sim.op_profile: the sum of profiled operations (workbench profile-ops)
        from workbench.sim.op_profile import OpProfileCostModel

        if profile is None:
            raise ConfigError("cost model 'op-profile' needs a profile file (--profile PATH; `workbench profile-ops`)")
        return OpProfileCostModel.load(profile).with_noise(noise_seed)
    raise ConfigError(f"unknown cost model {name!r}; expected one of {', '.join(COST_MODELS)}")
