"""The registry's algorithms on hand-made batches: targets, losses, and the audit's defects (issue 10)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from rlhflab.algos import functional as F
from rlhflab.algos.carriers import Experience, Scored, Targets
from rlhflab.algos.registry import ALGORITHMS, GRPO, PPO, RLOO, DrGRPO, OnlineDPO, ReinforcePP, ReMax
from rlhflab.errors import ConfigError
from rlhflab.rewards.builtin import RuleReward, score_rollout
from rlhflab.rollout.batch import Rollout
from rlhflab.tasks.sentiment import SentimentTask


def scored(scores, k=2, R=3, seed=0, baseline=None, values=False):
    """A batch of len(scores) completions with random log-probs and ragged masks."""
    g = torch.Generator().manual_seed(seed)
    n = len(scores)
    lengths = torch.randint(1, R + 1, (n,), generator=g)
    mask = (torch.arange(R)[None, :] < lengths[:, None]).float()
    old = -torch.rand(n, R, generator=g) * mask
    ref = -torch.rand(n, R, generator=g) * mask
    v = torch.randn(n, R, generator=g) if values else None
    return Scored(torch.tensor(scores, dtype=torch.float32), old, ref, mask, v, baseline)


def experience(s: Scored, targets: Targets, weights=None) -> Experience:
    n, R = s.response_mask.shape
    return Experience(torch.zeros(n, 2, dtype=torch.long), torch.zeros(n, R, dtype=torch.long), s.response_mask,
                      s.old_logprobs, s.ref_logprobs, targets, weights)


# ---- defect 1: ReMax with k samples per prompt subtracts each prompt's greedy score from all k

def test_remax_repeats_the_greedy_baseline_over_k_samples():
    s = scored([1.0, 0.0, 2.0, 4.0], baseline=torch.tensor([0.5, 3.0]))
    algo = ReMax(samples_per_prompt=2, kl_coef=0.0)
    targets, metrics = algo.prepare(s)
    assert_close(targets.advantages, torch.tensor([0.5, -0.5, -1.0, 1.0]))
    assert metrics["train/greedy_reward"].item() == pytest.approx(1.75)


# ---- defect 2: the greedy completion is scored by the same reward function as the samples

def test_greedy_baseline_gets_the_eos_penalty_like_the_samples():
    task = SentimentTask(response_words=2)
    tok = task.build_tokenizer()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    good = tok.convert_tokens_to_ids("good")
    response = torch.tensor([[good, eos, pad], [good, good, good]])  # the second never ends
    greedy = torch.tensor([[good, good, good]])  # runs past the budget too
    rollout = Rollout(query=torch.zeros(2, 1, dtype=torch.long), response=response, response_mask=torch.ones(2, 3),
                      logprobs=torch.zeros(2, 3), version=0, prompts=["p", "p"], texts=["good", "good good good"],
                      baseline_response=greedy, baseline_texts=["good good good"])
    scores, baseline = score_rollout(RuleReward(), None, task, rollout, eos, -1.0, greedy_baseline=True)
    assert scores.tolist() == [0.5, -1.0]
    assert baseline.tolist() == [-1.0]  # not the raw 1.0 the rule gives its first two words
    _, unpenalised = score_rollout(RuleReward(), None, task, rollout, eos, None, greedy_baseline=True)
    assert unpenalised.tolist() == [1.0]


# ---- defect 3: algo.kl_estimator chooses the logged train/kl for every algorithm

@pytest.mark.parametrize("cls", [GRPO, OnlineDPO, RLOO])
def test_kl_estimator_selects_the_logged_kl(cls):
    s = scored([1.0, 0.0, 2.0, 4.0])
    logged = {kind: float(cls(samples_per_prompt=2, kl_estimator=kind).prepare(s)[1]["train/kl"]) for kind in F.KL_KINDS}
    for kind, value in logged.items():
        expected = F.masked_sum(F.kl_penalty(s.old_logprobs, s.ref_logprobs, kind), s.response_mask, dim=1).mean()
        assert value == pytest.approx(float(expected))
    assert len(set(logged.values())) == 3


# ---- defect 4: online DPO's tied pairs

def test_online_dpo_skips_tied_groups_and_logs_their_fraction():
    # group 0 has a preference (2 > 0); group 1 is tied (1 == 1)
    s = scored([2.0, 0.0, 1.0, 1.0])
    skip, keep = OnlineDPO(ties="skip"), OnlineDPO(ties="keep")
    t_skip, m_skip = skip.prepare(s)
    t_keep, _ = keep.prepare(s)
    assert t_skip.pair_sign.tolist() == [1.0, -1.0, 0.0, 0.0]
    assert t_keep.pair_sign.tolist() == [1.0, -1.0, 1.0, -1.0]
    assert m_skip["train/tie_frac"].item() == 0.5
    grads = {}
    for algo, targets in ((skip, t_skip), (keep, t_keep)):
        logprobs = s.old_logprobs.clone().requires_grad_()
        loss, _ = algo.loss(logprobs, None, experience(s, targets))
        loss.backward()
        grads[algo.ties] = logprobs.grad
    assert grads["skip"][2:].abs().sum() == 0 and grads["skip"][:2].abs().sum() > 0
    assert grads["keep"][2:].abs().sum() > 0


def test_online_dpo_with_every_group_tied_has_zero_loss():
    s = scored([1.0, 1.0, 0.0, 0.0])
    targets, metrics = OnlineDPO().prepare(s)
    loss, _ = OnlineDPO().loss(s.old_logprobs.clone().requires_grad_(), None, experience(s, targets))
    assert loss.item() == 0.0 and metrics["train/tie_frac"].item() == 1.0


# ---- defect 7: one name, one meaning

@pytest.mark.parametrize("cls, coefficient", [(RLOO, "kl_coef"), (ReMax, "kl_coef"), (PPO, "kl_coef"), (ReinforcePP, "kl_coef"),
                                               (GRPO, "kl_loss_coef"), (DrGRPO, "kl_loss_coef"), (OnlineDPO, "beta")])
def test_each_kl_weight_is_named_for_what_it_is(cls, coefficient):
    import inspect

    params = inspect.signature(cls).parameters
    assert coefficient in params
    assert {"kl_coef", "kl_loss_coef", "beta"} & set(params) == {coefficient}


# ---- loss aggregation is a setting

def test_loss_agg_is_an_option_of_every_algorithm_and_checked():
    for name, cls in ALGORITHMS.items():
        algo = cls()
        assert algo.loss_agg in algo.loss_agg_modes, name
    with pytest.raises(ConfigError, match=r"^algo.loss_agg='token-mean': online_dpo takes one of seq-mean"):
        OnlineDPO(loss_agg="token-mean")
    with pytest.raises(ConfigError, match=r"^algo.loss_agg='mean'"):
        RLOO(loss_agg="mean")


def test_defaults_are_the_papers_aggregations():
    assert {n: c().loss_agg for n, c in ALGORITHMS.items()} == {
        "ppo": "token-mean", "rloo": "seq-mean-token-sum", "remax": "seq-mean-token-sum", "online_dpo": "seq-mean-token-sum",
        "grpo": "seq-mean-token-mean", "dr_grpo": "token-mean", "reinforce_pp": "token-mean",
    }


# ---- the new algorithms

def test_reinforce_pp_targets_are_whitened_returns_of_kl_penalised_token_rewards():
    s = scored([1.0, -1.0, 0.5, 0.0], R=4)
    algo = ReinforcePP(samples_per_prompt=2, kl_coef=0.1, kl_estimator="k2")
    targets, metrics = algo.prepare(s)
    rewards = F.token_level_rewards(s.scores, s.old_logprobs, s.ref_logprobs, s.response_mask, 0.1, "k2")
    returns = rewards.flip(1).cumsum(1).flip(1) * s.response_mask  # gamma 1: plain reward-to-go
    expected = F.masked_whiten(returns, s.response_mask) * s.response_mask
    assert_close(targets.advantages, expected)
    assert F.masked_mean(targets.advantages, s.response_mask).abs() < 1e-6  # whitened over the batch
    logprobs = s.old_logprobs.clone().requires_grad_()
    loss, m = algo.loss(logprobs, None, experience(s, targets))
    loss.backward()
    # ratio 1, token-mean: d/d logprobs = -A / (valid tokens)
    assert_close(logprobs.grad, -targets.advantages / s.response_mask.sum())


def test_dr_grpo_is_grpo_without_std_and_with_token_mean():
    s = scored([1.0, 3.0, 0.0, 0.0, 2.0, 5.0], k=3, R=4)
    dr, grpo = DrGRPO(samples_per_prompt=3), GRPO(samples_per_prompt=3)
    assert_close(dr.prepare(s)[0].advantages, torch.tensor([-1 / 3, 5 / 3, -4 / 3, -7 / 3, -1 / 3, 8 / 3]))
    assert not torch.allclose(grpo.prepare(s)[0].advantages, dr.prepare(s)[0].advantages)
    targets = dr.prepare(s)[0]
    lp = s.old_logprobs.clone().requires_grad_()
    dr.loss(lp, None, experience(s, targets))[0].backward()
    # the same loss from the pure functions: token-mean policy term + kl_loss_coef x token-mean k3
    lp2 = s.old_logprobs.clone().requires_grad_()
    pg, _, _ = F.clipped_policy_loss(lp2, s.old_logprobs, targets.advantages, s.response_mask, 0.2, "token-mean")
    (pg + 0.04 * F.kl_loss(lp2, s.ref_logprobs, s.response_mask, "token-mean")).backward()
    assert_close(lp.grad, lp2.grad)


def test_importance_weights_reach_the_loss():
    s = scored([1.0, 0.0, 2.0, 4.0])
    algo = RLOO(samples_per_prompt=2)
    targets, _ = algo.prepare(s)
    plain = algo.loss(s.old_logprobs.clone(), None, experience(s, targets))[0]
    zero = algo.loss(s.old_logprobs.clone(), None, experience(s, targets, torch.zeros_like(s.old_logprobs)))[0]
    assert plain.item() != 0.0 and zero.item() == 0.0


def test_experience_select_slices_every_field():
    s = scored([1.0, 0.0, 2.0, 4.0], values=True)
    targets, _ = PPO(num_minibatches=1).prepare(s)
    exp = experience(s, targets, torch.ones_like(s.old_logprobs))
    part = exp.select(torch.tensor([3, 1]))
    assert len(part) == 2
    assert_close(part.targets.returns, targets.returns[[3, 1]])
    assert_close(part.is_weights, torch.ones(2, s.old_logprobs.shape[1]))
    assert part.targets.pair_sign is None
