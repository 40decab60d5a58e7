"""LLM inference workbench: prefill and decode, measured and modelled.

Rooms: ``config`` (model shapes), ``model`` (the Llama-family transformer), ``kv`` (KV caches and the block
manager), ``engine`` (scheduler, runner, sampler, metrics), ``roofline``/``hardware`` (the analytical model),
``sim`` (the serving simulator), ``pipeline`` (notebooks into reports). Core modules import nothing from the
notebook stack.
"""

__version__ = "0.1.0"
