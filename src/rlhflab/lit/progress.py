"""One clean progress display per stage (Lightning's RichProgressBar, told what an RLHF run is).

Stage sft / rm / hydra_sft: `stage sft  epoch 2/3` with the stage's loss. Stage rl: RL steps done
out of the budget (a resumed run counts from where it stopped), the gold reward at the last
evaluation, the training reward (a reward model's standardised score, or the rule's value),
the KL to the reference and, in async mode, the staleness of the batch just trained on. Log
lines go through Rich's console (conf/hydra/job_logging/rlhflab.yaml), so they print above
the bar instead of into it.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBarTheme
from rich.console import Console


class StageProgressBar(RichProgressBar):
    """`stage <name>` instead of `Epoch 0/-2`; the module's own progress fields; no `v_num`."""

    def __init__(self, stage: str) -> None:
        # A stage's bar updates in place epoch after epoch (its log line sums it up); RL's stays on screen.
        # Not on a terminal (a file, a pipe, a cluster job's log), Rich draws the bar once, at 80 columns unless
        # COLUMNS says otherwise: wide enough for the RL bar's fields on one line.
        wide = {} if os.environ.get("COLUMNS") or Console().is_terminal else {"width": 160}
        super().__init__(leave=stage == "rl", theme=RichProgressBarTheme(metrics_format=".3f"), console_kwargs=wide)
        self.stage = stage

    def _get_train_description(self, current_epoch: int) -> str:
        if self.stage == "rl":
            return "stage rl"
        epochs = self.trainer.max_epochs
        return f"stage {self.stage}  epoch {current_epoch + 1}/{epochs}" if epochs and epochs > 0 else f"stage {self.stage}"

    @property
    def total_train_batches(self) -> int | float:
        if self.stage == "rl":
            module = self.trainer.lightning_module
            return module.updates - self.trainer.global_step + self.trainer.max_steps  # the whole budget
        return super().total_train_batches

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.stage != "rl":
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.train_progress_bar_id is None and not self.is_disabled:
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, pl_module.updates)  # RL steps, not batches since this start
        self._update_metrics(trainer, pl_module)
        self.refresh()

    def on_train_end(self, trainer, pl_module) -> None:
        # Lightning ends the callbacks (this bar) before the module, whose on_train_end evaluates the last policy
        # where the last step was not an evaluation step: the bar kept the evaluation before it as `gold`.
        if self.stage == "rl" and hasattr(pl_module, "final_evaluation") and not self.is_disabled:
            pl_module.final_evaluation()
            if self.train_progress_bar_id is not None:
                self._update_metrics(trainer, pl_module)
                self.refresh()
        super().on_train_end(trainer, pl_module)

    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        progress = getattr(pl_module, "progress", None)
        if progress is not None:
            return dict(progress)
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items
