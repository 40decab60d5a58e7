"""Hostile input to the engine's Python API (issue 14): each case is refused with the project's error, and the
engine keeps serving the good requests around it with the tokens it gives them alone."""

import pytest

from workbench.config import ModelConfig
from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.errors import ConfigError, RequestError
from workbench.model.transformer import Transformer
from workbench.request import SamplingParams

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return Transformer.from_config(ModelConfig.from_name("tiny-gqa"), seed=0)


def fresh(model, **kwargs) -> Engine:
    return Engine(model, EngineConfig(max_model_len=64, max_num_seqs=4, **kwargs))


def alone(model, prompt, sampling=GREEDY) -> list[int]:
    return fresh(model).generate([prompt], sampling).requests[0].tokens


def drain(engine: Engine) -> dict:
    """Step until idle; the final output (with its ``result``) of every request that finished meanwhile."""
    finished = {}
    while engine.has_unfinished():
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    assert engine.sequences == {}  # the engine keeps no finished request
    return finished


@pytest.mark.parametrize("seed", [2**64, 2**64 + 5, -1])
def test_seed_outside_64_bits_is_rejected_at_validation(seed):
    with pytest.raises(RequestError, match=r"seed must be in \[0, 2\*\*64\)"):
        SamplingParams(temperature=1.0, seed=seed)


def test_largest_seed_is_valid_and_seeds_sampling():
    SamplingParams(temperature=1.0, seed=2**64 - 1)  # the top of the range is accepted


def test_a_seed_too_large_never_breaks_the_engine(model):
    engine = fresh(model)
    bad = SamplingParams(temperature=1.0, seed=1, max_tokens=3)
    bad.seed = 2**64  # changed after validation: the engine validates again at add_request
    good = engine.add_request([5, 6, 7], GREEDY)
    rejected = engine.add_request([5, 6, 7], bad)
    dict_bad = engine.add_request([5, 6], {"temperature": 1.0, "seed": 2**64})
    done = drain(engine)
    assert done[rejected].finish_reason == "rejected"
    assert "2**64" in done[rejected].reject_reason
    assert done[dict_bad].finish_reason == "rejected"
    assert done[good].result.tokens == alone(model, [5, 6, 7])
    # and the engine serves later requests too
    assert engine.generate([[9, 10]], GREEDY).requests[0].tokens == alone(model, [9, 10])


def test_generate_with_fewer_sampling_params_than_prompts_refuses_before_queueing(model):
    engine = fresh(model)
    with pytest.raises(RequestError, match="2 sampling params for 3 prompts"):
        engine.generate([[1, 2], [3, 4], [5, 6]], [GREEDY, GREEDY])
    assert engine.sequences == {} and not engine.has_unfinished()


def test_duplicate_request_id_raises_before_changing_anything(model):
    engine = fresh(model)
    engine.add_request([1, 2, 3], GREEDY, request_id=7)
    first = engine.sequences[7]
    with pytest.raises(RequestError, match="request_id 7 is already in use"):
        engine.add_request([4, 5], GREEDY, request_id=7)
    assert engine.sequences[7] is first and len(engine.scheduler.waiting) == 1


def test_explicit_id_colliding_with_a_later_automatic_id_is_skipped(model):
    engine = fresh(model)
    engine.add_request([1, 2, 3], GREEDY, request_id=1)  # the automatic ids would give 0, then 1
    result = engine.generate([[4, 5], [6, 7]], GREEDY)
    assert [r.request_id for r in result.requests] == [0, 2]
    assert all(r.finish_reason == "length" for r in result.requests)
    assert 1 not in engine.sequences and not engine.has_unfinished()  # served by generate too, then dropped


@pytest.mark.parametrize(
    "prompt, sampling, message",
    [
        (None, None, "prompt_ids must be a list of token ids, got NoneType"),
        ("1,2,3", None, "prompt_ids must be a list of token ids, got str"),
        ([1, 2], "greedy", "sampling must be a SamplingParams, a dict of its fields or None, got str"),
        ([1, 2], [GREEDY], "sampling must be a SamplingParams, a dict of its fields or None, got list"),
        ([1, True], None, "outside the vocabulary"),
    ],
)
def test_wrongly_typed_request_is_rejected_with_a_request_error(model, prompt, sampling, message):
    engine = fresh(model)
    good = engine.add_request([5, 6, 7], GREEDY)
    rid = engine.add_request(prompt, sampling)
    done = drain(engine)
    assert done[rid].finish_reason == "rejected" and message in done[rid].reject_reason
    assert done[good].result.tokens == alone(model, [5, 6, 7])


def test_int8_engine_dtype_is_refused():
    with pytest.raises(ConfigError, match="dtype must be one of fp32, fp16, bf16"):
        EngineConfig(dtype="int8")


def test_ledger_reports_the_bytes_the_pool_allocated(model):
    # an fp32 model with a config that says bf16: the pool holds fp32, and the ledger says so
    engine = Engine(model, EngineConfig(max_model_len=64, max_num_seqs=2, dtype="bf16"))
    cfg = model.config
    by_hand = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, fp32
    allocated = (engine.cache.k[:, 0, 0].numel() + engine.cache.v[:, 0, 0].numel()) * engine.cache.k.element_size()
    assert engine.ledger.kv_bytes_per_token == by_hand == allocated
    assert engine.ledger.weight_bytes == sum(p.numel() * p.element_size() for p in model.parameters())


def test_triton_backend_without_cuda_or_interpreter_is_a_config_error(model, monkeypatch):
    import workbench.kernels._common

    monkeypatch.setattr(workbench.kernels._common, "INTERPRET", False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        Engine(model, EngineConfig(max_model_len=64, attention_backend="triton"))
    assert not hasattr(model, "attn_backend")  # the engine never set one on the model


def test_replay_results_carry_the_traces_own_ids(model):
    from workbench.workloads import Request

    reqs = [Request(11, 0.0, 4, 2), Request(3, 0.0, 5, 2)]
    result = fresh(model).replay(reqs)
    assert sorted(r.request_id for r in result.requests) == [3, 11]


def test_abort_mid_decode_frees_its_blocks_and_spares_the_others(model):
    engine = fresh(model, num_blocks=12, block_size=4)
    keep = engine.add_request([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    drop = engine.add_request([8, 9, 10, 11, 12], SamplingParams(max_tokens=6, ignore_eos=True))
    for _ in range(3):
        engine.step()
    seq = engine.sequences[drop]
    assert seq.num_output_tokens >= 1 and seq.block_table
    assert engine.abort(drop) and seq.finish_reason == "abort" and seq.block_table == []
    engine.block_manager.check_invariants([s.block_table for s in engine.scheduler.running])
    assert not engine.abort(drop) and not engine.abort(12345)  # already finished, unknown
    assert drain(engine)[keep].result.tokens == alone(model, [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    assert engine.block_manager.num_used_blocks == 0


def test_replay_with_ids_already_used_is_refused_before_anything_is_queued(model):
    from workbench.workloads import Request

    engine = fresh(model)
    engine.add_request([1, 2], GREEDY)  # request id 0, still in the engine
    with pytest.raises(RequestError, match=r"request id\(s\) \[0\]"):
        engine.replay([Request(5, 0.0, 4, 2), Request(0, 0.0, 4, 2)])
    assert list(engine.sequences) == [0]
    assert list(drain(engine)) == [0]  # nothing of the refused replay was queued
    with pytest.raises(RequestError, match=r"request id\(s\) \[7\] appear twice"):
        fresh(model).replay([Request(7, 0.0, 4, 2), Request(7, 0.1, 4, 2)])
