"""The computations behind the experiment notebooks: each notebook calls these, then plots and records.

- ``phases``: prefill and decode step times on this machine, placed on the roofline (notebooks 01, 02, 03);
- ``serving``: policies on the same workload through the real engine, and a long prompt among running decodes
  (notebooks 03, 04);
- ``weights``, ``compiled``, ``decode_parts``, ``vs_vllm`` (with ``vllm_worker``, run in vLLM's own interpreter),
  ``serve_load``, ``serve_clients``: what the ``workbench bench`` modes of one part of the stack measure
  (``workbench.commands.bench_tools``).
"""
