"""Off-policy corrections: which log-probs the learner's ratios start from, and importance weights.

`off_policy=` picks one; the rollout source applies it to every batch, so the
LightningModule never knows whether a batch was fresh or stale. Each takes the
behaviour log-probs the generator sampled with and, when it declares
`needs_recompute`, the learner's own log-probs under its weights before this
batch's updates (the proximal policy), and returns
`(old_logprobs, importance_weights or None, metrics)`, all (n, R).

- behaviour: the generator's log-probs are the old policy (no extra forward). In
  sync mode they are the current policy's, so the first ratio is 1.
- recompute: the learner's recomputed log-probs are the old policy (ratio 1 at
  the first update whatever the staleness; stale samples are not corrected).
- tis: recompute, and weight each token by min(pi_prox / mu, cap) (truncated IS).
- decoupled: AReaL's decoupled PPO (Fu et al., 2025): clip against the proximal
  policy and weight each token by pi_prox / mu, dropping tokens above the cap.
"""

from __future__ import annotations

import torch

from rlhflab.algos import functional as F
from rlhflab.errors import ConfigError

Correction = tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]


def _check_cap(cap: float | None, allow_none: bool) -> None:
    if cap is None and allow_none:
        return
    if cap is None or cap <= 1.0:
        raise ConfigError(f"off_policy.cap={cap}: must be above 1 (weights up to the cap are kept); e.g. off_policy.cap=2.0")


def _weight_metrics(weights: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"off_policy/weight_mean": F.masked_mean(weights, mask),
            "off_policy/dropped_frac": F.masked_mean((weights == 0).to(weights.dtype), mask)}


class Behaviour:
    """The generator's log-probs are the old policy of the ratios; no weights, no extra forward."""

    name = "behaviour"
    needs_recompute = False
    weights_samples = False

    def __call__(self, behaviour: torch.Tensor, recomputed: torch.Tensor | None, mask: torch.Tensor) -> Correction:
        return behaviour, None, {}


class Recompute:
    """The learner's log-probs before the update are the old policy; stale samples are not weighted."""

    name = "recompute"
    needs_recompute = True
    weights_samples = False

    def __call__(self, behaviour, recomputed, mask) -> Correction:
        return recomputed, None, {}


class TruncatedIS:
    """Recompute, and weight each token by the truncated ratio min(pi_prox / mu, cap)."""

    name = "tis"
    needs_recompute = True
    weights_samples = True

    def __init__(self, cap: float = 2.0) -> None:
        _check_cap(cap, allow_none=False)
        self.cap = cap

    def __call__(self, behaviour, recomputed, mask) -> Correction:
        weights = F.truncated_importance_weights(recomputed, behaviour, mask, self.cap)
        return recomputed, weights, _weight_metrics(weights, mask)


class Decoupled:
    """AReaL's decoupled PPO: clip against the proximal policy, weight by pi_prox / mu, drop above the cap."""

    name = "decoupled"
    needs_recompute = True
    weights_samples = True

    def __init__(self, cap: float | None = 5.0) -> None:
        _check_cap(cap, allow_none=True)
        self.cap = cap

    def __call__(self, behaviour, recomputed, mask) -> Correction:
        weights = F.decoupled_importance_weights(recomputed, behaviour, mask, self.cap)
        return recomputed, weights, _weight_metrics(weights, mask)
