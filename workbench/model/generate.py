"""The plainest generation loop: one static batch over a contiguous cache, prefill once, then decode step by step.

This is the seed's pseudocode made real (and what gpt-fast does): it has no scheduler, so every sequence waits for
the longest one. The engine (``workbench.engine``) does the same work with continuous batching, paging and
chunking; this loop stays as the reference it is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workbench.model.sampler import Sampler
from workbench.model.transformer import Transformer
from workbench.request import SamplingParams, validate_request


@dataclass
class GenerationResult:
    """One request's output."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"


def generate_static(
    model: Transformer, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams
) -> list[GenerationResult]:
    """Generate for all prompts as one static batch; stops each at EOS (unless ignore_eos) or max_tokens. A request
    whose prompt + max_tokens exceeds the model's positions is refused (RequestError,
    ``workbench.request.validate_request``), never cut short."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    cfg = model.config
    for p, sp in zip(prompts, params):  # the one request rule: prompt + max_tokens within the model's positions
        validate_request(p, sp.max_tokens, cfg.max_position_embeddings, cfg.vocab_size)
    max_len = max(len(p) + sp.max_tokens for p, sp in zip(prompts, params))
    cache = model.new_cache(len(prompts), max_len)
    sampler = Sampler()
    results = [GenerationResult() for _ in prompts]
    eos = [() if sp.ignore_eos else cfg.eos_token_ids for sp in params]
    active = list(range(len(prompts)))  # also each request's sampler id
    logits = model.prefill(prompts, cache, active)
    while active:
        tokens = sampler(logits, [params[i] for i in active], active)
        still = []
        for i, tok in zip(active, tokens):
            r = results[i]
            r.tokens.append(tok)
            if tok in eos[i]:
                r.finish_reason = "stop"
            elif len(r.tokens) < params[i].max_tokens:  # else finished at "length", the default
                still.append(i)
        active = still
        if active:
            logits = model.decode([results[i].tokens[-1] for i in active], cache, active)
    return results
