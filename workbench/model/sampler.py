"""Next-token sampling: greedy, temperature, top-k, top-p (nucleus), each request with its own seeded generator.

The whole batch stays on the device: greedy rows are one ``argmax``; the other rows are filtered and sampled row by
row with the request's own ``torch.Generator`` so that a seeded request gives the same tokens whatever it is batched
with. Only the chosen ids cross to the host, once per step.
"""

from __future__ import annotations

import torch

from workbench.request import SamplingParams


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Scaled logits with everything outside top-k and the top-p nucleus set to -inf. logits: (vocab,) fp32."""
    x = logits / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first token is always kept)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


class Sampler:
    """Picks one token per row of a (num_seqs, vocab) logits tensor."""

    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}

    def generator_for(self, seq_id: int, params: SamplingParams, device: torch.device) -> torch.Generator:
        """The request's own generator, seeded from ``params.seed`` (or from fresh entropy when None)."""
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(params.seed) if params.seed is not None else gen.seed()
            self._generators[seq_id] = gen
        return gen

    def release(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    @property
    def num_generators(self) -> int:
        """Requests holding a generator (released with each finished request)."""
        return len(self._generators)

    def generator_state(self, seq_id: int) -> torch.Tensor | None:
        """The state of the request's generator (None when it has none: greedy so far), to continue it elsewhere."""
        gen = self._generators.get(seq_id)
        return None if gen is None else gen.get_state()

    def resume(self, seq_id: int, state: torch.Tensor, device: torch.device) -> None:
        """Give the request a generator in ``state`` (``generator_state`` of another engine's sampler), so that its
        next draw continues that engine's sequence of draws instead of repeating it from the seed."""
        gen = torch.Generator(device=device)
        gen.set_state(state)
        self._generators[seq_id] = gen

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int]) -> list[int]:
        """logits: (num_seqs, vocab) fp32 -> one token id per row."""
        out = torch.argmax(logits, dim=-1)  # (num_seqs,)
        for row, (p, sid) in enumerate(zip(params, seq_ids)):
            if p.is_greedy:
                continue
            x = filter_logits(logits[row], p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(x, dim=-1)
            out[row] = torch.multinomial(probs, 1, generator=self.generator_for(sid, p, logits.device))[0]
        return out.tolist()
