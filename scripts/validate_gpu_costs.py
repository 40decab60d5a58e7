"""The roofline cost model against published GPU measurements (``data/validation/published_gpu.yaml``).

    python scripts/validate_gpu_costs.py            # error table with accelerators.yaml's calibration
    python scripts/validate_gpu_costs.py --ideal    # the same with the bare roofline
    python scripts/validate_gpu_costs.py --fit      # choose a calibration per accelerator on the calibration rows
    python scripts/validate_gpu_costs.py --json     # one JSON object

Prints one line per row (measured, predicted, error = predicted / measured - 1) and, per split, the median and the
largest absolute error. The calibration rows are what ``--fit`` sees; the held-out rows never are, so their errors
are the cost model's. Analytic: runs in a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from workbench.hardware import get_hardware
from workbench.sim.published import error_table, fit, load_published, load_stack_overheads, summarize_errors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ideal", action="store_true", help="the bare roofline (no calibration)")
    p.add_argument("--fit", action="store_true", help="fit each accelerator's calibration on its calibration rows")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    rows = load_published()
    calibration = None if args.ideal else "hardware"
    specs = None
    stacks = load_stack_overheads()
    if args.ideal:  # the bare roofline, but each source's published setup (its bandwidth) as it was
        stacks = {k: dataclasses.replace(v, per_kernel_s=0.0, per_request_s=0.0, per_collective_s=0.0,
                                      per_kernel_by_hardware=())
                  for k, v in load_stack_overheads().items()}  # fmt: skip
    fitted = {}
    if args.fit:
        specs, stacks, loss = fit(rows)
        for hw, spec in specs.items():
            cal = {k: v for k, v in spec.calibration.to_dict().items() if k != "source"}
            fitted[hw] = {"calibration": cal}
        fitted["loss"] = loss
    table = error_table(rows, calibration, specs, stacks)
    summary = {split: summarize_errors([r for r in table if r["split"] == split])
               for split in ("calibration", "held_out")}  # fmt: skip
    if args.json:
        stacks_json = {k: dataclasses.asdict(v) for k, v in stacks.items()}
        print(json.dumps({"rows": table, "summary": summary, "stacks": stacks_json, "fitted": fitted}))
        return 0
    for hw, f in fitted.items():
        if hw != "loss":
            print(f"fitted {hw}: {', '.join(f'{k} {v:.3g}' for k, v in f['calibration'].items())}")
    print(f"{'id':28s} {'split':11s} {'metric':9s} {'measured':>10s} {'predicted':>10s} {'error':>7s}")
    for r in table:
        print(f"{r['id']:28s} {r['split']:11s} {r['metric']:9s} {r['measured_s'] * 1e3:8.2f}ms "
              f"{r['predicted_s'] * 1e3:8.2f}ms {100 * r['error']:+6.1f}%")  # fmt: skip
    for split, s in summary.items():
        print(f"{split}: {s['n']} rows, median |error| {100 * s['median_abs_error']:.1f}%, "
              f"max |error| {100 * s['max_abs_error']:.1f}%")  # fmt: skip
    print("serving stacks (host per kernel, per request, per collective; bandwidth): "
          + ", ".join(f"{k} {dict(v.per_kernel_by_hardware) or v.per_kernel_s * 1e6} us, "
                      f"{v.per_request_s * 1e3:.0f} ms, "
                      f"{v.per_collective_s * 1e6:.0f} us; "
                      f"{'datasheet' if v.mem_bandwidth is None else f'{v.mem_bandwidth / 1e12:.2f} TB/s'}"
                      for k, v in stacks.items()))  # fmt: skip
    calibrations = {hw: get_hardware(hw).calibration.source for hw in sorted({r.hardware for r in rows})}
    print("calibration: " + ("ideal" if args.ideal else "fitted now" if args.fit else str(calibrations)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
