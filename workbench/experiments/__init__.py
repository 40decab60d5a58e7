"""The computations behind the experiment notebooks: each notebook calls these, then plots and records.

- ``phases``: prefill and decode step times on this machine, placed on the roofline (notebooks 01, 02, 03);
- ``serving``: policies on the same workload through the real engine, and a long prompt among running decodes
  (notebooks 03, 04).
"""
