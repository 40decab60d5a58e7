"""``workbench bench allreduce``'s measurement: times ``torch.distributed.all_reduce`` on every rank.

Each timing starts after a barrier, so every rank enters the collective together; a rank's time ends when its own
all-reduce returns, and the figure of one repetition is the slowest rank's (what a tensor-parallel layer waits
for), taken on the driver with a MAX all-reduce of the per-rank times.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from workbench.device import synchronize
from workbench.errors import ConfigError
from workbench.timing import now, set_threads


def message_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """Every power of four times ``min_bytes`` up to ``max_bytes`` (the message sizes of the benchmark)."""
    if min_bytes < 4 or max_bytes < min_bytes:
        raise ConfigError(f"need 4 <= min bytes <= max bytes, got {min_bytes} and {max_bytes}")
    sizes = [min_bytes]
    while sizes[-1] * 4 <= max_bytes:
        sizes.append(sizes[-1] * 4)
    return sizes


def all_reduce_samples(
    world_size: int, backend: str, threads: int, sizes: list[int], repeats: int, on_size: object = None
) -> tuple[str, str, dict[int, list[float]]]:
    """(backend used, machine, seconds of each timed all-reduce per message size) over ``world_size`` ranks started
    by ``workbench.dist.group.WorkerGroup`` (gloo on the CPU, NCCL on CUDA), ``threads`` each: 3 warm-up
    all-reduces per size, then ``repeats`` (a quarter of them above 1 MiB, never fewer than 5). ``on_size(size,
    times)`` is called after each size (a progress line)."""
    from workbench.dist.group import DistConfig, WorkerGroup
    from workbench.hardware import cpu_model_name

    if repeats < 1 or threads < 1:
        raise ConfigError(f"need repeats >= 1 and threads >= 1, got {repeats} and {threads}")
    samples: dict[int, list[float]] = {}
    with WorkerGroup(DistConfig(world_size, backend=backend, timeout_s=120.0), AllReduceTimer, (threads,)) as group:
        used = group.backend
        machine = cpu_model_name() if used == "gloo" else group.call("device_name")
        for size in sizes:
            times = group.call("time_all_reduce", size, max(5, repeats if size <= (1 << 20) else repeats // 4), 3)
            samples[size] = times
            if callable(on_size):
                on_size(size, times)
    return used, machine, samples


class AllReduceTimer:
    """One rank's side of the all-reduce benchmark (built by ``WorkerGroup`` on every rank)."""

    def __init__(self, rank: int, world_size: int, num_threads: int = 1) -> None:
        self.rank, self.world_size = rank, world_size
        set_threads(num_threads)
        nccl = dist.get_backend() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def time_all_reduce(self, num_bytes: int, repeats: int, warmup: int) -> list[float]:
        """Seconds of each of ``repeats`` all-reduces of a float32 tensor of ``num_bytes`` (slowest rank each)."""
        tensor = torch.ones(max(1, num_bytes // 4), dtype=torch.float32, device=self.device)
        times = []
        for i in range(warmup + repeats):
            tensor.fill_(1.0)
            dist.barrier()
            synchronize(self.device)
            start = now()
            dist.all_reduce(tensor)
            synchronize(self.device)
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
        return torch.cuda.get_device_name() if self.device.type == "cuda" else "cpu"
