"""The serving simulator: cost models and a discrete-event loop over the engine's own scheduler.

- ``workbench.sim.costmodel``: ``CostModel`` and its ``roofline``, ``profiled`` and ``trace`` models;
- ``workbench.sim.cluster``: ``SimConfig``, replicas, router, prefill/decode disaggregation, ``simulate``;
- ``workbench.sim.capacity``: ``capacity_search`` (bisection on the request rate), ``rate_scaled``, ``sweep``;
- ``workbench.sim.measure``: measuring the real engine's steps and fitting the ``profiled`` model.
"""
