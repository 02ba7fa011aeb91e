"""Pure tensor functions for RLHF algorithms (PPO, RLOO, ReMax, online DPO, GRPO, Dr. GRPO,
REINFORCE++) and the off-policy corrections of the rollout sources.

Tensors and plain scalars in, tensors out; no config objects.  Shape letters:
``b`` batch (or prompts), ``k`` samples per prompt, ``t`` response length.

Masks (``response_mask``) may be bool or float; they are read as booleans
(nonzero = real response token, EOS included).  Grouped tensors are flat
``(b*k,)`` with each prompt's ``k`` samples contiguous: index ``i*k + j`` is
sample ``j`` of prompt ``i``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

KL_KINDS = ("k1", "k2", "k3")
DPO_LOSS_TYPES = ("sigmoid", "ipo")
# How per-token losses (b, t) become one scalar (verl's `agg_loss` modes):
#   token-mean               every valid token of the batch weighs the same (DAPO, Dr. GRPO, PPO)
#   seq-mean-token-sum       sum over a sequence's tokens, mean over sequences (REINFORCE on whole completions)
#   seq-mean-token-mean      mean over a sequence's tokens, then over sequences (the GRPO paper)
#   seq-mean-token-sum-norm  sum over tokens / the fixed response budget t, mean over sequences (Dr. GRPO's constant)
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def divide_exact(a: int, b: int, what: str) -> int:
    """``a // b``; raise ``ValueError`` naming ``what`` unless ``b`` divides ``a``."""
    if b <= 0 or a % b != 0:
        raise ValueError(f"{what}: {a} is not divisible by {b}")
    return a // b


def _groups(x: torch.Tensor, k: int) -> torch.Tensor:
    """Flat ``(b*k,)`` -> ``(b, k)``, validating ``k``."""
    if k < 2:
        raise ValueError(f"k must be >= 2 samples per prompt, got {k}")
    b = divide_exact(x.numel(), k, "number of samples vs samples per prompt k")
    return x.reshape(b, k)


def _where_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where() instead of x * mask: padding may hold inf/NaN (e.g. -inf logprobs),
    # and inf * 0 would poison the sums.
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` is set.

    ``x``, ``mask``: same shape, e.g. ``(b, t)``.  ``dim=None`` -> scalar,
    otherwise the reduced shape (e.g. ``(b,)`` for ``dim=1``).
    """
    xm = _where_mask(x, mask)
    return xm.sum() if dim is None else xm.sum(dim=dim)


Total = Callable[[torch.Tensor], torch.Tensor]  # a sum over the ranks holding the rest of a batch (distributed.all_sum)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, total: Total | None = None) -> torch.Tensor:
    """Mean of ``x`` over masked positions (scalar for ``dim=None``, else reduced shape).

    An empty mask (or an all-empty row along ``dim``) gives 0 rather than NaN, so
    a fully padded micro-batch contributes nothing instead of crashing training.
    ``total`` (``dim=None``): the sum and count over every rank's share, so the mean
    is the whole batch's (with one rank it is the identity: the same numbers).
    """
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    summed = masked_sum(x, mask, dim)
    if total is not None:  # in float64: a count in bf16 is exact only to 256
        summed64, count = total(torch.stack([summed.double(), count.double()])).unbind()
        summed = summed64.to(summed.dtype)
    return summed / count.clamp(min=1).to(x.dtype)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, total: Total | None = None) -> torch.Tensor:
    """Variance (scalar) of ``x`` over all masked elements; ``x``, ``mask`` e.g. ``(b, t)``.

    With ``unbiased`` the Bessel correction n/(n-1) is applied; for n < 2 the
    correction is skipped (the variance is then 0), avoiding a host sync to raise.
    ``total``: over every rank's share, as masked_mean.
    """
    var = masked_mean((x - masked_mean(x, mask, total=total)) ** 2, mask, total=total)
    if unbiased:
        n = mask.bool().sum()
        n = (total(n.double()) if total is not None else n).to(x.dtype)
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8, total: Total | None = None
) -> torch.Tensor:
    """Whiten ``x`` with mean/variance taken over masked elements only.

    ``x``, ``mask``: ``(b, t)`` (any shape).  Returns the same shape; the affine
    transform is applied EVERYWHERE, so masked-out positions hold whitened
    garbage and must still be ignored by the caller.  ``shift_mean=False`` keeps
    the original mean (only rescales), as PPO implementations do for rewards.
    ``total``: the statistics over every rank's share of the batch (masked_mean).
    """
    mean, var = masked_mean(x, mask, total=total), masked_var(x, mask, total=total)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean


def first_true_indices(bools: torch.Tensor, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Index of the first True in each row of ``bools`` ``(b, t)`` -> ``(b,)``; ``t`` if none."""
    t = bools.size(-1)
    # False positions get t + j, True positions j: the row min is the first True (or >= t).
    idx = torch.arange(t, dtype=dtype, device=bools.device)
    return (t * (~bools).to(dtype) + idx).min(dim=-1).values


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi; shapes ``(b, t)`` -> ``(b, t)``.

    Schulman's estimators with log r = ref_logprobs - logprobs:
    ``k1 = -log r`` (unbiased, high variance, can be negative),
    ``k2 = 0.5 * (log r)^2`` (biased, low variance, >= 0),
    ``k3 = (r - 1) - log r`` (unbiased, >= 0).
    """
    if kind == "k1":
        return logprobs - ref_logprobs
    if kind == "k2":
        return 0.5 * (logprobs - ref_logprobs) ** 2
    if kind == "k3":
        log_r = ref_logprobs - logprobs
        # expm1 keeps precision when pi ~= ref, where exp(x) - 1 would cancel.
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {kind!r}; valid kinds: {', '.join(KL_KINDS)}")


def sequence_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_kind: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold the KL penalty into one reward per sequence (RLOO and ReMax: the KL is a reward penalty).

    ``scores`` ``(b,)``; ``logprobs``, ``ref_logprobs``, ``response_mask`` ``(b, t)``.
    Returns ``(rewards (b,), kl (b,))`` with ``kl = sum_t kl_token`` over valid
    tokens and ``rewards = scores - kl_coef * kl``.
    """
    kl = masked_sum(kl_penalty(logprobs, ref_logprobs, kl_kind), response_mask, dim=1)
    return scores - kl_coef * kl, kl


def token_level_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_kind: str = "k1",
) -> torch.Tensor:
    """PPO per-token rewards ``(b, t)``: ``-kl_coef * kl`` on valid tokens, 0 on padding,
    plus ``scores`` ``(b,)`` added at the last valid token of each row.

    Rows with no valid token get all zeros (their score is dropped).
    """
    mask = response_mask.bool()
    rewards = _where_mask(-kl_coef * kl_penalty(logprobs, ref_logprobs, kl_kind), mask)
    last = mask.size(1) - 1 - first_true_indices(mask.flip(1))  # -1 for empty rows
    has_any = last >= 0
    bonus = torch.zeros_like(rewards).scatter_(
        1, last.clamp(min=0).unsqueeze(1), (scores.to(rewards.dtype) * has_any).unsqueeze(1)
    )
    return rewards + bonus


def rloo_advantages(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """Leave-one-out advantages ``(b*k,)``: ``r_i - mean_{j != i} r_j`` within each group."""
    g = _groups(rewards, k)
    # r_i - (S - r_i)/(k-1) == (k*r_i - S)/(k-1): one pass, no k x k matrix.
    adv = (k * g - g.sum(dim=1, keepdim=True)) / (k - 1)
    return adv.reshape(rewards.shape)


def remax_advantages(rewards: torch.Tensor, greedy_rewards: torch.Tensor, k: int = 1) -> torch.Tensor:
    """ReMax: the greedy completion's reward is the baseline of its prompt's ``k`` samples.

    ``rewards`` ``(b*k,)``, ``greedy_rewards`` ``(b,)`` -> ``(b*k,)``.
    """
    if rewards.numel() != greedy_rewards.numel() * k:
        raise ValueError(f"{rewards.numel()} rewards for {greedy_rewards.numel()} greedy baselines x k={k}")
    return rewards - greedy_rewards.repeat_interleave(k)


def grpo_advantages(
    rewards: torch.Tensor, k: int, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO group-normalised advantages ``(b*k,)``: ``(r - mean_g) / (std_g + eps)``.

    ``std_g`` is the unbiased group std.  Groups whose rewards are all equal give
    exactly 0 (no signal), never NaN.  ``scale_by_std=False`` only centres (Dr. GRPO).
    """
    g = _groups(rewards, k)
    adv = g - g.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (g.std(dim=1, keepdim=True) + eps)
    # The float mean of equal values can differ from them by an ulp, which
    # divided by eps would be a large bogus advantage: zero constant groups exactly.
    constant = (g == g[:, :1]).all(dim=1, keepdim=True)
    adv = torch.where(constant, torch.zeros_like(adv), adv)
    return adv.reshape(rewards.shape)


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation over valid tokens; all inputs ``(b, t)``.

    Masked positions are skipped (the valid tokens of a row form the episode),
    the value after the last valid token is 0.  Returns ``(advantages, returns)``,
    both ``(b, t)``, detached, 0 at masked positions, ``returns = advantages + values``.
    """
    mask = response_mask.bool()
    rewards, values = rewards.detach(), values.detach()
    next_value = next_adv = rewards.new_zeros(rewards.size(0))
    advs = []
    for i in reversed(range(rewards.size(1))):
        delta = rewards[:, i] + gamma * next_value - values[:, i]
        adv = delta + gamma * lam * next_adv
        m = mask[:, i]
        # Carry state through padding holes so they do not cut the episode.
        next_value = torch.where(m, values[:, i], next_value)
        next_adv = torch.where(m, adv, next_adv)
        advs.append(adv)
    advantages = _where_mask(torch.stack(advs[::-1], dim=1), mask)
    returns = _where_mask(advantages + values, mask)
    return advantages, returns


def agg_loss(loss_mat: torch.Tensor, response_mask: torch.Tensor, mode: str, tokens: float | None = None) -> torch.Tensor:
    """Aggregate per-token losses ``(b, t)`` into a scalar; see ``LOSS_AGG_MODES``.

    Masked positions never count (they may hold inf/NaN).  An empty mask gives 0.
    ``seq-mean-token-sum-norm`` divides every sequence by ``t``, the padded
    response budget, so a sequence's weight does not depend on its length.
    ``tokens``: what token-mean divides the sum by, instead of this batch's valid
    tokens. Under data parallelism it is the global count over the world size, so
    that averaging the ranks' gradients gives the mean over every token of the
    global batch (not the mean of the ranks' means).
    """
    if mode == "token-mean":
        if tokens is None:
            return masked_mean(loss_mat, response_mask)
        return masked_sum(loss_mat, response_mask) / max(tokens, 1.0)
    per_seq = masked_sum(loss_mat, response_mask, dim=1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / response_mask.bool().sum(dim=1).clamp(min=1).to(per_seq.dtype)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = per_seq / response_mask.size(1)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown loss_agg {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    return per_seq.mean() if per_seq.numel() else per_seq.sum()


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_eps: float,
    loss_agg: str = "token-mean",
    weights: torch.Tensor | None = None,
    tokens: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate on token ratios (``tokens``: see ``agg_loss``). Returns ``(loss, clipfrac, approx_kl)``, all scalars.

    ``logprobs``, ``old_logprobs``, ``response_mask`` ``(b, t)``; ``advantages`` ``(b, t)`` or
    ``(b,)`` (one per sequence, broadcast to its tokens).  Per token:
    ``w * max(-A * ratio, -A * clip(ratio, 1-eps, 1+eps))`` with ``ratio = exp(logprobs - old)``
    and ``w`` the importance ``weights`` ``(b, t)`` of an off-policy correction (1 without),
    aggregated by ``loss_agg``.  With ratio 1 (the first update on a batch) and
    ``seq-mean-token-sum`` this is REINFORCE on whole completions: ``-mean_i A_i sum_t logprobs``.
    ``clipfrac`` is the token fraction where the clipped term is active; ``approx_kl`` the token
    mean of ``0.5 * log_ratio^2`` (k2), detached.
    """
    adv = advantages.detach()
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    log_ratio = logprobs - old_logprobs.detach()
    ratio = torch.exp(log_ratio)
    unclipped, clipped = -adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.maximum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = agg_loss(per_token, response_mask, loss_agg, tokens)
    clipfrac = masked_mean((clipped > unclipped).to(ratio.dtype), response_mask).detach()
    approx_kl = masked_mean(0.5 * log_ratio.detach() ** 2, response_mask)
    return loss, clipfrac, approx_kl


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip_eps: float,
    loss_agg: str = "token-mean",
    tokens: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped value loss, all inputs ``(b, t)``. Returns ``(loss, clipfrac)`` scalars (``tokens``: see ``agg_loss``).

    ``loss = 0.5 * agg(max((v - R)^2, (v_clip - R)^2))`` with
    ``v_clip = old + clamp(v - old, -eps, eps)``, aggregated by ``loss_agg``.
    """
    old_values, returns = old_values.detach(), returns.detach()
    v_clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    err, err_clipped = (values - returns) ** 2, (v_clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(err, err_clipped), response_mask, loss_agg, tokens)
    clipfrac = masked_mean((err_clipped > err).to(values.dtype), response_mask).detach()
    return loss, clipfrac


def sequence_logprobs(logprobs: torch.Tensor, response_mask: torch.Tensor, loss_agg: str) -> torch.Tensor:
    """One log-probability per sequence ``(b, t)`` -> ``(b,)`` for losses on whole sequences (DPO).

    ``seq-mean-token-sum``: the sequence's log-likelihood (DPO); ``seq-mean-token-mean``: its
    per-token mean (length-normalised, as SimPO); ``seq-mean-token-sum-norm``: the sum over ``t``.
    """
    total = masked_sum(logprobs, response_mask, dim=1)
    if loss_agg == "seq-mean-token-sum":
        return total
    if loss_agg == "seq-mean-token-mean":
        return total / response_mask.bool().sum(dim=1).clamp(min=1).to(total.dtype)
    if loss_agg == "seq-mean-token-sum-norm":
        return total / response_mask.size(1)
    raise ValueError(f"loss_agg {loss_agg!r} has no per-sequence log-probability; use a seq-mean-* mode")


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    pair_mask: torch.Tensor | None = None,
    pairs: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO / IPO loss on sequence log-probs ``(b,)``.

    ``logits = (pc - rc) - (pr - rr)``; ``sigmoid``: ``-logsigmoid(beta*logits)``;
    ``ipo``: ``(logits - 1/(2*beta))**2``; mean over the pairs where ``pair_mask`` ``(b,)`` is
    set (all by default; 0 when none is), or the masked sum over ``pairs`` (data parallelism,
    as ``tokens`` in ``agg_loss``).  Returns ``(loss, chosen_rewards, rejected_rewards)``
    with implicit rewards ``beta*(pc - rc)``, ``beta*(pr - rr)`` (``(b,)``, detached).
    """
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    logits = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        per_pair = -F.logsigmoid(beta * logits)
    elif loss_type == "ipo":
        per_pair = (logits - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(
            f"unknown DPO loss_type {loss_type!r}; valid: {', '.join(DPO_LOSS_TYPES)}"
        )
    mask = torch.ones_like(per_pair, dtype=torch.bool) if pair_mask is None else pair_mask.bool()
    loss = masked_mean(per_pair, mask) if pairs is None else masked_sum(per_pair, mask) / max(pairs, 1.0)
    return loss, (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach()


def best_worst_indices(rewards: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices ``(b,)``, ``(b,)`` of the best and worst sample of each group.

    ``rewards`` ``(b*k,)``.  Ties: chosen is the FIRST max, rejected the LAST min,
    so the two differ even when a group is all equal (see ``tied_groups``).
    """
    g = _groups(rewards, k)
    chosen = torch.argmax(g, dim=1)
    rejected = (k - 1) - torch.argmin(g.flip(1), dim=1)
    offset = torch.arange(g.size(0), device=g.device) * k
    return offset + chosen, offset + rejected


def tied_groups(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """``(b,)`` bool: every sample of the group has the same reward (no preference to learn)."""
    g = _groups(rewards, k)
    return g.amax(dim=1) == g.amin(dim=1)


def kl_loss(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, response_mask: torch.Tensor, loss_agg: str = "token-mean",
    tokens: float | None = None,
) -> torch.Tensor:
    """GRPO's KL term: the k3 estimator per token ``(b, t)``, aggregated by ``loss_agg`` -> scalar."""
    return agg_loss(kl_penalty(logprobs, ref_logprobs, "k3"), response_mask, loss_agg, tokens)


def discounted_returns(rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go ``G_t = sum_{s >= t} gamma^(s-t) r_s`` over each row's valid tokens ``(b, t)``.

    Masked positions neither contribute nor receive (0 there), as in REINFORCE++.
    Vectorised as ``r @ D`` with ``D[s, t] = gamma^(s-t)`` for ``s >= t``.
    """
    mask = response_mask.bool()
    r = _where_mask(rewards, mask)
    t = r.size(1)
    steps = torch.arange(t, device=r.device)
    power = (steps[:, None] - steps[None, :]).to(r.dtype)  # s - t
    discount = torch.where(power >= 0, torch.as_tensor(gamma, dtype=r.dtype) ** power.clamp(min=0), torch.zeros_like(power))
    return _where_mask(r @ discount, mask)


def reinforce_pp_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0, total: Total | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu, 2025): returns of the per-token (KL-penalised) rewards, whitened over the
    whole batch's valid tokens (over every rank's with ``total``, see masked_whiten); no critic.
    ``(b, t)`` -> ``(advantages, returns)``, 0 on padding.
    """
    returns = discounted_returns(token_rewards.detach(), response_mask, gamma)
    advantages = _where_mask(masked_whiten(returns, response_mask, total=total), response_mask)
    return advantages, returns


def truncated_importance_weights(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float,
) -> torch.Tensor:
    """Truncated IS weights ``min(pi/mu, cap)`` ``(b, t)`` for off-policy batches.

    Detached; 0 at masked positions.  ``cap`` must be > 0.
    """
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    # Clamp in log space so a huge ratio cannot overflow to inf before truncation.
    log_ratio = (logprobs - behaviour_logprobs).detach().clamp(max=math.log(cap))
    return _where_mask(torch.exp(log_ratio), response_mask)


def decoupled_importance_weights(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float | None,
) -> torch.Tensor:
    """AReaL's decoupled-PPO behaviour weights ``pi_prox / mu`` ``(b, t)``, detached.

    The clipped ratio is taken against the proximal policy (the learner's weights
    before this batch's updates), and each token is weighted by how much more the
    proximal policy likes it than the stale behaviour policy did.  A token whose
    weight exceeds ``cap`` is dropped (weight 0), not truncated (Fu et al., 2025);
    ``cap=None`` keeps every token.  0 at masked positions.
    """
    log_w = (proximal_logprobs - behaviour_logprobs).detach()
    keep = response_mask.bool()
    if cap is not None:
        if cap <= 0:
            raise ValueError(f"cap must be > 0, got {cap}")
        keep = keep & (log_w <= math.log(cap))
    # exp(80) is still finite in float32; dropped tokens are zeroed anyway.
    return _where_mask(torch.exp(log_w.clamp(max=80.0)), keep)


def eos_penalty(scores: torch.Tensor, has_eos: torch.Tensor, penalty: float | None) -> torch.Tensor:
    """Replace scores ``(b,)`` of completions without EOS (``has_eos`` ``(b,)`` bool) by
    ``penalty``; truncated text would otherwise be scored as if finished.  ``None``: no penalty."""
    if penalty is None:
        return scores
    return torch.where(has_eos.bool(), scores, torch.full_like(scores, penalty))
