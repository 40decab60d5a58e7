"""The benchmark logic on tiny models: accounting by hand, result keys, HF agreement. Never a timing assertion."""

import json

import pytest
import torch
from workbench.kernels.testing import TOLERANCES

from workbench import bench
from workbench.cli import main
from workbench.config import ModelConfig
from workbench.errors import ConfigError
from workbench.hardware import HardwareSpec
from workbench.model import load_checkpoint
from workbench.request import SamplingParams
from workbench.timing import random_prompts

# tiny-gqa: hidden 64, 4 heads of 16 (q 64), 2 KV heads (kv 32), intermediate 160, 2 layers, vocab 256, untied
H, Q, KV, INTER, L, V, NH = 64, 64, 32, 160, 2, 256, 4
FAKE_HW = HardwareSpec(name="fake", peak_flops={"fp32": 1e9}, mem_bandwidth=1e9, mem_capacity=1e9, source="test",
                       details={"read_bandwidth": 2e9})  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return bench.load_bench_model("tiny-gqa", device="cpu")


def test_linear_shapes_are_the_models_matrices():
    shapes = bench.linear_shapes(ModelConfig.resolve("tiny-gqa"))
    per_layer = [(H, Q + 2 * KV), (Q, H), (H, 2 * INTER), (INTER, H)]
    assert shapes == per_layer * L + [(H, V)]


def test_linear_sweep_weight_bytes_by_hand():
    sweep = bench.LinearSweep(ModelConfig.resolve("tiny-gqa"), torch.float32, torch.device("cpu"))
    by_hand = 4 * (L * (H * (Q + 2 * KV) + Q * H + H * 2 * INTER + INTER * H) + H * V)
    assert sweep.weight_bytes == by_hand
    assert sweep.run(3) > 0


def test_decode_bytes_by_hand():
    cfg = ModelConfig.resolve("tiny-gqa")
    contexts = [10, 7, 1]
    b = len(contexts)
    got = bench.decode_step_bytes(cfg, "fp32", contexts)
    # every weight once: per layer two norms, q/k/v, o, gate/up/down; the embedding rows of the B new tokens;
    # the final norm and the untied LM head; fp32 = 4 bytes
    weights = 4 * (L * (2 * H + H * (Q + 2 * KV) + Q * H + 3 * H * INTER) + b * H + H + H * V)
    # per layer: write B new K and V rows, read each sequence's K and V over its whole context
    kv = 4 * L * (2 * KV * b + 2 * KV * sum(contexts))
    assert got["weight_bytes"] == weights
    assert got["kv_bytes"] == kv
    assert got["bytes"] == weights + kv
    # bf16 halves every byte
    half = bench.decode_step_bytes(cfg, "bf16", contexts)
    assert half["bytes"] == (weights + kv) // 2


def test_prefill_flops_by_hand():
    cfg = ModelConfig.resolve("tiny-gqa")
    n = 12
    pairs = n * (n + 1) // 2  # causal: token i sees i + 1 keys
    per_layer = (
        4 * H * n  # attention norm
        + 2 * H * (Q + 2 * KV) * n  # q, k, v projections
        + 3 * (Q + KV) * n  # rotary on q and k
        + 2 * Q * pairs + 5 * NH * pairs + 2 * Q * pairs  # scores, softmax, P V
        + 2 * Q * H * n  # o projection
        + H * n  # residual
        + 4 * H * n  # mlp norm
        + 2 * 2 * H * INTER * n  # gate and up
        + 6 * INTER * n  # SiLU(gate) * up
        + 2 * INTER * H * n  # down
        + H * n  # residual
    )  # fmt: skip
    by_hand = L * per_layer + 4 * H + 2 * H * V  # final norm and LM head on the last position only
    assert bench.prefill_flops(cfg, "fp32", n) == by_hand


def test_decode_rows_have_the_contract_keys(tiny):
    rows = bench.bench_decode(tiny, batches=(1, 3), prompt_len=5, steps=2, warmup=1, hw=FAKE_HW)
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        for key in ("tokens_per_s", "mbu", "gemv_ratio", "overhead_share", "step_s", "achieved_bytes_per_s"):
            assert key in r and r[key] == r[key]  # present and not NaN
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / r["step_s"])
        assert r["mbu"] == pytest.approx(r["achieved_bytes_per_s"] / 2e9)  # over the read bandwidth
        assert r["gemv_ratio"] == pytest.approx(r["achieved_bytes_per_s"] / r["gemv_bytes_per_s"])
        assert 0 <= r["overhead_share"] < 1
    # batch 1: the prompt (5) plus the prefill's token; decode steps attend to 6 (warm-up), then 7 and 8 keys
    assert rows[0]["mean_context"] == pytest.approx(7.5)


def test_prefill_rows(tiny):
    rows = bench.bench_prefill(tiny, prompt_lens=(8, 20), repeats=2, warmup=1, hw=FAKE_HW)
    assert [r["prompt_len"] for r in rows] == [8, 20]
    for r in rows:
        assert r["flops"] == bench.prefill_flops(tiny.config, "fp32", r["prompt_len"])
        assert r["mfu"] == pytest.approx(r["flops"] / r["time_s"] / 1e9)


def test_offline_requests_are_seeded_and_fit_the_context():
    a = bench.offline_requests(256, num_requests=20, context=40, seed=3)
    assert a == bench.offline_requests(256, num_requests=20, context=40, seed=3)
    assert a != bench.offline_requests(256, num_requests=20, context=40, seed=4)
    assert len(a) == 20
    assert all(len(p) >= 1 and n >= 1 and len(p) + n <= 40 for p, n in a)
    assert max(len(p) + n for p, n in a) >= 39  # the longest draw is scaled onto the context (rounding: -1)
    assert all(0 <= t < 256 for p, _ in a for t in p)


def test_offline_counts_every_requested_token(tiny):
    out = bench.bench_offline(tiny, num_requests=6, context=32, max_num_seqs=4, repeats=1, seed=1)
    requests = bench.offline_requests(256, 6, 32, seed=1)
    assert out["output_tokens"] == sum(n for _, n in requests)
    assert out["total_tokens"] == sum(n + len(p) for p, n in requests)
    assert out["output_tokens_per_s"] == pytest.approx(out["output_tokens"] / out["time_s"])
    # an eager engine compiles nothing: its warm-up is the untimed run alone, with no cache lookups in it
    cache = out["compile_cache"]
    assert out["warmup_s"] > 0 and cache["dir"] and cache["fx_graph_cache"] in (True, False)
    assert all(cache[k] == 0 for k in cache if k.endswith(("hits", "misses", "bypasses")))


def test_engine_and_transformers_agree_token_for_token(tiny_checkpoint):
    path = tiny_checkpoint("tiny-gqa")
    model = load_checkpoint(path)
    hf = bench.load_hf_model(path, "fp32", torch.device("cpu"))
    dec = bench.compare_decode(model, hf, prompt_len=9, new_tokens=12, repeats=1)
    assert dec["identical_tokens"] is True
    assert dec["ratio"] == pytest.approx(dec["ours_tokens_per_s"] / dec["hf_tokens_per_s"])
    off = bench.compare_offline(model, hf, num_requests=10, context=48, max_num_seqs=4)
    assert off["identical_tokens"] is True, off["mismatched_requests"]
    assert off["ratio"] == pytest.approx(off["ours_tokens_per_s"] / off["hf_tokens_per_s"])


def test_hf_generate_ignores_eos_and_left_pads(tiny_checkpoint):
    path = tiny_checkpoint("tiny-gqa")
    hf = bench.load_hf_model(path, "fp32", torch.device("cpu"))
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    batched = bench.hf_generate(hf, prompts, 6)
    assert [len(t) for t in batched] == [6, 6]  # never stopped early
    alone = [bench.hf_generate(hf, [p], 6)[0] for p in prompts]
    assert batched == alone  # padding does not change a row's tokens


def test_cli_decode_json(capsys):
    assert main(["bench", "decode", "--model", "tiny-gqa", "--batch", "1", "2", "--prompt-len", "4", "--steps", "1",
                 "--warmup", "0", "--threads", "1", "--device", "cpu", "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["num_threads"] == 1 and out["bench"] == "decode"
    assert [r["batch"] for r in out["results"]] == [1, 2]
    assert {"tokens_per_s", "mbu", "gemv_ratio"} <= set(out["results"][0])
    assert all(r["compiled_decode"] for r in out["results"])  # the CPU default


def test_cli_prefill_table(capsys):
    assert main(["bench", "prefill", "--model", "tiny-gqa", "--prompt-len", "16", "--repeats", "1", "--threads",
                 "1", "--device", "cpu"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "mfu" in text and "1 threads" in text


def test_lengths_beyond_the_models_positions_are_refused(tiny):
    from workbench.errors import ConfigError

    # each benchmark sizes max_model_len to its requests, so tiny-gqa's 256 positions are the limit
    with pytest.raises(ConfigError, match=r"needs max_model_len 513 \(--prompt-len 512 \+ 1 generated token\).* 256 "
                       "positions.*at most 255"):  # fmt: skip
        bench.bench_prefill(tiny, prompt_lens=(512,), hw=FAKE_HW)
    # 250 + (2 warm-up + 8 steps + 1) generated + 1 spare = 262 > 256; the longest prompt is 256 - 12 = 244
    with pytest.raises(ConfigError, match=r"needs max_model_len 262 .* 256 positions.*at most 244$"):
        bench.bench_decode(tiny, batches=(1,), prompt_len=250, hw=FAKE_HW)


def test_fast_layer_paths_equal_their_references():
    """The decode hot path's rotary (roll + signed sine, bit for bit) and fused RMSNorm against the plain formulas."""
    from workbench.model.layers import RMSNorm, RotaryEmbedding, apply_rotary, apply_rotary_rolled, signed_sin

    cfg = ModelConfig.resolve("tiny-gqa")
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(7, 6, 16, generator=gen) * 3).to(dtype)  # (T, heads, d)
        cos, sin = RotaryEmbedding(cfg)(torch.tensor([0, 1, 5, 9, 100, 3, 255]), dtype)
        # the same IEEE products and sums, one sign moved from x to sin: exact on every CPU
        assert torch.equal(apply_rotary_rolled(x, cos, signed_sin(sin)), apply_rotary(x, cos, sin))
        norm = RMSNorm(64, 1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(64, generator=gen))
        h = (torch.randn(5, 64, generator=gen) * 2).to(dtype)
        h32 = h.float()
        reference = norm.weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        with torch.inference_mode():
            # the fused kernel reduces in its own order (vector width depends on the CPU): the dtype's tolerance
            torch.testing.assert_close(norm(h), reference, **TOLERANCES[dtype])


def test_decode_requests_that_finish_before_all_decode_name_the_budget_and_pool(tiny):
    """An engine that does not take every prompt before the first run out of tokens (here decode-first with a budget
    of 18 tokens a step: one 16-token prompt, then one decode and one prompt; the first request has its 2 tokens
    while two prompts wait) is a clear ConfigError naming the policy, the token budget and the pool, not a bare
    'finished early'."""
    engine = bench.bench_engine(tiny, 4, 18, policy="decode-first", token_budget=18)
    for prompt in random_prompts(4, 16, tiny.config.vocab_size, 0):
        engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    expected = r"finished \(length\) while 2 of 4 had no first token .*'decode-first' with a token budget of 18 tokens"
    with pytest.raises(ConfigError, match=expected + r" a step and a pool of \d+ blocks of 16"):
        bench.prefill_until_decoding(engine, 4)
    sized = bench.bench_engine(tiny, 4, 18)  # the default policy and budget take all four first
    for prompt in random_prompts(4, 16, tiny.config.vocab_size, 0):
        sized.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    assert sorted(bench.prefill_until_decoding(sized, 4).values()) == [17] * 4  # 16 prompt tokens + the first one
