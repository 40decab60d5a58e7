"""Plain ``F.linear`` against oneDNN-packed weights (``workbench.model.packed``) over row counts, on this CPU.

    .venv/bin/python scripts/bench_cpu_linear.py [--model bench-300m] [--threads 2] [--rows 1 2 4 ...] [--json]

For every row count, the model's weight matrices (one step's worth: fused qkv, o, fused gate/up, down and the LM
head, once each) are multiplied by a random activation, plain and packed alternately (ABAB, best of ``--repeats``
of each), in fp32. Prints the plain GFLOP/s and packed / plain speed: where the ratio is above 1 the packed
layout pays, which is what ``PACKED_MIN_ROWS`` / ``PACKED_MAX_ROWS`` should bracket on the machine at hand.
"""

from __future__ import annotations

import json
import sys
import time

from workbench.parsing import make_parser

DEFAULT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def main(argv: list[str] | None = None) -> int:
    p = make_parser(prog="bench_cpu_linear.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bench-300m", help="preset whose weight shapes are multiplied")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS), help="row counts")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds of each layout per row count")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)

    import torch

    from workbench.bench import linear_shapes, set_threads
    from workbench.config import ModelConfig
    from workbench.hardware import cpu_model_name

    if not torch.backends.mkldnn.is_available():
        print("error: this torch build has no oneDNN (torch.backends.mkldnn)", file=sys.stderr)
        return 2
    if any(r < 1 for r in args.rows) or args.repeats < 1:
        print("error: --rows and --repeats must be positive", file=sys.stderr)
        return 2
    set_threads(args.threads)
    cfg = ModelConfig.resolve(args.model)
    shapes = sorted(set(linear_shapes(cfg)))
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen) * 0.02 for i, o in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
    rows_out = []
    for rows in args.rows:
        xs = {i: torch.randn(rows, i, generator=gen) for i, _ in shapes}

        def plain(xs: dict = xs) -> None:
            for w in weights:
                torch.nn.functional.linear(xs[w.shape[1]], w)

        def onednn(xs: dict = xs) -> None:
            for w, pw in zip(weights, packed):
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], pw, None, "none", [], "")

        best = {"plain": float("inf"), "packed": float("inf")}
        for run in (plain, onednn):  # warm-up
            run()
        for _ in range(args.repeats):
            for name, run in (("plain", plain), ("packed", onednn)):
                t0 = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - t0)
        flops = sum(2.0 * rows * i * o for i, o in shapes)
        rows_out.append({
            "rows": rows,
            "plain_s": best["plain"],
            "packed_s": best["packed"],
            "plain_gflops": flops / best["plain"] / 1e9,
            "packed_gflops": flops / best["packed"] / 1e9,
            "packed_speedup": best["plain"] / best["packed"],
        })  # fmt: skip
    load = open("/proc/loadavg").read().split()[:3]
    result = {"model": cfg.name, "cpu": cpu_model_name(), "threads": args.threads, "load_average": load,
              "rows": rows_out}  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{cfg.name} weight shapes, fp32, {args.threads} threads, {result['cpu']} (load {' '.join(load)})")
    print(f"{'rows':>6s} {'plain GFLOP/s':>14s} {'packed GFLOP/s':>15s} {'packed speed-up':>16s}")
    for r in rows_out:
        print(f"{r['rows']:6d} {r['plain_gflops']:14.1f} {r['packed_gflops']:15.1f} {r['packed_speedup']:15.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
