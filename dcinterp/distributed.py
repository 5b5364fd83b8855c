"""Sweeps shared between the processes that `torchrun` (or `accelerate launch`) starts.

A sweep is a list of batches one process would run in turn. Under `torchrun --nproc-per-node N` each process runs
every N-th batch (`my_batches`), the processes exchange what they computed (`gather`), and every process then
combines the batches' results in the order one process would: the same batches, the same shapes and the same
additions, so the result is what one process computes, bit for bit (tested with gloo on two CPU processes).
A sum over batches is taken from every batch's own partial sum, in batch order (`sum_in_order`), not from one
partial sum per process, whose addition order would differ.

Without an initialised process group every function here is the one-process identity, so library code calls them
unconditionally. With one, every process must make the same calls in the same order with the same inputs (the
same prompts, the same batch size): each `gather` is a collective.

    rank, world_size, device = start()   # in a command line: joins torchrun's group (NCCL on GPUs, gloo on CPU)
    error = first_error(message)         # every process learns whether any process refused its input
    ...
    finish(world_size)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # torch is imported where it is used, so that the command lines' `--help` stays fast
    from torch import Tensor

T = TypeVar("T")
_started_here = False  # whether `start` created the process group (a group set up before it is not ours to end)


def rank_and_size() -> tuple[int, int]:
    """(rank, world size) of an initialised torch.distributed group, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def start() -> tuple[int, int, str | None]:
    """Join the process group that `torchrun` / `accelerate launch` set up (NCCL on GPUs, gloo on the CPU).

    Returns (rank, world size, this process's device: `cuda:LOCAL_RANK` or `cpu`); (0, 1, None) when not launched
    that way (WORLD_SIZE unset or 1)."""
    global _started_here
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, None
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        backend, device = "nccl", f"cuda:{local_rank}"
    else:
        backend, device = "gloo", "cpu"
    if not dist.is_initialized():
        dist.init_process_group(backend)
        _started_here = True
    return dist.get_rank(), dist.get_world_size(), device


def finish(world_size: int) -> None:
    """Leave the process group if `start` created it; a group someone else set up stays theirs.

    Args:
        world_size: the world size `start` returned (1: nothing to leave).
    """
    global _started_here
    import torch.distributed as dist

    if world_size > 1 and _started_here and dist.is_initialized():
        dist.destroy_process_group()
        _started_here = False


def process_device(device: str, rank_device: str | None) -> str:
    """The device this process computes on.

    Args:
        device: the device asked for.
        rank_device: what `start` returned for this process (None: not launched by torchrun).

    Returns:
        The process's own GPU (`cuda:LOCAL_RANK`) where `device` is a GPU and the process was started by torchrun,
        else `device` as given.
    """
    if rank_device is not None and device.split(":")[0] == rank_device.split(":")[0]:
        return rank_device
    return device


def my_batches(n_batches: int) -> list[int]:
    """The indices of the batches this process runs: every world_size-th from its rank (all of them alone).

    Args:
        n_batches: the batches in all.

    Returns:
        This process's batch indices.
    """
    rank, world_size = rank_and_size()
    return list(range(rank, n_batches, world_size))


def gather(local: dict[Any, T]) -> dict[Any, T]:
    """Every process's `local` results merged into one dict, on every process.

    Values travel pickled: pass CPU tensors or plain Python objects (`to_cpu`).

    Args:
        local: this process's results; the keys must not overlap those of other processes.

    Returns:
        Every process's results.
    """
    import torch.distributed as dist

    _, world_size = rank_and_size()
    if world_size == 1:
        return dict(local)
    shards: list[dict] = [{} for _ in range(world_size)]
    dist.all_gather_object(shards, local)
    merged = {}
    for shard in shards:
        merged.update(shard)
    return merged


def in_order(results: dict[int, T], n: int, what: str = "batch") -> list[T]:
    """`results[0], ..., results[n - 1]`.

    Args:
        results: results by index.
        n: how many there must be.
        what: the items, named in the error.

    Returns:
        The results in order.

    Raises:
        RuntimeError: one is missing (a process that skipped a batch).
    """
    missing = [i for i in range(n) if i not in results]
    if missing:
        raise RuntimeError(f"no result for {what} {missing[0]} of {n}: every process must run the same sweep")
    return [results[i] for i in range(n)]


def sum_in_order(partials: dict[int, Tensor], n: int, total: Tensor) -> Tensor:
    """`total` plus every batch's partial sum (from every process), added in batch order, as one process adds them.

    Args:
        partials: this process's partial sums, by batch index.
        n: the batches in all.
        total: zeros of the sum's shape, added to in place.

    Returns:
        `total`.
    """
    for part in in_order(gather(partials), n):
        total += part
    return total


def to_cpu(value: Any) -> Any:
    """Tensors (also inside dicts, lists and tuples) moved to the CPU, so that any process can unpickle them.

    Args:
        value: a tensor, or a dict, list or tuple holding them.

    Returns:
        The same structure, its tensors on the CPU.
    """
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(item) for item in value)
    return value


def first_error(message: str | None) -> str | None:
    """The first error among the processes (by rank), on every process.

    Call it where each process has checked its input, so that all of them stop together when any one refuses (a
    process that stopped alone would leave the others waiting in the next collective).

    Args:
        message: this process's error, or None.

    Returns:
        The first error, or None where every process had none.
    """
    _, world_size = rank_and_size()
    if world_size == 1:
        return message
    messages = gather({rank_and_size()[0]: message})
    return next((messages[rank] for rank in range(world_size) if messages[rank] is not None), None)
