"""Typed carriers between the RL module and the algorithms (torchtune's `Trajectory` habit).

n = samples in the rollout batch (prompts x samples_per_prompt, each prompt's
samples contiguous), R = response length, P = prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass(frozen=True)
class Scored:
    """What every algorithm's `prepare` gets for one rollout batch."""

    scores: torch.Tensor  # (n,) reward of each completion (EOS penalty applied)
    old_logprobs: torch.Tensor  # (n, R) policy log-probs the ratios start from (0 on padding)
    ref_logprobs: torch.Tensor  # (n, R) reference-policy log-probs (0 on padding)
    response_mask: torch.Tensor  # (n, R) 1 for response tokens up to and including EOS
    values: torch.Tensor | None = None  # (n, R) value estimates (algorithms with a critic)
    baseline_scores: torch.Tensor | None = None  # (n // k,) reward of each prompt's greedy completion (ReMax)


@dataclass(frozen=True)
class Targets:
    """Per-sample training targets `prepare` computes once per rollout batch (no grad).

    An algorithm fills the fields it uses and leaves the others None.
    """

    advantages: torch.Tensor | None = None  # (n,) per completion, or (n, R) per token
    returns: torch.Tensor | None = None  # (n, R) value targets
    old_values: torch.Tensor | None = None  # (n, R) values before the update (value clipping)
    pair_sign: torch.Tensor | None = None  # (n,) +1 chosen, -1 rejected, 0 not in a trained pair (online DPO)


@dataclass(frozen=True)
class Experience:
    """One rollout batch ready for updates: sequences, old/reference log-probs, targets.

    `select` cuts mini-batches (whole prompt groups, chosen by the caller).
    """

    query: torch.Tensor  # (n, P) left-padded prompt ids
    response: torch.Tensor  # (n, R) sampled ids
    response_mask: torch.Tensor  # (n, R)
    old_logprobs: torch.Tensor  # (n, R) log-probs the ratios start from (0 on padding)
    ref_logprobs: torch.Tensor  # (n, R) reference log-probs (0 on padding)
    targets: Targets
    is_weights: torch.Tensor | None = None  # (n, R) importance weights of the rollout source's off-policy correction
    # Under data parallelism: the global count of valid tokens (and of trained pairs) of this mini-batch over the
    # world size, which a mean divides by so that averaging the ranks' gradients is the global mean. None: local counts.
    tokens: float | None = None
    pairs: float | None = None

    def __len__(self) -> int:
        return self.response.shape[0]

    def select(self, index: torch.Tensor) -> "Experience":
        """The samples at `index` (a 1-d long tensor), every tensor field sliced alike."""
        targets = replace(self.targets, **{f.name: _take(getattr(self.targets, f.name), index) for f in fields(Targets)})
        sliced = {f.name: _take(getattr(self, f.name), index) for f in fields(self) if f.name not in ("targets", "tokens", "pairs")}
        return replace(self, targets=targets, **sliced)


def _take(x: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if x is None else x[index]


def counts(batch: Experience) -> dict[str, float]:
    """What a mean over this mini-batch divides by: its valid tokens and its trained pairs (online DPO)."""
    out = {"tokens": float(batch.response_mask.bool().sum())}
    if batch.targets.pair_sign is not None:
        out["pairs"] = float((batch.targets.pair_sign > 0).sum())
    return out
