"""mode=async: exact staleness, sync equivalence at N=0, fast failure, no orphans."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from mlflow.tracking import MlflowClient

from conftest import ROOT
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


def test_async_with_zero_staleness_equals_sync(make_cfg):
    sync = make_cfg("trainer.max_steps=6")
    asyn = make_cfg("mode=async", "staleness=0", "off_policy=recompute", "trainer.max_steps=6")
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


def start_cli(tmp_path, *args):
    env = os.environ | {"RLHFLAB_CACHE": str(tmp_path / "cache"), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/m.db"}
    cmd = [sys.executable, str(ROOT / "src" / "train.py"), "mode=async", "trainer.max_steps=100000", "rl.eval_every=0",
           "trainer.enable_progress_bar=false", "task.num_demonstrations=64", "task.num_preference_pairs=64",
           "stages.sft.epochs=1", "stages.rm.epochs=1", *args]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_generator(proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        kids = [c for c in psutil.Process(proc.pid).children() if "python" in c.name().lower() or c.cmdline()]
        if kids:
            time.sleep(3)  # let it produce a few batches
            return kids[0]
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    raise AssertionError("no generator process appeared")


@pytest.mark.slow
def test_killed_generator_fails_fast_and_leaves_nothing(tmp_path):
    proc = start_cli(tmp_path)
    child = wait_for_generator(proc)
    child.kill()
    killed = time.time()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert time.time() - killed < 15
    assert "generator process died (exit code -9)" in out
    assert not psutil.pid_exists(child.pid) or child.status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
def test_ctrl_c_stops_both_sides(tmp_path):
    proc = start_cli(tmp_path)
    child = wait_for_generator(proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    child_gone = not psutil.pid_exists(child.pid) or child.status() == psutil.STATUS_ZOMBIE
    assert child_gone, out
    assert "Traceback" not in out.split("KeyboardInterrupt")[0] or "generator" not in out


def test_only_the_adapter_travels_under_lora(make_cfg):
    from rlhflab.rollout.async_source import trainable_state

    lora = train(make_cfg("memory=lora", "mode=async", "trainer.max_steps=2")).module.memory.generation_model
    sent = trainable_state(lora)
    assert sent and all("lora_" in name for name in sent)
    total = sum(p.numel() for p in lora.parameters())
    assert sum(t.numel() for t in sent.values()) < 0.5 * total


@pytest.mark.parametrize("correction", ["tis off_policy.cap=1.5", "decoupled"])
def test_importance_weighted_corrections_run_and_learn(make_cfg, correction):
    name, *settings = correction.split()
    cfg = make_cfg("mode=async", "staleness=2", f"off_policy={name}", *settings, "trainer.max_steps=30")
    result = train(cfg)
    assert result.metrics["eval/gold_reward"] > result.metrics["eval/gold_reward_before"]
    history_keys = MlflowClient(cfg.logger.tracking_uri).get_run(result.run_id).data.metrics
    assert "off_policy/weight_mean" in history_keys


def test_spawned_generator_matches_the_forked_one(make_cfg):
    """spawn is what a CUDA generator needs; on CPU it must reproduce fork exactly."""
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
