"""The process-group layer, below the engine: ranks, spawn/torchrun and timeouts (``group``), the KV connector's
transport (``kv_connector``) and the collectives' benchmark (``collective_bench``)."""
