"""The algorithm registry: `algo=NAME` -> advantage estimator + loss + their scalars.

Each class is a thin adapter between the LightningModule and the pure
functions in `functional.py`: `prepare` turns a scored rollout into per-sample
training targets (no grad), `loss` turns fresh policy outputs on a mini-batch
into a scalar. The module never branches on the algorithm; it reads the
declared needs (`needs_values`, `needs_greedy_baseline`, `samples_per_prompt`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhflab.algos import functional as F
from rlhflab.errors import ConfigError


@dataclass
class Scored:
    """What every algorithm gets for one rollout batch; n samples, R response tokens."""

    scores: torch.Tensor  # (n,) rewards of the completions (EOS penalty applied)
    old_logprobs: torch.Tensor  # (n, R) policy log-probs before this batch's updates
    ref_logprobs: torch.Tensor  # (n, R) reference-policy log-probs
    response_mask: torch.Tensor  # (n, R)
    values: torch.Tensor | None = None  # (n, R) value estimates (PPO)
    baseline_scores: torch.Tensor | None = None  # (n,) greedy-completion rewards (ReMax)


class Algorithm:
    """Base: one policy-gradient update per rollout batch unless epochs/num_minibatches say more."""

    name = "base"
    needs_values = False
    needs_greedy_baseline = False
    min_samples = 1

    def __init__(self, samples_per_prompt: int, kl_coef: float, kl_estimator: str = "k1", epochs: int = 1, num_minibatches: int = 1):
        if samples_per_prompt < self.min_samples:
            raise ConfigError(
                f"algo.samples_per_prompt={samples_per_prompt}: {self.name} needs at least {self.min_samples} "
                f"samples per prompt; set algo.samples_per_prompt={self.min_samples} or more"
            )
        if kl_estimator not in ("k1", "k2", "k3"):
            raise ConfigError(f"algo.kl_estimator={kl_estimator!r}: use one of k1, k2, k3")
        for key, value in (("epochs", epochs), ("num_minibatches", num_minibatches)):
            if value < 1:
                raise ConfigError(f"algo.{key}={value}: must be at least 1")
        self.samples_per_prompt = samples_per_prompt
        self.kl_coef = kl_coef
        self.kl_estimator = kl_estimator
        self.epochs = epochs
        self.num_minibatches = num_minibatches

    def kl_metrics(self, s: Scored) -> dict[str, torch.Tensor]:
        kl = F.masked_sum(s.old_logprobs - s.ref_logprobs, s.response_mask, dim=1)
        return {"train/kl": kl.mean(), "train/reward": s.scores.mean()}

    def prepare(self, s: Scored) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """-> (per-sample targets for `loss`, metrics)."""
        raise NotImplementedError

    def loss(self, logprobs: torch.Tensor, values: torch.Tensor | None, mb: dict[str, torch.Tensor]):
        """logprobs (m, R) with grad; mb: the targets sliced to the mini-batch -> (loss, metrics)."""
        raise NotImplementedError


class _SequenceReinforce(Algorithm):
    """Whole completion = one action; the KL to the reference is folded into its reward.

    The sequence-level ratio is exactly 1 on the first update of a batch, so
    one update is plain REINFORCE; further epochs/mini-batches clip it.
    """

    def __init__(self, clip_eps: float = 0.2, **kw):
        super().__init__(**kw)
        self.clip_eps = clip_eps

    def baseline_advantages(self, rewards: torch.Tensor, s: Scored) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, s):
        rewards, _ = F.sequence_rewards(s.scores, s.old_logprobs, s.ref_logprobs, s.response_mask, self.kl_coef, self.kl_estimator)
        advantages = self.baseline_advantages(rewards, s)
        metrics = self.kl_metrics(s) | {"train/rlhf_reward": rewards.mean(), "train/advantage_std": advantages.std()}
        return {"advantages": advantages}, metrics

    def loss(self, logprobs, values, mb):
        loss, clipfrac, approx_kl = F.clipped_policy_loss(
            logprobs, mb["old_logprobs"], mb["advantages"], mb["response_mask"], self.clip_eps, sequence_level=True
        )
        return loss, {"train/pg_loss": loss.detach(), "train/clipfrac": clipfrac, "train/approx_kl": approx_kl}


class RLOO(_SequenceReinforce):
    """REINFORCE leave-one-out (Ahmadian et al., 2024): baseline = mean reward of the other k-1 samples."""

    name = "rloo"
    min_samples = 2

    def baseline_advantages(self, rewards, s):
        return F.rloo_advantages(rewards, self.samples_per_prompt)


class ReMax(_SequenceReinforce):
    """ReMax (Li et al., 2023): baseline = reward of the greedy completion of the same prompt."""

    name = "remax"
    needs_greedy_baseline = True

    def baseline_advantages(self, rewards, s):
        return F.remax_advantages(rewards, s.baseline_scores)

    def kl_metrics(self, s):
        return super().kl_metrics(s) | {"train/greedy_reward": s.baseline_scores.mean()}


class GRPO(Algorithm):
    """Group-normalised advantages, clipped token ratio, k3 KL to the reference in the loss."""

    name = "grpo"
    min_samples = 2

    def __init__(self, clip_eps: float = 0.2, scale_by_std: bool = True, **kw):
        super().__init__(**kw)
        self.clip_eps = clip_eps
        self.scale_by_std = scale_by_std

    def prepare(self, s):
        advantages = F.grpo_advantages(s.scores, self.samples_per_prompt, scale_by_std=self.scale_by_std)
        return {"advantages": advantages}, self.kl_metrics(s)

    def loss(self, logprobs, values, mb):
        pg, clipfrac, approx_kl = F.clipped_policy_loss(logprobs, mb["old_logprobs"], mb["advantages"], mb["response_mask"], self.clip_eps)
        kl = F.grpo_kl_loss(logprobs, mb["ref_logprobs"], mb["response_mask"])
        loss = pg + self.kl_coef * kl
        return loss, {"train/pg_loss": pg.detach(), "train/kl_loss": kl.detach(), "train/clipfrac": clipfrac, "train/approx_kl": approx_kl}


class PPO(Algorithm):
    """PPO-RLHF: per-token KL penalty in the reward, GAE, clipped policy and value losses."""

    name = "ppo"
    needs_values = True

    def __init__(self, gamma=1.0, lam=0.95, clip_eps=0.2, value_clip_eps=0.2, vf_coef=0.1, whiten_advantages=True, **kw):
        super().__init__(**kw)
        self.gamma, self.lam = gamma, lam
        self.clip_eps, self.value_clip_eps, self.vf_coef = clip_eps, value_clip_eps, vf_coef
        self.whiten_advantages = whiten_advantages

    def prepare(self, s):
        rewards = F.token_level_rewards(s.scores, s.old_logprobs, s.ref_logprobs, s.response_mask, self.kl_coef, self.kl_estimator)
        advantages, returns = F.gae_advantages(rewards, s.values, s.response_mask, self.gamma, self.lam)
        if self.whiten_advantages:
            advantages = F.masked_whiten(advantages, s.response_mask) * s.response_mask
        metrics = self.kl_metrics(s) | {"train/rlhf_reward": F.masked_sum(rewards, s.response_mask, dim=1).mean()}
        return {"advantages": advantages, "returns": returns, "old_values": s.values}, metrics

    def loss(self, logprobs, values, mb):
        pg, clipfrac, approx_kl = F.clipped_policy_loss(logprobs, mb["old_logprobs"], mb["advantages"], mb["response_mask"], self.clip_eps)
        vf, vf_clipfrac = F.clipped_value_loss(values, mb["old_values"], mb["returns"], mb["response_mask"], self.value_clip_eps)
        loss = pg + self.vf_coef * vf
        return loss, {
            "train/pg_loss": pg.detach(),
            "train/vf_loss": vf.detach(),
            "train/clipfrac": clipfrac,
            "train/vf_clipfrac": vf_clipfrac,
            "train/approx_kl": approx_kl,
        }


class OnlineDPO(Algorithm):
    """Online DPO: best and worst of k fresh samples (by the reward) form a preference pair.

    `kl_coef` is DPO's beta; loss_type sigmoid (DPO) or ipo.
    """

    name = "online_dpo"
    min_samples = 2

    def __init__(self, loss_type: str = "sigmoid", **kw):
        super().__init__(**kw)
        if loss_type not in ("sigmoid", "ipo"):
            raise ConfigError(f"algo.loss_type={loss_type!r}: use sigmoid or ipo")
        self.loss_type = loss_type

    def prepare(self, s):
        chosen, rejected = F.best_worst_indices(s.scores, self.samples_per_prompt)
        # A per-sample sign survives slicing into mini-batches of whole prompt groups.
        sign = torch.zeros_like(s.scores)
        sign[chosen], sign[rejected] = 1.0, -1.0
        margin = s.scores[chosen] - s.scores[rejected]
        return {"pair_sign": sign}, self.kl_metrics(s) | {"train/score_margin": margin.mean()}

    def loss(self, logprobs, values, mb):
        k = self.samples_per_prompt
        seq = F.masked_sum(logprobs, mb["response_mask"], dim=1).view(-1, k)
        ref = F.masked_sum(mb["ref_logprobs"], mb["response_mask"], dim=1).view(-1, k)
        sign = mb["pair_sign"].view(-1, k)
        c, r = sign.argmax(1, keepdim=True), sign.argmin(1, keepdim=True)
        pick = lambda x, i: x.gather(1, i).squeeze(1)  # noqa: E731
        loss, chosen_rewards, rejected_rewards = F.dpo_loss(pick(seq, c), pick(seq, r), pick(ref, c), pick(ref, r), self.kl_coef, self.loss_type)
        accuracy = (chosen_rewards > rejected_rewards).float().mean()
        return loss, {"train/dpo_loss": loss.detach(), "train/pair_accuracy": accuracy, "train/margin": (chosen_rewards - rejected_rewards).mean()}


ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (PPO, RLOO, ReMax, OnlineDPO, GRPO)}
