"""KV caches: the tensor pools (``cache``), the torch-free ``BlockManager`` and the memory ledger."""
