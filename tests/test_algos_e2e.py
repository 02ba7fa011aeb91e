"""Every algorithm, through the one LightningModule, raises the gold reward on the embedded task."""

import multiprocessing
import os
import threading

import pytest
import torch
from mlflow.tracking import MlflowClient

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


def test_fastest_keeps_the_faster_of_thread_and_process_with_the_same_numbers():
    """mode.reference=fastest times generation and the pair (policy forward + reference beside it) with a forked process
    and with the thread taking turns, TRIAL + 1 steps each (each first step untimed), keeps the one whose median is
    lower (the process only where it is over MARGIN faster: it holds more memory), and ends the other; every result
    is the reference's own, whichever computed it."""
    from rlhflab.lit.reference import ReferenceFastest

    def reference(query, response, mask):
        return (query.float() * 2 + response.float()) * mask

    steps = 2 * (ReferenceFastest.TRIAL + 1) + 2
    level = 5.0 * (1 - ReferenceFastest.MARGIN)  # the process this much faster: level, the thread kept
    for ms, kept in (({"thread": 9.0, "process": 5.0}, "process"), ({"thread": 5.0, "process": 9.0}, "thread"),
                     ({"thread": 5.0, "process": level + 0.01}, "thread"),
                     ({"thread": 5.0, "process": level - 0.01}, "process")):
        worker, said = ReferenceFastest(reference), []
        try:
            for step in range(steps):
                rows = torch.full((2, 3), step), torch.arange(6).view(2, 3), torch.ones(2, 3)
                if worker.chosen is None:  # turns: the process first (it forks at the first step), then the thread
                    assert worker.worker.name == ("process", "thread")[step % 2], (kept, step)
                assert torch.equal(worker.submit(*rows)(), reference(*rows)), (kept, step, worker.worker.name)
                said.append(worker.observe(ms[worker.worker.name] / 1000))
        finally:
            worker.close()
        assert said == [None] * (2 * ReferenceFastest.TRIAL + 1) + [kept, None, None]
        assert worker.chosen == kept and worker.worker.name == kept
        assert not [t for t in threading.enumerate() if t.name.startswith("rlhflab-reference")]
        assert not [c for c in multiprocessing.active_children() if c.name == "rlhflab-reference"]


def test_auto_runs_fastest_and_learns_the_learners_numbers(make_cfg, tmp_path, caplog):
    """The default (mode.reference=auto = fastest here): process (sampling half of each batch: mode.split_generation),
    then thread, then the faster, in one run of online DPO: the weights and every metric as with the reference
    computed first and every row sampled by the learner, and the run says which it kept."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: no core is free for the reference")
    from rlhflab.lit.reference import ReferenceFastest

    steps = 2 * (ReferenceFastest.TRIAL + 1) + 1
    args = ["algo=online_dpo", f"trainer.max_steps={steps}"]
    with caplog.at_level("INFO"):
        fastest = train(make_cfg(*args, f"output.dir={tmp_path / 'fastest'}"))
    learner = train(make_cfg(*args, "mode.reference=learner", f"output.dir={tmp_path / 'learner'}"))
    assert fastest.module.source.reference == "fastest" and fastest.module.reference_beside_update
    a, b = fastest.module.memory.policy.parameters(), learner.module.memory.policy.parameters()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert {k: v for k, v in fastest.metrics.items() if not k.startswith("perf/")} == \
        {k: v for k, v in learner.metrics.items() if not k.startswith("perf/")}
    kept = MlflowClient(make_cfg().logger.tracking_uri).get_run(fastest.run_id).data.params["rlhflab.reference_kept"]
    assert kept in ("thread", "process")
    assert f"a forked process (medians of {ReferenceFastest.TRIAL} steps each): the {kept} from here" in caplog.text
    assert "the reference's process samples the last rows of each batch" in caplog.text
    assert not [c for c in multiprocessing.active_children() if c.name == "rlhflab-reference"]


@pytest.mark.parametrize("algo, precision", [("rloo", "32-true"), ("grpo", "32-true"), ("online_dpo", "32-true"),
                                             ("rloo", "bf16-mixed")])
def test_reference_in_a_thread_or_a_process_gives_the_learners_numbers(make_cfg, tmp_path, caplog, algo, precision):
    """mode=sync mode.reference=thread / process runs the reference forward beside the update's policy forward
    (in a second thread / a forked process, which also samples half of each batch from step 2 on:
    mode.split_generation): the same losses, KLs and weights as computing it first (bit for bit: the same forwards,
    the same order, the same draws), under autocast too (per thread: the thread must be handed it). Under bf16-mixed
    every sampling, the evaluations' too, is generate()'s under autocast, which no process splits."""
    results = {}
    for where in ("learner", "thread", "process"):
        caplog.clear()
        with caplog.at_level("INFO", logger="rlhflab.rollout.hf"):
            results[where] = train(make_cfg(f"algo={algo}", "trainer.max_steps=3", f"mode.reference={where}",
                                            f"trainer.precision={precision}", f"output.dir={tmp_path / where}"))
        split = "the reference's process samples the last rows of each batch" in caplog.text
        assert split == (where == "process" and precision == "32-true"), where
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
