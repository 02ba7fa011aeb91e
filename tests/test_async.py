"""mode=async: exact staleness, sync equivalence at N=0, fast failure, no orphans."""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from mlflow.tracking import MlflowClient

from conftest import SHRINK, cli_run, wait_for
from rlhflab.rollout.async_source import GeneratorCrashed, required_version
from rlhflab.rollout.hf import HFGenerator
from rlhflab.train import train


def live_children():
    """Child processes, less multiprocessing's resource tracker (spawn starts one for the process's life)."""
    return [c for c in psutil.Process().children(recursive=True) if "resource_tracker" not in " ".join(c.cmdline())]


def history(cfg, run_id, key):
    return [m.value for m in sorted(MlflowClient(cfg.logger.tracking_uri).get_metric_history(run_id, key), key=lambda m: m.step)]


def test_required_version_by_hand():
    # N=2, weights every update: batches 0,1,2 from version 0, then batch i from i-2.
    assert [required_version(i, 2, 1) for i in range(6)] == [0, 0, 0, 1, 2, 3]
    # N=1, weights every 2 updates: the newest pushed version (even) at or before i-1.
    assert [required_version(i, 1, 2) for i in range(6)] == [0, 0, 0, 2, 2, 4]


@pytest.mark.parametrize("staleness, sync_every", [(0, 1), (1, 1), (2, 1), (4, 1), (1, 2), (3, 2), (2, 3)])
def test_a_weight_slot_is_never_rewritten_before_the_generator_reads_it(staleness, sync_every):
    """When the generator starts batch j (reading version need = required_version(j)), the learner may
    have pushed every version up to j (its step j waits for batch j): none of those after `need` may
    have gone into need's slot."""
    import torch

    from rlhflab.rollout.async_source import SharedWeights

    ring = SharedWeights(torch.nn.Linear(2, 2), staleness, sync_every)
    for j in range(40):
        need = required_version(j, staleness, sync_every)
        pushed_since = [v for v in range(need + 1, j + 1) if v % sync_every == 0]
        assert all(ring.slot(v) != ring.slot(need) for v in pushed_since), (j, need, pushed_since)


def _double_in_child(block) -> None:
    import torch

    block.tensors["w"].mul_(2)
    block.tensors["h"].mul_(2)
    block.tensors["b"].copy_(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))


@pytest.mark.parametrize("memfd", [True, False], ids=["memfd", "no-memfd"])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_shared_block_is_one_memory_in_both_processes(method, memfd, monkeypatch):
    """SharedWeights' ring (and so every push to a spawned generator, or to one at staleness 2+) lives in a memfd:
    what either process writes, the other reads, whether the block was inherited (fork) or pickled (spawn). Without
    memfd_create (not Linux) in torch's shared memory."""
    import multiprocessing

    import torch

    from rlhflab.shm import SharedBlock

    if not memfd:
        monkeypatch.delattr(os, "memfd_create")

    block = SharedBlock({"w": ((2, 3), torch.float32), "h": ((5,), torch.bfloat16), "b": ((3,), torch.float64)})
    assert all(not t.any() for t in block.tensors.values())
    ends = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in block.tensors.values())
    assert all(end <= start for (_, end), (start, _) in zip(ends, ends[1:]))  # no tensor overlaps the next
    block.tensors["w"].copy_(torch.arange(6.0).view(2, 3))
    block.tensors["h"].fill_(1.5)
    child = multiprocessing.get_context(method).Process(target=_double_in_child, args=(block,))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0
    assert (block.fd is not None) == memfd
    assert block.tensors["w"].tolist() == (2 * torch.arange(6.0)).view(2, 3).tolist()
    assert block.tensors["h"].tolist() == [3.0] * 5
    assert block.tensors["b"].tolist() == [1.0, 2.0, 3.0]


SMALL_SHM = r"""
import json, sys
from mlflow.tracking import MlflowClient
from omegaconf import open_dict
from conftest import compose_cfg
from rlhflab.rollout.async_source import AsyncSource
from rlhflab.train import train

if __name__ == "__main__":  # spawn imports this file again in its process
    cache, tmp = sys.argv[1], sys.argv[2]
    weights = []  # which way each run's pushes went

    def start(self, *args, **kwargs):
        started(self, *args, **kwargs)
        weights.append(type(self.weights).__name__)

    started, AsyncSource.start = AsyncSource.start, start
    out = {}
    for name, extra in (("fork", []), ("spawn", ["mode.start_method=spawn"])):
        cfg = compose_cfg([f"cache_dir={cache}", "mode=async", "staleness=1", "trainer.max_steps=4", *extra])
        with open_dict(cfg):
            cfg.logger.tracking_uri, cfg.output.dir = f"sqlite:///{tmp}/mlflow.db", f"{tmp}/{name}"
        run_id = train(cfg).run_id
        client = MlflowClient(cfg.logger.tracking_uri)
        out[name] = {k: [m.value for m in sorted(client.get_metric_history(run_id, k), key=lambda m: m.step)]
                     for k in ("train/reward", "train/kl", "train/loss", "rollout/staleness")}
    out["weights"] = weights
    print(json.dumps(out))
"""


def test_async_runs_in_a_small_dev_shm_as_in_a_large_one(make_cfg, stage_cache, tmp_path):
    """In a 256 KB /dev/shm (a private mount, as a container's small one; the default policy's trainable parameters
    are 0.35 MB): at staleness 1 the forked generator reads pushes from the learner's parameters, moved into a memfd;
    a spawned one gets the policy through a memfd and pushes through the ring, in memfds too. Both give the numbers of
    a run with room (torch raised 'No space left on device' at the first share_memory_ before)."""
    if os.geteuid() != 0 or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs root and unshare -m, to mount a small /dev/shm of its own")
    cfg = make_cfg("mode=async", "staleness=1", "trainer.max_steps=4")
    run_id = train(cfg).run_id
    roomy = {k: history(cfg, run_id, k) for k in ("train/reward", "train/kl", "train/loss", "rollout/staleness")}
    script = tmp_path / "small_shm.py"
    script.write_text(SMALL_SHM)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=256k tmpfs /dev/shm && "
                           f"exec {sys.executable} {script} {stage_cache} {tmp_path}"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["fork"] == roomy
    for key, values in roomy.items():
        assert out["spawn"][key] == pytest.approx(values, abs=1e-6), key
    assert out["weights"] == ["LearnerWeights", "SharedWeights"]  # fork at staleness 1, spawn


def test_weights_come_from_the_learners_parameters_only_where_that_cannot_stall_it():
    """LearnerWeights (no host copy of the policy) for a forked CPU generator at staleness 0 or 1; else the ring."""
    import torch

    from rlhflab.rollout.async_source import LearnerWeights

    model = torch.nn.Linear(2, 2)
    assert LearnerWeights.fits(model, 1, "fork", None) and LearnerWeights.fits(model, 0, "fork", None)
    assert not LearnerWeights.fits(model, 2, "fork", None)  # v is read N - 1 batches after the learner steps past it
    assert not LearnerWeights.fits(model, 1, "spawn", None)  # a spawned process shares none of the learner's memory
    assert not LearnerWeights.fits(model, 1, "fork", "cpu")  # mode.device: the ring, as for a GPU


def test_a_generator_killed_holding_the_copied_versions_lock_fails_the_learner_fast():
    """`LearnerWeights.copied` is a locked shared value the generator stores into after each copy. A generator killed
    while it held that lock left the lock taken: the learner's wait for the copy (`hold`) blocked on it for ever
    instead of noticing the death within a poll interval."""
    import multiprocessing
    import os
    import threading

    import torch

    from rlhflab.rollout.async_source import LearnerWeights

    ctx = multiprocessing.get_context("fork")
    weights = LearnerWeights(torch.nn.Linear(2, 2), ctx)
    weights.write(None, 0)  # the learner pushed version 0, which the generator has not copied

    def die_holding_the_lock():
        weights.copied.get_lock().acquire()
        os._exit(0)

    generator = ctx.Process(target=die_holding_the_lock)
    generator.start()
    generator.join()

    def alive():
        if not generator.is_alive():
            raise GeneratorCrashed("generator process died")

    failed = []

    def learner():
        try:
            weights.hold(alive)
        except GeneratorCrashed as err:
            failed.append(err)

    thread = threading.Thread(target=learner, daemon=True)  # daemon: without the fix it never returns
    thread.start()
    thread.join(timeout=60)
    assert failed, "the learner's hold() still waits on the lock its dead generator took"


def test_a_generator_reading_the_learners_parameters_gets_the_pushed_version(make_cfg, tmp_path, monkeypatch):
    """At staleness 1 the generator copies version v from the learner's own parameters while the learner trains
    batch v: the learner's optimizer step waits for that copy (hold_weights). Here each copy is made to start only
    once the learner is at that wait, the latest a copy can come: the numbers are still those of the ring of copies
    (SharedWeights), bit for bit. Without the wait the learner's step lands first and the generator samples from
    the weights one update on (the copy gives up waiting for the learner after 60 s)."""
    import multiprocessing

    from rlhflab.rollout import async_source

    def run(name):
        cfg = make_cfg("mode=async", "staleness=1", "trainer.max_steps=5", f"output.dir={tmp_path / name}")
        result = train(cfg)
        return {k: history(cfg, result.run_id, k) for k in ("train/reward", "train/kl", "train/loss", "rollout/staleness")}

    with monkeypatch.context() as m:
        m.setattr(async_source.LearnerWeights, "fits", staticmethod(lambda *args: False))
        ring = run("ring")

    at_hold, copies = multiprocessing.get_context("fork").Event(), multiprocessing.get_context("fork").Value("i", 0)
    hold, read = async_source.LearnerWeights.hold, async_source.LearnerWeights.read

    def late_read(self, slot, params, version):  # in the generator
        at_hold.wait(timeout=60)
        at_hold.clear()
        read(self, slot, params, version)
        with copies.get_lock():
            copies.value += 1

    def announced_hold(self, alive):  # in the learner
        if self.copied.value < self.pushed:
            at_hold.set()
        hold(self, alive)

    def waking_close(self):  # the learner's last push has no step after it to wait for its copy
        at_hold.set()
        close(self)

    close = async_source.AsyncSource.close
    monkeypatch.setattr(async_source.LearnerWeights, "read", late_read)
    monkeypatch.setattr(async_source.LearnerWeights, "hold", announced_hold)
    monkeypatch.setattr(async_source.AsyncSource, "close", waking_close)
    direct = run("direct")
    assert copies.value >= 3  # versions 1, 2, 3 for batches 2, 3, 4 (the generator may make batches nobody trains on)
    assert direct == ring
    assert direct["rollout/staleness"] == [0.0, 1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("n", [1, 2])
def test_staleness_is_exactly_n_after_warmup(make_cfg, n):
    cfg = make_cfg("mode=async", f"staleness={n}", "trainer.max_steps=8")
    result = train(cfg)
    seen = history(cfg, result.run_id, "rollout/staleness")
    assert seen == [float(min(i, n)) for i in range(8)]
    assert MlflowClient(cfg.logger.tracking_uri).get_run(result.run_id).data.tags["staleness"] == str(n)


def test_prompt_streams_stay_aligned_across_epochs(make_cfg):
    # 32 prompts, 16 per step: an epoch every 2 steps; the learner checks every batch's prompts.
    cfg = make_cfg("mode=async", "staleness=1", "task.num_train_prompts=32", "trainer.max_steps=7")
    assert train(cfg).module.policy_version == 7


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_async_with_zero_staleness_equals_sync(make_cfg, precision):
    """Also under autocast, which sync mode generates in (inside the training step): the forked generator
    enters the learner's (before, it sampled other completions at step 4 and its KL at step 1 was -8e-5, not 0).
    Both sides take the old log-probs from the learner's forward (off_policy=recompute): sync's default, the
    sampler's own, comes from cached one-token decoding, which under bf16 autocast differs from a whole-sequence
    forward by ~3e-5 per token on some machines (this one on 2026-11-25, an AMD EPYC: KL 0.0442 against 0.0445
    at step 4, though the same code passed the day before)."""
    sync = make_cfg("off_policy=recompute", "trainer.max_steps=6", f"trainer.precision={precision}")
    asyn = make_cfg("mode=async", "staleness=0", "off_policy=recompute", "trainer.max_steps=6", f"trainer.precision={precision}")
    a, b = train(sync), train(asyn)
    for key in ("train/reward", "train/kl", "train/loss"):
        assert history(sync, a.run_id, key) == pytest.approx(history(asyn, b.run_id, key), rel=1e-5, abs=1e-6), key


class CrashingGenerator(HFGenerator):
    """A real generator that fails on its third batch, inside the generator process."""

    calls = 0

    def generate(self, *args, **kwargs):
        type(self).calls += 1
        if type(self).calls == 3:
            raise RuntimeError("generator exploded on purpose")
        return super().generate(*args, **kwargs)


def test_generator_exception_fails_the_run_fast_with_its_traceback(make_cfg):
    cfg = make_cfg("mode=async", "trainer.max_steps=50", "generator._target_=test_async.CrashingGenerator")
    start = time.perf_counter()
    with pytest.raises(GeneratorCrashed, match="generator exploded on purpose") as err:
        train(cfg)
    assert "Traceback" in str(err.value)
    assert time.perf_counter() - start < 60
    assert not live_children()  # the generator was reaped


def test_a_generator_that_fails_on_its_way_to_its_device_says_why(make_cfg, monkeypatch):
    """The generator process moved its policy to mode.device before the part that sends errors to the learner: a GPU
    out of memory there (or a device torch cannot read) ended the run with 'died (exit code 1) without a traceback'."""
    from rlhflab.rollout import async_source

    def out_of_memory(device):
        raise RuntimeError("CUDA out of memory, on purpose")

    monkeypatch.setattr(async_source, "pin_cuda_device", out_of_memory)  # the forked generator inherits it
    with pytest.raises(GeneratorCrashed, match="CUDA out of memory, on purpose"):
        train(make_cfg("mode=async", "mode.device=cpu", "trainer.max_steps=4"))
    assert not live_children()


@pytest.mark.slow
def test_killed_generator_fails_fast_and_leaves_nothing(tmp_path, stage_cache):
    # PYTHONFAULTHANDLER: a learner that outlives its generator is sent SIGABRT, which prints every thread's stack.
    env = {"RLHFLAB_CACHE": str(stage_cache), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/m.db", "PYTHONFAULTHANDLER": "1"}
    out = tmp_path / "run"
    with cli_run([*SHRINK, "mode=async", "trainer.max_steps=100000", f"output.dir={out}", f"hydra.run.dir={out}"],
                 tmp_path, env) as proc:
        wait_for(lambda: (out / "train.log").exists() and "eval after 0 RL steps" in (out / "train.log").read_text(),
                 300, "the RL stage", proc)
        (child,) = [c for c in psutil.Process(proc.pid).children() if "resource_tracker" not in " ".join(c.cmdline())]
        child.kill()
        killed = time.time()
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            proc.wait(timeout=30)
            pytest.fail(f"the learner still ran 60 s after its generator was killed; its output and stacks:\n"
                        f"{proc.stdout.read()[-8000:]}")
        output = proc.stdout.read()
    assert rc == 1
    assert time.time() - killed < 15
    assert "generator process died (exit code -9)" in output
    assert MlflowClient(env["MLFLOW_TRACKING_URI"]).search_runs(["1"])[0].info.status == "FAILED"


def test_only_the_adapter_travels_under_lora(make_cfg):
    from rlhflab.rollout.async_source import trainable_state

    lora = train(make_cfg("memory=lora", "mode=async", "trainer.max_steps=2")).module.memory.generation_model
    sent = trainable_state(lora)
    assert sent and all("lora_" in name for name in sent)
    total = sum(p.numel() for p in lora.parameters())
    assert sum(t.numel() for t in sent.values()) < 0.5 * total


def test_the_generator_stops_by_itself_when_the_batch_it_queued_ahead_is_never_read(make_cfg, caplog):
    """With staleness 1 the generator has made one batch more than the run reads. A rollout larger than a pipe's
    buffer (64 KiB; here 64 prompts x 4 samples x 32 tokens) once kept its queue's feeder thread, and so the
    process, from exiting: close() waited 2 s, then its SIGTERM met the learner's handler, inherited by the fork."""

    cfg = make_cfg("mode=async", "staleness=1", "trainer.max_steps=2", "algo=rloo", "algo.samples_per_prompt=4",
                   "rl.prompts_per_step=64", "generator.max_new_tokens=32", "rl.eos_penalty=null")
    with caplog.at_level(logging.WARNING, logger="rlhflab"):
        train(cfg)
    assert not [r.getMessage() for r in caplog.records if "did not stop" in r.getMessage()]
    assert not live_children()


@pytest.mark.parametrize("correction", ["tis off_policy.cap=1.5", "decoupled"])
def test_importance_weighted_corrections_run_and_learn(make_cfg, correction):
    name, *settings = correction.split()
    cfg = make_cfg("mode=async", "staleness=2", f"off_policy={name}", *settings, "trainer.max_steps=30")
    result = train(cfg)
    assert result.metrics["eval/gold_reward"] > result.metrics["eval/gold_reward_before"]
    history_keys = MlflowClient(cfg.logger.tracking_uri).get_run(result.run_id).data.metrics
    assert "off_policy/weight_mean" in history_keys


@pytest.mark.parametrize("memory", ["full", "lora"])
def test_reference_in_the_generator_matches_the_learners(make_cfg, memory, caplog):
    """mode.reference=generator moves the reference forward into the (forked) generator: the same numbers, bit for
    bit (in float32, so without bf16's warning). balance splits each batch's rows between the two, where the split
    follows timings, and its reference runs every row's own forward (`split_reference`), not the shared-prompt one
    the other places run: within float32's rounding of theirs (its splits bit for bit: the test below and
    tests/test_rollout.py)."""
    places = ("learner", "generator", "balance")
    runs = {where: make_cfg(f"memory={memory}", "mode=async", "staleness=1", "trainer.max_steps=4", f"mode.reference={where}")
            for where in places}
    with caplog.at_level(logging.WARNING, logger="rlhflab"):
        results = {where: train(cfg) for where, cfg in runs.items()}
    assert not [r for r in caplog.records if "not bit for bit" in r.getMessage()]
    assert [results[where].module.memory.split_reference for where in places] == [False, False, True]
    for key in ("train/kl", "train/loss", "train/reward"):
        learner, generator, balance = (history(runs[w], results[w].run_id, key) for w in places)
        assert len(learner) == 4 and learner == generator, key
        assert balance == pytest.approx(learner, rel=1e-4, abs=1e-6), key
    assert history(runs["learner"], results["learner"].run_id, "train/kl")[-1] != 0.0  # the reference is in the numbers
    split = history(runs["balance"], results["balance"].run_id, "perf/ref_rows_generator")
    assert len(split) == 4 and split[0] == 0.5 and all(0 <= s <= 1 for s in split)  # half until both sides reported
    assert not live_children()


@pytest.mark.parametrize("override, why", [("trainer.precision=bf16-mixed", "under bfloat16 autocast"),
                                            ("mode.learner_threads=2", "with 2 torch threads on a side")])
def test_balance_says_where_its_numbers_follow_the_split(make_cfg, caplog, override, why):
    """Under bf16 autocast, or with more than one thread on a side, a row's numbers in a forward can depend on how
    many rows it holds (tests/test_rollout.py), so balance's timed split reaches the reference log-probs: the run
    says so once, as it starts, and runs."""
    cfg = make_cfg("mode=async", "staleness=1", "trainer.max_steps=2", "mode.reference=balance", override)
    with caplog.at_level(logging.WARNING, logger="rlhflab"):
        run_id = train(cfg).run_id
    said = [r.getMessage() for r in caplog.records if "not bit for bit" in r.getMessage()]
    assert said == [f"mode.reference=balance {why}: a row's reference log-probs can move in their last bits with where "
                    "the timed split cuts the batch, so runs are not bit for bit repeatable; mode.reference=generator "
                    "or learner are"]
    assert len(history(cfg, run_id, "perf/ref_rows_generator")) == 2
    assert not live_children()


def test_a_split_that_leaves_either_side_no_rows_gives_the_same_numbers(make_cfg, monkeypatch):
    """balance with every row in the learner (the generator sends an empty (0, R) block; a forward over no rows
    would fail), with every row in the generator (the learner adds none) and cut between: the same numbers."""
    from rlhflab.rollout.async_source import ReferenceSplit

    runs = {}
    for share in (0.0, 1.0, 0.4):
        monkeypatch.setattr(ReferenceSplit, "rows", lambda self, n, share=share: int(share * n))  # forked: the child's too
        cfg = make_cfg("mode=async", "staleness=1", "trainer.max_steps=3", "mode.reference=balance")
        run_id = train(cfg).run_id
        assert history(cfg, run_id, "perf/ref_rows_generator") == pytest.approx([share] * 3, abs=0.02)  # m / n, m whole
        runs[share] = history(cfg, run_id, "train/kl")
    assert runs[0.0] == runs[1.0] == runs[0.4] and runs[0.0][-1] != 0.0
    assert not live_children()


def test_the_reference_split_evens_out_the_busy_time():
    """ReferenceSplit: m rows in the generator make G + m g = L + (n - m) l."""
    from rlhflab.rollout.async_source import ReferenceSplit

    split = ReferenceSplit()
    assert split.rows(64) == 32  # nothing measured yet
    split.generated(0.4, 0.2, 32)  # generation 0.4 s, 32 reference rows in 0.2 s
    assert split.rows(64) == 32  # the learner has not reported
    split.learned((0.3, 0.1 / 32))  # its step without the reference 0.3 s, its 32 rows in 0.1 s
    m = split.rows(64)
    assert m == 11  # (0.3 + 64 * 0.1/32 - 0.4) / (0.3/32) = 10.7
    assert 0.4 + m * 0.2 / 32 == pytest.approx(0.3 + (64 - m) * 0.1 / 32, abs=0.2 / 32)
    split.generated(2.4, 0.0, 0)  # a slow batch, no rows: the per-row cost is kept, the time halfway there (1.4 s)
    assert split.costs["G"] == pytest.approx(1.4) and split.costs["g"] == pytest.approx(0.2 / 32)
    assert split.rows(64) == 0  # the generator is the slow side even without rows
    split.learned((5.0, None))
    assert split.rows(64) == 64


class SlowGenerator(HFGenerator):
    """A real generator that takes 0.2 s longer per batch: the slower side of an async run."""

    def generate(self, *args, **kwargs):
        time.sleep(0.2)
        return super().generate(*args, **kwargs)


def test_the_overlap_efficiency_counts_the_generators_time_in_the_step(make_cfg, monkeypatch):
    """perf/overlap_eff set a batch's own generation time against the step that trained on it. The batches the
    generator made ahead (up to `staleness`) while the learner evaluated went into steps shorter than they had
    taken, so a generator-bound run showed an overlap above 1 (here 6-10 in the steps after an evaluation, and 3.0 for the run; now 0.88-1.0 and 0.95). The
    generator's busy time now counts in the step it fell in, which it cannot exceed; perf/gen_s stays the batch's."""
    from rlhflab.lit.rl_module import RLHFModule

    evaluate = RLHFModule.evaluate  # a slow evaluation: the generator fills its queue meanwhile
    monkeypatch.setattr(RLHFModule, "evaluate", lambda self: (time.sleep(1.0), evaluate(self))[1])
    cfg = make_cfg("mode=async", "staleness=2", "trainer.max_steps=8", "rl.eval_every=4",
                   "generator._target_=test_async.SlowGenerator")
    result = train(cfg)
    overlap, gen = history(cfg, result.run_id, "perf/overlap_eff"), history(cfg, result.run_id, "perf/gen_s")
    assert len(overlap) == 8 and max(overlap) <= 1 + 1e-3, overlap
    assert 0 < result.metrics["perf/mean_overlap_eff"] <= 1 + 1e-3
    assert min(gen) >= 0.2, gen


def test_the_generators_busy_clock_counts_work_in_progress():
    import multiprocessing as mp

    from rlhflab.rollout.async_source import BusyClock

    clock = BusyClock(mp.get_context("fork"))
    assert clock.total(time.monotonic()) == 0.0
    clock.start()
    time.sleep(0.05)
    now = time.monotonic()
    during = clock.total(now)
    assert during >= 0.05 and clock.total(now) == during  # a batch in progress counts up to the time asked
    clock.stop()
    done = clock.total(time.monotonic())
    assert done >= during
    time.sleep(0.05)
    assert clock.total(time.monotonic()) == done  # idle: nothing more


def test_checkpoints_from_before_the_busy_clock_resume():
    from rlhflab.lit.rl_module import saved_step_times

    # (samples, generation, train, step) then; the generation stands in for the generator's time in the step
    assert saved_step_times([[32, 0.1, 0.2, 0.3], [32, 0.1, 0.05, 0.2, 0.3]]) == [(32, 0.1, 0.1, 0.2, 0.3), (32, 0.1, 0.05, 0.2, 0.3)]


@pytest.mark.parametrize("memfd", [True, False], ids=["memfd", "no-memfd"])
def test_spawned_generator_matches_the_forked_one(make_cfg, memfd, monkeypatch):
    """spawn is what a CUDA generator needs; on CPU it must reproduce fork exactly. It gets the policy through a
    memfd (without memfd_create, not Linux: through torch's shared memory)."""
    if not memfd:
        monkeypatch.delattr(os, "memfd_create")
    forked = make_cfg("mode=async", "staleness=1", "trainer.max_steps=4")
    spawned = make_cfg("mode=async", "staleness=1", "trainer.max_steps=4", "mode.start_method=spawn")
    a, b = train(forked), train(spawned)
    assert history(forked, a.run_id, "train/reward") == pytest.approx(history(spawned, b.run_id, "train/reward"), abs=1e-6)
    assert not live_children()


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device (none on the CPU build machine)")
def test_generator_on_its_own_gpu(make_cfg):
    import torch

    device = f"cuda:{torch.cuda.device_count() - 1}"
    cfg = make_cfg("trainer=gpu", "mode=async", "staleness=1", "trainer.max_steps=4", "mode.start_method=spawn", f"mode.device={device}")
    assert train(cfg).module.policy_version == 4


@pytest.mark.slow
def test_generator_dies_with_a_sigkilled_learner(tmp_path, stage_cache):
    """The kernel ends the generator when its learner dies however it dies (PR_SET_PDEATHSIG): before,
    it could block forever writing rollouts nobody reads, holding its copy of the policy."""
    env = {"RLHFLAB_CACHE": str(stage_cache), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/m.db"}
    out = tmp_path / "run"
    with cli_run([*SHRINK, "mode=async", "staleness=8", "trainer.max_steps=100000", f"output.dir={out}",
                  f"hydra.run.dir={out}"], tmp_path, env) as proc:
        wait_for(lambda: (out / "train.log").exists() and "eval after 0 RL steps" in (out / "train.log").read_text(),
                 300, "the RL stage", proc)
        (child,) = [c for c in psutil.Process(proc.pid).children() if "resource_tracker" not in " ".join(c.cmdline())]
        proc.kill()
        proc.wait()
        wait_for(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, 15, "the generator's end")


@pytest.mark.parametrize("mode, correction", [("mode=async staleness=1", "decoupled"), ("mode=sync mode.reference=learner", "recompute")])
def test_the_proximal_log_probs_are_the_updates_own_forward(make_cfg, tmp_path, monkeypatch, mode, correction):
    """With one pass over a batch in one mini-batch, a correction that recomputes the learner's log-probs before
    the update reads them from the update's own forward (detached): the same numbers as a forward of their own,
    which it no longer runs (one policy forward fewer per step)."""
    from rlhflab.lit.rl_module import RLHFModule
    from rlhflab.memory.full import FullMemory

    calls = []
    forward = FullMemory.policy_logprobs
    monkeypatch.setattr(FullMemory, "policy_logprobs", lambda self, *a, **kw: calls.append(1) or forward(self, *a, **kw))
    runs = {}
    for shared in (True, False):
        if not shared:  # the forward of their own, as before
            monkeypatch.setattr(RLHFModule, "proximal_from_update", property(lambda self: False))
        cfg = make_cfg(*mode.split(), f"off_policy={correction}", "algo=grpo", "rl.length_buckets=1", "trainer.max_steps=4",
                       f"output.dir={tmp_path / str(shared)}")
        calls.clear()
        result = train(cfg)
        runs[shared] = (cfg, result, len(calls))
    (cfg, shared, n_shared), (_, own, n_own) = runs[True], runs[False]
    assert shared.module.policy_version == own.module.policy_version == 4
    assert n_own - n_shared == 4  # every step's own recompute forward is gone
    keys = ["train/loss", "train/kl", "train/reward", "train/clipfrac", "train/approx_kl"]
    for key in keys + (["off_policy/weight_mean"] if correction == "decoupled" else []):
        assert history(cfg, shared.run_id, key) == pytest.approx(history(cfg, own.run_id, key), rel=1e-5, abs=1e-6), key
