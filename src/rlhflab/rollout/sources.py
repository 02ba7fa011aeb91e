"""Where the learner's rollouts come from: `mode=sync` generates them on demand."""

from __future__ import annotations

from rlhflab.rollout.batch import Rollout


class SyncSource:
    """Generate each batch with the current weights, then train on it (staleness 0)."""

    name = "sync"
    staleness = 0

    def __init__(self, generator) -> None:
        self.generator = generator

    def get(self, model, query, prompts: list[str], version: int, algo) -> Rollout:
        return self.generator.generate(
            model, query, prompts, algo.samples_per_prompt, version, greedy_baseline=algo.needs_greedy_baseline
        )

    def after_update(self, model, version: int) -> None:
        """Sync mode generates from the live policy: no weights to push."""

    def close(self) -> None:
        pass
