"""How completions are scored: a learned reward model or the task's gold rule."""

from __future__ import annotations

import torch

from rlhflab.rollout.batch import Rollout


class ModelReward:
    """Scores from the reward model trained in stage `rm` (or given by model.reward_model_path)."""

    needs_reward_model = True

    def score(self, memory, task, rollout: Rollout) -> torch.Tensor:
        return memory.scores(rollout.query, rollout.response)

    def score_baseline(self, memory, task, rollout: Rollout) -> torch.Tensor:
        query = rollout.query[:: rollout.num_samples // rollout.baseline_response.shape[0]]
        return memory.scores(query, rollout.baseline_response)


class RuleReward:
    """The task's gold rule used directly as the reward (no reward model, no stage `rm`)."""

    needs_reward_model = False

    def score(self, memory, task, rollout: Rollout) -> torch.Tensor:
        return task.gold_reward(rollout.prompts, rollout.texts)

    def score_baseline(self, memory, task, rollout: Rollout) -> torch.Tensor:
        k = rollout.num_samples // rollout.baseline_response.shape[0]
        return task.gold_reward(rollout.prompts[::k], rollout.baseline_texts)
