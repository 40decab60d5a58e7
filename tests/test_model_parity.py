"""Parity with Hugging Face transformers on the same weights (the acceptance core of the model).

Checkpoints are written by transformers itself (``save_random_checkpoint``) and read by our loader. In fp32 our
prefill logits and 16 decode steps must match transformers' model to ATOL/RTOL below, for a batch of prompts of
different lengths, and greedy generation must be identical token for token.
"""

import pytest
import torch
import transformers

from tests.conftest import TINY_PRESETS
from workbench.model import load_checkpoint
from workbench.model.generate import generate_static
from workbench.request import SamplingParams

MOE_MLA_PRESETS = ("tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-deepseek-v3")  # model.moe, model.mla
ATOL, RTOL = 1e-4, 1e-4  # fp32; observed differences are ~1e-7
NUM_DECODE_STEPS = 16
PROMPTS = [
    [1, 17, 33, 250, 4, 99, 100, 3, 7, 7, 8, 9, 10, 11, 12, 200] * 5 + [5],  # 81 tokens: past tiny-gqa's rope window
    [4, 4, 4],
    [42],
    list(range(3, 40)),
]


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("preset", TINY_PRESETS + MOE_MLA_PRESETS)
def test_prefill_and_decode_logits_match_hf(preset, tiny_checkpoint):
    path = tiny_checkpoint(preset)
    ours, theirs = load_checkpoint(path), hf_model(path)
    cache = ours.new_cache(len(PROMPTS), 128)
    slots = list(range(len(PROMPTS)))
    logits = ours.prefill(PROMPTS, cache, slots)
    seqs = [list(p) for p in PROMPTS]
    with torch.no_grad():
        for step in range(NUM_DECODE_STEPS + 1):
            for i, seq in enumerate(seqs):
                expected = theirs(torch.tensor([seq])).logits[0, -1]
                torch.testing.assert_close(logits[i], expected, atol=ATOL, rtol=RTOL, msg=f"step {step} seq {i}")
            if step == NUM_DECODE_STEPS:
                break
            nxt = logits.argmax(-1).tolist()
            for seq, t in zip(seqs, nxt):
                seq.append(t)
            logits = ours.decode(nxt, cache, slots)


@pytest.mark.parametrize("preset", TINY_PRESETS + MOE_MLA_PRESETS)
def test_greedy_generation_identical_to_hf(preset, tiny_checkpoint):
    path = tiny_checkpoint(preset)
    ours, theirs = load_checkpoint(path), hf_model(path)
    results = generate_static(ours, PROMPTS, SamplingParams(max_tokens=NUM_DECODE_STEPS, ignore_eos=True))
    for prompt, res in zip(PROMPTS, results):
        out = theirs.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NUM_DECODE_STEPS,
            min_new_tokens=NUM_DECODE_STEPS,
            do_sample=False,
            pad_token_id=0,
        )
        assert res.tokens == out[0, len(prompt) :].tolist()


def test_stops_at_eos_like_hf(tiny_checkpoint):
    path = tiny_checkpoint("tiny-mha")
    ours, theirs = load_checkpoint(path), hf_model(path)
    prompt = PROMPTS[0]
    free = generate_static(ours, [prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].tokens
    # declare the 4th generated token to be EOS: both must stop right after emitting it
    eos = free[3]
    ours.config = ours.config.with_overrides(eos_token_ids=(eos,))
    stopped = generate_static(ours, [prompt], SamplingParams(max_tokens=8))[0]
    out = theirs.generate(
        torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )  # fmt: skip
    assert stopped.tokens == out[0, len(prompt) :].tolist() == free[: free.index(eos) + 1]
    assert stopped.finish_reason == "stop"


def test_paged_forward_equals_contiguous_prefill(tiny_checkpoint):
    """The same prompts through scattered 4-token blocks give the same logits as the contiguous cache."""
    from workbench.kv.cache import KVCache
    from workbench.model.attention import build_metadata

    model = load_checkpoint(tiny_checkpoint("tiny-gqa"))
    lens = [len(p) for p in PROMPTS]
    contiguous = model.prefill(PROMPTS, model.new_cache(len(PROMPTS), 128), list(range(len(PROMPTS))))
    block_size, tables, nxt = 4, [], 0
    for n in lens:
        nb = -(-n // block_size)
        tables.append(list(range(nxt + nb - 1, nxt - 1, -1)))  # reversed order on purpose
        nxt += nb
    cache = KVCache(model.config, num_blocks=nxt, block_size=block_size)
    meta = build_metadata(lens, lens, tables, block_size)
    ids = torch.tensor([t for p in PROMPTS for t in p])
    paged = model.compute_logits(model.forward(ids, meta, cache)[meta.last_token_indices])
    torch.testing.assert_close(paged, contiguous, atol=1e-5, rtol=1e-5)


def test_prompt_errors(tiny_checkpoint):
    from workbench.errors import RequestError

    model = load_checkpoint(tiny_checkpoint("tiny-mha"))
    cache = model.new_cache(1, 64)
    with pytest.raises(RequestError, match="empty prompt"):
        model.prefill([[]], cache, [0])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        model.prefill([[1, 256]], cache, [0])
    with pytest.raises(RequestError, match="maximum context length is 64 tokens; the prompt alone has 65:"):
        model.prefill([[1] * 65], cache, [0])
    with pytest.raises(RequestError, match="256 tokens; the prompt has 300 and max_tokens asks for 2 more .302 in"):
        generate_static(model, [[1] * 300], SamplingParams(max_tokens=2))  # beyond max_position_embeddings (256)
    # the prompt fits, prompt + max_tokens does not: refused (the one rule), not cut short at 256 tokens
    with pytest.raises(RequestError, match="the prompt has 250 and max_tokens asks for 10 more .260 in all"):
        generate_static(model, [[1] * 250], SamplingParams(max_tokens=10))
