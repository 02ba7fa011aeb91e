"""Memory strategy `lora`: LoRA adapters on a frozen policy; the reference is that policy with the adapter off.

One copy of the policy weights serves two roles (TRL's `disable_adapter()`
reference): the adapter on is the trained policy, the adapter off is the
starting SFT policy, bit for bit. Everything else is as in `full` (whose
methods it inherits): the reward model is separate and frozen; PPO's value model (initialised from the reward model) trains its
own adapter and value head on a frozen backbone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pathlib import Path

from rlhflab.memory.full import FullMemory
from rlhflab.models.build import load_causal_lm, load_value_model
from rlhflab.rollout.weights import save_policy_checkpoint

# Every linear layer of Llama and GPT-NeoX blocks, and the LM head (lm_head / embed_out); names a
# model lacks are skipped. The head matters: the final norm bounds the trunk's output, so adapters
# below it alone cannot sharpen a flat distribution (on the tiny model P(positive word) stalled at 0.32).
DEFAULT_TARGETS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
    "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "embed_out",
)
# The scalar head of a token-classification model, per architecture (Llama: score; GPT-NeoX: classifier).
VALUE_HEAD_NAMES = ["score", "classifier"]


def lora_config(r: int, lora_alpha: float, lora_dropout: float, target_modules, task_type, **extra):
    """A peft LoraConfig; `target_modules` is "all-linear" or a list of module names (a Hydra ListConfig is fine)."""
    from peft import LoraConfig

    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    return LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=targets, task_type=task_type, **extra)


def trainable_parameters(module: nn.Module | None) -> list[nn.Parameter]:
    return [] if module is None else [p for p in module.parameters() if p.requires_grad]


class LoraMemory(FullMemory):
    """Policy = frozen SFT weights + LoRA adapter; reference = the same weights, adapter off.

    r: LoRA rank; lora_alpha: the adapter's output is scaled by lora_alpha / r;
    lora_dropout: dropout on the adapter input; target_modules: module names
    or "all-linear" (which leaves the LM head out); gradient_checkpointing:
    recompute activations in backward.
    """

    name = "lora"

    def __init__(
        self,
        r: int = 8,
        lora_alpha: float = 16.0,
        lora_dropout: float = 0.0,
        target_modules: str | Sequence[str] = DEFAULT_TARGETS,
        gradient_checkpointing: bool = False,
    ) -> None:
        super().__init__(gradient_checkpointing)
        self.lora = {"r": r, "lora_alpha": lora_alpha, "lora_dropout": lora_dropout, "target_modules": target_modules}

    def build(self, policy_path, reward_path, need_values: bool, tokenizer, dtype: str = "float32") -> "LoraMemory":
        """Load the models this run needs. reward_path None: no reward model (rule reward)."""
        from peft import TaskType, get_peft_model

        self.pad_token_id = tokenizer.pad_token_id
        self.dtype = dtype
        policy = self.trainable(load_causal_lm(policy_path, dtype))
        self.policy = get_peft_model(policy, lora_config(**self.lora, task_type=TaskType.CAUSAL_LM))
        self.load_reward_model(reward_path, tokenizer)
        self.value_model = None
        if need_values:
            # Values start from the reward model when there is one (as in the PPO-RLHF recipes);
            # listing the head in modules_to_save trains it in full and keeps the adapter off it.
            start = reward_path if reward_path and self.reward_tokenizer is None else policy_path
            backbone = self.trainable(load_value_model(start, dtype, self.pad_token_id))
            config = lora_config(**self.lora, task_type=TaskType.TOKEN_CLS, modules_to_save=VALUE_HEAD_NAMES)
            self.value_model = get_peft_model(backbone, config)
        return self

    def save_policy(self, path, merge: bool, state_dict: dict | None = None) -> None:
        """The adapter (its base is the SFT policy it was trained on); with `merge`, a merged copy in path/merged."""
        # The LM head's adapter is a LoRA pair: the frozen head itself need not be copied.
        self.policy.save_pretrained(path, save_embedding_layers=False, state_dict=state_dict)
        if merge:
            save_policy_checkpoint(self.policy, Path(path) / "merged")

    @torch.no_grad()
    def reference_logprobs(self, query, response, temperature: float) -> torch.Tensor:
        """(n, R) log-probs under the starting policy: the same weights with the adapter switched off."""
        with self.policy.disable_adapter():
            return self._logprobs(self.policy, query, response, temperature)

    def model_modules(self) -> list[nn.Module]:
        """Every model this strategy holds (for memory accounting); there is no reference model to list."""
        return [m for m in (self.policy, self.reward_model, self.value_model) if m is not None]

