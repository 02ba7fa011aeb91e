"""LightningModules of the stages before RL: `sft` (demonstrations), `rm` (preference pairs) and
`hydra_sft` (both at once, on one trunk with an LM head and a reward head)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import lightning as L
import torch
import torch.nn.functional as F

from rlhflab.errors import NonFiniteError
from rlhflab.models.heads import ScalarHead, sequence_scores, trunk
from rlhflab.models.sharding import shard, warm_up
from rlhflab.perf import ActivationMeter, model_state_bytes, peak_memory_mb
from rlhflab.rollout.lean import forward_logits, lm_loss_of
from rlhflab.rollout.sources import autocast_as, current_autocast


class BatchThreads:
    """Stages sft, rm and hydra_sft on the CPU in one process (stages.batch_threads): each batch's rows in `threads` shares,
    each share's forward and backward in a thread of its own, their gradients summed where autograd accumulates
    them (a + b, the same in either order). Each share's loss is its sum over the batch's count (rows or label
    tokens), so the shares add up to the batch's mean: the loss and gradients of one forward, to rounding.

    Why: a stage's batch of 128 rows on torch's intra-op threads waits on OpenMP at every op, which on 2 cores
    under OMP_WAIT_POLICY=PASSIVE (src/train.py) is slower than one thread (the tiny SFT step: 52-56 ms with 2
    intra-op threads, 37-46 ms with 1, 24-32 ms as two shares of 64 rows in two threads at 1 intra-op thread).
    Spinning OpenMP threads instead (GOMP_SPINCOUNT) were as fast alone and 5x slower with a second run beside."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="rlhflab-stage") if threads > 1 else None
        self.pending: list[torch.Tensor] = []  # the other shares' losses, for backward

    def forwards(self, share: Callable[..., tuple], *rows: torch.Tensor) -> list[tuple]:
        """share(*its rows) -> (loss, what else it measured) for each share of the rows, the first in this thread,
        under this thread's autocast and grad mode -> their results in the shares' order; the other shares' losses
        are kept for `backward`."""
        # no empty share: a batch of fewer rows than threads (an epoch's last) takes one thread a row; every tensor
        # in as many shares (hydra_sft's demonstrations and pairs are batches of their own sizes)
        count = min(self.threads, *(len(t) for t in rows))
        parts = list(zip(*(t.tensor_split(count) for t in rows)))
        state = current_autocast(), torch.is_grad_enabled()
        others = [self.pool.submit(self._call, state, share, part) for part in parts[1:]]
        try:
            first = share(*parts[0])
        finally:
            rest = [wait(f) for f in others]  # each waited for, even when a forward failed: no share left running
        for result in rest:
            if isinstance(result, BaseException):
                raise result
        self.pending = [result[0] for result in rest]
        return [first, *rest]

    @staticmethod
    def _call(state, share, part):
        autocast, grad = state
        with autocast_as(autocast), torch.set_grad_enabled(grad):
            return share(*part)

    def backward(self, own: Callable[[], None], scale: float) -> None:
        """The other shares' backwards (their losses times `scale`: Lightning divides the returned loss by
        trainer.accumulate_grad_batches) in their threads, while `own` runs this thread's share's."""
        pending, self.pending = self.pending, []
        others = [self.pool.submit(lambda loss=loss: (loss * scale).backward()) for loss in pending]
        try:
            own()
        finally:
            errors = [e for e in (wait(f) for f in others) if isinstance(e, BaseException)]
        if errors:
            raise errors[0]

    def close(self) -> None:
        self.pending = []
        if self.pool is not None:
            self.pool.shutdown()


class SharedBatches(L.LightningModule):
    """A stage's module whose batches train as `shares` (BatchThreads): the other shares' backwards beside the one
    Lightning runs on the loss training_step returned (the first share's)."""

    shares: BatchThreads

    def backward(self, loss, *args, **kwargs) -> None:
        if self.shares.threads > 1:
            self.shares.backward(lambda: super(SharedBatches, self).backward(loss, *args, **kwargs),
                                 1 / self.trainer.accumulate_grad_batches)
        else:
            super().backward(loss, *args, **kwargs)

    def teardown(self, stage: str) -> None:
        self.shares.close()


def wait(future):
    """A future's result, or the exception it raised."""
    try:
        return future.result()
    except BaseException as err:  # noqa: BLE001 (handed to the caller, which raises it)
        return err


def require_finite(loss: torch.Tensor, stage: str, key: str, step: int, lr_key: str) -> None:
    """Stop the stage (nothing cached) on a NaN or Inf loss, naming the step and the quantity."""
    if not torch.isfinite(loss):
        raise NonFiniteError(f"stage {stage}: {key} is {loss.item()} at step {step}; nothing was cached. Lower {lr_key} and run again")


class SFTModule(SharedBatches):
    """Next-token cross-entropy on the response (and EOS) of each demonstration.

    Also measures its memory the way the RL stage does (rlhflab.perf): a full
    fine-tune is the reference point the memory strategies are compared with.
    """

    def __init__(self, model, lr: float, batch_threads: int = 1) -> None:
        super().__init__()
        self.model = model
        self.lr = lr
        self.shares = BatchThreads(batch_threads)

    def configure_model(self) -> None:
        if self.device_mesh is not None:  # trainer=fsdp
            shard(self.model, self.device_mesh["data_parallel"])

    def on_fit_start(self) -> None:
        warm_up(self.model)
        self.activations = ActivationMeter(self.model.parameters())

    def training_step(self, batch, batch_idx):
        input_ids, attention_mask, labels = batch
        if self.shares.threads > 1:
            tokens = int((labels[:, 1:] != -100).sum())  # what the loss is the mean over (HF shifts the labels)

            def share(ids, mask, share_labels):
                with self.activations.track():
                    return (lm_loss_of(self.model, ids, mask, share_labels, num_items_in_batch=tokens),)

            losses = [out[0] for out in self.shares.forwards(share, input_ids, attention_mask, labels)]
            loss, own = sum(x.detach() for x in losses), losses[0]
        else:
            with self.activations.track():
                loss = own = lm_loss_of(self.model, input_ids, attention_mask, labels)
        require_finite(loss, "sft", "sft/loss", self.global_step, "stages.sft.lr")
        self.log("sft/loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        return own

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


class RewardModule(SharedBatches):
    """Bradley-Terry loss: -log sigmoid(r(chosen) - r(rejected))."""

    def __init__(self, model, lr: float, batch_threads: int = 1) -> None:
        super().__init__()
        self.model = model
        self.lr = lr
        self.shares = BatchThreads(batch_threads)

    def configure_model(self) -> None:
        if self.device_mesh is not None:  # trainer=fsdp
            shard(self.model, self.device_mesh["data_parallel"])

    def on_fit_start(self) -> None:
        warm_up(self.model)

    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        attention_mask = (input_ids != self.model.config.pad_token_id).long()
        return forward_logits(self.model, input_ids, attention_mask).squeeze(-1)

    def margins(self, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        # Chosen and rejected share one forward (pair_tensors pads them to one width), as in HydraSFTModule.
        scores = self.score(torch.cat([chosen, rejected])).view(2, -1)
        return scores[0] - scores[1]

    def training_step(self, batch, batch_idx):
        chosen, rejected = batch
        if self.shares.threads > 1:
            def share(c, r):
                margin = self.margins(c, r)
                return -F.logsigmoid(margin).sum() / len(chosen), margin

            outs = self.shares.forwards(share, chosen, rejected)
            loss, own = sum(out[0].detach() for out in outs), outs[0][0]
            margin = torch.cat([out[1].detach() for out in outs])
        else:
            margin = self.margins(chosen, rejected)
            loss = own = -F.logsigmoid(margin).mean()
        require_finite(loss, "rm", "rm/loss", self.global_step, "stages.rm.lr")
        self.log("rm/loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        self.log("rm/accuracy", (margin > 0).float().mean(), prog_bar=True, on_step=True, on_epoch=False)
        return own

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """(n, T, V) logits, (n, T) labels (-100 = ignore) -> mean (or sum) next-token cross-entropy."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100, reduction=reduction)


class HydraSFTModule(SharedBatches):
    """loss = LM cross-entropy on demonstrations + reward_loss_weight x -log sigmoid(r(chosen) - r(rejected)).
    With batch_threads > 1 (BatchThreads) each share is a share of the demonstrations and one of the pairs, its loss
    their sums over the whole batch's label tokens and pairs."""

    def __init__(
        self, causal_lm, reward_head: ScalarHead, pad_token_id: int, lm_lr: float, reward_lr: float, reward_loss_weight: float,
        batch_threads: int = 1,
    ) -> None:
        super().__init__()
        self.causal_lm = causal_lm
        self.reward_head = reward_head
        self.pad_token_id = pad_token_id
        self.lm_lr = lm_lr
        self.reward_lr = reward_lr
        self.reward_loss_weight = reward_loss_weight
        self.shares = BatchThreads(batch_threads)

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

    def losses(self, input_ids, attention_mask, labels, chosen, rejected, tokens: int | None = None, pairs: int | None = None):
        """(LM loss, preference loss, margins) of demonstrations and pairs: means, or sums over `tokens` label tokens
        and `pairs` pairs (a share of a batch that has them)."""
        logits = self.causal_lm.get_output_embeddings()(trunk(self.causal_lm, input_ids, attention_mask))
        sft_loss = lm_loss(logits, labels) if tokens is None else lm_loss(logits, labels, "sum") / tokens
        # Chosen and rejected share one forward.
        scores = self.score(torch.cat([chosen, rejected])).view(2, -1)
        margin = scores[0] - scores[1]
        rm_loss = -F.logsigmoid(margin).mean() if pairs is None else -F.logsigmoid(margin).sum() / pairs
        return sft_loss, rm_loss, margin

    def training_step(self, batch, batch_idx):
        input_ids, attention_mask, labels = batch["sft"]
        chosen, rejected = batch["rm"]
        if self.shares.threads > 1:
            tokens, pairs = int((labels[:, 1:] != -100).sum()), len(chosen)

            def share(*rows):
                sft, rm, margin = self.losses(*rows, tokens=tokens, pairs=pairs)
                return sft + self.reward_loss_weight * rm, sft, rm, margin

            outs = self.shares.forwards(share, input_ids, attention_mask, labels, chosen, rejected)
            own = outs[0][0]
            sft_loss, rm_loss = (sum(out[i].detach() for out in outs) for i in (1, 2))
            margin = torch.cat([out[3].detach() for out in outs])
            loss = sft_loss + self.reward_loss_weight * rm_loss
        else:
            sft_loss, rm_loss, margin = self.losses(input_ids, attention_mask, labels, chosen, rejected)
            loss = own = sft_loss + self.reward_loss_weight * rm_loss
        require_finite(loss, "hydra_sft", "hydra_sft/loss", self.global_step, "stages.sft.lr or stages.rm.lr")
        # The same keys as stages sft and rm, so their curves compare across memory strategies.
        self.log_dict(
            {"sft/loss": sft_loss, "rm/loss": rm_loss, "rm/accuracy": (margin > 0).float().mean(), "hydra_sft/loss": loss},
            prog_bar=True, on_step=True, on_epoch=False,
        )
        return own

    def configure_optimizers(self):
        return torch.optim.AdamW(
            [{"params": self.causal_lm.parameters(), "lr": self.lm_lr}, {"params": self.reward_head.parameters(), "lr": self.reward_lr}]
        )
