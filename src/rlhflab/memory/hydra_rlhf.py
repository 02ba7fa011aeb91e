"""Memory strategy `memory=hydra`: Hydra-RLHF (Santacroce et al., 2023), one backbone, several heads.

(In code the strategy is `HydraRLHFMemory` and its stage `hydra_sft`, so that "hydra"
alone never has to be read as the config framework.)

Layout of the one model:

    input ids -> decoder (frozen; LoRA adapters "policy" and, for PPO, "value")
              -> final hidden states h (n, T, H)
                   -> LM head      -> logits: policy (adapter "policy"), reference (adapters off)
                   -> reward head  -> scores: reward model (adapters off; frozen)
                   -> value head   -> values: critic (adapter "value"; trainable, starts as the reward head)

Stage `hydra_sft` (rlhflab.stages.hydra_sft) trains the decoder, LM head and reward
head together on demonstrations and preference pairs. RL then trains only the
adapters (and the value head): with the adapters off the model is, bit for
bit, the reference policy and the reward model, so no second copy exists.
Reference log-probs and scores read the same adapter-off trunk, so one forward
serves both for a batch.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path
from contextlib import contextmanager, nullcontext
from typing import Sequence

import torch
from torch import nn

from rlhflab.errors import ConfigError
from rlhflab.memory.base import MemoryStrategy
from rlhflab.memory.lora import DEFAULT_TARGETS, LoraSettings, adapt, lora_config, trainable_parameters
from rlhflab.models.build import DTYPES, freeze, load_causal_lm, module_name, read_reward_norm
from rlhflab.models.heads import ScalarHead, has_reward_head, sequence_scores, trunk
from rlhflab.rollout.batch import join, read_before, token_logprobs
from rlhflab.rollout.weights import save_policy_checkpoint

POLICY, VALUE = "policy", "value"  # adapter names


class HydraRLHFMemory(LoraSettings, MemoryStrategy):
    """One backbone for policy, reference, reward and value; LoRA adapters carry what RL learns.

    r, lora_alpha, lora_dropout, target_modules, gradient_checkpointing: as in `lora`.
    actor_critic: PPO's critic. "separate": a value adapter of its own beside the policy's (Hydra-PPO); "joint": the
    value head reads the policy adapter's trunk (the paper's J-Hydra-PPO), so the update's one trunk forward and
    backward serve both losses, and no value adapter exists.
    """

    name = "hydra"  # the user's word: memory=hydra
    # The reference's log-probs read the frozen trunk output the reward head scored the batch with (_frozen_hidden):
    # the RL module runs the reference over the whole batch then, not split by completion length.
    reference_shares_scoring_forward = True

    def __init__(self, r: int = 8, lora_alpha: float = 16.0, lora_dropout: float = 0.0,
                 target_modules: str | Sequence[str] = DEFAULT_TARGETS, gradient_checkpointing: bool = False,
                 actor_critic: str = "separate") -> None:
        super().__init__(r, lora_alpha, lora_dropout, target_modules, gradient_checkpointing)
        self.joint = actor_critic == "joint"  # the schema (HydraMemory) admits separate and joint, before any model loads

    # ---- stages ----------------------------------------------------------------------------

    def check(self, model_cfg, task, need_reward: bool) -> None:
        """Settings this strategy cannot run with, caught before any model loads."""
        if not need_reward:
            return
        if model_cfg.get("reward_model_path"):
            raise ConfigError(
                "model.reward_model_path: memory=hydra scores with a reward head on the policy's own backbone, not a separate "
                "reward model; set it to null (stage hydra_sft trains the head) or use memory=full or memory=lora"
            )
        ready = model_cfg.get("sft_path") and has_reward_head(model_cfg.sft_path)  # a hydra_sft output: nothing to train
        lacking = [what for what, rows in (("demonstrations (task.demonstrations_path)", task.demonstrations()),
                                           ("preference pairs (task.preferences_path)", task.preference_pairs())) if rows is None]
        if not ready and lacking:  # it said 'demonstrations or preference pairs', not which
            raise ConfigError(f"memory=hydra: stage hydra_sft trains the policy and its reward head together, and task "
                              f"{task.name} has no {' and no '.join(lacking)}; give {'them' if len(lacking) > 1 else 'it'}, "
                              "or use memory=lora (with model.reward_model_path=<a ready reward model> where the task has "
                              "no preference pairs), or reward=function")

    def stages(self, need_reward: bool) -> tuple[str, ...]:
        """Stage hydra_sft trains the shared trunk with both heads; without a reward, plain stage sft."""
        return ("hydra_sft",) if need_reward else ("sft",)

    # ---- building ------------------------------------------------------------------------

    def build(self, policy_path, reward_path, need_values: bool, tokenizer, dtype: str = "float32") -> "HydraRLHFMemory":
        """Wrap the hydra_sft checkpoint in adapters and load its heads. reward_path None: no reward head (rule reward)."""
        from peft import TaskType

        self.pad_token_id = tokenizer.pad_token_id
        self.dtype = dtype
        causal_lm = self.trainable(load_causal_lm(policy_path, dtype), context_fn=self._recompute_context)
        lm_head = module_name(causal_lm, causal_lm.get_output_embeddings())
        self.lm = adapt(causal_lm, lora_config(**self.lora, task_type=TaskType.CAUSAL_LM), adapter_name=POLICY)
        self.reward_head = None
        self.reward_norm = (0.0, 1.0)
        if reward_path is not None:
            self.reward_head = freeze(ScalarHead.from_pretrained(reward_path, dtype))
            self.reward_norm = read_reward_norm(reward_path)
        self.value_head = None
        if need_values and not self.joint:
            # The value adapter sits where the policy's does, except on the LM head, which values never read.
            targets = [n for n in self.lm.targeted_module_names if n != lm_head]
            self.lm.add_adapter(VALUE, lora_config(**{**self.lora, "target_modules": targets}, task_type=TaskType.CAUSAL_LM))
            from rlhflab.models.lora_add import fuse_lora_adds

            fuse_lora_adds(self.lm)  # peft adds to the policy's modules in place; any it made anew get the fused add
        if need_values:
            # The critic starts as the reward model (as in the PPO-RLHF recipes), or at 0 without one.
            fresh = self.reward_head is None
            head = ScalarHead(causal_lm.config.hidden_size, DTYPES[dtype]) if fresh else copy.deepcopy(self.reward_head)
            self.value_head = head.requires_grad_(True).train()
        self._collect_trainable()
        self._memo = None
        self._activate(POLICY)
        return self

    def shard(self, mesh) -> None:
        super().shard(mesh)
        self._collect_trainable()  # fully_shard replaced every parameter with a DTensor one

    def _collect_trainable(self) -> None:
        """The parameter objects each adapter trains (read once: _activate sets them trainable at every switch)."""
        self._policy_params = self._adapter_parameters(POLICY)
        self._value_params = self._adapter_parameters(VALUE) + trainable_parameters(self.value_head)

    def _adapter_parameters(self, adapter: str) -> list[nn.Parameter]:
        return [p for n, p in self.lm.named_parameters() if f".{adapter}." in n]

    # ---- which adapter the trunk runs with -------------------------------------------------

    def _activate(self, adapter: str | None) -> None:
        """Route trunk forwards through `adapter`; None: no adapter (the SFT backbone = reference and reward model)."""
        if adapter is None:
            self.lm.base_model.disable_adapter_layers()
        else:
            self.lm.base_model.enable_adapter_layers()
            self.lm.set_adapter(adapter)
        self._active = adapter
        # peft freezes the adapters it switches off, but here both adapters train whichever one is active.
        for p in self._policy_params + self._value_params:
            p.requires_grad_(True)

    @contextmanager
    def _using(self, adapter: str | None):
        previous = self._active
        if adapter != previous:
            self._activate(adapter)
        try:
            yield
        finally:
            if adapter != previous:
                self._activate(previous)

    def _recompute_context(self):
        """Checkpoint recomputation runs in backward, after the adapter may have switched: use the forward's."""
        return nullcontext(), self._using(self._active)

    # ---- forwards ------------------------------------------------------------------------

    @property
    def causal_lm(self):
        """The adapted causal LM itself (decoder + LM head), without peft's wrapper."""
        return self.lm.get_base_model()

    def _hidden(self, query, response) -> torch.Tensor:
        input_ids, attention_mask, position_ids = join(query, response, self.pad_token_id)
        return trunk(self.causal_lm, input_ids, attention_mask, position_ids)

    def _response_logprobs(self, hidden, query, response, temperature: float) -> torch.Tensor:
        """`hidden`: the trunk over prompt + response, or over prompt + every response token but the last (`read_before`:
        the policy's and the critic's forwards; the frozen trunk runs the whole response, which the scores read)."""
        # The whole sequence through the LM head, as the model's own forward does, so the reference is bit-exact.
        logits = self.causal_lm.get_output_embeddings()(hidden)
        start = query.shape[1] - 1
        return token_logprobs(logits[:, start : start + response.shape[1]], response, temperature)

    def _frozen_hidden(self, query, response) -> torch.Tensor:
        """Trunk output with the adapters off, which scores and reference log-probs of a batch share.

        The last batch's result is kept (until the next batch), keyed by its input tensors: their
        ids stay unique while the memo holds them, and _version changes on any in-place write.
        """
        key = (id(query), id(response), query._version, response._version)
        if self._memo is None or self._memo[0] != key:
            with torch.no_grad(), self._using(None):
                self._memo = (key, (query, response), self._hidden(query, response))
        return self._memo[2]

    @property
    def generation_model(self) -> nn.Module:
        return self.lm  # the policy adapter is active outside the forwards below

    def save_policy(self, path, merge: bool, state_dict: dict | None = None) -> None:
        """The policy adapter alone (its base is the stage hydra_sft model); with `merge`, a merged copy in path/merged."""
        path = Path(path)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            self.lm.save_pretrained(tmp, selected_adapters=[POLICY], save_embedding_layers=False, state_dict=state_dict)
            shutil.move(str(Path(tmp) / POLICY), str(path))  # peft puts a non-default adapter in a subdirectory
        if merge:
            save_policy_checkpoint(self.lm, path / "merged")

    def policy_logprobs(self, query, response, temperature: float) -> torch.Tensor:
        """(n, P), (n, R) -> (n, R) log-probs of the response under the policy adapter (with grad)."""
        with self._using(POLICY):
            return self._response_logprobs(self._hidden(query, read_before(response)), query, response, temperature)

    @torch.no_grad()
    def reference_logprobs(self, query, response, temperature: float) -> torch.Tensor:
        """(n, R) log-probs under the backbone with the adapters off: the SFT policy of stage hydra_sft."""
        hidden = self._frozen_hidden(query, response)
        with self._using(None):  # the LM head carries an adapter too
            return self._response_logprobs(hidden, query, response, temperature)

    @property
    def _critic(self) -> str:
        """The adapter the critic's trunk runs with (actor_critic)."""
        return POLICY if self.joint else VALUE

    def _read_values(self, hidden, query) -> torch.Tensor:
        """`hidden` over prompt + every response token but the last (`read_before`)."""
        return self.value_head(hidden).squeeze(-1)[:, query.shape[1] - 1 :].float()

    def values(self, query, response) -> torch.Tensor:
        """(n, R) value estimates from the critic's trunk and the value head (with grad)."""
        with self._using(self._critic):
            return self._read_values(self._hidden(query, read_before(response)), query)

    def policy_logprobs_and_values(self, query, response, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """policy_logprobs and values of the same rows; with actor_critic=joint from one trunk forward."""
        if not self.joint:
            return super().policy_logprobs_and_values(query, response, temperature)
        with self._using(POLICY):
            hidden = self._hidden(query, read_before(response))
            return self._response_logprobs(hidden, query, response, temperature), self._read_values(hidden, query)

    @torch.no_grad()
    def scores(self, query, response, prompts=None, completions=None) -> torch.Tensor:
        """(n,) standardised reward-head scores of the whole completion, adapters off."""
        input_ids = torch.cat([query, response], dim=1)
        raw = sequence_scores(self.reward_head, self._frozen_hidden(query, response), input_ids, self.pad_token_id)
        mean, std = self.reward_norm
        return (raw.float() - mean) / std

    # ---- what the RL module and the accounting see -------------------------------------------

    def model_modules(self) -> list[nn.Module]:
        """The one backbone (with its adapters) and the heads: nothing else exists."""
        return [m for m in (self.lm, self.reward_head, self.value_head) if m is not None]

    def trainable_modules(self) -> list[nn.Module]:
        return [m for m in (self.lm, self.value_head) if m is not None]

    def policy_parameters(self):
        return list(self._policy_params)

    def value_parameters(self):
        return list(self._value_params)
