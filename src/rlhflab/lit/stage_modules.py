"""LightningModules of the stages before RL: `sft` (demonstrations), `rm` (preference pairs) and
`hydra_sft` (both at once, on one trunk with an LM head and a reward head)."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F

from rlhflab.errors import NonFiniteError
from rlhflab.models.heads import ScalarHead, sequence_scores, trunk
from rlhflab.models.sharding import shard, warm_up
from rlhflab.perf import ActivationMeter, model_state_bytes, peak_memory_mb


def require_finite(loss: torch.Tensor, stage: str, key: str, step: int, lr_key: str) -> None:
    """Stop the stage (nothing cached) on a NaN or Inf loss, naming the step and the quantity."""
    if not torch.isfinite(loss):
        raise NonFiniteError(f"stage {stage}: {key} is {loss.item()} at step {step}; nothing was cached. Lower {lr_key} and run again")


class SFTModule(L.LightningModule):
    """Next-token cross-entropy on the response (and EOS) of each demonstration.

    Also measures its memory the way the RL stage does (rlhflab.perf): a full
    fine-tune is the reference point the memory strategies are compared with.
    """

    def __init__(self, model, lr: float) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def configure_model(self) -> None:
        if self.device_mesh is not None:  # trainer=fsdp
            shard(self.model, self.device_mesh["data_parallel"])

    def on_fit_start(self) -> None:
        warm_up(self.model)
        self.activations = ActivationMeter(self.model.parameters())

    def training_step(self, batch, batch_idx):
        input_ids, attention_mask, labels = batch
        with self.activations.track():
            loss = self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        require_finite(loss, "sft", "sft/loss", self.global_step, "stages.sft.lr")
        self.log("sft/loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.activations.reset()  # backward has freed what the forward saved

    def on_train_end(self) -> None:
        state = model_state_bytes([self.model], self.optimizers().optimizer)
        peak, _ = peak_memory_mb(state, self.activations.peak, self.device)
        if self.logger is not None:
            self.logger.log_metrics({"sft/peak_mem_mb": peak, "sft/activation_peak_mb": self.activations.peak / 2**20,
                                     **{k.replace("perf/", "sft/"): v for k, v in state.items()}})

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr)


class RewardModule(L.LightningModule):
    """Bradley-Terry loss: -log sigmoid(r(chosen) - r(rejected))."""

    def __init__(self, model, lr: float) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def configure_model(self) -> None:
        if self.device_mesh is not None:  # trainer=fsdp
            shard(self.model, self.device_mesh["data_parallel"])

    def on_fit_start(self) -> None:
        warm_up(self.model)

    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        attention_mask = (input_ids != self.model.config.pad_token_id).long()
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1)

    def training_step(self, batch, batch_idx):
        chosen, rejected = batch
        # Chosen and rejected share one forward (pair_tensors pads them to one width), as in HydraSFTModule.
        scores = self.score(torch.cat([chosen, rejected])).view(2, -1)
        margin = scores[0] - scores[1]
        loss = -F.logsigmoid(margin).mean()
        require_finite(loss, "rm", "rm/loss", self.global_step, "stages.rm.lr")
        self.log("rm/loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        self.log("rm/accuracy", (margin > 0).float().mean(), prog_bar=True, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(n, T, V) logits, (n, T) labels (-100 = ignore) -> mean next-token cross-entropy."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


class HydraSFTModule(L.LightningModule):
    """loss = LM cross-entropy on demonstrations + reward_loss_weight x -log sigmoid(r(chosen) - r(rejected))."""

    def __init__(
        self, causal_lm, reward_head: ScalarHead, pad_token_id: int, lm_lr: float, reward_lr: float, reward_loss_weight: float
    ) -> None:
        super().__init__()
        self.causal_lm = causal_lm
        self.reward_head = reward_head
        self.pad_token_id = pad_token_id
        self.lm_lr = lm_lr
        self.reward_lr = reward_lr
        self.reward_loss_weight = reward_loss_weight

    def configure_model(self) -> None:
        if self.device_mesh is not None:  # trainer=fsdp
            for model in (self.causal_lm, self.reward_head):
                shard(model, self.device_mesh["data_parallel"])

    def on_fit_start(self) -> None:
        warm_up(self.causal_lm)

    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(n, T) right-padded sequences -> (n,) raw reward-head scores."""
        hidden = trunk(self.causal_lm, input_ids, (input_ids != self.pad_token_id).long())
        return sequence_scores(self.reward_head, hidden, input_ids, self.pad_token_id)

    def training_step(self, batch, batch_idx):
        input_ids, attention_mask, labels = batch["sft"]
        chosen, rejected = batch["rm"]
        logits = self.causal_lm.get_output_embeddings()(trunk(self.causal_lm, input_ids, attention_mask))
        sft_loss = lm_loss(logits, labels)
        # Chosen and rejected share one forward.
        scores = self.score(torch.cat([chosen, rejected])).view(2, -1)
        margin = scores[0] - scores[1]
        rm_loss = -F.logsigmoid(margin).mean()
        loss = sft_loss + self.reward_loss_weight * rm_loss
        require_finite(loss, "hydra_sft", "hydra_sft/loss", self.global_step, "stages.sft.lr or stages.rm.lr")
        # The same keys as stages sft and rm, so their curves compare across memory strategies.
        self.log_dict(
            {"sft/loss": sft_loss, "rm/loss": rm_loss, "rm/accuracy": (margin > 0).float().mean(), "hydra_sft/loss": loss},
            prog_bar=True, on_step=True, on_epoch=False,
        )
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(
            [{"params": self.causal_lm.parameters(), "lr": self.lm_lr}, {"params": self.reward_head.parameters(), "lr": self.reward_lr}]
        )
