"""The serving simulator: cost models and a discrete-event loop over the engine's own scheduler.

- ``workbench.sim.stats``: ``StepStats`` (what a step computes) and the ``CostModel`` interface;
- ``workbench.sim.roofline_cost``, ``profiled``, ``trace_cost``: the cost models, one per file; ``fit``: the one
  NNLS solver and ``fit_profile``; ``costmodel``: the factory ``make_cost_model`` (and every name above);
- ``workbench.sim.cluster``: ``SimConfig``, replicas, router, prefill/decode disaggregation, ``simulate``;
- ``workbench.sim.capacity``: ``capacity_search`` (bisection on the request rate), ``rate_scaled``, ``sweep``;
- ``workbench.sim.measure``: measuring the real engine's steps and fitting the ``profiled`` model;
- ``workbench.sim.comm``: measured collective profiles (the analytic collectives are ``workbench.hardware``'s);
- ``workbench.sim.published``: published GPU measurements, the roofline's predictions of them, the calibration fit;
- ``workbench.sim.planner``: the capacity planner (``workbench plan``), its simulations on Ray or serially.
- ``workbench.sim.op_profile``: ``OpProfileCostModel`` (a step as the sum of its profiled operations plus a fitted
  overhead; Vidur's approach) and its overhead fit; ``workbench.sim.op_timing``: timing every operation
  (``workbench profile-ops``).
"""
