"""Where the learner's rollouts come from: `mode=sync` generates them on demand."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from rlhflab.rollout.batch import Rollout


@contextmanager
def seeded(seed: int, batch: int):
    """Sampling noise that depends only on (seed, batch index): sync and async draw the same samples."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003 + batch)
        yield


class SyncSource:
    """Generate each batch with the current weights, then train on it (staleness 0)."""

    name = "sync"
    staleness = 0
    max_staleness = 0
    off_policy = "none"  # the learner's recomputed log-probs are the behaviour policy's

    def __init__(self, generator) -> None:
        self.generator = generator
        self.next_batch = 0
        self.seed = 0

    @property
    def eval_generator(self):
        """What the learner samples evaluation completions with."""
        return self.generator

    def start(self, model, loader, train_prompts, algo, seed: int) -> None:
        self.seed = seed

    def get(self, model, query, prompts: list[str], version: int, algo) -> Rollout:
        with seeded(self.seed, self.next_batch):
            rollout = self.generator.generate(
                model, query, prompts, algo.samples_per_prompt, version, greedy_baseline=algo.needs_greedy_baseline
            )
        self.next_batch += 1
        return rollout

    def after_update(self, model, version: int) -> None:
        """Sync mode generates from the live policy: no weights to push."""

    def close(self) -> None:
        pass
