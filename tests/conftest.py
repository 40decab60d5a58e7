"""Shared fixtures. TRITON_INTERPRET must be set before any Triton kernel is defined, so it is set here first."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("MPLBACKEND", "agg")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # one worker per core (make test: -n auto): torch's intra-op threads would oversubscribe the cores and spin in
    # OpenMP's barriers, so each worker (and what it starts) computes on one thread unless a test sets otherwise
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # ... and where one does (notebook 05's colocated engine: 2 threads), a thread waiting at a barrier sleeps
    # instead of spinning (libgomp reads this when torch loads it, so it applies to the processes the worker
    # starts: nbval's kernels, the pipeline's, engine ranks): with the other worker busy on the second core, a
    # spinning thread burns the time slice its teammate needs; notebook 05's replays took 4x the CPU and 4-6x the
    # wall time of one thread under load
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

TINY_PRESETS = ("tiny-mha", "tiny-gqa", "tiny-mqa", "tiny-qwen2")

# The files that take minutes under `make test` (its --durations: each notebook's nbval run, the pipeline's smoke
# run, every README command), longest first. make test hands whole files to its workers (--dist loadfile) in
# collection order (--no-loadscope-reorder), so these start first and the ~90 files of seconds fill in around them:
# a long file started last would leave the other worker idle for its length at the end.
LONG_FIRST = (
    "notebooks/05_disaggregation.ipynb",
    "notebooks/04_chunked_prefill.ipynb",
    "tests/test_report_smoke.py",
    "notebooks/03_batching.ipynb",
    "notebooks/09_speculative_decoding.ipynb",
    "notebooks/07_simulator_validation.ipynb",
    "tests/test_readme_commands.py",
    "notebooks/",  # the other notebooks
)


def _long_first_rank(nodeid: str) -> int:
    return next((i for i, prefix in enumerate(LONG_FIRST) if nodeid.startswith(prefix)), len(LONG_FIRST))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of ``LONG_FIRST`` first, in its order; each file's own items keep their order."""
    items.sort(key=lambda item: _long_first_rank(item.nodeid))  # a stable sort


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A function preset -> directory of a random HF checkpoint written by transformers (made once per session)."""
    from workbench.model.checkpoint import save_random_checkpoint

    made: dict[str, object] = {}

    def make(preset: str, seed: int = 0):
        key = f"{preset}-{seed}"
        if key not in made:
            made[key] = save_random_checkpoint(preset, tmp_path_factory.mktemp(key), seed=seed)
        return made[key]

    return make


def hf_greedy_tokens(path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (exactly ``max_new_tokens``, EOS ignored): the peer
    implementation the engine's tokens are checked against."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    for p in prompts:
        tokens = hf.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        out.append(tokens[0, len(p) :].tolist())
    return out


def one_line_error(capsys, rc: int, *needles: str, warnings_too: bool = False) -> str:
    """The one stderr line of a command that failed cleanly (exit 2, no traceback), checked to contain ``needles``;
    ``warnings_too``: lines starting 'warning:' may come before it (this CPU's own, e.g. emulated bf16)."""
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line]
    if warnings_too:
        lines = [line for line in lines if not line.startswith("warning:")]
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def pack_every_linear(monkeypatch):
    """Engines (and profile-ops) pack every linear layer, however small (``PACKED_MIN_WEIGHT`` 0): the tiny
    presets' matrices are all below the threshold, and the tests of the packed path run on them."""
    from workbench.model import packed

    monkeypatch.setattr(packed, "PACKED_MIN_WEIGHT", 0)
