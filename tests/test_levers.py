"""Decode levers (workbench.experiments.levers), logit accuracy (workbench.model.accuracy) and the byte counts
of quantized formats in the decode benchmark: by hand or against transformers; never a timing assertion."""

import json
import math

import pytest
import torch

from workbench import bench
from workbench.cli import main
from workbench.config import ModelConfig
from workbench.experiments import claims, levers
from workbench.experiments.trials import DecisionRule, run_rounds
from workbench.hardware import HardwareSpec
from workbench.model.accuracy import compare_logits, logit_agreement, prompt_logits

FAKE_HW = HardwareSpec(name="fake", peak_flops={"fp32": 1e9}, mem_bandwidth=1e9, mem_capacity=1e9, source="test",
                       details={"read_bandwidth": 2e9})  # fmt: skip


def test_compare_logits_by_hand():
    # p = softmax(1, 0), q = softmax(0, 1): KL = p1 * 1 + p2 * (-1) = (e - 1) / (e + 1); orthogonal: cosine 0
    got = compare_logits(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]))
    assert got["kl"] == pytest.approx((math.e - 1) / (math.e + 1))
    assert got["cosine"] == pytest.approx(0.0) and got["top1_agreement"] == 0.0
    same = compare_logits(torch.tensor([[3.0, 4.0], [1.0, 2.0]]), torch.tensor([[6.0, 8.0], [2.0, 1.0]]))
    assert same["cosine"] == pytest.approx((1 + 0.8) / 2) and same["top1_agreement"] == 0.5


def test_prompt_logits_equal_transformers(tiny_checkpoint):
    import transformers

    from workbench.model.checkpoint import load_model

    path = tiny_checkpoint("tiny-gqa")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3]  # 18 tokens: two blocks of 16
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    ours = prompt_logits(load_model(str(path)), prompt)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_decode_bytes_of_quantized_formats_by_hand():
    cfg = ModelConfig.resolve("tiny-gqa")  # hidden 64, q 64, kv 32, intermediate 160, 2 layers, vocab 256, untied
    contexts = [10, 20]
    plain = bench.decode_step_bytes(cfg, "fp32", contexts)
    # linear weights: per layer qkv 64x128, o 64x64, gate_up 64x320, down 160x64 = 43,008; x2 layers + head 256x64
    linear = 2 * (64 * 128 + 64 * 64 + 64 * 320 + 160 * 64) + 256 * 64  # 102,400
    rows = 2 * (64 + 32 + 32 + 64 + 160 + 160 + 64) + 256  # output channels: 1,408 fp32 scales
    int8 = bench.decode_step_bytes(cfg, "fp32", contexts, "int8")
    assert plain["weight_bytes"] - int8["weight_bytes"] == 4 * linear - (linear + 4 * rows)
    groups = 2 * (128 * 2 + 64 * 2 + 320 * 2 + 64 * 5) + 256 * 2  # (out x in / 32) groups, a (scale, zero) each
    int4 = bench.decode_step_bytes(cfg, "fp32", contexts, "int4", 32)
    assert plain["weight_bytes"] - int4["weight_bytes"] == 4 * linear - (linear // 2 + 2 * 4 * groups)
    # a tied head (tiny-qwen2: hidden 64, vocab 256, tied) is read as its quantized copy, not as the fp32 table
    tied = ModelConfig.resolve("tiny-qwen2")
    tied_plain = bench.decode_step_bytes(tied, "fp32", contexts)
    tied_int8 = bench.decode_step_bytes(tied, "fp32", contexts, "int8")
    tied_linear = 2 * (64 * 128 + 64 * 64 + 64 * 256 + 128 * 64) + 256 * 64  # intermediate 128; + the head
    tied_rows = 2 * (128 + 64 + 256 + 64) + 256
    assert tied_plain["weight_bytes"] - tied_int8["weight_bytes"] == 4 * tied_linear - (tied_linear + 4 * tied_rows)
    kv8 = bench.decode_step_bytes(cfg, "fp32", contexts, kv_cache_dtype="int8")
    assert kv8["kv_bytes"] == pytest.approx(plain["kv_bytes"] * (16 + 4) / (16 * 4))  # int8 + fp32 scale per head


def test_kv_capacity_by_hand():
    cfg = ModelConfig.resolve("tiny-gqa")  # KV per token: fp32 2*2*2*16*4 = 512 B; int8 2*2*2*(16+4) = 160 B
    rows = levers.kv_capacity(cfg, "fp32", ["auto", "int8"], context_len=100, budget_bytes=1 << 20, block_size=16)
    # 100 tokens = 7 blocks of 16; blocks in 1 MiB: 2**20 // (16 * 512) = 128 and 2**20 // (16 * 160) = 409
    assert [(r["kv_cache_dtype"], r["sequences_that_fit"]) for r in rows] == [("fp32", 128 // 7), ("int8", 409 // 7)]


def test_make_schemes_labels():
    schemes = levers.make_schemes(["none", "int8", "int4"], [32, 128], ["auto", "int8"])
    assert [s.label for s in schemes] == [
        "fp32", "fp32 kv-int8", "int8", "int8 kv-int8", "int4-g32", "int4-g32 kv-int8", "int4-g128",
        "int4-g128 kv-int8",
    ]  # fmt: skip


def test_decode_prefill_accuracy_rows_on_a_tiny_model():
    schemes = levers.make_schemes(["none", "int8", "int4"], [32], ["auto"]) + [levers.Scheme(kv_cache_dtype="int8")]
    models = levers.load_scheme_models("tiny-gqa", schemes, "cpu")
    assert len(models) == 3  # the KV variant shares the fp32 weights
    rows = levers.decode_schemes(models, schemes, [2], 8, FAKE_HW, steps=2, warmup=0)
    assert [r["scheme"] for r in rows] == ["fp32", "int8", "int4-g32", "fp32 kv-int8"]
    cfg = ModelConfig.resolve("tiny-gqa")
    for r in rows:
        s = next(s for s in schemes if s.label == r["scheme"])
        by_format = bench.decode_step_bytes(cfg, "fp32", [r["context_len"]] * 2, s.quantization, s.group_size,
                                            s.kv_cache_dtype)  # fmt: skip
        assert r["bytes_per_step"] == pytest.approx(by_format["bytes"])
        assert r["mbu"] == pytest.approx(r["achieved_bytes_per_s"] / 2e9)
    assert rows[0]["speedup"] == 1.0 and rows[1]["bytes_ratio"] > 2.5
    pre = levers.prefill_schemes(models, schemes[:2], [8], repeats=1, warmup=0)
    assert [r["scheme"] for r in pre] == ["fp32", "int8"] and all(r["time_s"] > 0 for r in pre)
    acc = levers.accuracy_schemes(models[schemes[0].weights_key], models, schemes, [[1, 2, 3, 4], [5, 6, 7]])
    assert acc[0]["kl"] == 0.0 and acc[0]["top1_agreement"] == 1.0 and acc[0]["num_positions"] == 7
    assert acc[2]["kl"] > acc[1]["kl"] > 0  # int4 moves the logits more than int8 does


def test_logit_agreement_with_an_int8_cache_changes_only_through_the_cache():
    from workbench.model.checkpoint import load_model

    model = load_model("tiny-gqa")
    got = logit_agreement(model, model, [[1, 2, 3, 4, 5, 6]], kv_cache_dtype="int8")
    assert 0 < got["kl"] < 1e-3 and got["cosine"] > 0.999  # the first position attends to its own key only


def test_cli_decode_compares_schemes(capsys):
    args = ["bench", "decode", "--model", "tiny-gqa", "--batch", "1", "--prompt-len", "4", "--steps", "1", "--warmup",
            "0", "--threads", "1", "--device", "cpu", "--no-compile-decode", "--quantization", "none", "int8",
            "--kv-cache-dtype", "auto", "fp8", "--accuracy-prompts", "1", "--json"]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schemes"] == ["fp32", "fp32 kv-fp8", "int8", "int8 kv-fp8"]
    assert [a["scheme"] for a in out["accuracy"]] == out["schemes"]
    assert {"tokens_per_s", "achieved_bytes_per_s", "mbu", "speedup", "bytes_ratio"} <= set(out["results"][0])
    assert [c["kv_cache_dtype"] for c in out["kv_capacity"]] == ["fp32", "fp8"]


def test_cli_quantization_errors_are_one_line(capsys):
    assert main(["bench", "decode", "--model", "tiny-gqa", "--quantization", "int4", "--group-size", "128",
                 "--device", "cpu", "--cached-ceilings"]) == 2  # fmt: skip
    assert "does not divide q_proj" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny-gqa", "--prompt-ids", "1,2", "--kv-cache-dtype", "int4"]) == 2
    assert "unknown kv cache dtype" in capsys.readouterr().err


def _row(scheme, mb, tps, lo=None, hi=None, **kw):
    return {"scheme": scheme, "bytes_per_step": mb * 1e6, "tokens_per_s": tps, "tokens_per_s_min": lo or tps,
            "tokens_per_s_max": hi or tps, **kw}  # fmt: skip


def _pair(ratios, a="fp32", b="int8"):
    """A paired comparison of two schemes whose per-round tokens/s ratio b/a is ``ratios`` (one look, 95%)."""
    n = len(ratios)
    arms = {a: lambda i: 20.0, b: lambda i: 20.0 * ratios[i]}
    return run_rounds(arms, DecisionRule("higher", 0.05), min_rounds=n, max_rounds=n, warmup=0,
                      control=lambda i: 20.0 * (1.0 + 0.01 * (-1) ** i))  # fmt: skip


def test_claim_fewer_weight_bytes_faster_decode_each_verdict():
    faster = _pair([2.2, 2.3, 2.1, 2.25, 2.2, 2.15])
    slower = _pair([0.6, 0.62, 0.58, 0.61, 0.6, 0.59], "int8", "int4-g32")
    unclear = _pair([0.9, 1.3, 1.0, 1.25, 0.95, 1.2], "int8", "int4-g32")
    ok = claims.fewer_weight_bytes_faster_decode([faster, _pair([1.3, 1.35, 1.28, 1.32, 1.3, 1.31], "int8", "int4")])
    assert ok["verdict"] == "confirmed" and ok["evidence"]["ratio"] == pytest.approx(faster.ratio)
    assert len(ok["evidence"]["pairs"]) == 2 and ok["evidence"]["pairs"][1]["verdict"] == "confirmed"
    bad = claims.fewer_weight_bytes_faster_decode([faster, slower])
    assert bad["verdict"] == "not_confirmed" and "int4-g32/int8 = 0.6" in bad["detail"] and "opposite" in bad["detail"]
    assert claims.fewer_weight_bytes_faster_decode([faster, unclear])["verdict"] == "inconclusive"


def test_claim_kv_quantized_long_decode_each_verdict():
    cap = [{"kv_cache_dtype": "fp32", "sequences_that_fit": 10}, {"kv_cache_dtype": "int8", "sequences_that_fit": 30},
           {"kv_cache_dtype": "fp8", "sequences_that_fit": 40}]  # fmt: skip
    faster = _pair([1.4, 1.45, 1.38, 1.42, 1.4, 1.41], "fp32", "fp32 kv-int8")
    fp8_faster = _pair([1.3, 1.35, 1.28, 1.32, 1.3, 1.31], "fp32", "fp32 kv-fp8")
    same = _pair([1.0, 1.01, 0.99, 1.0, 1.005, 0.995], "fp32", "fp32 kv-fp8")
    unclear = _pair([0.9, 1.3, 1.0, 1.25, 0.95, 1.2], "fp32", "fp32 kv-fp8")
    ok = claims.fewer_kv_bytes_faster_long_decode([faster, fp8_faster], cap)
    assert ok["verdict"] == "confirmed" and ok["evidence"]["ratio"] == pytest.approx(faster.ratio)
    assert ok["evidence"]["sequences_that_fit"] == {"fp32": 10, "int8": 30, "fp8": 40} and ok["uses"] == ["paired"]
    assert [p["verdict"] for p in ok["evidence"]["pairs"]] == ["confirmed", "confirmed"]
    bad = claims.fewer_kv_bytes_faster_long_decode([faster, same], cap)
    assert bad["verdict"] == "not_confirmed" and "equivalent" in bad["detail"] and "KV fp8 40" in bad["detail"]
    assert claims.fewer_kv_bytes_faster_long_decode([faster, unclear], cap)["verdict"] == "inconclusive"
    fewer_fit = [cap[0], {**cap[1], "sequences_that_fit": 10}, cap[2]]  # faster, but no more sequences fit
    assert claims.fewer_kv_bytes_faster_long_decode([faster, fp8_faster], fewer_fit)["verdict"] == "not_confirmed"


def test_claim_decode_not_prefill_each_verdict():
    # four interleaved decode steps: int8 at 2.5x fp32's rate in every pair (step times 0.4 s against 0.16 s)
    dec = [
        {"scheme": "fp32", "speedup": 1.0, "bytes_ratio": 1.0, "time_s": 0.4, "times_s": [0.4, 0.42, 0.38, 0.4]},
        {"scheme": "int8", "speedup": 2.5, "bytes_ratio": 2.8, "time_s": 0.16, "times_s": [0.16, 0.168, 0.152, 0.16]},
    ]
    pre = [
        {"scheme": "fp32", "prompt_len": 256, "time_s": 1.0, "speedup": 1.0, "times_s": [1.0, 1.1, 0.9]},
        {"scheme": "int8", "prompt_len": 256, "time_s": 1.3, "speedup": 1 / 1.3, "times_s": [1.3, 1.2, 1.4]},
    ]
    ok = claims.fewer_bytes_move_decode_not_prefill(dec, pre)
    ev = ok["evidence"]
    assert ok["verdict"] == "confirmed" and ev["decode_verdict"] == "confirmed"
    # the same 2.5x in every pair: a zero-width t interval (4 pairs, 95%)
    assert (ev["ratio"], ev["ci_low"], ev["ci_high"]) == (pytest.approx(2.5),) * 3
    assert ev["rounds"] == 4 and ev["confidence"] == 0.95 and ev["margin"] == 0.10
    # prefill: three pairs, their min..max: 1/1.3, 1.1/1.2 (0.917: inside -10%), 0.9/1.4
    pf = ev["prefill"]
    assert pf["interval"] == "min..max" and pf["rounds"] == 3 and pf["reason"] == "short of the margin"
    assert (pf["ci_low"], pf["ci_high"]) == (pytest.approx(0.9 / 1.4), pytest.approx(1.1 / 1.2))
    pre[1].update(time_s=0.3, speedup=1 / 0.3, times_s=[0.3, 0.31, 0.29])  # prefill gained too
    assert claims.fewer_bytes_move_decode_not_prefill(dec, pre)["verdict"] == "not_confirmed"
    pre[1].update(times_s=[1.0, 0.9, 1.1])  # prefill's pairs 1.0, 1.22, 0.82: straddling the margin
    assert claims.fewer_bytes_move_decode_not_prefill(dec, pre)["verdict"] == "inconclusive"


def test_claim_int4_costs_more_accuracy_each_verdict():
    acc = [{"scheme": "int8", "kl": 1e-4, "top1_agreement": 0.99}, {"scheme": "int4-g32", "kl": 1e-2,
           "top1_agreement": 0.9}]  # fmt: skip
    assert claims.int4_costs_more_accuracy(acc)["verdict"] == "confirmed"
    acc[1]["kl"] = 1e-5
    assert claims.int4_costs_more_accuracy(acc)["verdict"] == "not_confirmed"


def test_cli_bench_kinds_refuse_what_they_cannot_compare(capsys):
    assert main(["bench", "prefill", "--model", "tiny-gqa", "--quantization", "int8", "int4", "--device", "cpu"]) == 2
    assert "bench decode only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # an option bench offline does not have (its own parser)
        main(["bench", "offline", "--model", "tiny-gqa", "--kv-cache-dtype", "int8", "--device", "cpu"])
    assert exc.value.code == 2 and "an option of bench decode" in capsys.readouterr().err
