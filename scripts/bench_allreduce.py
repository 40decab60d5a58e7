"""All-reduce time against message size over torch.distributed, written as a profile the simulator reads.

    .venv/bin/python scripts/bench_allreduce.py [--world-size 2] [--backend auto] [--threads 1]
        [--min-bytes 4] [--max-bytes 67108864] [--repeats 20] [--out data/profiles/allreduce-....json]

Spawns ``world_size`` ranks through ``workbench.dist.group.WorkerGroup`` (gloo on the CPU, NCCL on CUDA), times a
float32 all-reduce at every power of four between the two sizes (warm-up first; each repetition is the slowest
rank's time after a barrier), and prints one line per size (median, min, max, algorithm and bus bandwidth) and
the latency-bandwidth fit. The profile (``workbench.sim.comm.CollectiveProfile``) goes to ``--out``; the default
name carries the backend, the world size and the machine.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from workbench.config import DATA_DIR
from workbench.dist.collective_bench import AllReduceTimer
from workbench.dist.group import DistConfig, WorkerGroup
from workbench.hardware import cpu_model_name
from workbench.sim.comm import CollectiveProfile, bus_bandwidth
from workbench.timing import median


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--world-size", type=int, default=2, help="ranks (default: %(default)s)")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"), help="(default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default: %(default)s)")
    p.add_argument("--min-bytes", type=int, default=4, help="smallest message (default: %(default)s)")
    p.add_argument("--max-bytes", type=int, default=64 << 20, help="largest message (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=20, help="timed repetitions per size (default: %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="profile path (default: data/profiles/allreduce-...)")
    args = p.parse_args()
    if args.min_bytes < 4 or args.max_bytes < args.min_bytes or args.repeats < 1 or args.threads < 1:
        p.error("need 4 <= --min-bytes <= --max-bytes, --repeats >= 1 and --threads >= 1")

    sizes = []
    n = args.min_bytes
    while n <= args.max_bytes:
        sizes.append(n)
        n *= 4
    config = DistConfig(args.world_size, backend=args.backend, timeout_s=120.0)
    samples: dict[int, list[float]] = {}
    with WorkerGroup(config, AllReduceTimer, (args.threads,)) as group:
        backend = group.backend
        machine = cpu_model_name() if backend == "gloo" else group.call("device_name")
        print(f"all-reduce, {backend}, {args.world_size} ranks, {args.threads} thread(s) each, on {machine}")
        print(f"{'bytes':>10} {'median_us':>11} {'min_us':>9} {'max_us':>9} {'algbw_GB/s':>11} {'busbw_GB/s':>11}")
        for size in sizes:
            # fewer repetitions of the large messages keep the run short; never fewer than 5
            repeats = max(5, args.repeats if size <= (1 << 20) else args.repeats // 4)
            times = group.call("time_all_reduce", size, repeats, 3)
            samples[size] = times
            med = median(times)
            print(
                f"{size:>10} {med * 1e6:>11.1f} {min(times) * 1e6:>9.1f} {max(times) * 1e6:>9.1f} "
                f"{size / med / 1e9:>11.3f} {bus_bandwidth(size, med, args.world_size) / 1e9:>11.3f}"
            )
    profile = CollectiveProfile.from_samples(
        "all_reduce", backend, args.world_size, machine, samples, threads_per_rank=args.threads, dtype="fp32"
    )
    print(
        f"fit: latency {profile.latency_s * 1e6:.1f} us, algorithm bandwidth "
        f"{profile.bandwidth_bytes_per_s / 1e9:.3f} GB/s"
    )
    slug = re.sub(r"[^a-z0-9]+", "-", machine.lower()).strip("-")
    out = args.out or DATA_DIR / "profiles" / f"allreduce-{backend}-{args.world_size}-{slug}.json"
    profile.save(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
