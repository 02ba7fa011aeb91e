"""Every algorithm, through the one LightningModule, raises the gold reward on the embedded task."""

import multiprocessing
import threading

import pytest
import torch

from rlhflab.algos.registry import ALGORITHMS
from rlhflab.train import train


@pytest.mark.slow
@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
def test_algorithm_raises_gold_reward(make_cfg, algo):
    result = train(make_cfg(f"algo={algo}", "trainer.max_steps=80"))
    before, after = result.metrics["eval/gold_reward_before"], result.metrics["eval/gold_reward"]
    assert after > before + 0.15, (algo, before, after)


@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
def test_algorithm_updates_only_what_it_trains(make_cfg, algo):
    """Two steps: the policy moves, the reference and reward model do not (and values only for PPO)."""
    cfg = make_cfg(f"algo={algo}", "trainer.max_steps=2")
    result = train(cfg)
    memory = result.module.memory
    moved = [not torch.equal(p, r) for p, r in zip(memory.policy.parameters(), memory.reference.parameters())]
    assert any(moved)
    assert all(not p.requires_grad for p in memory.reference.parameters())
    assert all(not p.requires_grad for p in memory.reward_model.parameters())
    assert (memory.value_model is not None) == ALGORITHMS[algo].needs_values


def test_remax_takes_several_samples_per_prompt(make_cfg):
    """Each prompt's greedy score is the baseline of all its k samples (it crashed with k=2)."""
    result = train(make_cfg("algo=remax", "algo.samples_per_prompt=2", "trainer.max_steps=2"))
    assert result.module.policy_version == 2


@pytest.mark.parametrize("algo, precision", [("rloo", "32-true"), ("grpo", "32-true"), ("online_dpo", "32-true"),
                                             ("rloo", "bf16-mixed")])
def test_reference_in_a_thread_or_a_process_gives_the_learners_numbers(make_cfg, tmp_path, algo, precision):
    """mode=sync mode.reference=thread / process runs the reference forward beside the update's policy forward
    (in a second thread / a forked process): the same losses, KLs and weights as computing it first (bit for bit:
    the same forwards, the same order), under autocast too (per thread: the thread must be handed it)."""
    results = {where: train(make_cfg(f"algo={algo}", "trainer.max_steps=3", f"mode.reference={where}",
                                     f"trainer.precision={precision}", f"output.dir={tmp_path / where}"))
               for where in ("learner", "thread", "process")}
    assert not results["learner"].module.reference_beside_update
    assert results["thread"].module.reference_beside_update and results["process"].module.reference_beside_update
    learner = results["learner"].module.memory
    learned = {w: {k: v for k, v in r.metrics.items() if not k.startswith("perf/")} for w, r in results.items()}
    for where in ("thread", "process"):
        beside = results[where].module.memory
        assert all(torch.equal(a, b) for a, b in zip(learner.policy.parameters(), beside.policy.parameters())), where
        assert learned["learner"] == learned[where], where
    assert learned["learner"]["eval/kl"] > 0  # the reference is in the numbers
    assert not [t for t in threading.enumerate() if t.name.startswith("rlhflab-reference")]  # each ended with its run
    assert not [c for c in multiprocessing.active_children() if c.name == "rlhflab-reference"]
