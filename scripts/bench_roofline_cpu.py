"""Predicted (roofline with this machine's measured ceilings) versus measured step times of ``bench-300m``.

Measures the CPU's ceilings (``workbench.hardware.measured_spec``: fp32 matmul peak, read bandwidth), then
times prefill and decode steps of the ``bench-300m`` preset in fp32 with random weights, and prints one JSON
object: per case the predicted time, the measured median, their ratio (measured / predicted), and the MFU
and MBU of the measured step (bytes include KV and activations). The measurements are
``workbench.experiments.phases``' (``measure_prefill``, ``measure_decode``, ``add_roofline``), as in
notebook 01. The ratio is a reported number, never an assertion: it says how far this machine's kernels are
from its own ceilings.

    .venv/bin/python scripts/bench_roofline_cpu.py [--repeats 5] [--cached] [--out result.json]

On a machine shared with other work both the ceilings and the steps slow down, not necessarily alike; the
ceilings are therefore measured in the same run as the steps unless ``--cached`` is given.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from workbench.config import ModelConfig
from workbench.experiments.phases import add_roofline, measure_decode, measure_prefill
from workbench.hardware import measured_spec
from workbench.model import Transformer
from workbench.parsing import make_parser

PRESET = "bench-300m"
# (batch, prompt_len) for prefill; (batch, context_len) for decode
PREFILL_CASES = [(1, 128), (4, 64)]
DECODE_CASES = [(1, 128), (8, 128)]


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per case (median reported)")
    parser.add_argument(
        "--cached", action="store_true", help="reuse cached ceilings instead of measuring them in this run"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    hw = measured_spec("cpu", refresh=not args.cached)  # ceilings and steps measured in the same run
    model = Transformer.from_config(ModelConfig.from_name(PRESET), dtype=torch.float32, device="cpu", seed=0)
    rows = []
    for batch, prompt_len in PREFILL_CASES:
        rows += measure_prefill(model, [prompt_len], batch=batch, repeats=args.repeats)
    for batch, context_len in DECODE_CASES:
        rows += measure_decode(model, [batch], [context_len], warmup=2, repeats=args.repeats)
    cases = [dict(r, ratio_measured_over_predicted=r["time_s"] / r["predicted_s"])
             for r in add_roofline(rows, model, hw, "fp32")]  # fmt: skip
    result = {"preset": PRESET, "dtype": "fp32", "torch_threads": torch.get_num_threads(), "hardware": hw.to_dict(),
              "cases": cases}  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
