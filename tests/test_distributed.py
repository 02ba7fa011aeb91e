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
def test_fsdp_shards_a_model_whose_head_is_tied_to_its_embeddings(tmp_path):
    """tie_word_embeddings (GPT-2, Gemma, Qwen2.5, Llama 3.2 1B/3B) was refused under trainer=fsdp, after the stages
    had trained: the head and the embeddings were separate units of one parameter. They are one unit now, kept
    gathered from forward to backward: Hydra-RLHF runs its trunk (the embeddings) without the LM head for the value,
    and with the unit resharded in between, the backward read an empty storage ('setStorage: ... out of bounds for
    storage of size 0'). Seen equal to trainer=ddp, whose gold and KL it matched to the printed digits."""
    from transformers import AutoModelForCausalLM

    run(tmp_path, "trainer=fsdp", "memory=hydra", "algo=ppo", "+model.arch.tie_word_embeddings=true", *SHORT,
        "output.dir=run")
    client, (result,) = runs(tmp_path)
    history = {k: [m.value for m in client.get_metric_history(result.info.run_id, k)] for k in ("train/grad_norm", "eval/kl")}
    assert min(history["train/grad_norm"]) > 0 and history["eval/kl"][-1] > 0.01, history
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


@pytest.mark.slow
@pytest.mark.parametrize("sig, group", [(signal.SIGINT, True), (signal.SIGTERM, False)], ids=["ctrl-c", "sigterm-rank0"])
def test_a_signal_stops_both_ranks_with_one_checkpoint_and_resumes(tmp_path, stage_cache, sig, group):
    """Ctrl-C in a terminal sends SIGINT to every rank; `kill PID` sends SIGTERM to rank 0 alone. Either way both
    ranks stop at the same step boundary, one checkpoint is written, and the run exits 128 + the signal without a
    traceback. Before: with SIGINT, rank 1 (which does not hold the written path) took the checkpoint for missing
    and gathered for a second one after rank 0 had left (a gloo 'Connection closed by peer' traceback); with
    SIGTERM, Lightning's handler (installed after on_fit_start took the signals back) broadcast from inside the
    signal handler while rank 1 was in the backward's all-reduce: both ranks hung. The checkpoint then resumes
    on two ranks into the same MLflow run."""
    out = tmp_path / "run"
    args = ["trainer=ddp", *SHORT, f"output.dir={out}", f"hydra.run.dir={out}"]
    with cli_run([*args, "trainer.max_steps=100000"], tmp_path, clean_env(tmp_path, stage_cache)) as proc:
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
    run(tmp_path, *args, f"trainer.max_steps={step + 2}", "resume=auto", cache=stage_cache)
    assert client.get_run(run_id).info.status == "FINISHED"
    losses = [m.step for m in client.get_metric_history(run_id, "train/loss")]
    assert losses == list(range(1, step + 3)), losses  # every step once, the resumed ones in the same run


@pytest.mark.slow
def test_a_rank_that_fails_while_rank_0_is_busy_ends_the_run_failed_in_one_line(tmp_path, stage_cache):
    """Rank 1's reward function raises while rank 0's is still working. Before, Lightning's observer SIGKILLed rank
    0 five seconds after rank 1 exited: exit 137, no line from rank 0, and the MLflow run RUNNING forever. Now rank
    0's watch gives it GRACE_S to end by itself, then marks the run FAILED and says which rank failed."""
    (tmp_path / "rank_reward.py").write_text(
        "import os, time\n"
        "def score(prompts, completions, **columns):\n"
        "    if os.environ.get('LOCAL_RANK') == '1':\n"
        "        raise ValueError('rank 1 refuses')\n"
        "    time.sleep(600)  # rank 0: busy far longer than the watch waits\n")
    out = tmp_path / "run"
    args = ["trainer=ddp", *SHORT, "reward=function", "reward.fn=rank_reward.py:score", f"output.dir={out}"]
    with cli_run(args, tmp_path, clean_env(tmp_path, stage_cache)) as proc:
        rc = proc.wait(timeout=300)
        output = proc.stdout.read()
    assert rc == 1, output[-4000:]
    assert "Traceback" not in output and "zombies" not in output, output[-4000:]  # Lightning's observer is not there
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and errors[0].startswith("error: rank 1 of 2: reward function score raised ValueError: "
                                                     "rank 1 refuses"), errors
    assert errors[1] == ("error: rank 1 of 2 exited with code 1 (its error is above); rank 0 stopped the run; "
                         "the MLflow run is FAILED"), errors
    run_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    assert MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(run_id).info.status == "FAILED"


def _rank(rank: int, store: str, results) -> None:
    """One of two forked ranks over gloo: a shared error, then rank 1 leaves and rank 0's collective fails."""
    import torch

    from rlhflab import distributed
    from rlhflab.errors import NonFiniteError

    code = 0
    try:
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        shared = distributed.as_rank_error(NonFiniteError("loss not finite", shared=True))
        results.put((rank, "shared", shared.rank, shared.quiet, str(shared)))
        distributed.barrier()
        if rank == 1:
            code = 1  # gone without a word, as a rank that crashed
            return
        try:
            distributed.gather("anything")
        except RuntimeError as err:
            said = distributed.as_rank_error(err)
            results.put((rank, type(said).__name__, said.rank, said.quiet, str(said)))
    except BaseException as err:  # the test says what went wrong at once, not after its timeout
        results.put((rank, "crashed", repr(err), None, ""))
    finally:
        results.close()
        results.join_thread()  # what it put is in the pipe before the process goes
        os._exit(code)


def test_a_collective_that_lost_its_peer_is_one_line_and_a_shared_error_is_said_once(tmp_path):
    """Before, the rank left alone printed gloo's 'Connection closed by peer' as a Hydra traceback, and an error
    every rank raised together (a non-finite loss) printed once per rank."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), results)) for r in (0, 1)]
    try:
        for p in procs:
            p.start()
        got = []
        while len(got) < 3 and not any(g[1] == "crashed" for g in got):
            got.append(results.get(timeout=120))
        got.sort()
    finally:
        for p in procs:
            p.kill()
            p.join()
    lost = got[0][4]  # gloo says 'Connection closed by peer' or 'Read error [...]: Connection reset by peer'
    assert got[0][:4] == (0, "RankLost", "rank 0 of 2", False) and " by peer" in lost, got
    assert lost.startswith("another rank stopped first (its own error line says why, or its log): RuntimeError: "), got
    assert got[1] == (0, "shared", "rank 0 of 2", False, "loss not finite"), got
    assert got[2] == (1, "shared", "rank 1 of 2", True, "loss not finite"), got
