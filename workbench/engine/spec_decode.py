"""Speculative decoding's torch half: verification (``verify``) and the proposers that need the model
(``OracleProposer``, ``DraftModelProposer``); the config, the n-gram proposer, the counters and the shape of a
speculating step are in the torch-free ``workbench.engine.speculative``.

Row ``i`` of a speculating chunk's logits is the target's distribution ``p_i`` of the token after proposal ``d_i``
(``d_0``: the sequence's last token).

- greedy (temperature 0): the accepted prefix is the longest with ``d_{i+1} = argmax p_i``, followed by the
  target's own next token: exactly the tokens the target would have produced one step at a time.
- temperature > 0 (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023): every proposer here is deterministic, a
  point mass ``q_i = 1[d_i]``, so ``d_{i+1}`` is accepted with probability ``min(1, p_i(d)/q_i(d)) = p_i(d)``, and
  at the first rejection the token is drawn from the residual ``norm(max(0, p_i - q_i))`` (``rejection_sample``).
  Each emitted token is then distributed exactly as the target's own sampling (``p_i`` is the distribution the
  sampler draws from, after temperature, top-k and top-p).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from workbench.engine.scheduler import StepPlan
from workbench.engine.speculative import NgramProposer, SpeculativeConfig
from workbench.errors import ConfigError
from workbench.kv.block_manager import BlockManager
from workbench.kv.cache import KVCache
from workbench.model.attention import build_metadata
from workbench.model.sampler import Sampler, filter_logits
from workbench.model.transformer import Transformer
from workbench.request import SamplingParams, Sequence


# ---- verification ------------------------------------------------------------------------------------------------
def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(n, vocab) fp32 logits -> the (n, vocab) distributions the sampler draws from (temperature, top-k, top-p)."""
    return torch.stack([torch.softmax(filter_logits(row, params.temperature, params.top_k, params.top_p), -1)
                        for row in logits])  # fmt: skip


def greedy_verify(draft: list[int], targets: list[int]) -> list[int]:
    """``targets[i]`` = argmax of row i (``len(draft) + 1`` rows): the accepted proposals and the target's token."""
    a = 0
    while a < len(draft) and draft[a] == targets[a]:
        a += 1
    return targets[: a + 1]


def rejection_sample(
    drafts: torch.Tensor, num_draft: torch.Tensor, probs: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al.'s verification of deterministic proposals, for a batch of B sequences at once.

    drafts: (B, K) proposed ids (row b's first ``num_draft[b]`` count, the rest is padding); probs: (B, K + 1, vocab),
    row b's target distributions at its ``num_draft[b] + 1`` positions; uniforms: (B, K + 1) in [0, 1), row b's
    first ``num_draft[b]`` decide its acceptances and its last one (``uniforms[b, K]``) draws the emitted token by
    inverse CDF: from the residual ``p_a`` without ``d_{a+1}`` at the first rejection ``a``, else from ``p_k``.
    Returns (accepted (B,), tokens (B, K + 1)): row b emits ``tokens[b, : accepted[b] + 1]``."""
    b, k = drafts.shape
    arange = torch.arange(b, device=probs.device)
    p_draft = probs[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # (B, K): p_i(d_{i+1})
    valid = torch.arange(k, device=probs.device).unsqueeze(0) < num_draft.unsqueeze(1)
    accept = (uniforms[:, :k] < p_draft) & valid
    accepted = torch.cumprod(accept.to(torch.int64), dim=1).sum(dim=1)  # (B,) leading accepts
    final = probs[arange, accepted].clone()  # (B, vocab)
    rejected = accepted < num_draft
    if k:
        rejected_token = drafts[arange, accepted.clamp(max=k - 1)]
        final[arange[rejected], rejected_token[rejected]] = 0.0  # max(0, p - q), q the point mass at the draft
    cdf = final.cumsum(-1)
    x = uniforms[:, k : k + 1] * cdf[:, -1:]
    token = torch.searchsorted(cdf, x, right=True).clamp(max=final.shape[-1] - 1).squeeze(-1)
    tokens = torch.cat([drafts, torch.zeros(b, 1, dtype=drafts.dtype, device=drafts.device)], dim=1)
    tokens[arange, accepted] = token
    return accepted, tokens


def verify(plan: StepPlan, logits: torch.Tensor, sampler: Sampler) -> dict[int, int | list[int]]:
    """Tokens of a step with proposals (``logits``: the rows of ``StepInput.rows``): for a speculating chunk the list of
    accepted proposals plus the target's token, for any other sampling chunk its one token (``sampler``'s draw).
    A sampling request's generator gives k + 1 uniforms per verification, whatever it is batched with."""
    argmax = torch.argmax(logits, dim=-1).tolist()
    out: dict[int, int | list[int]] = {}
    sampled: list[tuple[int, list[int], torch.Tensor, torch.Tensor]] = []  # (seq id, draft, probs, uniforms)
    row = 0
    for chunk in plan.chunks:
        if not chunk.samples:
            continue
        seq, draft = chunk.seq, chunk.spec_token_ids
        n = len(draft) + 1
        params = seq.sampling
        if not draft:
            out[seq.seq_id] = sampler(logits[row : row + 1], [params], [seq.seq_id])[0]
        elif params.is_greedy:
            out[seq.seq_id] = greedy_verify(draft, argmax[row : row + n])
        else:
            gen = sampler.generator_for(seq.seq_id, params, logits.device)
            uniforms = torch.rand(n, generator=gen, device=logits.device)
            sampled.append((seq.seq_id, draft, target_probs(logits[row : row + n], params), uniforms))
        row += n
    if sampled:
        k = max(len(d) for _, d, _, _ in sampled)
        b, vocab, dev = len(sampled), logits.shape[-1], logits.device
        drafts = torch.zeros(b, k, dtype=torch.long, device=dev)
        probs = torch.zeros(b, k + 1, vocab, device=dev)
        uniforms = torch.zeros(b, k + 1, device=dev)
        for i, (_, draft, p, u) in enumerate(sampled):
            n = len(draft)
            drafts[i, :n] = torch.tensor(draft, device=dev)
            probs[i, : n + 1] = p
            uniforms[i, :n] = u[:n]
            uniforms[i, k] = u[n]
        num_draft = torch.tensor([len(d) for _, d, _, _ in sampled], device=dev)
        accepted, tokens = rejection_sample(drafts, num_draft, probs, uniforms)
        for (sid, _, _, _), a, toks in zip(sampled, accepted.tolist(), tokens.tolist()):
            out[sid] = toks[: a + 1]
    return out


# ---- proposers that need a model -----------------------------------------------------------------------------------
class OracleProposer:
    """The target's greedy continuation, each token kept with probability ``acceptance`` (else a different token,
    seeded coin flips), so a run's acceptance rate is dialled for experiments. The continuation is a reference run
    (``add_reference``: a run without speculation, kept by prompt), or else computed on first need with the static
    loop (``generate_static``, greedy, EOS ignored) and again whenever the outputs leave it, kept by request until
    ``release``."""

    def __init__(self, model: Transformer, acceptance: float, seed: int = 0) -> None:
        self.model, self.acceptance = model, acceptance
        self.vocab_size = model.config.vocab_size
        self.rng = random.Random(seed)
        self.references: dict[tuple[int, ...], list[int]] = {}  # prompt -> the target's greedy continuation
        self._computed: dict[int, list[int]] = {}  # request id -> a continuation computed here (until release)

    def add_reference(self, prompt: list[int], continuation: list[int]) -> None:
        """The target's greedy continuation of ``prompt`` (from a run without speculation)."""
        self.references[tuple(prompt)] = list(continuation)

    def _reference(self, seq: Sequence, k: int) -> list[int]:
        out = seq.output_token_ids
        n = len(out)
        for ref in (self.references.get(tuple(seq.prompt_token_ids)), self._computed.get(seq.seq_id)):
            if ref is not None and ref[:n] == out and (len(ref) >= n + k or len(ref) >= seq.sampling.max_tokens):
                return ref
        from workbench.model.generate import generate_static

        context = seq.prompt_token_ids + out
        horizon = min(max(seq.sampling.max_tokens - n, k), self.model.config.max_position_embeddings - len(context))
        ref = list(out)
        if horizon > 0:
            params = SamplingParams(max_tokens=horizon, ignore_eos=True)
            ref += generate_static(self.model, [context], params)[0].tokens
        self._computed[seq.seq_id] = ref
        return ref

    def propose(self, seq: Sequence, k: int) -> list[int]:
        ref = self._reference(seq, k)
        n = seq.num_output_tokens
        proposal = []
        for token in ref[n : n + k]:
            if self.rng.random() >= self.acceptance:  # a wrong token: any other id of the vocabulary
                token = (token + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
            proposal.append(token)
        return proposal

    @property
    def num_requests(self) -> int:
        """Requests holding a computed continuation."""
        return len(self._computed)

    def release(self, seq_id: int) -> None:
        self._computed.pop(seq_id, None)


class DraftModelProposer:
    """A smaller model's greedy continuation, one token per forward, over its own paged KV pool: each step it catches
    up on the tokens it has not seen; its KV past the accepted tokens is dropped (``BlockManager.truncate``)."""

    def __init__(self, draft: Transformer, target_vocab: int, num_blocks: int, block_size: int) -> None:
        if draft.config.vocab_size != target_vocab:
            raise ConfigError(
                f"the draft model's vocabulary ({draft.config.vocab_size}) differs from the target's ({target_vocab}); "
                "a draft must share the target's tokenizer"
            )
        self.model = draft
        self.cache = KVCache(draft.config, num_blocks, block_size, dtype=draft.dtype, device=draft.device)
        self.block_manager = BlockManager(num_blocks, block_size)
        self._seqs: dict[int, Sequence] = {}  # the draft's own view of each target sequence

    def propose(self, seq: Sequence, k: int) -> list[int]:
        mine = self._seqs.get(seq.seq_id)
        if mine is None:
            mine = self._seqs[seq.seq_id] = Sequence(seq.seq_id, seq.prompt_token_ids)
        tokens = seq.token_ids
        # the draft's K/V stand for the positions whose tokens the target kept (its proposals past them are gone)
        valid = 0
        limit = min(mine.num_computed_tokens, len(tokens) - 1)  # the last token's logits are always computed anew
        mine_tokens = mine.token_ids
        while valid < limit and mine_tokens[valid] == tokens[valid]:
            valid += 1
        mine.output_token_ids = tokens[len(seq.prompt_token_ids) :]
        mine.num_computed_tokens = valid
        self.block_manager.truncate(mine, valid)
        k = min(k, self.model.config.max_position_embeddings - len(tokens))
        proposal: list[int] = []
        for _ in range(k):
            end = mine.num_tokens
            if not self.block_manager.append_slots(mine, end):
                break  # the draft's pool is full: propose what there is
            start = mine.num_computed_tokens
            ids = torch.tensor(mine.token_slice(start, end), dtype=torch.long, device=self.model.device)
            meta = build_metadata([end - start], [end], [mine.block_table], self.cache.block_size, self.model.device)
            hidden = self.model.forward(ids, meta, self.cache)
            token = int(torch.argmax(self.model.compute_logits(hidden[-1:]), dim=-1)[0])
            mine.num_computed_tokens = end
            mine.output_token_ids.append(token)
            proposal.append(token)
        return proposal

    @property
    def num_requests(self) -> int:
        """Requests the draft holds a sequence (and KV blocks) for."""
        return len(self._seqs)

    def release(self, seq_id: int) -> None:
        mine = self._seqs.pop(seq_id, None)
        if mine is not None:
            self.block_manager.free(mine)


class Speculator:
    """The engine's proposer: ``propose(running)`` is the scheduler's ``proposer`` hook (proposals for every running
    sequence that decodes next), ``release`` drops a finished request's state."""

    def __init__(self, config: SpeculativeConfig, proposer: Any) -> None:
        self.config, self.proposer = config, proposer
        self.k = config.num_speculative_tokens

    def propose(self, running: list[Sequence]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for seq in running:
            if seq.num_computed_tokens != seq.num_tokens - 1:
                continue  # still prefilling
            k = min(self.k, seq.sampling.max_tokens - seq.num_output_tokens - 1)
            if k < 1:
                continue
            draft = self.proposer.propose(seq.token_ids if isinstance(self.proposer, NgramProposer) else seq, k)
            if draft:
                out[seq.seq_id] = draft
        return out

    def release(self, seq_id: int) -> None:
        if not isinstance(self.proposer, NgramProposer):
            self.proposer.release(seq_id)

    @property
    def num_requests(self) -> int:
        """Requests whose proposer state is held (the n-gram proposer holds none)."""
        return 0 if isinstance(self.proposer, NgramProposer) else self.proposer.num_requests


def make_speculator(
    config: SpeculativeConfig, model: Transformer, max_num_seqs: int, max_model_len: int, block_size: int
) -> Speculator:
    """The ``Speculator`` of ``config`` for target ``model``; a draft model is loaded on the target's device and
    dtype with a pool for ``max_num_seqs`` sequences of ``max_model_len`` tokens."""
    if config.method == "ngram":
        return Speculator(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max))
    if config.method == "oracle":
        return Speculator(config, OracleProposer(model, config.acceptance, config.seed))
    from workbench.config import ceil_div
    from workbench.model.checkpoint import load_model

    draft = load_model(config.model, dtype=model.dtype, device=model.device)
    num_blocks = max_num_seqs * ceil_div(max_model_len, block_size)
    return Speculator(config, DraftModelProposer(draft, model.config.vocab_size, num_blocks, block_size))
