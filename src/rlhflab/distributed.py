"""Which process this is, and the few collectives rlhflab needs (no-ops in a single process).

Lightning starts ranks 1..N-1 at the first `Trainer.fit` by running the same command again
(LOCAL_RANK, NODE_RANK and WORLD_SIZE in their environment), so every rank runs the whole of
`train(cfg)`: the stages, RL and the saving. The process group exists from that first fit on.
Rank 0 alone talks to MLflow and writes files; decisions every rank must share (a cache hit,
a stop, a non-finite value) go through these helpers so that no rank waits for another forever.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch


# What Lightning's launcher puts in rank 0's environment when it starts the other ranks.
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


@contextmanager
def one_job():
    """A job that may start ranks (every `train(cfg)`): afterwards its process group is gone and the
    launcher's variables are as before, so the next job of a sweep in this process starts its own ranks
    (Lightning launches none while LOCAL_RANK is set, and would reuse a group whose peers have exited)."""
    before = {k: os.environ.get(k) for k in LAUNCH_VARS}
    try:
        yield
    finally:
        if initialized():
            torch.distributed.destroy_process_group()
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank() -> int:
    """This process's global rank (valid once the process group exists; 0 in a single process)."""
    return torch.distributed.get_rank() if initialized() else int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


def world_size() -> int:
    return torch.distributed.get_world_size() if initialized() else 1


def is_main() -> bool:
    """Rank 0, also before the process group exists (a launched rank has LOCAL_RANK or NODE_RANK > 0)."""
    if initialized():
        return torch.distributed.get_rank() == 0
    if "RANK" in os.environ:
        return int(os.environ["RANK"]) == 0
    if int(os.environ.get("SLURM_NTASKS", 1)) > 1:  # hydra/launcher=slurm: SLURM starts every rank
        return int(os.environ.get("SLURM_PROCID", 0)) == 0
    return int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(os.environ.get("NODE_RANK", 0)) == 0


def _device() -> torch.device:
    """Where collective tensors must live: the current GPU under NCCL, else the CPU."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if initialized():
        torch.distributed.barrier()


def broadcast(value):
    """Rank 0's `value` on every rank (any picklable object)."""
    if not initialized():
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def gather(value) -> list:
    """Every rank's `value`, in rank order, on every rank."""
    if not initialized():
        return [value]
    out = [None] * world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def all_true(flag: bool) -> bool:
    """True only if `flag` holds on every rank."""
    if not initialized():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return bool(t.item())


def any_true(flag: bool) -> bool:
    return not all_true(not flag)


def mean(values: dict[str, float]) -> dict[str, float]:
    """Each value's mean over ranks (every rank must pass the same keys in the same order)."""
    if not initialized() or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_device())
    torch.distributed.all_reduce(t)
    return {k: float(v) / world_size() for k, v in zip(keys, t.tolist())}


def total(value: float) -> float:
    """The sum of `value` over ranks."""
    if not initialized():
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=_device())
    torch.distributed.all_reduce(t)
    return float(t.item())
