"""Simulator fidelity on this machine: the profiled cost model against the engine's measured latencies, per policy.

    .venv/bin/python scripts/sim_fidelity.py [--model tiny-gqa] [--profile FILE] [--num-requests 40] [--rate 10]
    .venv/bin/python scripts/sim_fidelity.py --disaggregate 1:1 [--repeats 3] [...]

Fits the profiled cost model on training workloads (``workbench.sim.measure.training_workloads``, seed 1000: a light
and a heavy Poisson load and a burst, under the continuous and chunked policies; ``fit_engine_profile``) unless
``--profile`` is given, then for each policy replays a held-out Poisson workload (another seed, other lengths) on the
real engine and simulates the same workload with the same scheduler settings, with the deterministic profile
(``profiled``) and with its measured residuals drawn back in as seeded noise (``profiled_noise``). Prints one JSON
object: per policy and model the measured and simulated median and p90 of TTFT and ITL and their relative errors
((simulated - measured) / measured), plus the largest absolute error of each model. This is a report, not a
test: CPU timings on a shared machine are noisy.

``--disaggregate P:D``: the real disaggregated engines instead (``workbench.dist.disagg``, one thread per engine
process, as the profile was measured), ``--repeats`` times on the held-out workload, against the simulator's
disaggregated model with the same profile on every replica and a KV link fitted to the real transfers
(``workbench.sim.comm.fit_latency_bandwidth`` over each request's bytes and transfer seconds). The JSON then holds
the measured runs' spread (min..max of each statistic over the repeats), the fitted link, and the simulated
statistics with their errors against the median of the measured runs.
"""

from __future__ import annotations

import json
import sys

from workbench.engine.config import EngineConfig
from workbench.engine.scheduler import POLICIES
from workbench.parsing import make_parser
from workbench.sim.cluster import SimConfig, simulate
from workbench.sim.costmodel import ProfiledCostModel
from workbench.sim.measure import fit_engine_profile
from workbench.workloads import synthetic_workload


def main() -> int:
    p = make_parser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-gqa")
    p.add_argument("--profile", default=None, help="use this profile instead of fitting one")
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--rate", type=float, default=10.0)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=7, help="seed of the held-out workload")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--disaggregate", default=None, metavar="P:D", help="the real disaggregated engines instead")
    p.add_argument("--repeats", type=int, default=3, help="--disaggregate: measured runs")
    args = p.parse_args()

    import torch

    from workbench.engine.engine import Engine
    from workbench.model.checkpoint import load_model

    torch.set_num_threads(args.threads)  # as the profile was measured (fit-profile --threads, default 1)

    if args.profile:
        profile = ProfiledCostModel.load(args.profile)
    else:
        profile = fit_engine_profile(args.model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len)
    held_out = synthetic_workload(args.num_requests, rate=args.rate, prompt_lens="uniform:4:160",
                                  output_lens="uniform:2:48", seed=args.seed)  # fmt: skip
    if args.disaggregate:
        print(json.dumps(disaggregated_fidelity(args, profile, held_out)))
        return 0
    net = load_model(args.model, seed=0)
    warm = EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, device="cpu")
    Engine(net, warm).replay(held_out[:4])  # warm-up, not measured
    out: dict = {"model": args.model, "profile": profile.to_dict(), "num_requests": args.num_requests,
                 "rate": args.rate, "policies": {}}  # fmt: skip
    worst = {"profiled": 0.0, "profiled_noise": 0.0}
    for policy in args.policies.split(","):
        budget = args.max_model_len // 2 if policy == "chunked" else None
        ecfg = EngineConfig(policy=policy, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                            token_budget=budget, device="cpu")  # fmt: skip
        engine = Engine(net, ecfg)
        measured = engine.replay(held_out).summary()["metrics"]
        scfg = SimConfig(policy=policy, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                         token_budget=budget, num_blocks=engine.block_manager.num_blocks,
                         block_size=engine.block_manager.block_size, dtype="fp32")  # fmt: skip
        rows = {}
        for label, cost in (("profiled", profile), ("profiled_noise", profile.with_noise(args.seed))):
            sim = simulate(held_out, net.config, cost, scfg).summary()["metrics"]
            row = {}
            for metric in ("ttft_s", "itl_s"):
                for stat in ("median", "p90"):
                    m, s = measured[metric][stat], sim[metric][stat]
                    err = (s - m) / m if m else 0.0
                    worst[label] = max(worst[label], abs(err))
                    row[f"{metric}_{stat}"] = {"measured": m, "simulated": s, "rel_error": err}
            rows[label] = row
            print(policy, label, {k: round(v["rel_error"], 3) for k, v in row.items()}, file=sys.stderr)
        out["policies"][policy] = rows
    out["max_abs_rel_error"] = worst
    print(json.dumps(out))
    return 0


def disaggregated_fidelity(args, profile: ProfiledCostModel, held_out: list) -> dict:  # noqa: ANN001
    """The real disaggregated run (repeated) against the simulated one, with the link fitted to the real one."""
    import statistics

    from workbench.config import ModelConfig, parse_disaggregate
    from workbench.dist.disagg import DisaggCluster, DisaggConfig
    from workbench.engine.metrics import summarize
    from workbench.request import SamplingParams
    from workbench.sim.comm import fit_latency_bandwidth
    from workbench.workloads import prompt_token_ids

    split = parse_disaggregate(args.disaggregate)
    cfg_model = ModelConfig.resolve(args.model)
    ecfg = EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, device="cpu")
    work = [(prompt_token_ids(r, cfg_model.vocab_size, 0), SamplingParams(max_tokens=r.output_len, ignore_eos=True),
             r.arrival_time_s) for r in held_out]  # fmt: skip
    dcfg = DisaggConfig(prefill=ecfg, decode=ecfg, num_prefill=split[0], num_decode=split[1],
                        threads_per_engine=args.threads)  # fmt: skip
    runs, points = [], []
    with DisaggCluster(args.model, dcfg) as cluster:
        cluster.run(work[:4], online=False)  # warm-up, not measured
        for _ in range(args.repeats):
            result = cluster.run(work, online=True)
            runs.append(summarize(result.requests, duration_s=result.duration_s)["metrics"])
            points += [(t["kv_transfer_bytes"], t["kv_transfer_s"]) for t in result.transfers.values()
                       if t["kv_transfer_bytes"] > 0]  # fmt: skip
            num_blocks = ecfg.cache_shape(cfg_model)[0]
    latency, bandwidth = fit_latency_bandwidth(points)
    scfg = SimConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, num_blocks=num_blocks,
                     block_size=ecfg.block_size, dtype="fp32", disaggregate=split,
                     link_gbps=bandwidth * 8 / 1e9, link_latency_s=latency)  # fmt: skip
    out: dict = {"model": args.model, "disaggregate": args.disaggregate, "repeats": args.repeats,
                 "link": {"latency_s": latency, "gbps": bandwidth * 8 / 1e9, "num_transfers": len(points)},
                 "models": {}}  # fmt: skip
    noisy = [profile.with_noise(args.seed + i) for i in range(sum(split))]  # stateful: one per replica
    for label, costs in (("profiled", [profile] * sum(split)), ("profiled_noise", noisy)):
        sim = simulate(held_out, cfg_model, costs, scfg).summary()["metrics"]
        rows = {}
        for metric in ("ttft_s", "itl_s"):
            for stat in ("median", "p90"):
                measured = [run[metric][stat] for run in runs]
                m = statistics.median(measured)
                rows[f"{metric}_{stat}"] = {
                    "measured": m, "measured_min": min(measured), "measured_max": max(measured),
                    "simulated": sim[metric][stat], "rel_error": (sim[metric][stat] - m) / m if m else 0.0,
                }  # fmt: skip
        out["models"][label] = rows
        print(label, {k: round(v["rel_error"], 3) for k, v in rows.items()}, file=sys.stderr)
    return out


if __name__ == "__main__":
    sys.exit(main())
