"""The algorithm registry: `algo=NAME` -> advantage estimator + loss + their scalars.

Each class is a thin adapter between the LightningModule and the pure
functions in `functional.py`: `prepare` turns a `Scored` rollout batch into
`Targets` (no grad), `loss` turns fresh policy outputs on a mini-batch of an
`Experience` into a scalar. The module never branches on the algorithm; it reads
the declared needs (`needs_values`, `needs_greedy_baseline`, `samples_per_prompt`,
`uses_importance_ratio`).

Each coefficient is named for what it is: `kl_coef` is a KL penalty in the
reward (rloo, remax, ppo, reinforce_pp), `kl_loss_coef` a KL term in the loss
(grpo, dr_grpo), `beta` DPO's inverse temperature (online_dpo).
"""

from __future__ import annotations

import torch

from rlhflab import distributed
from rlhflab.algos import functional as F
from rlhflab.algos.carriers import Experience, Scored, Targets
from rlhflab.errors import ConfigError


class Algorithm:
    """Base: a clipped policy-gradient update per mini-batch; subclasses say how targets are made.

    samples_per_prompt: completions per prompt (contiguous groups of k).
    kl_estimator: per-token KL(pi || ref) estimator, k1, k2 or k3 (the logged train/kl uses it too).
    loss_agg: how per-token losses become one scalar (functional.LOSS_AGG_MODES).
    epochs, num_minibatches: passes over each rollout batch, and optimizer steps per pass.
    """

    name = "base"
    needs_values = False
    needs_greedy_baseline = False
    uses_importance_ratio = True  # its loss has a ratio an off-policy correction can weight
    min_samples = 1
    loss_agg_modes = F.LOSS_AGG_MODES

    def __init__(self, samples_per_prompt: int, kl_estimator: str, loss_agg: str, epochs: int, num_minibatches: int) -> None:
        if samples_per_prompt < self.min_samples:
            raise ConfigError(
                f"algo.samples_per_prompt={samples_per_prompt}: {self.name} needs at least {self.min_samples} "
                f"samples per prompt; set algo.samples_per_prompt={self.min_samples} or more"
            )
        if kl_estimator not in F.KL_KINDS:
            raise ConfigError(f"algo.kl_estimator={kl_estimator!r}: use one of {', '.join(F.KL_KINDS)}")
        if loss_agg not in self.loss_agg_modes:
            raise ConfigError(f"algo.loss_agg={loss_agg!r}: {self.name} takes one of {', '.join(self.loss_agg_modes)}")
        for key, value in (("epochs", epochs), ("num_minibatches", num_minibatches)):
            if value < 1:
                raise ConfigError(f"algo.{key}={value}: must be at least 1")
        self.samples_per_prompt = samples_per_prompt
        self.kl_estimator = kl_estimator
        self.loss_agg = loss_agg
        self.epochs = epochs
        self.num_minibatches = num_minibatches

    @property
    def updates_per_batch(self) -> int:
        """Optimizer updates (RL steps) one rollout batch makes: epochs x mini-batches."""
        return self.epochs * self.num_minibatches

    def kl_metrics(self, s: Scored) -> dict[str, torch.Tensor]:
        kl = F.masked_sum(F.kl_penalty(s.old_logprobs, s.ref_logprobs, self.kl_estimator), s.response_mask, dim=1)
        return {"train/kl": kl.mean(), "train/reward": s.scores.mean()}

    def prepare(self, s: Scored) -> tuple[Targets, dict[str, torch.Tensor]]:
        """-> (per-sample targets for `loss`, metrics)."""
        raise NotImplementedError

    def loss(self, logprobs: torch.Tensor, values: torch.Tensor | None, batch: Experience):
        """logprobs (m, R) with grad on a mini-batch; values (m, R) or None -> (loss, metrics)."""
        raise NotImplementedError

    def policy_loss(self, logprobs: torch.Tensor, batch: Experience, clip_eps: float):
        """The clipped surrogate every policy-gradient algorithm here shares."""
        loss, clipfrac, approx_kl = F.clipped_policy_loss(
            logprobs, batch.old_logprobs, batch.targets.advantages, batch.response_mask, clip_eps, self.loss_agg, batch.is_weights,
            batch.tokens,
        )
        return loss, {"train/pg_loss": loss.detach(), "train/clipfrac": clipfrac, "train/approx_kl": approx_kl}


class _WholeCompletionReinforce(Algorithm):
    """Whole completion = one action: the KL to the reference is folded into its reward, and the
    completion's advantage is shared by its tokens. With one update per batch and the default
    `seq-mean-token-sum` this is REINFORCE on sequences; reused batches clip token ratios.
    """

    def __init__(self, samples_per_prompt: int = 4, kl_coef: float = 0.05, kl_estimator: str = "k1", clip_eps: float = 0.2,
                 loss_agg: str = "seq-mean-token-sum", epochs: int = 1, num_minibatches: int = 1) -> None:
        super().__init__(samples_per_prompt, kl_estimator, loss_agg, epochs, num_minibatches)
        self.kl_coef = kl_coef
        self.clip_eps = clip_eps

    def baseline_advantages(self, rewards: torch.Tensor, s: Scored) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, s):
        rewards, _ = F.sequence_rewards(s.scores, s.old_logprobs, s.ref_logprobs, s.response_mask, self.kl_coef, self.kl_estimator)
        advantages = self.baseline_advantages(rewards, s)
        metrics = self.kl_metrics(s) | {"train/rlhf_reward": rewards.mean(), "train/advantage_std": advantages.std()}
        return Targets(advantages=advantages), metrics

    def loss(self, logprobs, values, batch):
        return self.policy_loss(logprobs, batch, self.clip_eps)


class RLOO(_WholeCompletionReinforce):
    """REINFORCE leave-one-out (Ahmadian et al., 2024): baseline = mean reward of the other k-1 samples."""

    name = "rloo"
    min_samples = 2

    def baseline_advantages(self, rewards, s):
        return F.rloo_advantages(rewards, self.samples_per_prompt)


class ReMax(_WholeCompletionReinforce):
    """ReMax (Li et al., 2023): baseline = reward of the greedy completion of the same prompt."""

    name = "remax"
    needs_greedy_baseline = True

    def __init__(self, samples_per_prompt: int = 1, kl_coef: float = 0.05, kl_estimator: str = "k1", clip_eps: float = 0.2,
                 loss_agg: str = "seq-mean-token-sum", epochs: int = 1, num_minibatches: int = 1) -> None:
        super().__init__(samples_per_prompt, kl_coef, kl_estimator, clip_eps, loss_agg, epochs, num_minibatches)

    def baseline_advantages(self, rewards, s):
        return F.remax_advantages(rewards, s.baseline_scores, self.samples_per_prompt)

    def kl_metrics(self, s):
        return super().kl_metrics(s) | {"train/greedy_reward": s.baseline_scores.mean()}


class ReinforcePP(Algorithm):
    """REINFORCE++ (Hu, 2025; OpenRLHF, verl): per-token KL penalty in the reward, reward-to-go
    returns whitened over the whole batch (no critic, no per-prompt baseline), clipped token ratio."""

    name = "reinforce_pp"

    def __init__(self, samples_per_prompt: int = 4, kl_coef: float = 0.05, kl_estimator: str = "k1", gamma: float = 1.0,
                 clip_eps: float = 0.2, loss_agg: str = "token-mean", epochs: int = 1, num_minibatches: int = 1) -> None:
        super().__init__(samples_per_prompt, kl_estimator, loss_agg, epochs, num_minibatches)
        self.kl_coef = kl_coef
        self.gamma = gamma
        self.clip_eps = clip_eps

    def prepare(self, s):
        rewards = F.token_level_rewards(s.scores, s.old_logprobs, s.ref_logprobs, s.response_mask, self.kl_coef, self.kl_estimator)
        advantages, returns = F.reinforce_pp_advantages(rewards, s.response_mask, self.gamma, total=distributed.all_sum)
        metrics = self.kl_metrics(s) | {"train/rlhf_reward": F.masked_sum(rewards, s.response_mask, dim=1).mean()}
        return Targets(advantages=advantages), metrics

    def loss(self, logprobs, values, batch):
        return self.policy_loss(logprobs, batch, self.clip_eps)


class GRPO(Algorithm):
    """GRPO (Shao et al., 2024): group-normalised advantages, clipped token ratio, k3 KL to the
    reference in the loss (weighted by kl_loss_coef); per-sequence token means (the paper's 1/|o|)."""

    name = "grpo"
    min_samples = 2

    def __init__(self, samples_per_prompt: int = 4, kl_loss_coef: float = 0.04, kl_estimator: str = "k1", clip_eps: float = 0.2,
                 scale_by_std: bool = True, loss_agg: str = "seq-mean-token-mean", epochs: int = 1, num_minibatches: int = 1) -> None:
        super().__init__(samples_per_prompt, kl_estimator, loss_agg, epochs, num_minibatches)
        self.kl_loss_coef = kl_loss_coef
        self.clip_eps = clip_eps
        self.scale_by_std = scale_by_std

    def prepare(self, s):
        advantages = F.grpo_advantages(s.scores, self.samples_per_prompt, scale_by_std=self.scale_by_std)
        return Targets(advantages=advantages), self.kl_metrics(s)

    def loss(self, logprobs, values, batch):
        pg, metrics = self.policy_loss(logprobs, batch, self.clip_eps)
        kl = F.kl_loss(logprobs, batch.ref_logprobs, batch.response_mask, self.loss_agg, batch.tokens)
        return pg + self.kl_loss_coef * kl, metrics | {"train/kl_loss": kl.detach()}


class DrGRPO(GRPO):
    """Dr. GRPO (Liu et al., 2025) / DAPO-style aggregation: GRPO without the group-std scaling and
    with one token mean over the whole batch, which removes GRPO's length and difficulty biases."""

    name = "dr_grpo"

    def __init__(self, samples_per_prompt: int = 4, kl_loss_coef: float = 0.04, kl_estimator: str = "k1", clip_eps: float = 0.2,
                 scale_by_std: bool = False, loss_agg: str = "token-mean", epochs: int = 1, num_minibatches: int = 1) -> None:
        super().__init__(samples_per_prompt, kl_loss_coef, kl_estimator, clip_eps, scale_by_std, loss_agg, epochs, num_minibatches)


class PPO(Algorithm):
    """PPO-RLHF: per-token KL penalty in the reward, GAE, clipped policy and value losses."""

    name = "ppo"
    needs_values = True

    def __init__(self, samples_per_prompt: int = 1, kl_coef: float = 0.05, kl_estimator: str = "k1", gamma: float = 1.0,
                 lam: float = 0.95, clip_eps: float = 0.2, value_clip_eps: float = 0.2, vf_coef: float = 0.1,
                 whiten_advantages: bool = True, loss_agg: str = "token-mean", epochs: int = 2, num_minibatches: int = 2) -> None:
        super().__init__(samples_per_prompt, kl_estimator, loss_agg, epochs, num_minibatches)
        self.kl_coef = kl_coef
        self.gamma, self.lam = gamma, lam
        self.clip_eps, self.value_clip_eps, self.vf_coef = clip_eps, value_clip_eps, vf_coef
        self.whiten_advantages = whiten_advantages

    def prepare(self, s):
        rewards = F.token_level_rewards(s.scores, s.old_logprobs, s.ref_logprobs, s.response_mask, self.kl_coef, self.kl_estimator)
        advantages, returns = F.gae_advantages(rewards, s.values, s.response_mask, self.gamma, self.lam)
        if self.whiten_advantages:
            advantages = F.masked_whiten(advantages, s.response_mask, total=distributed.all_sum) * s.response_mask
        metrics = self.kl_metrics(s) | {"train/rlhf_reward": F.masked_sum(rewards, s.response_mask, dim=1).mean()}
        return Targets(advantages=advantages, returns=returns, old_values=s.values), metrics

    def loss(self, logprobs, values, batch):
        pg, metrics = self.policy_loss(logprobs, batch, self.clip_eps)
        t = batch.targets
        vf, vf_clipfrac = F.clipped_value_loss(values, t.old_values, t.returns, batch.response_mask, self.value_clip_eps, self.loss_agg,
                                               batch.tokens)
        return pg + self.vf_coef * vf, metrics | {"train/vf_loss": vf.detach(), "train/vf_clipfrac": vf_clipfrac}


class OnlineDPO(Algorithm):
    """Online DPO (Guo et al., 2024; the async-RLHF paper's most stale-robust method): the best and
    worst of k fresh samples (by the reward) form a pair, trained with the DPO (or IPO) loss.

    beta: DPO's strength of the implicit KL to the reference. ties: a group whose samples all score
    the same has no preference; `skip` gives it no gradient (as the async-RLHF paper's code does),
    `keep` trains its first sample over its last. loss_agg: the sequence log-prob is the token sum
    (DPO) or the token mean (length-normalised).
    """

    name = "online_dpo"
    min_samples = 2
    uses_importance_ratio = False
    loss_agg_modes = ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

    def __init__(self, samples_per_prompt: int = 2, beta: float = 0.1, kl_estimator: str = "k1", loss_type: str = "sigmoid",
                 ties: str = "skip", loss_agg: str = "seq-mean-token-sum", epochs: int = 1, num_minibatches: int = 1) -> None:
        super().__init__(samples_per_prompt, kl_estimator, loss_agg, epochs, num_minibatches)
        if loss_type not in F.DPO_LOSS_TYPES:
            raise ConfigError(f"algo.loss_type={loss_type!r}: use one of {', '.join(F.DPO_LOSS_TYPES)}")
        if ties not in ("skip", "keep"):
            raise ConfigError(f"algo.ties={ties!r}: use skip (no gradient from tied groups) or keep")
        self.beta = beta
        self.loss_type = loss_type
        self.ties = ties

    def prepare(self, s):
        k = self.samples_per_prompt
        chosen, rejected = F.best_worst_indices(s.scores, k)
        tied = F.tied_groups(s.scores, k)
        if self.ties == "skip":
            chosen, rejected = chosen[~tied], rejected[~tied]
        # A per-sample sign survives slicing into mini-batches of whole prompt groups.
        sign = torch.zeros_like(s.scores)
        sign[chosen], sign[rejected] = 1.0, -1.0
        margin = s.scores[chosen] - s.scores[rejected]
        metrics = self.kl_metrics(s) | {"train/tie_frac": tied.float().mean(), "train/score_margin": margin.mean() if len(margin) else margin.sum()}
        return Targets(pair_sign=sign), metrics

    def loss(self, logprobs, values, batch):
        k = self.samples_per_prompt
        seq = F.sequence_logprobs(logprobs, batch.response_mask, self.loss_agg).view(-1, k)
        ref = F.sequence_logprobs(batch.ref_logprobs, batch.response_mask, self.loss_agg).view(-1, k)
        sign = batch.targets.pair_sign.view(-1, k)
        c, r = sign.argmax(1, keepdim=True), sign.argmin(1, keepdim=True)
        pick = lambda x, i: x.gather(1, i).squeeze(1)  # noqa: E731
        has_pair = sign.ne(0).any(1)
        loss, chosen_rewards, rejected_rewards = F.dpo_loss(
            pick(seq, c), pick(seq, r), pick(ref, c), pick(ref, r), self.beta, self.loss_type, pair_mask=has_pair, pairs=batch.pairs
        )
        accuracy = F.masked_mean((chosen_rewards > rejected_rewards).to(seq.dtype), has_pair)
        margin = F.masked_mean(chosen_rewards - rejected_rewards, has_pair)
        return loss, {"train/dpo_loss": loss.detach(), "train/pair_accuracy": accuracy, "train/margin": margin}


ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (PPO, RLOO, ReMax, OnlineDPO, GRPO, DrGRPO, ReinforcePP)
}
