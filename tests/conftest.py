"""Shared fixtures. TRITON_INTERPRET must be set before any Triton kernel is defined, so it is set here first."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MPLBACKEND", "agg")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
