"""Random state: a fixed seed for a block of work, and every generator's state for checkpoints."""

from __future__ import annotations

import random
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def fixed_seed(seed: int):
    """Run the block with torch's CPU generator seeded to `seed`, then restore the caller's state:
    what the block draws depends on `seed` alone, not on what ran before it in the process."""
    with torch.random.fork_rng(devices=[]):
        # Not torch.manual_seed: with CUDA not initialised it queues a lazy seeding call and captures a
        # stack trace each time (0.35-0.9 ms, once per rollout batch). A model on a GPU has initialised it.
        torch.random.default_generator.manual_seed(seed)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(seed)
        yield


def rng_state() -> dict:
    """Python's, numpy's and torch's generator states, as plain types (torch.load(weights_only=True) reads them)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
