"""How completions are scored: a learned reward model or the task's gold rule (the `reward=` group)."""

from __future__ import annotations

import torch

from rlhflab.algos import functional as F
from rlhflab.contracts import MemoryStrategy, Reward, Task
from rlhflab.rollout.batch import Rollout


class ModelReward:
    """Scores from the reward model trained in stage `rm` (or given by model.reward_model_path)."""

    needs_reward_model = True

    def score(self, memory: MemoryStrategy, task: Task, rollout: Rollout) -> torch.Tensor:
        return memory.scores(rollout.query, rollout.response,
                             *self._texts(memory, task, rollout.split, rollout.rows, rollout.prompts, rollout.texts))

    def score_baseline(self, memory: MemoryStrategy, task: Task, rollout: Rollout) -> torch.Tensor:
        k = rollout.num_samples // rollout.baseline_response.shape[0]
        rows = rollout.rows[::k] if rollout.rows is not None else None
        return memory.scores(rollout.query[::k], rollout.baseline_response,
                             *self._texts(memory, task, rollout.split, rows, rollout.prompts[::k], rollout.baseline_texts))

    @staticmethod
    def _texts(memory: MemoryStrategy, task: Task, split: str, rows, prompts: list[str], texts: list[str]):
        """A reward model of its own tokenizer reads the dataset's own prompts (text, or messages it renders with its
        own chat template), as a reward function does, not the policy's rendering of them; the others read tokens."""
        if getattr(memory, "reward_tokenizer", None) is None:
            return prompts, texts
        raw, completions, _ = task.reward_inputs(split, rows, prompts, texts)
        return raw, completions


class RuleReward:
    """The task's gold rule used directly as the reward (no reward model, no stage `rm`)."""

    needs_reward_model = False
    needs_gold = True  # the task must have a gold rule (checked before anything loads)

    def score(self, memory: MemoryStrategy, task: Task, rollout: Rollout) -> torch.Tensor:
        return task.gold_reward(rollout.prompts, rollout.texts, rollout.split, rollout.rows)

    def score_baseline(self, memory: MemoryStrategy, task: Task, rollout: Rollout) -> torch.Tensor:
        k = rollout.num_samples // rollout.baseline_response.shape[0]
        rows = rollout.rows[::k] if rollout.rows is not None else None
        return task.gold_reward(rollout.prompts[::k], rollout.baseline_texts, rollout.split, rows)


def score_rollout(reward: Reward, memory: MemoryStrategy, task: Task, rollout: Rollout, eos_token_id: int,
                  eos_penalty: float | None, greedy_baseline: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(n,) scores and, when asked, (b,) greedy-baseline scores, both under the same reward function:
    a completion (sampled or greedy) that never emits EOS gets `eos_penalty` instead of its score."""
    scores = F.eos_penalty(reward.score(memory, task, rollout), rollout.has_eos(eos_token_id), eos_penalty)
    if not greedy_baseline:
        return scores, None
    baseline = reward.score_baseline(memory, task, rollout)
    return scores, F.eos_penalty(baseline, rollout.baseline_has_eos(eos_token_id), eos_penalty)
