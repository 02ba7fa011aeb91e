"""LightningModules of the supervised stages: `sft` (demonstrations) and `rm` (preference pairs)."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F

from rlhflab.perf import ActivationMeter, model_state_bytes, peak_memory_mb


class SFTModule(L.LightningModule):
    """Next-token cross-entropy on the response (and EOS) of each demonstration.

    Also measures its memory the way the RL stage does (rlhflab.perf): a full
    fine-tune is the reference point the memory strategies are compared with.
    """

    def __init__(self, model, lr: float) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def on_fit_start(self) -> None:
        self.activations = ActivationMeter(self.model.parameters())

    def training_step(self, batch, batch_idx):
        input_ids, attention_mask, labels = batch
        with self.activations.track():
            loss = self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
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

    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        attention_mask = (input_ids != self.model.config.pad_token_id).long()
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1)

    def training_step(self, batch, batch_idx):
        chosen, rejected = batch
        margin = self.score(chosen) - self.score(rejected)
        loss = -F.logsigmoid(margin).mean()
        self.log("rm/loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        self.log("rm/accuracy", (margin > 0).float().mean(), prog_bar=True, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr)
