"""Several processes serving one engine: the worker group over torch.distributed (``group``)."""
