"""The engine API of issue 29: ``step()`` returns per-request deltas, the engine forgets finished requests, the step
log can be bounded, and the handoff methods (``hold``/``release``, ``add_prefilled``) move a request between two
engines in one process with the tokens one engine gives it (the KV copied slot by slot with the connector's
``pack``/``unpack``, the peer of the transfer over torch.distributed)."""

import pytest

from workbench.config import ModelConfig
from workbench.dist.kv_connector import pack, token_slots, unpack
from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.engine.metrics import StepLog
from workbench.errors import RequestError
from workbench.model.transformer import Transformer
from workbench.request import SamplingParams

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [3] * 20]
SAMPLING = SamplingParams(max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=20, seed=11, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return Transformer.from_config(ModelConfig.from_name("tiny-gqa"), seed=0)


def fresh(model, **kwargs) -> Engine:
    return Engine(model, EngineConfig(max_model_len=64, max_num_seqs=4, block_size=4, **kwargs))


def test_step_deltas_add_up_to_generate_and_the_engine_keeps_nothing(model):
    expected = [r.tokens for r in fresh(model).generate(PROMPTS, SAMPLING).requests]
    engine = fresh(model)
    ids = [engine.add_request(p, SAMPLING) for p in PROMPTS]
    tokens, times, finals = {i: [] for i in ids}, {i: [] for i in ids}, {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id not in finals, "no output after the final one"
            tokens[out.request_id] += out.new_token_ids
            times[out.request_id] += out.new_token_times
            assert out.num_output_tokens == len(tokens[out.request_id])
            assert out.num_tokens == len(PROMPTS[ids.index(out.request_id)]) + out.num_output_tokens
            if out.finished:
                finals[out.request_id] = out
    assert [tokens[i] for i in ids] == expected
    for i in ids:
        final = finals[i]
        assert final.finish_reason == "length" and final.result.tokens == tokens[i]
        assert final.result.token_times == times[i] and final.first_token_time == times[i][0]
    assert engine.sequences == {} and engine._num_reported == {}  # nothing of a finished request is kept


def test_a_rejection_is_the_next_steps_output(model):
    engine = fresh(model)
    rid = engine.add_request([], SAMPLING)
    (out,) = engine.step()
    assert (out.request_id, out.finished, out.finish_reason) == (rid, True, "rejected")
    assert "empty prompt" in out.reject_reason and out.new_token_ids == []
    assert engine.sequences == {} and not engine.has_unfinished()


def test_a_bounded_step_log_keeps_the_latest_steps_and_counts_all(model):
    log = StepLog(max_steps=3)
    engine = fresh(model)
    engine.step_log = log
    engine.generate([PROMPTS[0]], SamplingParams(max_tokens=10, ignore_eos=True))  # 10 steps
    assert log.num_recorded == 10 and 3 <= len(log) <= 6
    assert [s.step for s in log.steps] == list(range(10 - len(log), 10))
    with pytest.raises(ValueError, match="max_steps"):
        StepLog(max_steps=0)


def copy_kv(src: Engine, src_table: list[int], dst: Engine, num_tokens: int):
    """A ``receive`` for ``add_prefilled``: the prompt's KV from ``src``'s held blocks into ``dst``'s."""

    def receive(table: list[int]) -> float:
        heads = slice(0, src.cache.num_kv_heads)
        buffer = pack(src.cache, token_slots(src_table, num_tokens, src.cache.block_size), heads)
        unpack(dst.cache, token_slots(table, num_tokens, dst.cache.block_size), heads, buffer)
        return dst.now()

    return receive


@pytest.mark.parametrize("sampling", [SAMPLING, SEEDED], ids=["greedy", "seeded"])
def test_a_request_handed_from_a_prefill_to_a_decode_engine_gets_one_engines_tokens(model, sampling):
    expected = [r.tokens for r in fresh(model).generate(PROMPTS, sampling).requests]
    prefill, decode = fresh(model), fresh(model)
    prefill.hold()
    ids = [prefill.add_request(p, SamplingParams(**{**vars(sampling), "max_tokens": 1})) for p in PROMPTS]
    firsts = {}
    while prefill.has_unfinished():
        firsts.update((o.request_id, o) for o in prefill.step() if o.finished)
    used = prefill.stats()["num_used_blocks"]
    assert used > 0  # held: the blocks stay until release
    for rid, prompt in zip(ids, PROMPTS):
        first = firsts[rid]
        receive = copy_kv(prefill, prefill.held_blocks(rid), decode, len(prompt))
        status = decode.add_prefilled(
            rid, prompt, sampling, first.arrival_time, first.new_token_ids[0], first.first_token_time,
            prefill.handoff_state(rid), receive,
        )  # fmt: skip
        assert status == "admitted" and prefill.release(rid)
    assert prefill.stats()["num_used_blocks"] == 0 and not prefill.release(ids[0])
    done = {}
    while decode.has_unfinished():
        done.update((o.request_id, o) for o in decode.step() if o.finished)
    assert [done[i].result.tokens for i in ids] == expected
    assert [done[i].result.prompt_ids for i in ids] == PROMPTS


def test_a_failed_receive_changes_nothing_and_a_recomputed_request_keeps_its_prompt_and_first_token(model):
    expected = fresh(model).generate([PROMPTS[1]], SAMPLING).requests[0].tokens
    decode = fresh(model)
    args = (7, PROMPTS[1], SAMPLING, 0.0, expected[0], 0.5)
    assert decode.add_prefilled(*args, None, lambda table: None) == "failed"
    assert decode.sequences == {} and decode.stats()["num_used_blocks"] == 0
    assert decode.add_prefilled(*args) == "admitted"  # no KV: the prompt is recomputed here
    with pytest.raises(RequestError, match="already in use"):
        decode.add_prefilled(*args)
    done = {}
    while decode.has_unfinished():
        done.update((o.request_id, o) for o in decode.step() if o.finished)
    result = done[7].result
    assert result.tokens == expected and result.prompt_ids == PROMPTS[1]
    assert result.first_token_time == 0.5 and result.num_prompt_tokens == len(PROMPTS[1])


def test_a_full_decode_engine_answers_full_and_keeps_nothing(model):
    decode = Engine(model, EngineConfig(max_model_len=64, max_num_seqs=1, block_size=4))
    decode.add_request(PROMPTS[0], SAMPLING)
    decode.step()  # its one batch slot is taken
    called = []
    status = decode.add_prefilled(1, PROMPTS[1], SAMPLING, 0.0, 5, 0.1, None, called.append)
    assert status == "full" and called == [] and list(decode.sequences) == [0]
