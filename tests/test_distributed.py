"""Distributed training from the command line, as a user runs it: `trainer=ddp` and `trainer=fsdp` on 2 CPU ranks
over gloo, the whole pipeline (stage caches written by one rank, RL in sync and async mode, evaluation, the saved policy), exactly one
MLflow run logged from rank 0, and a Hydra multirun of 2-rank jobs nesting under one sweep parent."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from conftest import ROOT, SHRINK

TRAIN = str(ROOT / "src" / "train.py")
# Short enough for a test, long enough that the gold reward visibly moves (eval at steps 0, 10, 20).
SHORT = [*SHRINK, "trainer.max_steps=20", "rl.eval_every=10", "trainer.devices=2"]


def clean_env(tmp_path, cache=None) -> dict[str, str]:
    """The environment of a run of its own: its MLflow store, and its stage cache unless `cache` (the session's,
    for a test whose subject is not how ranks train the stages) is given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RLHFLAB_MLFLOW", "MASTER_", "LOCAL_RANK", "WORLD_SIZE"))}
    return env | {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "RLHFLAB_CACHE": str(cache or tmp_path / "cache"),
                  "OMP_WAIT_POLICY": "PASSIVE"}


def run(tmp_path, *args: str, timeout: int = 600, cache=None) -> subprocess.CompletedProcess:
    env = clean_env(tmp_path, cache)
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
@pytest.mark.parametrize("trainer, mode", [("ddp", "async"), ("fsdp", "sync")])
def test_two_ranks_run_the_whole_pipeline_into_one_mlflow_run(tmp_path, trainer, mode):
    """trainer=ddp runs mode=async here (every rank its own generator process, docs/DISTRIBUTED.md), which no test
    ran before; DDP in sync mode runs in test_distributed_stops.py and in the sweep below (fsdp refuses async)."""
    out = run(tmp_path, f"trainer={trainer}", f"mode={mode}", *SHORT)
    client, found = runs(tmp_path)
    assert len(found) == 1, [r.info.run_name for r in found]  # rank 1 created no run of its own
    (result,) = found
    assert result.info.status == "FINISHED"
    assert result.data.params["trainer.devices"] == "2" and result.data.params["rlhflab.ranks"] == "2"
    gold = client.get_metric_history(result.info.run_id, "eval/gold_reward")
    assert [m.step for m in gold] == [0, 10, 20]  # evaluated once per eval step (sharded and gathered), not per rank
    assert gold[-1].value > gold[0].value, [m.value for m in gold]
    steps = [m.step for m in client.get_metric_history(result.info.run_id, "train/loss")]
    assert steps == sorted(set(steps)) and len(steps) == 20  # one value per step: reduced across ranks, logged once
    if mode == "async":  # batch j from policy version j - 1 on every rank (logged: the ranks' mean)
        staleness = [m.value for m in client.get_metric_history(result.info.run_id, "rollout/staleness")]
        assert staleness == [0.0] + [1.0] * 19, staleness
    policy = tmp_path / "outputs"
    assert len(list(policy.glob("*/*/policy/model.safetensors"))) == 1  # gathered whole and written once
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_fsdp_trains_hydra_rlhfs_adapters_on_a_model_whose_head_is_tied_to_its_embeddings(tmp_path):
    """memory=hydra under trainer=fsdp: the adapters (policy and value) and the value head receive gradients, and
    the policy moves away from the reference. Before, the memory kept the parameter objects of before fully_shard,
    which replaces every parameter with a DTensor: the optimizer stepped stale copies, train/grad_norm was 0.0 at
    every step and the gold reward and KL stayed at their first values (-0.021, 0.00 after 80 steps).

    The model ties its LM head to its input embeddings (GPT-2, Gemma, Qwen2.5, Llama 3.2 1B/3B), which was refused
    under trainer=fsdp after the stages had trained. The two are one unit now, kept gathered from forward to
    backward: Hydra-RLHF runs its trunk (the embeddings) without the LM head for the value, and with the unit
    resharded in between the backward read an empty storage ('setStorage: ... out of bounds for storage of size
    0'). Seen equal to trainer=ddp, whose gold and KL it matched to the printed digits."""
    from transformers import AutoModelForCausalLM

    run(tmp_path, "trainer=fsdp", "memory=hydra", "algo=ppo", "+model.arch.tie_word_embeddings=true", *SHORT,
        "output.dir=run")
    client, (result,) = runs(tmp_path)
    history = {k: [m.value for m in client.get_metric_history(result.info.run_id, k)]
               for k in ("train/grad_norm", "eval/kl")}
    assert len(history["train/grad_norm"]) == 5 and min(history["train/grad_norm"]) > 0, history["train/grad_norm"]  # per rollout batch
    assert history["eval/kl"][-1] > 0.01, history["eval/kl"]  # the policy left the reference (adapters off)
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "policy")
    assert policy.get_output_embeddings().weight is policy.get_input_embeddings().weight  # saved tied, gathered whole


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
