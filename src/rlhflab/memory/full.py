"""Memory strategy `full`: separate policy, reference, reward model and value model.

Algorithms never see this class's layout: they ask for policy log-probs,
reference log-probs, values and scores. Other strategies answer the same calls.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from rlhflab.memory.base import MemoryStrategy
from rlhflab.models.build import (
    foreign_tokenizer, freeze, load_causal_lm, load_reward_model, load_value_model, read_reward_norm, text_scores, without_dropout,
)


class FullMemory(MemoryStrategy):
    """Every role is its own model; the reference is a frozen copy of the starting policy.

    gradient_checkpointing: recompute activations in backward to save memory.
    """

    name = "full"

    def build(self, policy_path, reward_path, need_values: bool, tokenizer, dtype: str = "float32") -> "FullMemory":
        """Load the models this run needs. reward_path None: no reward model (rule reward)."""
        self.pad_token_id = tokenizer.pad_token_id
        self.dtype = dtype
        policy = without_dropout(load_causal_lm(policy_path, self.dtype))
        self.reference = freeze(copy.deepcopy(policy))
        self.policy = self.trainable(policy)
        self.load_reward_model(reward_path, tokenizer)
        # Values start from the reward model when there is one (as in the PPO-RLHF recipes).
        self.value_model = None
        if need_values:
            # (a reward model with a tokenizer of its own cannot be the critic of the policy's tokens)
            start = reward_path if reward_path and self.reward_tokenizer is None else policy_path
            self.value_model = self.trainable(load_value_model(start, self.dtype, self.pad_token_id))
        return self

    def load_reward_model(self, reward_path, tokenizer) -> None:
        """A frozen reward model and the score statistics its stage measured; None: no reward model (rule reward).
        A reward model whose tokenizer differs from the policy's reads decoded text, re-tokenised its own way."""
        self.reward_model = None
        self.reward_tokenizer = None
        self.reward_norm = (0.0, 1.0)
        if reward_path is not None:
            self.reward_tokenizer = foreign_tokenizer(reward_path, tokenizer)
            pad = self.pad_token_id if self.reward_tokenizer is None else self.reward_tokenizer.pad_token_id
            self.reward_model = freeze(load_reward_model(reward_path, self.dtype, pad))
            self.reward_norm = read_reward_norm(reward_path)

    @property
    def generation_model(self) -> nn.Module:
        return self.policy

    def save_policy(self, path, merge: bool, state_dict: dict | None = None) -> None:
        self.policy.save_pretrained(path, state_dict=state_dict)

    def policy_logprobs(self, query, response, temperature: float) -> torch.Tensor:
        """(n, P), (n, R) -> (n, R) log-probs of the response under the trained policy (with grad)."""
        return self._logprobs(self.policy, query, response, temperature)

    @torch.no_grad()
    def reference_logprobs(self, query, response, temperature: float) -> torch.Tensor:
        """(n, R) log-probs under the frozen reference policy."""
        return self._logprobs(self.reference, query, response, temperature, shared_prompt=not self.split_reference)

    def frozen_models(self) -> list[nn.Module]:
        """The reference and a reward model."""
        return [m for m in (self.reference, self.reward_model) if m is not None]

    def values(self, query, response) -> torch.Tensor:
        """(n, R) value estimates (with grad)."""
        return self._values(self.value_model, query, response)

    @torch.no_grad()
    def scores(self, query, response, prompts: list[str] | None = None, completions: list[str] | None = None) -> torch.Tensor:
        """(n,) standardised reward-model scores of the whole completion (from the texts when the
        reward model has a tokenizer of its own)."""
        if self.reward_tokenizer is None:
            return self._scores(self.reward_model, query, response)
        raw = text_scores(self.reward_model, self.reward_tokenizer, prompts, completions).to(query.device)
        mean, std = self.reward_norm
        return (raw - mean) / std

    def model_modules(self) -> list[nn.Module]:
        """Every model this strategy holds (for memory accounting)."""
        return [m for m in (self.policy, self.reference, self.reward_model, self.value_model) if m is not None]

    def trainable_modules(self) -> list[nn.Module]:
        return [m for m in (self.policy, self.value_model) if m is not None]

    def policy_parameters(self):
        return [p for p in self.policy.parameters() if p.requires_grad]

    def value_parameters(self):
        return [] if self.value_model is None else [p for p in self.value_model.parameters() if p.requires_grad]
