"""The worker of ``scripts/bench_allreduce.py``: times ``torch.distributed.all_reduce`` on every rank.

Each timing starts after a barrier, so every rank enters the collective together; a rank's time ends when its own
all-reduce returns, and the figure of one repetition is the slowest rank's (what a tensor-parallel layer waits
for), taken on the driver with a MAX all-reduce of the per-rank times.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from workbench.timing import now, set_threads


class AllReduceTimer:
    """One rank's side of the all-reduce benchmark (built by ``WorkerGroup`` on every rank)."""

    def __init__(self, rank: int, world_size: int, num_threads: int = 1) -> None:
        self.rank, self.world_size = rank, world_size
        set_threads(num_threads)
        self.device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"

    def _sync(self) -> None:
        if self.device != "cpu":
            torch.cuda.synchronize()

    def time_all_reduce(self, num_bytes: int, repeats: int, warmup: int) -> list[float]:
        """Seconds of each of ``repeats`` all-reduces of a float32 tensor of ``num_bytes`` (slowest rank each)."""
        tensor = torch.ones(max(1, num_bytes // 4), dtype=torch.float32, device=self.device)
        times = []
        for i in range(warmup + repeats):
            tensor.fill_(1.0)
            dist.barrier()
            self._sync()
            start = now()
            dist.all_reduce(tensor)
            self._sync()
            elapsed = torch.tensor([now() - start], dtype=torch.float64, device=self.device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= warmup:
                times.append(float(elapsed.item()))
        # ones summed over the ranks: exactly world_size everywhere (small integers are exact in float32)
        if not bool((tensor == self.world_size).all()):
            raise RuntimeError(f"all-reduce of ones over {self.world_size} ranks gave {tensor[0].item()}")
        return times

    def device_name(self) -> str:
        """The accelerator's name (for the profile's ``machine``), or 'cpu'."""
        return torch.cuda.get_device_name() if self.device != "cpu" else "cpu"
