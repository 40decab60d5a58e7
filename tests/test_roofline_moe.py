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
    """EP 8 over Mixtral's 8 experts, 8 sequences: each GPU decodes one token, sends it to its 2 experts and back
    in each of the 32 layers, 7 of 8 destinations remote; each GPU holds one expert per layer."""
    cost = moe_decode_cost(MIXTRAL, batch=8, context_len=0, expert_parallel_size=8, hw="h100-sxm")
    assert cost.all_to_all_bytes == pytest.approx(32 * 2 * 1 * 2 * 4096 * 2 * 7 / 8)  # layers x there-and-back x k
    single = moe_decode_cost(MIXTRAL, batch=8, context_len=0)
    assert single.all_to_all_bytes == 0
    experts_bytes = 32 * 3 * 4096 * 14336 * 2  # one expert in every layer
    distinct = 8 * (1 - (6 / 8) ** 8)
    assert single.weight_bytes - cost.weight_bytes == pytest.approx(
        distinct * experts_bytes * 7 / 8 + 7 * 4096 * 2  # 7/8 of the distinct experts, 7 embedding rows fewer
    )
    with pytest.raises(ConfigError, match="must divide Mixtral-8x7B's 8 routed experts"):
        check_expert_parallel(MIXTRAL, 3)
    with pytest.raises(ConfigError, match="dense model"):
        check_expert_parallel(ModelConfig.from_name("Llama-3.1-8B"), 2)
    with pytest.raises(ConfigError, match="positive integer"):
        check_expert_parallel(MIXTRAL, 0)


# ---- the per-operation roofline (what the simulator prices) -----------------------------------------------------
MIXTRAL_NON_EXPERT = (
    2 * 32000 * 4096  # embedding table and LM head (untied)
    + 4096  # final norm
    + 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 8 * 4096 + 2 * 4096)  # q, o, k, v, router, two norms per layer
)
MIXTRAL_EXPERT = 3 * 4096 * 14336  # one expert's gate, up and down


def test_roofline_mixtral_decode_weight_bytes_hand_count():
    model = RooflineModel(MIXTRAL, "h100-sxm")
    batch_one = model.decode([17])
    assert batch_one.weight_bytes == pytest.approx(25_497_714_688, rel=1e-12)  # the hand count above
    names = [op.name for op in batch_one.ops]
    assert "expert_gate_proj" in names and "router" in names and "gate_proj" not in names  # no dense MLP layer
    # a large batch reads every expert: all weights but the embedding table, plus one row per token
    b = 4096
    every = (MIXTRAL_NON_EXPERT + 32 * 8 * MIXTRAL_EXPERT - 32000 * 4096 + b * 4096) * 2
    assert model.decode([17] * b, detailed=False).weight_bytes == pytest.approx(every, rel=1e-12)
    # in between: the non-expert weights, B embedding rows and E (1 - (1 - k/E)^B) experts per layer
    for n in (2, 5, 16):
        distinct = 8 * (1 - (1 - 2 / 8) ** n)
        hand = (MIXTRAL_NON_EXPERT - 32000 * 4096 + n * 4096 + 32 * distinct * MIXTRAL_EXPERT) * 2
        assert model.decode([17] * n, detailed=False).weight_bytes == pytest.approx(hand, rel=1e-12)
    # routed FLOPs follow the active parameters: two experts' matrices per token
    expert_flops = sum(op.flops for op in batch_one.ops if op.name in ("expert_gate_proj", "expert_up_proj",
                                                                         "expert_down_proj"))  # fmt: skip
    assert expert_flops == 32 * 2 * 2 * MIXTRAL_EXPERT


@pytest.mark.parametrize("name", ["Mixtral-8x7B", "Qwen2-57B-A14B", "Qwen3-30B-A3B", "DeepSeek-V3"])
@pytest.mark.parametrize("ep", [1, 4])
def test_roofline_weight_bytes_equal_the_closed_form(name, ep):
    """The per-operation table and ``moe_decode_cost`` (counted from ``num_params``) agree on the weights read."""
    cfg = ModelConfig.from_name(name)
    model = RooflineModel(cfg, "h200", expert_parallel_size=ep)
    for batch in (4, 64, 1000):
        ops = model.decode([100] * batch, detailed=False)
        assert ops.weight_bytes == pytest.approx(
            moe_decode_cost(cfg, batch, 99, expert_parallel_size=ep).weight_bytes, rel=1e-12
        )


def test_roofline_deepseek_v3_mla_kv_and_attention_hand_count():
    """DeepSeek-V3 decode at context 1000: each of 61 layers reads 1000 latent entries of 512 + 64 values and
    writes one; scores are 2 x 128 heads x 576 FLOPs per key, values 2 x 128 x 512 (absorbed form)."""
    cfg = ModelConfig.from_name("DeepSeek-V3")
    cost = RooflineModel(cfg, "h200").decode([1000, 1000])
    assert cost.kv_bytes == 2 * (1000 + 1) * 61 * (512 + 64) * 2
    ops = {op.name: op for op in cost.ops}
    assert ops["attn_scores"].flops == 2 * 61 * 2 * 128 * 576 * 1000
    assert ops["attn_value"].flops == 2 * 61 * 2 * 128 * 512 * 1000
    assert ops["q_absorb"].weight_bytes == 61 * 128 * 128 * 512 * 2  # W_UK: heads x nope dim x latent
    assert {"gate_proj", "shared_gate_proj", "q_a_proj", "kv_a_norm"} <= set(ops)  # 3 dense layers, shared expert
    assert ops["gate_proj"].count == 3 and ops["expert_gate_proj"].count == 58


def test_roofline_expert_parallel_bytes_per_gpu_and_all_to_all():
    """Mixtral on 8 H100s, EP 8: each GPU holds every non-expert weight and one expert per layer; a decode step
    of 64 sequences runs 8 on each GPU, whose 8 x 2 hidden states (bf16) go out and come back in 32 layers."""
    from workbench.hardware import get_hardware

    model = RooflineModel(MIXTRAL, "h100-sxm", expert_parallel_size=8)
    assert model.weight_bytes_per_gpu() == (MIXTRAL_NON_EXPERT + 32 * MIXTRAL_EXPERT) * 2
    assert model.shard.num_gpus == 8
    cost = model.decode([100] * 64)
    a2a = {op.name: op for op in cost.ops}["moe_all_to_all"]
    held = 8 * 2 * 4096 * 2  # one GPU's dispatch buffer: 8 tokens x 2 experts x 4096 values x 2 bytes
    assert a2a.link_bytes == pytest.approx(32 * 2 * held * 7 / 8)
    ic = get_hardware("h100-sxm").interconnect
    assert a2a.time_s == pytest.approx(32 * 2 * (6.6e-6 + 7 / 8 * held / 450e9), rel=1e-9)
    assert ic.base_latency_s == pytest.approx(6.6e-6) and ic.intra_node_bandwidth == 450e9
    # attention is data parallel: one GPU reads the KV of its 8 sequences only
    assert cost.kv_bytes == pytest.approx(8 * 101 * MIXTRAL.kv_bytes_per_token("bf16"))


def test_roofline_refuses_impossible_expert_layouts():
    with pytest.raises(ConfigError, match="must divide Mixtral-8x7B's 8 routed experts"):
        RooflineModel(MIXTRAL, "h100-sxm", expert_parallel_size=3)
    with pytest.raises(ConfigError, match="dense model"):
        RooflineModel(ModelConfig.from_name("Llama-3.1-8B"), "h100-sxm", expert_parallel_size=2)
    with pytest.raises(ConfigError, match="needs tensor_parallel_size 1, got 2"):
        RooflineModel(MIXTRAL, "h100-sxm", expert_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="must divide Mixtral-8x7B's 8 routed experts"):
        RooflineModel(MIXTRAL, "h100-sxm", expert_parallel_size=16)  # more EP ranks than experts


def test_moe_decode_turns_compute_bound_later_than_the_dense_count_would_say():
    """With every expert read once the batch is large, the MoE step turns compute-bound where compute catches up
    with the total weights, a batch the search finds (and a batch one smaller is still memory-bound)."""
    model = RooflineModel(MIXTRAL, "h100-sxm")
    b = model.decode_compute_bound_batch(64)
    assert b is not None and b > 1

    def bound(n: int) -> str:
        return model.decode([64] * n, detailed=False).bound

    assert bound(b) == "compute" and bound(b - 1) == "memory"


def test_tensor_parallel_mixtral_weights_per_gpu_by_hand():
    """TP 2 splits the heads, every expert's intermediate size and the vocabulary; the router and the norms are
    replicated: per GPU q and o 4096 x 2048, k and v 512 x 4096, eight experts of 3 x 4096 x 7168, the router 8 x
    4096, two norms; half the embedding table and half the LM head, the final norm."""
    from workbench.roofline import Shard

    layer = 2 * 4096 * 2048 + 2 * 512 * 4096 + 8 * 3 * 4096 * 7168 + 8 * 4096 + 2 * 4096
    hand = (32 * layer + 2 * 16000 * 4096 + 4096) * 2
    assert Shard.of(MIXTRAL, 2).weight_bytes(MIXTRAL) == hand
    assert RooflineModel(MIXTRAL, "h100-sxm", tensor_parallel_size=2).weight_bytes_per_gpu() == hand
