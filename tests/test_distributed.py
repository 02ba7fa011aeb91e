"""Distributed training from the command line, as a user runs it: `trainer=ddp` and `trainer=fsdp` on 2 CPU ranks
over gloo, the whole pipeline (stage caches written by one rank, RL, evaluation, the saved policy), exactly one
MLflow run logged from rank 0, and a Hydra multirun of 2-rank jobs nesting under one sweep parent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from conftest import ROOT, SHRINK, cli_run, wait_for

TRAIN = str(ROOT / "src" / "train.py")
# Short enough for a test, long enough that the gold reward visibly moves (eval at steps 0, 10, 20).
SHORT = [*SHRINK, "trainer.max_steps=20", "rl.eval_every=10", "trainer.devices=2"]


def clean_env(tmp_path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLHFLAB_MLFLOW", "MASTER_", "LOCAL_RANK", "WORLD_SIZE"))}
    return env | {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "RLHFLAB_CACHE": str(tmp_path / "cache"),
                  "OMP_WAIT_POLICY": "PASSIVE"}


def run(tmp_path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = clean_env(tmp_path)
    # subprocess.run kills the child on timeout; Lightning's rank-1 process is its child and dies with it (pdeathsig).
    out = subprocess.run([sys.executable, TRAIN, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return out


def runs(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("rlhflab")
    return client, client.search_runs([experiment.experiment_id])


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["ddp", "fsdp"])
def test_two_ranks_run_the_whole_pipeline_into_one_mlflow_run(tmp_path, trainer):
    out = run(tmp_path, f"trainer={trainer}", *SHORT)
    client, found = runs(tmp_path)
    assert len(found) == 1, [r.info.run_name for r in found]  # rank 1 created no run of its own
    (result,) = found
    assert result.info.status == "FINISHED"
    assert result.data.params["trainer.devices"] == "2"
    gold = client.get_metric_history(result.info.run_id, "eval/gold_reward")
    assert [m.step for m in gold] == [0, 10, 20]  # evaluated once per eval step (sharded and gathered), not per rank
    assert gold[-1].value > gold[0].value, [m.value for m in gold]
    steps = [m.step for m in client.get_metric_history(result.info.run_id, "train/loss")]
    assert steps == sorted(set(steps)) and len(steps) == 20  # one value per step: reduced across ranks, logged once
    policy = tmp_path / "outputs"
    assert len(list(policy.glob("*/*/policy/model.safetensors"))) == 1  # gathered whole and written once
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_fsdp_trains_hydra_rlhfs_adapters(tmp_path):
    """memory=hydra under trainer=fsdp: the adapters (policy and value) and the value head receive gradients, and
    the policy moves away from the reference. Before, the memory kept the parameter objects of before fully_shard, which replaces every parameter
    with a DTensor: the optimizer stepped stale copies, train/grad_norm was 0.0 at every step and the gold reward
    and KL stayed at their first values (-0.021, 0.00 after 80 steps)."""
    run(tmp_path, "trainer=fsdp", "memory=hydra", "algo=ppo", *SHORT)
    client, (result,) = runs(tmp_path)
    history = {k: [m.value for m in client.get_metric_history(result.info.run_id, k)]
               for k in ("train/grad_norm", "eval/kl")}
    assert len(history["train/grad_norm"]) == 5 and min(history["train/grad_norm"]) > 0, history["train/grad_norm"]  # per rollout batch
    assert history["eval/kl"][-1] > 0.01, history["eval/kl"]  # the policy left the reference (adapters off)


@pytest.mark.slow
def test_a_sweep_of_two_rank_jobs_nests_under_one_parent(tmp_path):
    tiny = ["trainer.max_steps=2", "rl.prompts_per_step=4", "rl.eval_every=0", "stages.sft.epochs=1",
            "stages.rm.epochs=1", "task.num_demonstrations=64", "task.num_preference_pairs=64",
            "task.num_eval_prompts=4", "trainer.enable_progress_bar=false"]
    run(tmp_path, "-m", "trainer=ddp", "trainer.devices=2", "algo=rloo,grpo", *tiny)
    client, found = runs(tmp_path)
    parents = [r for r in found if r.data.tags.get("rlhflab.sweep") == "1"]
    assert len(parents) == 1
    children = [r for r in found if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(found) == 3 and len(children) == 2  # no stray run from either job's rank 1
    assert sorted(r.data.tags["algo"] for r in children) == ["grpo", "rloo"]
    assert all(r.info.status == "FINISHED" and r.data.params["trainer.devices"] == "2" for r in children)


@pytest.mark.slow
@pytest.mark.parametrize("sig, group", [(signal.SIGINT, True), (signal.SIGTERM, False)], ids=["ctrl-c", "sigterm-rank0"])
def test_a_signal_stops_both_ranks_with_one_checkpoint_and_resumes(tmp_path, sig, group):
    """Ctrl-C in a terminal sends SIGINT to every rank; `kill PID` sends SIGTERM to rank 0 alone. Either way both
    ranks stop at the same step boundary, one checkpoint is written, and the run exits 128 + the signal without a
    traceback. Before: with SIGINT, rank 1 (which does not hold the written path) took the checkpoint for missing
    and gathered for a second one after rank 0 had left (a gloo 'Connection closed by peer' traceback); with
    SIGTERM, Lightning's handler (installed after on_fit_start took the signals back) broadcast from inside the
    signal handler while rank 1 was in the backward's all-reduce: both ranks hung. The checkpoint then resumes
    on two ranks into the same MLflow run."""
    out = tmp_path / "run"
    args = ["trainer=ddp", *SHORT, f"output.dir={out}", f"hydra.run.dir={out}"]
    with cli_run([*args, "trainer.max_steps=100000"], tmp_path, clean_env(tmp_path)) as proc:
        log = out / "train.log"
        wait_for(lambda: log.exists() and "eval after 0 RL steps" in log.read_text(), 600, "the RL stage", proc)
        (os.killpg if group else os.kill)(proc.pid, sig)  # the terminal signals the whole foreground group
        rc = proc.wait(timeout=120)
        output = proc.stdout.read()
    assert rc == 128 + sig, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    (checkpoint,) = (out / "checkpoints").glob("step-*")
    assert output.count("checkpoint: ") == 1, output[-4000:]
    assert output.count("stopped: ") == 1, output[-4000:]  # rank 0 speaks for both
    run_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert client.get_run(run_id).info.status == "KILLED"
    if sig == signal.SIGTERM:
        return  # the resume is the same either way
    step = int(checkpoint.name.split("-")[1])
    run(tmp_path, *args, f"trainer.max_steps={step + 2}", "resume=auto")
    assert client.get_run(run_id).info.status == "FINISHED"
    losses = [m.step for m in client.get_metric_history(run_id, "train/loss")]
    assert losses == list(range(1, step + 3)), losses  # every step once, the resumed ones in the same run
