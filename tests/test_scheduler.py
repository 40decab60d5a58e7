"""Scheduler policies driven by a pure-Python fake executor that really goes through the block tables.

The fake executor writes (position, token) into a dict of KV slots at ``block_table[p // bs] * bs + p % bs``
for every scheduled token, then "attends" by reading positions ``[0, start + n)`` back through the block
table; the next token is a fixed function of the whole prefix read from the cache. So a wrong block table,
a lost or overwritten block, or a bad prefix-cache hit changes the tokens. The reference computes the same
function directly from the token list.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench.engine.scheduler import POLICIES, Scheduler, SchedulerConfig, StepPlan
from workbench.errors import ConfigError, RequestError
from workbench.kv.block_manager import BlockManager
from workbench.request import SamplingParams, Sequence, SequenceStatus

VOCAB = 97


def next_token(tokens: list[int]) -> int:
    acc = len(tokens)
    for i, t in enumerate(tokens):
        acc = (acc * 31 + (i + 1) * t) % 1_000_003
    return acc % VOCAB


def reference_outputs(prompt: list[int], max_tokens: int, max_model_len: int, eos: tuple[int, ...] = ()) -> list[int]:
    tokens = list(prompt)
    out: list[int] = []
    while True:
        t = next_token(tokens)
        out.append(t)
        tokens.append(t)
        if t in eos or len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out


class FakeExecutor:
    """Writes every scheduled token's KV into a slot dict and samples from what it reads back."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.slots: dict[int, tuple[int, int]] = {}

    def slot(self, seq: Sequence, p: int) -> int:
        bs = self.bm.block_size
        return seq.block_table[p // bs] * bs + p % bs

    def execute(self, plan: StepPlan) -> dict[int, int]:
        bs = self.bm.block_size
        for c in plan.chunks:
            seq = c.seq
            assert c.start == seq.num_computed_tokens
            assert len(seq.block_table) * bs >= c.start + c.num_new_tokens, "block table too short"
            for p in range(c.start, c.start + c.num_new_tokens):
                block = self.bm.blocks[seq.block_table[p // bs]]
                assert block.ref_count == 1 and block.hash is None, f"write into shared/cached {block}"
                self.slots[self.slot(seq, p)] = (p, seq.token_at(p))
        sampled = {}
        for c in plan.chunks:
            seq = c.seq
            assert c.samples == (c.start + c.num_new_tokens == seq.num_tokens)
            if c.samples:
                toks = []
                for p in range(seq.num_tokens):
                    pos, tok = self.slots[self.slot(seq, p)]
                    assert pos == p
                    toks.append(tok)
                assert toks == seq.token_ids
                sampled[seq.seq_id] = next_token(toks)
        return sampled


def make_prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    return [[(seed + 7 * i + 3 * j * j) % VOCAB for j in range(lengths[i % len(lengths)])] for i in range(n)]


def run(
    prompts: list[list[int]],
    max_tokens: list[int],
    policy: str,
    num_blocks: int = 256,
    block_size: int = 4,
    max_num_seqs: int = 8,
    token_budget: int | None = None,
    chunk_size: int | None = None,
    max_model_len: int = 128,
    prefix_caching: bool = False,
    arrivals: list[float] | None = None,
    eos: tuple[int, ...] = (),
    extra: list[Sequence] | None = None,
) -> tuple[Scheduler, list[Sequence], list[StepPlan]]:
    bm = BlockManager(num_blocks, block_size, prefix_caching)
    cfg = SchedulerConfig(
        policy=policy,
        max_num_seqs=max_num_seqs,
        token_budget=token_budget,
        chunk_size=chunk_size,
        max_model_len=max_model_len,
        enable_prefix_caching=prefix_caching,
    )
    sched = Scheduler(cfg, bm)
    ex = FakeExecutor(bm)
    arrivals = arrivals or [0.0] * len(prompts)
    pending = [
        Sequence(i, p, SamplingParams(max_tokens=m), arrival_time=a, eos_token_ids=eos)
        for i, (p, m, a) in enumerate(zip(prompts, max_tokens, arrivals))
    ] + list(extra or [])
    pending.sort(key=lambda s: s.arrival_time)
    finished: list[Sequence] = []
    plans: list[StepPlan] = []
    now = 0.0
    for _ in range(10_000):
        while pending and pending[0].arrival_time <= now:
            sched.add(pending.pop(0))
        if not pending and not sched.has_unfinished():
            break
        plan = sched.schedule(now)
        plans.append(plan)
        now += 1.0
        finished += sched.update(plan, ex.execute(plan), now)
        bm.check_invariants([s.block_table for s in sched.running])
        assert sum(s.status is SequenceStatus.RUNNING for s in sched.running) == sched.num_running
    else:
        raise AssertionError("did not finish")
    ids = [s.seq_id for s in finished]
    assert len(ids) == len(set(ids)), "a request finished twice"
    assert bm.num_used_blocks == 0, "blocks leaked"
    return sched, finished, plans


PROMPTS = make_prompts(6, [5, 12, 9, 16, 3, 20])
MAX_TOKENS = [7, 3, 10, 1, 12, 6]
EXPECTED = [reference_outputs(p, m, 128) for p, m in zip(PROMPTS, MAX_TOKENS)]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_every_policy_gives_reference_tokens(policy: str, block_size: int) -> None:
    budget = 16 if policy == "chunked" else None
    chunk = 5 if policy == "chunked" else None
    arrivals = [0.0, 0.0, 2.0, 3.0, 3.0, 9.0]
    sched, finished, _ = run(
        PROMPTS, MAX_TOKENS, policy, block_size=block_size, token_budget=budget, chunk_size=chunk, arrivals=arrivals
    )
    assert len(finished) == len(PROMPTS)
    for seq in finished:
        assert seq.output_token_ids == EXPECTED[seq.seq_id]
        assert seq.finish_reason == "length"
        assert len(seq.token_times) == seq.num_output_tokens
        assert seq.arrival_time <= seq.first_scheduled_time < seq.first_token_time <= seq.finish_time


def test_contiguous_configuration_one_block_per_sequence() -> None:
    # the engine's contiguous cache: block_size = max_model_len, num_blocks = max_num_seqs
    sched, finished, plans = run(PROMPTS, MAX_TOKENS, "continuous", num_blocks=3, block_size=128, max_num_seqs=3)
    assert sorted(s.seq_id for s in finished) == list(range(6))
    assert all(s.output_token_ids == EXPECTED[s.seq_id] for s in finished)
    assert sched.num_preemptions == 0
    assert max(p.num_seqs for p in plans) == 3


def test_static_admits_a_batch_and_runs_it_to_the_end() -> None:
    prompts = make_prompts(3, [4, 6, 5])
    # A: 2 tokens, B: 5 tokens, C waits for the batch {A, B} to finish
    sched, finished, plans = run(prompts, [2, 5, 3], "static", max_num_seqs=2)
    # step 1: prefill A (4) and B (6), padded to 6: 2 padding tokens
    assert [(c.seq.seq_id, c.num_new_tokens) for c in plans[0].chunks] == [(0, 4), (1, 6)]
    assert plans[0].num_padding_tokens == 2
    # step 2 decodes A and B (A finishes with 2 tokens); steps 3-5 decode B alone with one idle slot
    assert [[c.seq.seq_id for c in p.chunks] for p in plans[1:5]] == [[0, 1], [1], [1], [1]]
    assert [p.num_idle_slots for p in plans[1:5]] == [0, 1, 1, 1]
    # step 6: C admitted only now, as a new batch
    assert [(c.seq.seq_id, c.num_new_tokens) for c in plans[5].chunks] == [(2, 5)]
    by_id = {s.seq_id: s for s in finished}
    assert by_id[2].first_scheduled_time == 5.0 and by_id[1].finish_time == 5.0
    assert len(plans) == 8  # C: prefill + 2 decodes


def test_continuous_step_is_all_prefill_or_all_decode() -> None:
    arrivals = [0.0, 0.0, 2.0, 3.0, 3.0, 9.0]
    _, _, plans = run(PROMPTS, MAX_TOKENS, "continuous", arrivals=arrivals)
    for p in plans:
        assert p.num_prefill_tokens == 0 or p.num_decode_tokens == 0
    # the arrival at t=2 stalls the decodes of requests 0 and 1 for one step
    assert [c.seq.seq_id for c in plans[2].chunks] == [2] and plans[2].num_decode_tokens == 0


def test_decode_first_mixes_whole_prompts_after_decodes() -> None:
    arrivals = [0.0, 0.0, 2.0, 3.0, 3.0, 9.0]
    _, _, plans = run(PROMPTS, MAX_TOKENS, "decode-first", arrivals=arrivals)
    step = plans[2]  # t=2: 0 and 1 decode, 2 (9 tokens) is prefilled whole in the same step
    assert [(c.seq.seq_id, c.num_new_tokens, c.is_prefill) for c in step.chunks] == [
        (0, 1, False),
        (1, 1, False),
        (2, 9, True),
    ]


def test_chunked_fills_the_budget_with_decodes_first() -> None:
    prompts = make_prompts(4, [2, 2, 2, 30])
    # three short requests decode from t=1 on; the 30-token prompt arrives at t=2
    for chunk_size, expected_first_chunk in ((4, 4), (8, 5)):
        _, _, plans = run(
            prompts, [20, 20, 20, 2], "chunked", token_budget=8, chunk_size=chunk_size, arrivals=[0, 0, 0, 2]
        )
        step = plans[2]
        assert [c.num_new_tokens for c in step.chunks[:3]] == [1, 1, 1]
        assert not any(c.is_prefill for c in step.chunks[:3])
        assert (step.chunks[3].seq.seq_id, step.chunks[3].num_new_tokens) == (3, expected_first_chunk)
        assert all(p.num_tokens <= 8 for p in plans)


@pytest.mark.parametrize(("chunk_size", "expected"), [(4, [(0, 4), (4, 4), (8, 4)]), (5, [(0, 5), (5, 5), (10, 2)])])
def test_chunk_sizes_that_do_and_do_not_divide_the_prompt(chunk_size: int, expected: list[tuple[int, int]]) -> None:
    prompt = make_prompts(1, [12])
    _, finished, plans = run(prompt, [3], "chunked", token_budget=16, chunk_size=chunk_size)
    chunks = [(c.start, c.num_new_tokens, c.samples) for p in plans for c in p.chunks if c.is_prefill]
    assert chunks == [(s, n, i == len(expected) - 1) for i, (s, n) in enumerate(expected)]
    assert finished[0].output_token_ids == reference_outputs(prompt[0], 3, 128)
    # the first token comes with the last chunk
    assert finished[0].first_token_time == float(len(expected))


@pytest.mark.parametrize("policy", POLICIES)
def test_tiny_pool_preempts_and_still_gives_the_same_tokens(policy: str) -> None:
    prompts = make_prompts(6, [10, 7, 12, 5, 9, 11])
    max_tokens = [14, 12, 10, 16, 13, 9]
    budget = 16 if policy == "chunked" else None
    big, big_fin, _ = run(prompts, max_tokens, policy, num_blocks=256, block_size=2, token_budget=budget)
    # the longest request needs ceil((12 + 10 - 1) / 2) = 11 blocks, so 12 blocks hold it alone
    small, small_fin, plans = run(prompts, max_tokens, policy, num_blocks=12, block_size=2, token_budget=budget)
    assert big.num_preemptions == 0
    assert small.num_preemptions > 0
    assert small.num_preemptions == sum(s.num_preemptions for s in small_fin)
    assert small.num_preemptions == sum(len(p.preempted) for p in plans)
    assert {s.seq_id: s.output_token_ids for s in small_fin} == {s.seq_id: s.output_token_ids for s in big_fin}
    assert all(
        s.output_token_ids == reference_outputs(prompts[s.seq_id], s.sampling.max_tokens, 128) for s in small_fin
    )


@pytest.mark.parametrize("policy", ["continuous", "chunked", "decode-first"])
def test_prefix_cache_hit_computes_fewer_prefill_tokens(policy: str) -> None:
    shared = [(5 * j + 1) % VOCAB for j in range(32)]
    prompts = [shared + [1, 2, 3, 4, 5], shared + [9, 8, 7, 6, 5]]
    budget = 64 if policy == "chunked" else None
    kwargs = dict(block_size=8, arrivals=[0.0, 20.0], token_budget=budget, chunk_size=16 if budget else None)
    off, off_fin, _ = run(prompts, [4, 4], policy, prefix_caching=False, **kwargs)
    on, on_fin, _ = run(prompts, [4, 4], policy, prefix_caching=True, **kwargs)
    # without the cache: 37 + 37 prompt tokens; with it the second request reuses the 4 full shared blocks
    assert off.num_prefill_tokens == 74
    assert on.num_prefill_tokens == 37 + 5
    assert on.num_cached_tokens == 32
    assert {s.seq_id: s.num_cached_tokens for s in on_fin} == {0: 0, 1: 32}
    assert {s.seq_id: s.output_token_ids for s in on_fin} == {s.seq_id: s.output_token_ids for s in off_fin}


def test_prefix_cache_full_hit_still_computes_one_token() -> None:
    prompt = [(3 * j) % VOCAB for j in range(16)]  # exactly two blocks of 8
    sched, fin, plans = run([prompt, prompt], [3, 3], "continuous", block_size=8, prefix_caching=True, arrivals=[0, 10])
    second = next(s for s in fin if s.seq_id == 1)
    assert second.num_cached_tokens == 8  # the last block is recomputed so that the step has logits
    assert second.output_token_ids == reference_outputs(prompt, 3, 128)
    assert sched.num_prefill_tokens == 16 + 8


def test_rejected_requests_do_not_stop_the_others() -> None:
    extra = [
        Sequence(100, [], SamplingParams(max_tokens=2)),
        Sequence(101, list(range(200)), SamplingParams(max_tokens=2)),  # longer than max_model_len 128
        Sequence(102, [1] * 60, SamplingParams(max_tokens=60)),  # needs 30 blocks of 4; pool has 20
        Sequence(103, [1] * 8, SamplingParams(max_tokens=121)),  # 8 + 121 > 128: rejected, not capped at 128
    ]
    sched, finished, _ = run(PROMPTS, MAX_TOKENS, "continuous", num_blocks=20, extra=extra)
    by_id = {s.seq_id: s for s in finished}
    assert sorted(by_id) == [0, 1, 2, 3, 4, 5, 100, 101, 102, 103]
    for i in (100, 101, 102, 103):
        assert by_id[i].finish_reason == "rejected" and by_id[i].output_token_ids == []
    assert "empty prompt" in by_id[100].reject_reason
    assert "max_model_len" in by_id[101].reject_reason
    assert "30 KV blocks" in by_id[102].reject_reason
    assert (
        "maximum context length is 128 tokens; the prompt has 8 and max_tokens asks for 121" in by_id[103].reject_reason
    )
    assert all(by_id[i].output_token_ids == EXPECTED[i] for i in range(6))
    assert sched.num_rejected == 4


def test_eos_stops_unless_ignored() -> None:
    prompt = make_prompts(1, [6])[0]
    ref = reference_outputs(prompt, 20, 128)
    eos = (ref[2],)
    _, fin, _ = run([prompt], [20], "continuous", eos=eos)
    expected = reference_outputs(prompt, 20, 128, eos)
    assert fin[0].output_token_ids == expected and fin[0].finish_reason == "stop"
    seq = Sequence(0, prompt, SamplingParams(max_tokens=20, ignore_eos=True), eos_token_ids=eos)
    assert seq.eos_token_ids == ()


def test_a_request_that_fills_max_model_len_finishes_and_one_beyond_it_is_rejected_not_capped() -> None:
    prompt = make_prompts(1, [10])[0]
    _, fin, _ = run([prompt, prompt], [6, 7], "continuous", max_model_len=16)  # 10 + 6 = 16 fits; 10 + 7 does not
    by_id = {s.seq_id: s for s in fin}
    assert by_id[0].num_tokens == 16 and by_id[0].finish_reason == "length"
    assert by_id[0].output_token_ids == reference_outputs(prompt, 6, 16)
    assert by_id[1].finish_reason == "rejected" and by_id[1].output_token_ids == []
    assert "maximum context length is 16 tokens; the prompt has 10 and max_tokens asks for 7 more" in (
        by_id[1].reject_reason
    )


def test_abort_frees_blocks() -> None:
    bm = BlockManager(16, 4)
    sched = Scheduler(SchedulerConfig(max_model_len=64), bm)
    a, b = Sequence(0, [1] * 10, SamplingParams(max_tokens=5)), Sequence(1, [2] * 3)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    sched.update(plan, {0: 5, 1: 6}, 1.0)
    assert bm.num_used_blocks == 3 + 1
    assert sched.abort(0) is a and a.finish_reason == "abort"
    assert bm.num_used_blocks == 1 and sched.num_running == 1
    assert sched.abort(0) is None


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="policy must be one of static, continuous, chunked"):
        SchedulerConfig(policy="fcfs")
    with pytest.raises(ConfigError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ConfigError, match="token_budget"):
        SchedulerConfig(policy="continuous", token_budget=100, max_model_len=4096)
    assert SchedulerConfig(policy="chunked", token_budget=100).chunk_size == 100
    with pytest.raises(ConfigError, match="chunk_size"):
        SchedulerConfig(policy="chunked", chunk_size=-1)
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(RequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1)


def test_core_modules_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import workbench.engine.scheduler, workbench.engine.metrics, workbench.kv.block_manager\n"
        "import workbench.kv.ledger, workbench.workloads, workbench.commands.trace_stats\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(POLICIES),
    block_size=st.sampled_from([1, 2, 4, 8]),
    spare_blocks=st.integers(0, 12),
    lengths=st.lists(st.tuples(st.integers(1, 14), st.integers(1, 9), st.integers(0, 6)), min_size=1, max_size=7),
    caching=st.booleans(),
    chunk_size=st.integers(1, 9),
    shared_prefix=st.integers(0, 10),
)
def test_random_workloads_finish_with_reference_tokens(
    policy: str,
    block_size: int,
    spare_blocks: int,
    lengths: list[tuple[int, int, int]],
    caching: bool,
    chunk_size: int,
    shared_prefix: int,
) -> None:
    max_model_len = 32
    prefix = [(11 * j + 4) % VOCAB for j in range(shared_prefix)]
    prompts = [(prefix + make_prompts(1, [p], seed=i)[0])[: max_model_len - 1] for i, (p, _, _) in enumerate(lengths)]
    # within the context: a longer request is rejected (test_rejected_requests_do_not_stop_the_others), never capped
    max_tokens = [min(m, max_model_len - len(p)) for p, (_, m, _) in zip(prompts, lengths)]
    arrivals = [float(a) for _, _, a in lengths]
    # the smallest pool that holds the longest request alone, plus some spare blocks
    longest = max(len(p) + m - 1 for p, m in zip(prompts, max_tokens))
    num_blocks = -(-max(longest, max(map(len, prompts))) // block_size) + spare_blocks
    budget = max(chunk_size, 4) if policy == "chunked" else None
    sched, finished, _ = run(
        prompts,
        max_tokens,
        policy,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=3,
        token_budget=budget,
        chunk_size=chunk_size if policy == "chunked" else None,
        max_model_len=max_model_len,
        prefix_caching=caching,
        arrivals=arrivals,
    )
    assert sorted(s.seq_id for s in finished) == list(range(len(prompts)))
    for seq in finished:
        assert seq.output_token_ids == reference_outputs(prompts[seq.seq_id], max_tokens[seq.seq_id], max_model_len)
    assert sched.num_preemptions == sum(s.num_preemptions for s in finished)
