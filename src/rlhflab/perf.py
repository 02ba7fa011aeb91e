"""Memory accounting that means the same thing on every machine.

On GPU, `perf/peak_mem_mb` is `torch.cuda.max_memory_allocated`. On CPU the
process RSS is useless for comparisons (glibc keeps freed memory, and a sweep
runs jobs in one process), so it is a tracked byte count instead:

    model state (parameters + gradients + optimizer state)
  + the peak bytes of tensors saved for backward (activations), counted once
    per storage and excluding parameters, through saved_tensors_hooks.

`perf/mem_method` (a tag) names which one a run used.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from torch import nn

from rlhflab.models.sharding import local

MB = 2**20


def _bytes(tensors) -> int:
    """Bytes of distinct storages; of a sharded (FSDP) tensor, this rank's shard."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = local(t).untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def model_state_bytes(modules: list[nn.Module], optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes of trainable and frozen parameters, gradients and optimizer state across `modules`.

    Parameters shared between modules (a reference that is the policy with the
    adapter off, a shared trunk) are counted once.
    """
    params = {id(p): p for m in modules if m is not None for p in m.parameters()}.values()
    trainable = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    # Adam keeps two moments per trainable parameter; count what it actually holds once it has stepped.
    optim = [] if optimizer is None else [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "perf/param_bytes_trainable": _bytes(trainable),
        "perf/param_bytes_frozen": _bytes(frozen),
        "perf/grad_bytes": sum(local(p).numel() * p.element_size() for p in trainable),  # gradients exist at the peak
        "perf/optim_bytes": _bytes(optim),
        "perf/param_count": sum(p.numel() for p in params),  # the whole model's, sharded or not
    }


class ActivationMeter:
    """Peak bytes of tensors autograd saves for backward, between `reset()` calls."""

    def __init__(self, parameters) -> None:
        self.param_ptrs = {local(p).untyped_storage().data_ptr() for p in parameters}
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.lock = threading.Lock()

    def reset(self) -> None:
        self.live.clear()
        self.current = 0

    @contextmanager
    def track(self):
        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            with self.lock:  # the stages' batch threads (stages.batch_threads) pack at once
                if ptr not in self.param_ptrs and ptr not in self.live:
                    self.live[ptr] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield


def peak_memory_mb(state: dict[str, int], activation_peak: int, device: torch.device) -> tuple[float, str]:
    """-> (peak MB, method name)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MB, "cuda_max_memory_allocated"
    tracked = state["perf/param_bytes_trainable"] + state["perf/param_bytes_frozen"] + state["perf/grad_bytes"]
    return (tracked + state["perf/optim_bytes"] + activation_peak) / MB, "tracked_bytes"
