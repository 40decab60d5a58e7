"""Tensor parallelism over 2 gloo ranks, fp32: a sharded model gives TP=1's logits and transformers' tokens.

One group of 2 ranks serves every checkpoint (spawned ranks are slow to start on 2 cores); each test asks it to
load another one. Rank 0 samples greedily and broadcasts the tokens, as the engine's driver does.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.conftest import TINY_PRESETS, hf_greedy_tokens
from workbench.config import ModelConfig
from workbench.dist.group import DistConfig, WorkerGroup
from workbench.errors import ConfigError
from workbench.model import load_checkpoint
from workbench.model.checkpoint import load_model
from workbench.model.sharding import TensorParallelShard, check_tensor_parallel_size, gather_logits

PROMPTS = [[1, 17, 33, 250, 4, 99, 100, 3, 7, 7, 8, 9] * 4 + [5], [4, 4, 4], list(range(3, 30))]
NUM_DECODE_STEPS = 8
ATOL = RTOL = 1e-5  # fp32: the all-reduce sums partial products in another order than one matmul


class ShardProbe:
    """One rank of a TP model: loads its shard, runs prefill and greedy decode, rank 0 returns the logits."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def load(self, source: str, seed: int = 0) -> None:
        self.model = load_model(source, seed=seed, tensor_parallel=(self.rank, self.world_size))
        self.shard = self.model.tp_shard

    def greedy(self, prompts: list[list[int]], steps: int) -> list[torch.Tensor] | None:
        cache = self.model.new_cache(len(prompts), 128)
        slots = list(range(len(prompts)))
        every_step = []
        logits = gather_logits(self.model.prefill(prompts, cache, slots), self.shard)
        for step in range(steps + 1):
            every_step.append(logits)
            if step == steps:
                break
            tokens = logits.argmax(-1) if self.rank == 0 else torch.empty(len(prompts), dtype=torch.long)
            dist.broadcast(tokens, src=0)  # only the driver samples; the others follow its tokens
            logits = gather_logits(self.model.decode(tokens.tolist(), cache, slots), self.shard)
        return every_step if self.rank == 0 else None

    def local_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(p.shape) for name, p in self.model.named_parameters()}


@pytest.fixture(scope="module")
def tp2():
    with WorkerGroup(DistConfig(2, backend="gloo", timeout_s=120), ShardProbe) as group:
        yield group


def single_rank_logits(model, prompts, steps):
    cache = model.new_cache(len(prompts), 128)
    slots = list(range(len(prompts)))
    logits = model.prefill(prompts, cache, slots)
    out = [logits]
    for _ in range(steps):
        logits = model.decode(logits.argmax(-1).tolist(), cache, slots)
        out.append(logits)
    return out


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_tp2_logits_equal_tp1_and_tokens_equal_transformers(preset, tiny_checkpoint, tp2):
    path = tiny_checkpoint(preset)
    tp2.call("load", str(path))
    sharded = tp2.call("greedy", PROMPTS, NUM_DECODE_STEPS)
    whole = single_rank_logits(load_checkpoint(path), PROMPTS, NUM_DECODE_STEPS)
    for step, (a, b) in enumerate(zip(sharded, whole)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=f"{preset} step {step}")
    ours = torch.stack([s.argmax(-1) for s in sharded[:-1]], dim=1)  # (num_prompts, steps)
    assert ours.tolist() == hf_greedy_tokens(path, PROMPTS, NUM_DECODE_STEPS), preset


def test_a_rank_holds_only_its_shard(tiny_checkpoint, tp2):
    # tiny-gqa: 4 heads of 16, 2 KV heads, intermediate 160, vocab 256, untied head; rank 0 of 2 by hand
    tp2.call("load", str(tiny_checkpoint("tiny-gqa")))
    shapes = tp2.call("local_shapes")
    assert shapes["layers.0.self_attn.qkv_proj.weight"] == (2 * 16 + 2 * 1 * 16, 64)  # 2 query + 1 K + 1 V head
    assert shapes["layers.0.self_attn.o_proj.weight"] == (64, 2 * 16)
    assert shapes["layers.0.mlp.gate_up_proj.weight"] == (2 * 80, 64)
    assert shapes["layers.0.mlp.down_proj.weight"] == (64, 80)
    assert shapes["lm_head.weight"] == (128, 64)
    assert shapes["embed_tokens.weight"] == (256, 64)  # replicated


def test_random_preset_shards_add_up_to_the_same_model(tp2):
    tp2.call("load", "tiny-qwen2", 7)
    sharded = tp2.call("greedy", PROMPTS[1:], 2)
    whole = single_rank_logits(load_model("tiny-qwen2", seed=7), PROMPTS[1:], 2)
    for a, b in zip(sharded, whole):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


def test_mqa_kv_head_is_replicated():
    cfg = ModelConfig.resolve("tiny-mqa")
    shards = [TensorParallelShard(cfg, r, 2) for r in range(2)]
    assert cfg.num_kv_heads == 1
    assert [s.num_kv_heads for s in shards] == [1, 1] and [s.first_kv_head for s in shards] == [0, 0]
    assert shards[1].rows("model.layers.0.self_attn.k_proj.weight") == slice(0, cfg.head_dim)
    q = cfg.num_heads // 2 * cfg.head_dim
    assert shards[1].rows("model.layers.0.self_attn.q_proj.weight") == slice(q, 2 * q)


@pytest.mark.parametrize("tp, field", [(3, "num_heads"), (0, "positive integer")])
def test_a_size_that_does_not_divide_the_model_is_a_config_error(tp, field):
    with pytest.raises(ConfigError, match=field):
        check_tensor_parallel_size(ModelConfig.resolve("tiny-gqa"), tp)


def test_uneven_vocabulary_slices_cover_it_once():
    cfg = ModelConfig.resolve("tiny-gqa")
    import dataclasses

    odd = dataclasses.replace(cfg, vocab_size=255)
    ranges = [TensorParallelShard(odd, r, 2).vocab_range for r in range(2)]
    assert ranges == [(0, 128), (128, 255)]
