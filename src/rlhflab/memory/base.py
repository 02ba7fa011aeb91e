"""The base of the memory strategies (the contract is rlhflab.contracts.MemoryStrategy).

A strategy decides how policy, reference, reward and value share weights. It
declares which training stages it needs (`stages`) and builds its models from
their outputs (`build`); it never runs a stage itself.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from rlhflab.models.build import lower_linears, without_dropout
from rlhflab.models.sharding import shard, warm_up
from rlhflab.rollout.batch import join, read_before, token_logprobs
from rlhflab.rollout.lean import forward_logits, lean_unsupported, prompt_once_logits, prompt_once_scores, prompt_once_values


class MemoryStrategy(nn.Module):
    """Shared helpers: the standard stages, trainable-module preparation, one forward over prompt + response."""

    name = "base"
    pad_token_id: int
    reward_norm: tuple[float, float]
    prompt_once = False  # rl.prompt_once (the RL module sets it): log-probs with each prompt's positions run once
    # mode.reference=balance (the RL module sets it): the reference's rows are computed in two parts, and each part
    # must get a row the numbers of the whole batch's forward, which the shared-prompt forward does not (`_logprobs`)
    split_reference = False

    def __init__(self, gradient_checkpointing: bool = False) -> None:
        super().__init__()
        self.gradient_checkpointing = gradient_checkpointing

    def stages(self, need_reward: bool) -> tuple[str, ...]:
        """Stage sft for the policy, and stage rm when the reward needs a reward model."""
        return ("sft", "rm") if need_reward else ("sft",)

    def check(self, model_cfg, task, need_reward: bool) -> None:
        """Raise ConfigError for settings this strategy cannot run with (called before any model loads)."""

    def save_policy(self, path: Path, merge: bool, state_dict: dict | None = None) -> None:
        """Write the trained policy where `from_pretrained` loads it (the tokenizer is the caller's);
        with adapters, the adapter, and with `merge` also a merged copy in path/merged. `state_dict`:
        the generation model's whole state, gathered, when its parameters are sharded (trainer=fsdp)."""
        raise NotImplementedError

    def frozen_models(self) -> list[nn.Module]:
        """The wholly frozen models held apart from the trained ones: none here (the reference is the policy's own
        weights, adapters off, and the reward a head on a shared trunk)."""
        return []

    def lower_frozen(self, dtype: torch.dtype) -> int:
        """Each frozen model's linear layers stored in autocast's `dtype` (models.build.lower_linears): the same
        numbers under that autocast, half their bytes (226 MB for a 113M reference); -> the bytes freed."""
        return sum(lower_linears(m, dtype) for m in self.frozen_models())

    def shard(self, mesh) -> None:
        """FSDP2 over the data-parallel `mesh`: every model this strategy holds, each on its own."""
        for model in self.model_modules():
            shard(model, mesh)

    def warm_up(self) -> None:
        """After sharding and moving to the device: a first forward through each root (see models.sharding)."""
        for model in self.model_modules():
            warm_up(model)

    def trainable(self, model: nn.Module, **checkpoint_kwargs) -> nn.Module:
        """Ready a model whose weights RL trains: no dropout (the rollout pass and the update pass must
        compute the same log-probs), activation checkpointing if asked, and train mode, which HF's
        checkpointing requires (from_pretrained returns eval-mode models, and Lightning keeps modes)."""
        without_dropout(model)
        if self.gradient_checkpointing:
            # Non-reentrant, so frozen inputs need no grad.
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False, **checkpoint_kwargs})
        return model.train()

    def policy_logprobs_and_values(self, query, response, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(policy log-probs with grad, values with grad) of the same rows, for an update that needs both (PPO):
        two forwards here; one where the critic reads the policy's own trunk (memory=hydra actor_critic=joint)."""
        return self.policy_logprobs(query, response, temperature), self.values(query, response)

    def _forward(self, model, query, response, **kwargs) -> torch.Tensor:
        """The model's logits over prompt + response (a reward model's: its score per row; a value model's: per
        position). A plain Llama on the CPU through the lean forward: HF's logits and gradients bit for bit, without
        its per-call overhead (`forward_logits`); use_cache=False elsewhere: no past keys to keep."""
        input_ids, attention_mask, position_ids = join(query, response, self.pad_token_id)
        return forward_logits(model, input_ids, attention_mask, position_ids=position_ids, **kwargs)

    def _shared_prompt(self, once, model, query, inputs, shared: bool = True) -> torch.Tensor | None:
        """rl.prompt_once's forward, `once(model, query, inputs, pad)` (rollout/lean.py's `prompt_once_logits`,
        `_values` or `_scores`: each distinct prompt's positions run once for its k samples), where it runs; None where
        it does not (off, `shared` False, not a plain Llama on the CPU, no prompt repeats): the caller's one forward
        over every row then."""
        if self.prompt_once and shared and lean_unsupported(model, autocast_ok=True) is None:
            return once(model, query, inputs, self.pad_token_id)
        return None

    def _logprobs(self, model, query, response, temperature: float, shared_prompt: bool = True) -> torch.Tensor:
        """shared_prompt: rl.prompt_once's forward may run (each distinct prompt's positions once). Its products run
        over the rows' prompts and responses packed together, so a row's floats depend on the rows beside it (~1e-6
        apart on 768-wide layers), where every row's own forward (`lean_forward`, HF's) gives a row the same numbers
        whichever rows it runs with: what mode.reference=balance's split needs (tests/test_rollout.py)."""
        # The logit at position t predicts token t+1: those predicting the response are the prompt's last position's
        # and each response position's but the last. The last response token is not run (`read_before`).
        # logits_to_keep: the LM head (and its (n, T, V) output) covers those positions only, not the prompt.
        inputs = read_before(response)
        logits = self._shared_prompt(prompt_once_logits, model, query, inputs, shared_prompt)
        if logits is None:
            logits = self._forward(model, query, inputs, logits_to_keep=response.shape[1])
        return token_logprobs(logits, response, temperature)

    def _values(self, model, query, response) -> torch.Tensor:
        """V at response token t is read where token t-1 is the last input (the state before t): the last response
        token is not run (`read_before`). Each distinct prompt's positions run once for its k samples where
        rl.prompt_once's forward runs (`prompt_once_values`: within ~2e-6 of one forward over every row), as the
        policy's log-probs and the reward model's scores run them."""
        inputs = read_before(response)
        out = self._shared_prompt(prompt_once_values, model, query, inputs)
        if out is not None:
            return out.squeeze(-1).float()
        out = self._forward(model, query, inputs)
        return out.squeeze(-1)[:, query.shape[1] - 1 :].float()

    def _scores(self, model, query, response) -> torch.Tensor:
        """A reward model's standardised scores; each distinct prompt's positions run once for its k samples where
        rl.prompt_once's forward runs (`prompt_once_scores`: within 2e-6 of one forward over every row, relative to
        the largest score; that forward runs otherwise)."""
        raw = self._shared_prompt(prompt_once_scores, model, query, response)
        if raw is None:
            raw = self._forward(model, query, response)
        mean, std = self.reward_norm
        return (raw.squeeze(-1).float() - mean) / std
