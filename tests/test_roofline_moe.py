"""The MoE / MLA decode cost of ``workbench.roofline``: hand counts, the distinct-experts formula against a seeded
simulation of routing, and expert-parallel layouts."""

import pytest

from workbench.config import ModelConfig
from workbench.errors import ConfigError
from workbench.roofline import (
    RooflineModel,
    check_expert_parallel,
    expected_distinct_experts,
    moe_decode_cost,
    simulated_distinct_experts,
)

MIXTRAL = ModelConfig.from_name("Mixtral-8x7B")


def test_mixtral_batch_one_decode_reads_the_active_weights():
    """Mixtral-8x7B, bf16, one token: per layer q 4096x4096, k and v 1024x4096 each, o 4096x4096, the router
    8x4096, two of the eight experts (3 x 4096 x 14336 each) and two norms of 4096; then the final norm, the LM head
    32000x4096 and one embedding row of 4096."""
    per_layer = 4096 * 4096 * 2 + 2 * 1024 * 4096 + 8 * 4096 + 2 * 3 * 4096 * 14336 + 2 * 4096
    hand = (32 * per_layer + 4096 + 32000 * 4096 + 4096) * 2
    assert hand == 25_497_714_688
    cost = moe_decode_cost(MIXTRAL, batch=1, context_len=0)
    assert cost.distinct_experts == pytest.approx(2.0)
    assert cost.weight_bytes == pytest.approx(hand, rel=1e-12)


def test_large_batch_reads_every_expert():
    b = 4096
    cost = moe_decode_cost(MIXTRAL, batch=b, context_len=0)
    every = (MIXTRAL.num_params() - 32000 * 4096 + b * 4096) * 2  # all weights; the table only as b rows
    assert cost.weight_bytes == pytest.approx(every, rel=1e-9)
    sizes = [moe_decode_cost(MIXTRAL, batch=n, context_len=0).weight_bytes - n * 4096 * 2 for n in (1, 2, 4, 8, 64)]
    assert sizes == sorted(sizes) and sizes[-1] < every  # grows with the batch, towards the total


@pytest.mark.parametrize("experts, k", [(8, 2), (64, 8), (256, 8)])
@pytest.mark.parametrize("tokens", [1, 3, 16, 64])
def test_distinct_experts_formula_against_seeded_routing(experts, k, tokens):
    simulated = simulated_distinct_experts(experts, k, tokens, trials=3000, seed=tokens)
    assert expected_distinct_experts(experts, k, tokens) == pytest.approx(simulated, rel=0.02)


def test_distinct_experts_limits():
    assert expected_distinct_experts(256, 8, 1) == pytest.approx(8)
    assert expected_distinct_experts(256, 8, 0) == 0
    assert expected_distinct_experts(8, 2, 200) == pytest.approx(8, rel=1e-12)


def test_mla_decode_kv_bytes_hand_count():
    cfg = ModelConfig.from_name("DeepSeek-V3")
    cost = moe_decode_cost(cfg, batch=4, context_len=999)
    assert cost.kv_bytes == 4 * 1000 * 61 * (512 + 64) * 2


def test_expert_parallel_all_to_all_and_layouts():
    cost = moe_decode_cost(MIXTRAL, batch=1, context_len=0, expert_parallel_size=8, hw="h100-sxm")
    assert cost.all_to_all_bytes == pytest.approx(32 * 2 * 1 * 2 * 4096 * 2 * 7 / 8)  # layers x there-and-back x k
    single = moe_decode_cost(MIXTRAL, batch=1, context_len=0)
    assert single.all_to_all_bytes == 0
    experts_bytes = 32 * 2 * 3 * 4096 * 14336 * 2
    assert single.weight_bytes - cost.weight_bytes == pytest.approx(experts_bytes * 7 / 8)
    with pytest.raises(ConfigError, match="must divide Mixtral-8x7B's 8 routed experts"):
        check_expert_parallel(MIXTRAL, 3)
    with pytest.raises(ConfigError, match="dense model"):
        check_expert_parallel(ModelConfig.from_name("Llama-3.1-8B"), 2)
    with pytest.raises(ConfigError, match="positive integer"):
        check_expert_parallel(MIXTRAL, 0)


def test_per_operation_roofline_refuses_moe_clearly():
    with pytest.raises(ConfigError, match="moe_decode_cost"):
        RooflineModel(MIXTRAL, "h100-sxm")
