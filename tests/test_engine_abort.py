"""``Engine.abort``: an aborted request frees its KV blocks between steps and the others finish unchanged."""

from workbench.engine.config import EngineConfig
from workbench.engine.engine import Engine
from workbench.request import SamplingParams


def _engine():
    return Engine.from_model("tiny-gqa", EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4))


def test_abort_frees_blocks_and_the_others_get_the_same_tokens():
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = _engine().generate([[5, 6, 7]], sp).requests[0].tokens  # the survivor served by itself

    engine = _engine()
    keep = engine.add_request([5, 6, 7], sp)
    drop = engine.add_request([9, 10, 11, 12, 13], sp)
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    out = engine.abort(drop)
    assert out is not None and out.finished and out.finish_reason == "abort" and out.finish_time is not None
    assert out.new_token_ids == [] and out.result.num_output_tokens == 3 and drop not in engine.sequences
    assert engine.abort(drop) is None  # already gone
    # the survivor: positions 0-4 computed (3 prompt + 2 outputs; the newest output is not in the cache yet): 2 blocks
    assert engine.block_manager.num_used_blocks == 2
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() if out.request_id == keep for t in out.new_token_ids]
    assert engine.sequences == {}
    assert len(tokens) == 12 - 3 and tokens == alone[3:]  # the deltas after the first three steps
    assert engine.block_manager.num_used_blocks == 0


def test_abort_of_a_waiting_request_and_of_an_unknown_id():
    engine = _engine()
    rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4))
    assert engine.abort(rid).finish_reason == "abort"
    assert not engine.has_unfinished() and engine.abort(12345) is None
