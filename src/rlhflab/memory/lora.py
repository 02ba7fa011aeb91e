"""Memory strategy `lora`: LoRA adapters on a frozen policy; the reference is that policy with the adapter off.

One copy of the policy weights serves two roles (TRL's `disable_adapter()`
reference): the adapter on is the trained policy, the adapter off is the
starting SFT policy, bit for bit. PPO's critic and the reward model share one frozen backbone the same
way: the value model is the reward model's backbone with an adapter and a value head, and the reward is
that backbone with the adapter off, read by the reward model's own head. So PPO holds two backbones, not
three (Hydra-RLHF's "LoRA-PPO" arrangement). Without values (every algorithm but PPO), or with a reward
model of another tokenizer, the reward model is separate and frozen, as in `full`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pathlib import Path

from rlhflab.errors import ConfigError
from rlhflab.memory.full import FullMemory
from rlhflab.models.build import foreign_tokenizer, freeze, load_causal_lm, load_reward_model, load_value_model, read_reward_norm
from rlhflab.models.targets import decoder_linear_names, targets_reach_nothing
from rlhflab.rollout.batch import join
from rlhflab.rollout.lean import last_token_index
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


def critic_of(reward_path) -> str:
    """Which model a target line is about, where it is memory=lora's critic on the reward model's backbone."""
    return f" (the critic, on model.reward_model_path={reward_path})"


def adapt(model: nn.Module, config, of: str = "", keep=(), **kwargs):
    """`get_peft_model`, refusing in one line target names that reach none of the model's decoder layers: the
    default names are Llama's and GPT-NeoX's, and on GPT-2 they matched its (tied) LM head alone, so the policy
    trained an adapter on the head only and the critic's, with no head to match, raised peft's
    NoMatchingPeftModuleError traceback. `of`, `keep`: which model, where it is not the policy (critic_of), and the
    names the list keeps for the policy (targets_reach_nothing)."""
    from peft import get_peft_model
    from peft.utils.error import NoMatchingPeftModuleError

    linear = decoder_linear_names(model)
    try:
        wrapped = get_peft_model(model, config, **kwargs)
    except NoMatchingPeftModuleError:
        if not linear:  # no decoder layers to name: peft's own message is all there is
            raise
        wrapped = None
    if linear and (wrapped is None or not {n.rpartition(".")[2] for n in wrapped.targeted_module_names} & set(linear)):
        raise targets_reach_nothing(model, linear, of, keep)
    if wrapped is not None:
        from rlhflab.models.lora_add import fuse_lora_adds

        fuse_lora_adds(wrapped)
    return wrapped


def critic_on_reward_model(need_values: bool, reward_path, tokenizer) -> bool:
    """Whether memory=lora's critic is the reward model's backbone with an adapter (else the policy's): where there
    are values, and a reward model that reads the policy's tokens."""
    return need_values and reward_path is not None and foreign_tokenizer(reward_path, tokenizer) is None


def trainable_parameters(module: nn.Module | None) -> list[nn.Parameter]:
    return [] if module is None else [p for p in module.parameters() if p.requires_grad]


class LoraSettings:
    """The adapter settings of memory=lora and memory=hydra, kept in `self.lora` for every adapter they
    train (a mixin: the strategy's own base class comes next in the MRO and takes gradient_checkpointing)."""

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


class LoraMemory(LoraSettings, FullMemory):
    """Policy = frozen SFT weights + LoRA adapter; reference = the same weights, adapter off.

    r: LoRA rank; lora_alpha: the adapter's output is scaled by lora_alpha / r;
    lora_dropout: dropout on the adapter input; target_modules: module names
    or "all-linear" (which leaves the LM head out); gradient_checkpointing:
    recompute activations in backward.
    """

    name = "lora"

    def build(self, policy_path, reward_path, need_values: bool, tokenizer, dtype: str = "float32") -> "LoraMemory":
        """Load the models this run needs. reward_path None: no reward model (rule reward)."""
        from peft import TaskType

        self.pad_token_id = tokenizer.pad_token_id
        self.dtype = dtype
        policy = self.trainable(load_causal_lm(policy_path, dtype))
        self.policy = adapt(policy, lora_config(**self.lora, task_type=TaskType.CAUSAL_LM))
        self.value_model = None
        self.reward_head = None  # set when the critic's frozen backbone is the reward model's
        share = critic_on_reward_model(need_values, reward_path, tokenizer)
        if share:
            self.reward_model, self.reward_tokenizer = None, None
            self.reward_norm = read_reward_norm(reward_path)
            reward = load_reward_model(reward_path, dtype, self.pad_token_id)
            self.reward_head = freeze(reward.score)  # the reward model's head alone; its backbone is the critic's
            del reward
        else:
            self.load_reward_model(reward_path, tokenizer)
        if need_values:
            # Values start from the reward model when there is one (as in the PPO-RLHF recipes);
            # listing the head in modules_to_save trains it in full and keeps the adapter off it.
            start = reward_path if share else policy_path
            backbone = self.trainable(load_value_model(start, dtype, self.pad_token_id))
            config = lora_config(**self.lora, task_type=TaskType.TOKEN_CLS, modules_to_save=VALUE_HEAD_NAMES)
            of, keep = (critic_of(reward_path), self.lora["target_modules"]) if share else ("", ())
            self.value_model = adapt(backbone, config, of, keep)
        return self

    @torch.no_grad()
    def scores(self, query, response, prompts=None, completions=None) -> torch.Tensor:
        """(n,) standardised reward scores; with a shared critic backbone: that backbone with the adapter
        off (the reward model's weights exactly), read at the last token by the reward model's head."""
        if self.reward_head is None:
            return super().scores(query, response, prompts, completions)
        model = self.value_model.get_base_model()
        input_ids, attention_mask, position_ids = join(query, response, self.pad_token_id)
        with self.value_model.disable_adapter():
            hidden = getattr(model, model.base_model_prefix)(input_ids=input_ids, attention_mask=attention_mask,
                                                              position_ids=position_ids).last_hidden_state
        last = last_token_index(input_ids, self.pad_token_id)
        raw = self.reward_head(hidden[torch.arange(len(hidden), device=hidden.device), last]).squeeze(-1).float()
        mean, std = self.reward_norm
        return (raw - mean) / std

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
            return self._logprobs(self.policy, query, response, temperature, shared_prompt=not self.split_reference)

    def frozen_models(self) -> list[nn.Module]:
        """A reward model of its own (not one whose backbone is the critic's): the reference is the policy, adapter off."""
        return [m for m in (self.reward_model,) if m is not None]

    def model_modules(self) -> list[nn.Module]:
        """Every model this strategy holds (for memory accounting); there is no reference model to list."""
        return [m for m in (self.policy, self.reward_model, self.value_model, self.reward_head) if m is not None]

