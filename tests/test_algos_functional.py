"""Tests for rlhflab.algos.functional: hand-derived examples + plain-loop references."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch.testing import assert_close

from rlhflab.algos import functional as F

D = torch.float64


def t(x, dtype=D):
    return torch.tensor(x, dtype=dtype)


def ragged_mask(lengths, T):
    """Right-padded bool mask (b, T) with the given per-row lengths."""
    return torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


# --------------------------------------------------------------------- divide_exact
def test_divide_exact():
    assert F.divide_exact(12, 4, "rollouts") == 3
    with pytest.raises(ValueError, match="rollouts: 10 is not divisible by 4"):
        F.divide_exact(10, 4, "rollouts")
    with pytest.raises(ValueError):
        F.divide_exact(3, 0, "x")


# --------------------------------------------------------------------- masked reductions
def test_masked_sum_mean_hand():
    # masked values: row0 -> 1, 2 ; row1 -> 4.  inf sits in padding and must not leak.
    x = t([[1.0, 2.0, math.inf], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    m = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert F.masked_sum(x, m).item() == 7.0  # 1 + 2 + 4
    assert_close(F.masked_sum(x, m, dim=1), t([3.0, 4.0, 0.0]))
    assert_close(F.masked_mean(x, m), t(7.0 / 3.0))  # 7 over 3 elements
    # row means: (1+2)/2, 4/1, empty row -> 0 (not NaN)
    assert_close(F.masked_mean(x, m.bool(), dim=1), t([1.5, 4.0, 0.0]))
    # column sums: col0 1+4, col1 2, col2 nothing
    assert_close(F.masked_sum(x, m, dim=0), t([5.0, 2.0, 0.0]))


def test_masked_sum_mean_vs_loop(gen):
    x = torch.randn(5, 7, generator=gen, dtype=D)
    m = torch.rand(5, 7, generator=gen) > 0.4
    rows_sum = [sum(x[i, j].item() for j in range(7) if m[i, j]) for i in range(5)]
    rows_n = [int(m[i].sum()) for i in range(5)]
    assert_close(F.masked_sum(x, m, dim=1), t(rows_sum))
    assert_close(F.masked_sum(x, m.float(), dim=1), t(rows_sum))
    exp_mean = [s / n if n else 0.0 for s, n in zip(rows_sum, rows_n)]
    assert_close(F.masked_mean(x, m, dim=1), t(exp_mean))
    assert_close(F.masked_mean(x, m), t(sum(rows_sum) / sum(rows_n)))


def test_masked_var_hand_and_loop(gen):
    # masked values 1, 2, 4: mean 7/3, squared deviations 16/9, 1/9, 25/9 (sum 14/3)
    # unbiased: (14/3)/2 = 7/3 ; biased: (14/3)/3 = 14/9
    x = t([[1.0, 2.0, 50.0], [4.0, -9.0, 0.0]])
    m = t([[1, 1, 0], [1, 0, 0]])
    assert_close(F.masked_var(x, m), t(7.0 / 3.0))
    assert_close(F.masked_var(x, m, unbiased=False), t(14.0 / 9.0))

    x = torch.randn(4, 9, generator=gen, dtype=D)
    m = torch.rand(4, 9, generator=gen) > 0.3
    vals = [x[i, j].item() for i in range(4) for j in range(9) if m[i, j]]
    assert_close(F.masked_var(x, m), t(statistics.variance(vals)))
    assert_close(F.masked_var(x, m, unbiased=False), t(statistics.pvariance(vals)))


def test_masked_whiten_hand():
    # masked 1, 2, 3: mean 2, unbiased var 1 -> whitened -1, 0, 1; the padding 100
    # gets the same affine map: (100 - 2)/1 = 98.  shift_mean=False adds the mean back.
    x = t([[1.0, 2.0, 3.0, 100.0]])
    m = t([[1, 1, 1, 0]])
    assert_close(F.masked_whiten(x, m), t([[-1.0, 0.0, 1.0, 98.0]]))
    assert_close(F.masked_whiten(x, m, shift_mean=False), t([[1.0, 2.0, 3.0, 100.0]]))


def test_masked_whiten_stats(gen):
    x = 3.0 + 5.0 * torch.randn(6, 11, generator=gen, dtype=D)
    m = ragged_mask([11, 3, 7, 1, 9, 5], 11)
    x[~m] = 1e6  # padding must not influence the statistics
    w = F.masked_whiten(x, m)
    assert abs(F.masked_mean(w, m).item()) < 1e-9
    assert abs(F.masked_var(w, m).item() - 1.0) < 1e-6
    w2 = F.masked_whiten(x, m, shift_mean=False)
    assert_close(F.masked_mean(w2, m), F.masked_mean(x, m))
    assert abs(F.masked_var(w2, m).item() - 1.0) < 1e-6


# --------------------------------------------------------------------- first_true_indices
def test_first_true_indices(gen):
    b = torch.tensor([[False, True, True], [False, False, False], [True, False, False]])
    assert F.first_true_indices(b).tolist() == [1, 3, 0]  # row 1 has none -> t = 3
    assert F.first_true_indices(b, dtype=torch.int32).dtype == torch.int32

    r = torch.rand(8, 6, generator=gen) > 0.7
    ref = [next((j for j in range(6) if r[i, j]), 6) for i in range(8)]
    assert F.first_true_indices(r).tolist() == ref


# --------------------------------------------------------------------- KL estimators
def test_kl_penalty_hand():
    # pi = 0.5, ref = 0.25: r = ref/pi = 1/2, log r = -log 2
    #   k1 = -log r = log 2 ; k2 = 0.5 (log 2)^2 ; k3 = r - 1 - log r = log 2 - 1/2
    # pi = 0.25, ref = 0.5: r = 2 -> k1 = -log 2, k2 = 0.5 (log 2)^2, k3 = 1 - log 2
    lp = t([[math.log(0.5), math.log(0.25)]])
    ref = t([[math.log(0.25), math.log(0.5)]])
    l2 = math.log(2.0)
    assert_close(F.kl_penalty(lp, ref, "k1"), t([[l2, -l2]]))
    assert_close(F.kl_penalty(lp, ref, "k2"), t([[0.5 * l2**2, 0.5 * l2**2]]))
    assert_close(F.kl_penalty(lp, ref, "k3"), t([[l2 - 0.5, 1.0 - l2]]))


def test_kl_penalty_properties(gen):
    lp = 3 * torch.randn(50, 20, generator=gen, dtype=D)
    ref = 3 * torch.randn(50, 20, generator=gen, dtype=D)
    assert (F.kl_penalty(lp, ref, "k3") >= 0).all()
    assert (F.kl_penalty(lp, ref, "k2") >= 0).all()
    assert (F.kl_penalty(lp, lp, "k3") == 0).all()
    # element-wise loop reference for k3
    k3 = F.kl_penalty(lp, ref, "k3")
    for i, j in [(0, 0), (7, 3), (49, 19)]:
        lr = ref[i, j].item() - lp[i, j].item()
        assert k3[i, j].item() == pytest.approx(math.exp(lr) - 1 - lr, rel=1e-9)
    # k1 and k3 are unbiased: the exact expectation under pi equals KL(pi || ref)
    pi = torch.softmax(torch.randn(30, generator=gen, dtype=D), 0)
    q = torch.softmax(torch.randn(30, generator=gen, dtype=D), 0)
    kl = (pi * (pi.log() - q.log())).sum()
    for kind in ("k1", "k3"):
        assert_close((pi * F.kl_penalty(pi.log(), q.log(), kind)).sum(), kl)


def test_kl_penalty_unknown_kind():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        F.kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# --------------------------------------------------------------------- rewards
def _reward_inputs():
    # logprobs - ref = d; row0 valid 2 tokens, row1 3, row2 none
    d = t([[0.1, 0.2, 0.3], [0.5, -0.1, 0.4], [1.0, 1.0, 1.0]])
    mask = t([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    return t([1.0, 2.0, 3.0]), d, torch.zeros_like(d), mask


def test_sequence_rewards_hand():
    # k1 sums: row0 0.1+0.2 = 0.3, row1 0.5-0.1+0.4 = 0.8, row2 0
    # kl_coef 0.5: rewards 1-0.15 = 0.85, 2-0.4 = 1.6, 3-0 = 3
    scores, lp, ref, mask = _reward_inputs()
    rewards, kl = F.sequence_rewards(scores, lp, ref, mask, kl_coef=0.5)
    assert_close(kl, t([0.3, 0.8, 0.0]))
    assert_close(rewards, t([0.85, 1.6, 3.0]))
    # k2 sums: row0 0.5(0.01+0.04) = 0.025 -> reward 1 - 0.0125
    rewards2, _ = F.sequence_rewards(scores, lp, ref, mask, kl_coef=0.5, kl_kind="k2")
    assert rewards2[0].item() == pytest.approx(0.9875)


def test_sequence_rewards_vs_loop(gen):
    b, T = 5, 8
    scores = torch.randn(b, generator=gen, dtype=D)
    lp, ref = torch.randn(2, b, T, generator=gen, dtype=D)
    mask = ragged_mask([8, 1, 4, 0, 6], T)
    rewards, kl = F.sequence_rewards(scores, lp, ref, mask, kl_coef=0.3, kl_kind="k3")
    for i in range(b):
        s = 0.0
        for j in range(T):
            if mask[i, j]:
                lr = ref[i, j].item() - lp[i, j].item()
                s += math.exp(lr) - 1 - lr
        assert kl[i].item() == pytest.approx(s, abs=1e-12)
        assert rewards[i].item() == pytest.approx(scores[i].item() - 0.3 * s, abs=1e-12)


def test_token_level_rewards_hand():
    # kl_coef 0.5: row0 [-0.05, -0.1 + 1, 0], row1 [-0.25, +0.05, -0.2 + 2], row2 all 0
    scores, lp, ref, mask = _reward_inputs()
    r = F.token_level_rewards(scores, lp, ref, mask, kl_coef=0.5)
    assert_close(r, t([[-0.05, 0.9, 0.0], [-0.25, 0.05, 1.8], [0.0, 0.0, 0.0]]))


def test_token_level_rewards_vs_loop(gen):
    b, T = 6, 7
    scores = torch.randn(b, generator=gen, dtype=D)
    lp, ref = torch.randn(2, b, T, generator=gen, dtype=D)
    mask = torch.rand(b, T, generator=gen) > 0.3  # holes allowed: score at last True
    mask[2] = False
    r = F.token_level_rewards(scores, lp, ref, mask.float(), kl_coef=0.2, kl_kind="k2")
    ref_r = torch.zeros(b, T, dtype=D)
    for i in range(b):
        last = None
        for j in range(T):
            if mask[i, j]:
                ref_r[i, j] = -0.2 * 0.5 * (lp[i, j] - ref[i, j]) ** 2
                last = j
        if last is not None:
            ref_r[i, last] += scores[i]
    assert_close(r, ref_r)
    # the reward sum equals the sequence-level reward
    seq, _ = F.sequence_rewards(scores, lp, ref, mask, 0.2, "k2")
    seq = torch.where(mask.any(1), seq, torch.zeros_like(seq))
    assert_close(r.sum(1), seq)


# --------------------------------------------------------------------- baselines
def test_rloo_trl_example():
    # TRL RLOO write-up: 3 prompts x 4 completions, k-major (row j = completion j)
    rlhf_reward = t([1, 2, 3, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    k, n_prompts = 4, 3
    # loop: each completion's reward minus the mean of the other 3 of the same prompt
    loop = []
    for idx in range(len(rlhf_reward)):
        j, p = divmod(idx, n_prompts)
        others = [rlhf_reward[jj * n_prompts + p].item() for jj in range(k) if jj != j]
        loop.append(rlhf_reward[idx].item() - sum(others) / len(others))
    loop = t(loop)
    assert loop[0].item() == pytest.approx(1 - (2 + 5 + 8) / 3)  # = -4
    assert loop[7].item() == pytest.approx(6 - (3 + 2 + 9) / 3)  # = 4/3
    # to our prompt-major layout: ours[p*k + j] = kmajor[j*n_prompts + p]
    ours = rlhf_reward.view(k, n_prompts).t().reshape(-1)
    adv = F.rloo_advantages(ours, k)
    assert_close(adv, loop.view(k, n_prompts).t().reshape(-1))
    assert adv[0].item() == pytest.approx(-4.0)
    assert adv[1 * k + 2].item() == pytest.approx(4.0 / 3.0)  # prompt 1, sample 2 = elt 7


def test_rloo_vs_loop_and_errors(gen):
    r = torch.randn(5 * 3, generator=gen, dtype=D)
    ref = [
        r[i].item() - (sum(r[(i // 3) * 3 : (i // 3) * 3 + 3]).item() - r[i].item()) / 2
        for i in range(15)
    ]
    assert_close(F.rloo_advantages(r, 3), t(ref))
    assert_close(F.rloo_advantages(r, 3).view(5, 3).sum(1), torch.zeros(5, dtype=D))
    with pytest.raises(ValueError):
        F.rloo_advantages(r, 1)
    with pytest.raises(ValueError, match="not divisible"):
        F.rloo_advantages(torch.zeros(10), 4)


def test_remax_advantages():
    # [1 - 0.5, 2 - 3]
    assert_close(F.remax_advantages(t([1.0, 2.0]), t([0.5, 3.0])), t([0.5, -1.0]))
    # k=2: each prompt's greedy score is the baseline of both its samples
    assert_close(F.remax_advantages(t([1.0, 0.0, 2.0, 4.0]), t([0.5, 3.0]), k=2), t([0.5, -0.5, -1.0, 1.0]))
    with pytest.raises(ValueError, match="greedy baselines"):
        F.remax_advantages(t([1.0, 0.0, 2.0, 4.0]), t([0.5, 3.0]))  # (4,) samples, (2,) baselines, k=1


def test_grpo_hand_ties_and_constant():
    # group0 [1,2,3]: mean 2, unbiased std 1 -> [-1, 0, 1] / (1 + eps)
    # group1 [5,5,5]: constant -> exact zeros
    # group2 [0,0,3]: mean 1, devs [-1,-1,2], var (1+1+4)/2 = 3 -> [-1,-1,2]/sqrt(3); ties equal
    # group3 [0.1]*3: float mean may be off by an ulp; must still be exactly 0
    r = t([1, 2, 3, 5, 5, 5, 0, 0, 3, 0.1, 0.1, 0.1], dtype=torch.float32)
    adv = F.grpo_advantages(r, 3, eps=0.0)
    s3 = math.sqrt(3.0)
    exp = [-1, 0, 1, 0, 0, 0, -1 / s3, -1 / s3, 2 / s3, 0, 0, 0]
    assert_close(adv, t(exp, torch.float32))
    assert not torch.isnan(adv).any()
    assert (adv[3:6] == 0).all() and (adv[9:] == 0).all()
    assert adv[6] == adv[7]
    # default eps=1e-6 divides by (1 + 1e-6)
    assert F.grpo_advantages(r, 3)[2].item() == pytest.approx(1 / (1 + 1e-6), rel=1e-6)
    # no std scaling: only centring
    assert_close(
        F.grpo_advantages(r, 3, scale_by_std=False),
        t([-1, 0, 1, 0, 0, 0, -1, -1, 2, 0, 0, 0], torch.float32),
    )


def test_grpo_vs_loop_and_errors(gen):
    k = 4
    r = torch.randn(6 * k, generator=gen, dtype=D)
    ref = []
    for i in range(6):
        grp = r[i * k : (i + 1) * k].tolist()
        mu, sd = statistics.mean(grp), statistics.stdev(grp)
        ref += [(x - mu) / (sd + 1e-6) for x in grp]
    assert_close(F.grpo_advantages(r, k), t(ref))
    with pytest.raises(ValueError):
        F.grpo_advantages(r, 1)
    with pytest.raises(ValueError):
        F.grpo_advantages(torch.zeros(7), 2)


def test_best_worst_indices():
    # group0 [3,1,3,0]: first max 0, last min 3 -> 0, 3
    # group1 [2,2,2,2]: first max 0, last min 3 -> 4, 7 (distinct although all equal)
    # group2 [0,5,0,5]: first max 1 -> 9, last min 2 -> 10
    r = t([3, 1, 3, 0, 2, 2, 2, 2, 0, 5, 0, 5])
    c, rj = F.best_worst_indices(r, 4)
    assert c.tolist() == [0, 4, 9] and rj.tolist() == [3, 7, 10]
    with pytest.raises(ValueError):
        F.best_worst_indices(r, 1)
    with pytest.raises(ValueError):
        F.best_worst_indices(r, 5)


def test_tied_groups():
    # group0 [3,1,3,0] has a preference; group1 [2,2,2,2] none; group2 [5,5] of k=2 none
    r = t([3, 1, 3, 0, 2, 2, 2, 2])
    assert F.tied_groups(r, 4).tolist() == [False, True]
    assert F.tied_groups(t([5, 5, 1, 0]), 2).tolist() == [True, False]


def test_best_worst_vs_loop(gen):
    k = 3
    r = torch.randint(0, 3, (20 * k,), generator=gen).to(D)  # many ties
    c, rj = F.best_worst_indices(r, k)
    for i in range(20):
        g = r[i * k : (i + 1) * k].tolist()
        best = max(range(k), key=lambda j: (g[j], -j))
        worst = min(range(k), key=lambda j: (g[j], -j))
        assert c[i].item() == i * k + best and rj[i].item() == i * k + worst
        assert c[i] != rj[i]


# --------------------------------------------------------------------- GAE
def test_gae_hand():
    # gamma 0.9, lam 0.5, valid tokens 0..1 (position 2 is padding with value 100)
    # t=1: delta = 1 + 0.9*0 - 2 = -1, A1 = -1
    # t=0: delta = 0 + 0.9*2 - 1 = 0.8, A0 = 0.8 + 0.9*0.5*(-1) = 0.35
    # returns = A + V = [1.35, 1.0], padding 0
    rewards = t([[0.0, 1.0, 7.0]])
    values = t([[1.0, 2.0, 100.0]])
    mask = t([[1, 1, 0]])
    adv, ret = F.gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    assert_close(adv, t([[0.35, -1.0, 0.0]]))
    assert_close(ret, t([[1.35, 1.0, 0.0]]))


def _gae_loop(rewards, values, mask, gamma, lam):
    b, T = rewards.shape
    adv = torch.zeros(b, T, dtype=D)
    for i in range(b):
        idx = [j for j in range(T) if mask[i, j]]
        last = 0.0
        for n in reversed(range(len(idx))):
            j = idx[n]
            nv = values[i, idx[n + 1]].item() if n + 1 < len(idx) else 0.0
            delta = rewards[i, j].item() + gamma * nv - values[i, j].item()
            last = delta + gamma * lam * last
            adv[i, j] = last
    return adv, torch.where(mask.bool(), adv + values, torch.zeros_like(adv))


@pytest.mark.parametrize("holes", [False, True])
def test_gae_vs_loop_ragged(gen, holes):
    b, T = 5, 9
    rewards, values = torch.randn(2, b, T, generator=gen, dtype=D)
    mask = ragged_mask([9, 1, 5, 0, 3], T)
    if holes:
        mask[0, 4] = False
        mask[2, 1] = False
    adv, ret = F.gae_advantages(rewards, values, mask.float(), gamma=0.95, lam=0.9)
    ref_adv, ref_ret = _gae_loop(rewards, values, mask, 0.95, 0.9)
    assert_close(adv, ref_adv)
    assert_close(ret, ref_ret)
    # gamma = lam = 1: advantage = (sum of future valid rewards) - value
    adv1, _ = F.gae_advantages(rewards, values, mask, 1.0, 1.0)
    rr = torch.where(mask, rewards, torch.zeros_like(rewards))
    future = rr.flip(1).cumsum(1).flip(1)
    assert_close(adv1, torch.where(mask, future - values, torch.zeros_like(values)))


# --------------------------------------------------------------------- losses
def test_agg_loss_hand():
    # row0 tokens [1, 2] (3 padded away, inf too), row1 [4, 5, 6]; budget t = 4
    x = t([[1.0, 2.0, math.inf, 3.0], [4.0, 5.0, 6.0, 0.0]])
    m = t([[1, 1, 0, 0], [1, 1, 1, 0]])
    assert F.agg_loss(x, m, "token-mean").item() == pytest.approx(18 / 5)  # (1+2+4+5+6)/5
    assert F.agg_loss(x, m, "seq-mean-token-sum").item() == pytest.approx((3 + 15) / 2)
    assert F.agg_loss(x, m, "seq-mean-token-mean").item() == pytest.approx((1.5 + 5) / 2)
    assert F.agg_loss(x, m, "seq-mean-token-sum-norm").item() == pytest.approx((3 / 4 + 15 / 4) / 2)
    with pytest.raises(ValueError, match="token-mean"):
        F.agg_loss(x, m, "sum")


def test_agg_loss_vs_loop(gen):
    x = torch.randn(5, 7, generator=gen, dtype=D)
    m = ragged_mask([7, 3, 1, 0, 5], 7)
    rows = [[x[i, j].item() for j in range(7) if m[i, j]] for i in range(5)]
    flat = [v for r in rows for v in r]
    assert F.agg_loss(x, m, "token-mean").item() == pytest.approx(sum(flat) / len(flat))
    assert F.agg_loss(x, m, "seq-mean-token-sum").item() == pytest.approx(sum(sum(r) for r in rows) / 5)
    means = [sum(r) / len(r) if r else 0.0 for r in rows]
    assert F.agg_loss(x, m, "seq-mean-token-mean").item() == pytest.approx(sum(means) / 5)
    assert F.agg_loss(x, m, "seq-mean-token-sum-norm").item() == pytest.approx(sum(sum(r) / 7 for r in rows) / 5)


def test_clipped_policy_loss_hand_token_level():
    # eps 0.2.  token: (ratio, A) -> max(-A r, -A clip(r))
    #   (1.5,  1) -> max(-1.5, -1.2) = -1.2  clipped
    #   (0.5, -1) -> max( 0.5,  0.8) =  0.8  clipped
    #   (1.0,  2) -> -2                      not clipped
    #   (1.5, -1) -> max( 1.5,  1.2) =  1.5  not clipped (pessimistic side)
    # loss = (-1.2 + 0.8 - 2 + 1.5)/4 = -0.225, clipfrac 2/4; padding token ignored.
    # grads: clipped tokens 0; token2 -A r/4 = -0.5; token3 -(-1)(1.5)/4 = 0.375
    ratios = [1.5, 0.5, 1.0, 1.5, 50.0]
    old = t([[-1.0, -2.0, -0.3, -0.7, -4.0]])
    lp = (old + t([[math.log(r) for r in ratios]])).requires_grad_()
    adv = t([[1.0, -1.0, 2.0, -1.0, 9.0]])
    mask = t([[1, 1, 1, 1, 0]])
    loss, clipfrac, approx_kl = F.clipped_policy_loss(lp, old, adv, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-0.225)
    assert clipfrac.item() == pytest.approx(0.5)
    kl = 0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2 + 0 + math.log(1.5) ** 2) / 4
    assert approx_kl.item() == pytest.approx(kl)
    loss.backward()
    assert_close(lp.grad, t([[0.0, 0.0, -0.5, 0.375, 0.0]]))
    # importance weights scale each token's term: weight 2 on token2 doubles its -2, 0 drops token3
    w = t([[1.0, 1.0, 2.0, 0.0, 1.0]])
    loss_w, _, _ = F.clipped_policy_loss(lp, old, adv, mask, 0.2, weights=w)
    assert loss_w.item() == pytest.approx((-1.2 + 0.8 - 4.0 + 0.0) / 4)
    # seq-mean-token-sum: the same per-token terms summed over the row, one row
    loss_s, _, _ = F.clipped_policy_loss(lp, old, adv, mask, 0.2, loss_agg="seq-mean-token-sum")
    assert loss_s.item() == pytest.approx(-0.9)


def test_clipped_policy_loss_vs_loop(gen):
    b, T, eps = 4, 6, 0.2
    old = torch.randn(b, T, generator=gen, dtype=D)
    lp = old + 0.4 * torch.randn(b, T, generator=gen, dtype=D)
    adv = torch.randn(b, T, generator=gen, dtype=D)
    w = torch.rand(b, T, generator=gen, dtype=D) * 2
    mask = ragged_mask([6, 2, 4, 1], T)
    rows, clipped, n = [[] for _ in range(b)], 0, 0
    for i in range(b):
        for j in range(T):
            if mask[i, j]:
                r = math.exp(lp[i, j].item() - old[i, j].item())
                a = adv[i, j].item()
                u, c = -a * r, -a * min(max(r, 1 - eps), 1 + eps)
                rows[i].append(max(u, c) * w[i, j].item())
                clipped += c > u
                n += 1
    loss, cf, _ = F.clipped_policy_loss(lp, old, adv, mask, eps, weights=w)
    assert loss.item() == pytest.approx(sum(map(sum, rows)) / n)
    assert cf.item() == pytest.approx(clipped / n)
    loss, _, _ = F.clipped_policy_loss(lp, old, adv, mask, eps, "seq-mean-token-mean", w)
    assert loss.item() == pytest.approx(sum(sum(r) / len(r) for r in rows) / b)
    # (b,) advantages broadcast to every token
    a1 = adv[:, 0]
    l_b, _, _ = F.clipped_policy_loss(lp, old, a1, mask, eps)
    l_bt, _, _ = F.clipped_policy_loss(lp, old, a1[:, None].expand(b, T), mask, eps)
    assert_close(l_b, l_bt)
    # on-policy (ratio 1), seq-mean-token-sum is REINFORCE on whole completions:
    # d/d logprobs[i, t] = -A_i / b on valid tokens
    lp_leaf = old.clone().requires_grad_()
    F.clipped_policy_loss(lp_leaf, old, a1, mask, eps, "seq-mean-token-sum")[0].backward()
    assert_close(lp_leaf.grad, torch.where(mask, -a1[:, None] / b, torch.zeros_like(old)))


def test_clipped_value_loss_hand_and_loop(gen):
    # eps 0.2: (v, old, R)
    #   (1.0, 0.5, 0.0): v_clip 0.7, err 1.0, err_clip 0.49 -> 1.0   (not clipped)
    #   (1.0, 0.5, 1.0): v_clip 0.7, err 0.0, err_clip 0.09 -> 0.09  (clipped)
    #   (0.6, 0.5, 2.0): v_clip 0.6, err 1.96 both         -> 1.96  (not clipped)
    # loss = 0.5 * (1 + 0.09 + 1.96)/3 = 0.508333..., clipfrac 1/3
    v = t([[1.0, 1.0, 0.6, 8.0]])
    old = t([[0.5, 0.5, 0.5, 0.0]])
    R = t([[0.0, 1.0, 2.0, -8.0]])
    m = t([[1, 1, 1, 0]])
    loss, cf = F.clipped_value_loss(v, old, R, m, 0.2)
    assert loss.item() == pytest.approx(0.5 * 3.05 / 3)
    assert cf.item() == pytest.approx(1 / 3)

    v, old, R = torch.randn(3, 5, 7, generator=gen, dtype=D)
    m = ragged_mask([7, 3, 1, 5, 6], 7)
    tot, nclip, n = 0.0, 0, 0
    for i in range(5):
        for j in range(7):
            if m[i, j]:
                vv, oo, rr = v[i, j].item(), old[i, j].item(), R[i, j].item()
                vc = oo + min(max(vv - oo, -0.3), 0.3)
                tot += max((vv - rr) ** 2, (vc - rr) ** 2)
                nclip += (vc - rr) ** 2 > (vv - rr) ** 2
                n += 1
    loss, cf = F.clipped_value_loss(v, old, R, m, 0.3)
    assert loss.item() == pytest.approx(0.5 * tot / n)
    assert cf.item() == pytest.approx(nclip / n)


def test_dpo_loss_hand():
    # pair0: pc-rc = -1-(-2) = 1, pr-rr = -3-(-2.5) = -0.5 -> logits 1.5
    # pair1: pc-rc = -2-(-1) = -1, pr-rr = 0 -> logits -1
    # sigmoid, beta 0.1: -logsigmoid(z) = log(1 + e^-z):
    #   log(1 + e^-0.15) = log(1.860708) = 0.620957 ; log(1 + e^0.1) = log(2.105171) = 0.744397
    #   mean = 0.682677
    # ipo: 1/(2 beta) = 5 -> ((1.5-5)^2 + (-1-5)^2)/2 = (12.25 + 36)/2 = 24.125
    pc, pr = t([-1.0, -2.0]), t([-3.0, -1.0])
    rc, rr = t([-2.0, -1.0]), t([-2.5, -1.0])
    loss, cr, rjr = F.dpo_loss(pc, pr, rc, rr, beta=0.1)
    exp = (math.log1p(math.exp(-0.15)) + math.log1p(math.exp(0.1))) / 2
    assert loss.item() == pytest.approx(exp)
    assert loss.item() == pytest.approx(0.682677, abs=1e-6)
    assert_close(cr, t([0.1, -0.1]))
    assert_close(rjr, t([-0.05, 0.0]))
    loss_ipo, _, _ = F.dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="ipo")
    assert loss_ipo.item() == pytest.approx(24.125)
    with pytest.raises(ValueError, match="sigmoid"):
        F.dpo_loss(pc, pr, rc, rr, 0.1, loss_type="hinge")


def test_dpo_loss_vs_loop_and_detached_rewards(gen):
    pc, pr, rc, rr = torch.randn(4, 6, generator=gen, dtype=D)
    pc.requires_grad_()
    loss, cr, _ = F.dpo_loss(pc, pr, rc, rr, beta=0.3)
    ref = 0.0
    for i in range(6):
        z = 0.3 * ((pc[i] - rc[i]) - (pr[i] - rr[i])).item()
        ref += -math.log(1 / (1 + math.exp(-z)))
    assert loss.item() == pytest.approx(ref / 6)
    assert not cr.requires_grad and loss.requires_grad


def test_kl_loss_hand():
    # k3 of (pi=0.5, ref=0.25) = log2 - 0.5 ; of (pi=0.25, ref=0.5) = 1 - log2 ; mean 0.25, sum 0.5
    lp = t([[math.log(0.5), math.log(0.25), 3.0]])
    ref = t([[math.log(0.25), math.log(0.5), -3.0]])
    m = t([[1, 1, 0]])
    assert F.kl_loss(lp, ref, m).item() == pytest.approx(0.25)
    assert F.kl_loss(lp, ref, m, "seq-mean-token-sum").item() == pytest.approx(0.5)


def test_sequence_logprobs_hand():
    lp = t([[-1.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
    m = t([[1, 1, 0], [1, 1, 1]])
    assert_close(F.sequence_logprobs(lp, m, "seq-mean-token-sum"), t([-3.0, -1.5]))
    assert_close(F.sequence_logprobs(lp, m, "seq-mean-token-mean"), t([-1.5, -0.5]))
    assert_close(F.sequence_logprobs(lp, m, "seq-mean-token-sum-norm"), t([-1.0, -0.5]))
    with pytest.raises(ValueError, match="seq-mean"):
        F.sequence_logprobs(lp, m, "token-mean")


def test_dpo_loss_pair_mask_gives_masked_pairs_no_gradient():
    pc, pr, rc, rr = (t([-1.0, -2.0]).requires_grad_(), t([-3.0, -1.0]), t([-2.0, -1.0]), t([-2.5, -1.0]))
    loss, _, _ = F.dpo_loss(pc, pr, rc, rr, beta=0.1, pair_mask=torch.tensor([True, False]))
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.15)))  # pair0 alone (see test_dpo_loss_hand)
    loss.backward()
    assert pc.grad[1].item() == 0.0 and pc.grad[0].item() != 0.0
    none, _, _ = F.dpo_loss(pc, pr, rc, rr, beta=0.1, pair_mask=torch.tensor([False, False]))
    assert none.item() == 0.0


# --------------------------------------------------------------------- REINFORCE++
def test_discounted_returns_hand():
    # rewards [1, 2, 3 | pad 7], gamma 0.5: G2 = 3, G1 = 2 + 1.5 = 3.5, G0 = 1 + 1.75 = 2.75
    r = t([[1.0, 2.0, 3.0, 7.0]])
    m = t([[1, 1, 1, 0]])
    assert_close(F.discounted_returns(r, m, 0.5), t([[2.75, 3.5, 3.0, 0.0]]))
    assert_close(F.discounted_returns(r, m, 1.0), t([[6.0, 5.0, 3.0, 0.0]]))


def test_reinforce_pp_advantages_vs_loop(gen):
    """Against verl's backward loop (returns reset after each row's last token), then whitening."""
    b, T, gamma = 5, 6, 0.9
    rewards = torch.randn(b, T, generator=gen, dtype=D)
    mask = ragged_mask([6, 3, 1, 4, 5], T)
    returns = torch.zeros(b, T, dtype=D)
    for i in range(b):
        running = 0.0
        for j in reversed(range(T)):
            running = rewards[i, j].item() * mask[i, j].item() + gamma * running
            returns[i, j] = running if mask[i, j] else 0.0
            running = running * mask[i, j].item()
    adv, ret = F.reinforce_pp_advantages(rewards, mask, gamma)
    assert_close(ret, returns)
    vals = [returns[i, j].item() for i in range(b) for j in range(T) if mask[i, j]]
    mean, std = statistics.mean(vals), statistics.stdev(vals)
    expected = torch.where(mask, (returns - mean) / math.sqrt(std**2 + 1e-8), torch.zeros_like(returns))
    assert_close(adv, expected)


# --------------------------------------------------------------------- off-policy weights
def test_decoupled_importance_weights_hand_and_loop(gen):
    # pi_prox / mu = 0.5, 3 (above cap 2: dropped, not truncated), 1.5; padding 0
    beh = t([[0.0, 0.0, 0.0, -1e4]])
    prox = t([[math.log(0.5), math.log(3.0), math.log(1.5), 0.0]])
    m = t([[1, 1, 1, 0]])
    assert_close(F.decoupled_importance_weights(prox, beh, m, cap=2.0), t([[0.5, 0.0, 1.5, 0.0]]))
    assert_close(F.decoupled_importance_weights(prox, beh, m, cap=None), t([[0.5, 3.0, 1.5, 0.0]]))
    with pytest.raises(ValueError):
        F.decoupled_importance_weights(prox, beh, m, cap=0.0)
    prox, beh = torch.randn(2, 4, 5, generator=gen, dtype=D)
    m = ragged_mask([5, 0, 2, 4], 5)
    w = F.decoupled_importance_weights(prox, beh, m, cap=1.3)
    for i in range(4):
        for j in range(5):
            r = math.exp(prox[i, j].item() - beh[i, j].item())
            assert w[i, j].item() == pytest.approx(r if m[i, j] and r <= 1.3 else 0.0)


def test_truncated_importance_weights(gen):
    # ratios 0.5, 3 -> capped at 2, 1.5, padding -> 0 (even if its ratio overflows)
    beh = t([[0.0, 0.0, 0.0, -1e4]])
    lp = t([[math.log(0.5), math.log(3.0), math.log(1.5), 0.0]]).requires_grad_()
    m = t([[1, 1, 1, 0]])
    w = F.truncated_importance_weights(lp, beh, m, cap=2.0)
    assert_close(w, t([[0.5, 2.0, 1.5, 0.0]]))
    assert not w.requires_grad

    lp, beh = torch.randn(2, 4, 5, generator=gen, dtype=D)
    m = ragged_mask([5, 0, 2, 4], 5)
    w = F.truncated_importance_weights(lp, beh, m, cap=1.2)
    for i in range(4):
        for j in range(5):
            e = min(math.exp(lp[i, j].item() - beh[i, j].item()), 1.2) if m[i, j] else 0.0
            assert w[i, j].item() == pytest.approx(e)
    with pytest.raises(ValueError):
        F.truncated_importance_weights(lp, beh, m, cap=0.0)


def test_eos_penalty():
    # the middle completion never emitted EOS -> its 0.9 becomes -1; no penalty -> unchanged
    s = t([0.3, 0.9, -0.2])
    out = F.eos_penalty(s, torch.tensor([True, False, True]), -1.0)
    assert_close(out, t([0.3, -1.0, -0.2]))
    assert_close(F.eos_penalty(s, torch.tensor([True, False, True]), None), s)


# --------------------------------------------------------------------- data parallelism
@pytest.mark.parametrize("mode", F.LOSS_AGG_MODES)
def test_ranks_averaged_gradients_equal_the_global_batch_gradient(gen, mode):
    """Two ranks with unequal token counts: each divides its token sum by the global count over the
    world size (`tokens`), DDP averages their gradients, and the result is the one-process gradient of
    the whole mini-batch: a token-weighted (sample-weighted) mean. The mean of each rank's own token mean
    (rank-weighted) would differ. Sequence modes need nothing: the ranks hold equal numbers of sequences."""
    old = torch.randn(4, 6, generator=gen, dtype=D)
    adv = torch.randn(4, generator=gen, dtype=D)
    mask = ragged_mask([6, 5, 1, 2], 6)  # rank 0 holds rows 0-1 (11 tokens), rank 1 rows 2-3 (3 tokens)

    def grad(rows, tokens=None):
        lp = old.clone().requires_grad_()
        F.clipped_policy_loss(lp[rows], old[rows], adv[rows], mask[rows], 0.2, mode, tokens=tokens)[0].backward()
        return lp.grad

    whole = grad(slice(0, 4))
    world = 2
    tokens = float(mask.sum()) / world if mode == "token-mean" else None
    ddp = (grad(slice(0, 2), tokens) + grad(slice(2, 4), tokens)) / world
    assert_close(ddp, whole)
    if mode == "token-mean":
        rank_weighted = (grad(slice(0, 2)) + grad(slice(2, 4))) / world
        assert not torch.allclose(rank_weighted, whole)


def test_dpo_pairs_normaliser_makes_the_ranks_mean_the_global_mean():
    pc = t([-1.0, -2.0, -0.5, -3.0]).requires_grad_()
    pr, rc, rr = t([-3.0, -1.0, -2.0, -1.0]), t([-2.0, -1.0, -1.0, -2.0]), t([-2.5, -1.0, -1.5, -1.0])
    valid = torch.tensor([True, True, True, False])  # rank 1 has one trained pair, rank 0 two
    whole, _, _ = F.dpo_loss(pc, pr, rc, rr, 0.1, pair_mask=valid)
    halves = [F.dpo_loss(pc[s], pr[s], rc[s], rr[s], 0.1, pair_mask=valid[s], pairs=3 / 2)[0] for s in (slice(0, 2), slice(2, 4))]
    assert (halves[0] + halves[1]).item() / 2 == pytest.approx(whole.item())


def _whiten_rank(rank: int, x: torch.Tensor, mask: torch.Tensor) -> tuple[list, list]:
    """One of two gloo ranks: masked_whiten and REINFORCE++'s advantages of its half of the batch, with the
    statistics summed over both ranks (distributed.all_sum), as PPO's and REINFORCE++'s prepare() run them."""
    from rlhflab import distributed

    rows = slice(rank * len(x) // 2, (rank + 1) * len(x) // 2)
    whitened = F.masked_whiten(x[rows], mask[rows], total=distributed.all_sum)
    advantages, _ = F.reinforce_pp_advantages(x[rows], mask[rows], 0.9, total=distributed.all_sum)
    return whitened.tolist(), advantages.tolist()


def test_whitening_under_two_ranks_uses_the_global_batchs_statistics(tmp_path):
    """PPO's whiten_advantages and REINFORCE++ whitened over each rank's share of the batch (no collective), so
    the advantages differed from one process's on the same batch by up to ~1 and results depended on the number of
    ranks. Two real gloo ranks, each with half of an uneven batch, now give one process's values."""
    from conftest import on_two_gloo_ranks

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 6, generator=gen, dtype=torch.float64) * torch.arange(1, 9, dtype=torch.float64)[:, None]
    mask = (torch.arange(6)[None] < torch.tensor([6, 5, 1, 2, 6, 6, 6, 3])[:, None]).to(torch.float64)
    got = on_two_gloo_ranks(_whiten_rank, tmp_path / "store", x, mask)
    valid = mask.bool()
    whole = F.masked_whiten(x, mask)
    ranks = {k: torch.tensor([row for g in got for row in g[k]], dtype=torch.float64) for k in (0, 1)}
    assert_close(ranks[0][valid], whole[valid])
    assert_close(ranks[1], F.reinforce_pp_advantages(x, mask, 0.9)[0])
    per_rank = torch.cat([F.masked_whiten(x[:4], mask[:4]), F.masked_whiten(x[4:], mask[4:])])
    assert (per_rank[valid] - whole[valid]).abs().max() > 0.5  # what each rank alone gave
