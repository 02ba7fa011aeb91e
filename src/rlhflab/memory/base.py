"""What every memory strategy answers, and the default way to get its starting models.

A strategy decides how policy, reference, reward and value share weights. The
RL module and the algorithms only call: `policy_logprobs`, `reference_logprobs`,
`values`, `scores`, `generation_model`, `policy_parameters`, `value_parameters`,
`model_modules`, `trainable_modules`, and `run_stages` (before `build`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from rlhflab.rollout.batch import join, token_logprobs

log = logging.getLogger(__name__)


def enable_checkpointing(model, **checkpoint_kwargs) -> None:
    """Recompute each layer's activations in backward; non-reentrant, so frozen inputs need no grad."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False, **checkpoint_kwargs})


class MemoryStrategy(nn.Module):
    name = "base"

    def check(self, model_cfg, task, need_reward: bool) -> None:
        """Raise ConfigError for settings this strategy cannot run with (called before any model loads)."""

    def run_stages(self, model_cfg: dict, base, tokenizer, task, stages: dict, cache_dir, make_trainer, need_reward: bool):
        """-> (sft_path, reward_path or None): stage sft then stage rm, each skipped when given or cached."""
        from rlhflab.stages import run_rm, run_sft

        if model_cfg.get("sft_path"):
            sft_path = model_cfg["sft_path"]
            log.info("stage sft: skipped, using model.sft_path=%s", sft_path)
        else:
            sft_path = run_sft(base, tokenizer, task, stages["sft"], model_cfg["dtype"], cache_dir, make_trainer)
        if not need_reward:
            log.info("stage rm: skipped, the reward needs no reward model")
            return sft_path, None
        if model_cfg.get("reward_model_path"):
            log.info("stage rm: skipped, using model.reward_model_path=%s", model_cfg["reward_model_path"])
            return sft_path, model_cfg["reward_model_path"]
        return sft_path, run_rm(sft_path, tokenizer, task, stages["rm"], model_cfg["dtype"], cache_dir, make_trainer)

    # Helpers shared by the strategies: one forward over prompt + response.

    def _forward(self, model, query, response, **kwargs):
        input_ids, attention_mask, position_ids = join(query, response, self.pad_token_id)
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)

    def _logprobs(self, model, query, response, temperature: float) -> torch.Tensor:
        logits = self._forward(model, query, response).logits
        # The logit at position t predicts token t+1: keep those predicting the response.
        return token_logprobs(logits[:, query.shape[1] - 1 : -1], response, temperature)

    def _values(self, model, query, response) -> torch.Tensor:
        """V at response token t is read where token t-1 is the last input (the state before t)."""
        out = self._forward(model, query, response).logits
        return out.squeeze(-1)[:, query.shape[1] - 1 : -1].float()

    def _scores(self, model, query, response) -> torch.Tensor:
        raw = self._forward(model, query, response).logits
        mean, std = self.reward_norm
        return (raw.squeeze(-1).float() - mean) / std
