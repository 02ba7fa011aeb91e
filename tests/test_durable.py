"""Durable runs (issue 12): the saved policy, exact resume, the stage cache. How runs fail and stop (signals,
non-finite values, full disks, bad model directories) is in test_failures.py."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf, open_dict

from conftest import SHRINK, TRAIN, cli_run, history, run_id_of, tensors, wait_for
from rlhflab.config import validate
from rlhflab.errors import ConfigError, NonFiniteError, RunInterrupted, StageFailed, TrackingLost
from rlhflab.models.build import ensure_base_model
from rlhflab.train import train


# ---- the trained policy is kept ------------------------------------------------------------

@pytest.mark.parametrize("memory", ["full", "lora", "hydra"])
def test_saved_policy_loads_with_from_pretrained_and_generates(make_cfg, memory, caplog):
    from transformers import AutoModelForCausalLM, GenerationConfig

    cfg = make_cfg(f"memory={memory}", "trainer.max_steps=2", "output.merge_lora=true")
    result = train(cfg)
    # with memory=full it was ignored without a word
    assert ("output.merge_lora: memory=full saves the whole policy" in caplog.text) == (memory == "full")
    path = result.output_dir / "policy"
    policy = AutoModelForCausalLM.from_pretrained(path).eval()
    module = result.module
    query = module.eval_query[:4]
    with torch.no_grad():
        ids = torch.cat([query, torch.full((4, 1), module.tokenizer.eos_token_id)], dim=1)
        expected = module.memory.generation_model(input_ids=ids).logits
        torch.testing.assert_close(policy(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
        out = policy.generate(input_ids=query, attention_mask=(query != module.tokenizer.pad_token_id).long(),
                              max_new_tokens=3, do_sample=False, pad_token_id=module.tokenizer.pad_token_id)
    assert query.shape[1] < out.shape[1] <= query.shape[1] + 3  # it generates (greedy may end at once with EOS)
    if memory != "full":
        assert (path / "adapter_config.json").is_file()
        merged = AutoModelForCausalLM.from_pretrained(path / "merged").eval()
        with torch.no_grad():
            torch.testing.assert_close(merged(input_ids=ids).logits, expected, atol=1e-4, rtol=1e-4)
        # given as model.sft_path it said "not an intact saved model (no config.json there)"; the merged one works
        with pytest.raises(ConfigError, match=rf"^model.sft_path: '{path}' is a LoRA adapter \(adapter_config.json\), not a "
                                              rf"whole model; give {path / 'merged'}, the merged model beside it$"):
            validate(make_cfg(f"model.sft_path={path}"))
        validate(make_cfg(f"model.sft_path={path / 'merged'}"))
        # the merged copy had no generation_config.json (a hub model's eos_token_id list, sampling defaults) and no
        # record of the run and step it came from
        assert GenerationConfig.from_pretrained(path / "merged").to_dict() == module.memory.generation_model.generation_config.to_dict()
        assert (path / "merged" / "rlhflab.json").read_text() == (path / "rlhflab.json").read_text()
    else:
        assert (path / "generation_config.json").is_file()
    assert json.loads((path / "rlhflab.json").read_text()) == {"rl_step": 2, "run_id": result.run_id}
    client = MlflowClient(cfg.logger.tracking_uri)
    logged = {a.path for a in client.list_artifacts(result.run_id, "policy")}
    assert "policy/tokenizer.json" in logged and any(p.endswith(".safetensors") for p in logged)


# ---- exact resume -----------------------------------------------------------------------------

# flush_every_s=3600: metrics reach MLflow only at checkpoints and the run end, so a step lost by the kill shows.
RUN = [*SHRINK, "trainer.max_steps=12", "checkpoint.every_n_steps=4", "rl.prompts_per_step=8", "logger.flush_every_s=3600"]


@pytest.mark.slow
def test_resume_after_sigkill_is_bit_identical_and_logs_each_step_once(tmp_path, stage_cache):
    """Killed with SIGKILL once a checkpoint exists, then `resume=auto`: the same final weights as an
    uninterrupted run, one MLflow run, and every step of its history exactly once. Until the resume the killed run
    stayed RUNNING for good; the next run in its experiment (here the uninterrupted one) ends it KILLED and says how
    to continue it."""
    from rlhflab.naming import STOP_TAG

    env = {"RLHFLAB_CACHE": str(stage_cache), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    with cli_run([*RUN, f"output.dir={cut}"], tmp_path, env) as proc:
        wait_for(lambda: (cut / "checkpoints" / "step-00000008").is_dir(), 300, "the step-8 checkpoint", proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    # On a loaded machine the kill may land after a later checkpoint (step 12 = the whole budget): resume uses the newest.
    newest = max(p.name for p in (cut / "checkpoints").iterdir() if p.name.startswith("step-"))
    first_run = run_id_of(cut)
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    assert client.get_run(first_run).info.status == "RUNNING"
    with cli_run([*RUN, f"output.dir={whole}"], tmp_path, env) as proc:
        assert proc.wait(timeout=300) == 0, proc.stdout.read()[-4000:]
        said = "".join(proc.stdout.read().split())  # the console wraps long lines
    name = "".join(client.get_run(first_run).info.run_name.split())
    assert (f"mlflow:run{first_run}({name}),leftRUNNINGbyaprocessthatisgone(SIGKILL,orastorethatstoppedanswering),isendedKILLED;resume=autooutput.dir="
            f"{cut}continuesitfromitsnewestcheckpoint") in said
    killed = client.get_run(first_run)
    assert killed.info.status == "KILLED" and killed.data.tags[STOP_TAG].endswith(f"next run in its experiment, {run_id_of(whole)}")
    with cli_run([*RUN, f"output.dir={cut}", "resume=auto"], tmp_path, env) as proc:
        assert proc.wait(timeout=300) == 0, proc.stdout.read()[-4000:]
        out = "".join(proc.stdout.read().split())  # the console wraps long paths
    assert "resume:continuingfrom" in out and newest in out
    assert run_id_of(cut) == first_run
    a, b = tensors(whole / "policy"), tensors(cut / "policy")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    uri = env["MLFLOW_TRACKING_URI"]
    steps = [s for s, _ in history(uri, first_run, "train/reward")]
    assert steps == list(range(1, 13))
    assert [v for _, v in history(uri, first_run, "train/reward")] == [v for _, v in history(uri, run_id_of(whole), "train/reward")]
    assert client.get_run(first_run).info.status == "FINISHED" and STOP_TAG not in client.get_run(first_run).data.tags
    assert len(client.search_runs([client.get_run(first_run).info.experiment_id])) == 2  # whole + cut, no third


@pytest.mark.slow
@pytest.mark.parametrize("resume", ["resume=auto", None])
def test_a_run_sigkilled_before_its_first_checkpoint_is_ended_killed_by_the_next_run_in_its_directory(tmp_path, stage_cache,
                                                                                                      resume):
    """SIGKILL before any checkpoint: nothing ends the MLflow run, and no resume can continue it (there is nothing to
    resume from), so it stayed RUNNING for good while the next run in the directory overwrote mlflow_run.json. That
    next run (resume=auto, or the same command again) ends it KILLED, saying why, and names it."""
    env = {"RLHFLAB_CACHE": str(stage_cache), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    out = tmp_path / "run"
    args = [*SHRINK, "trainer.max_steps=2", "checkpoint.every_n_steps=100", f"output.dir={out}"]
    with cli_run(args, tmp_path, env) as proc:
        wait_for(lambda: (out / "mlflow_run.json").is_file(), 300, "the MLflow run", proc)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    killed = run_id_of(out)
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    assert client.get_run(killed).info.status == "RUNNING"
    with cli_run([*args, *filter(None, [resume])], tmp_path, env) as proc:
        assert proc.wait(timeout=300) == 0, proc.stdout.read()[-4000:]
        said = " ".join(proc.stdout.read().split())
    assert f"run {killed}, left RUNNING in" in said
    new = run_id_of(out)
    assert new != killed and client.get_run(new).info.status == "FINISHED"
    assert client.get_run(new).data.tags["rlhflab.replaces_run"] == killed
    old = client.get_run(killed)
    assert old.info.status == "KILLED" and new in old.data.tags["rlhflab.stopped"]


class StopAt:
    """A Lightning callback that sends SIGINT to this process after RL step `n` (as Ctrl-C would)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, module) -> None:
        if module.updates == self.n:
            os.kill(os.getpid(), signal.SIGINT)


@contextmanager
def stopped_after(monkeypatch, n: int):
    """Within the block, SIGINT after RL step `n` (StopAt, called as each step's metrics are logged)."""
    from rlhflab.lit import rl_module

    stop, original = StopAt(n), rl_module.RLHFModule._log_step

    def log_and_maybe_stop(self, metrics):
        original(self, metrics)
        stop(self)

    monkeypatch.setattr(rl_module.RLHFModule, "_log_step", log_and_maybe_stop)
    try:
        yield
    finally:
        monkeypatch.setattr(rl_module.RLHFModule, "_log_step", original)


@pytest.mark.parametrize("reference", ["auto", "balance"])
def test_async_resume_loses_and_repeats_no_batch_and_keeps_staleness_exact(make_cfg, tmp_path, monkeypatch, reference):
    """Stopped at step 6 (SIGINT: a checkpoint holds the generator's rollouts made by older weights),
    then resumed: the staleness history is exactly that of an uninterrupted run, and so are the weights, bit for bit
    (with mode.reference=balance too: its kept rollouts carry only their first rows' reference log-probs, and the
    resumed run's split, which follows timings, is another one)."""
    args = ["mode=async", "staleness=2", "trainer.max_steps=12", "rl.prompts_per_step=8", f"mode.reference={reference}"]
    whole = train(make_cfg(*args, f"output.dir={tmp_path}/whole"))
    cut_cfg = make_cfg(*args, f"output.dir={tmp_path}/cut")
    with stopped_after(monkeypatch, 6), pytest.raises(RunInterrupted):
        train(cut_cfg)
    checkpoint = tmp_path / "cut" / "checkpoints" / "step-00000006"
    assert checkpoint.is_dir()
    state = torch.load(checkpoint / "state.pt", weights_only=True)
    assert [r["extras"]["batch"] for r in state["ranks"][0]["source"]["pending"]] == [6, 7]  # made with versions 4 and 5
    resumed = train(make_cfg(*args, f"output.dir={tmp_path}/cut", "resume=auto"))
    uri = cut_cfg.logger.tracking_uri
    assert resumed.run_id == run_id_of(tmp_path / "cut")
    staleness = history(uri, resumed.run_id, "rollout/staleness")
    assert staleness == [(i + 1, float(min(i, 2))) for i in range(12)]
    assert bool(history(uri, resumed.run_id, "perf/ref_rows_generator")) == (reference == "balance")
    a, b = whole.module.memory.policy.state_dict(), resumed.module.memory.policy.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    run = MlflowClient(uri).get_run(resumed.run_id)
    assert run.info.status == "FINISHED"
    # what stopped it, kept apart: a finished run does not read as stopped
    assert "rlhflab.stopped" not in run.data.tags and run.data.tags["rlhflab.stopped_before_resume"] == "stopped by SIGINT"


def test_a_stop_between_weight_pushes_trains_on_to_the_next_and_checkpoints_there(make_cfg, tmp_path, monkeypatch, caplog):
    """mode.sync_every=3, SIGINT after step 4: a resume starts only where the generator's weights were pushed, so the
    stop wrote no checkpoint and said the run stopped before its first (under DDP: 29 steps lost). It now trains on
    to step 6, checkpoints and stops there, and the resume continues it."""
    args = ["mode=async", "staleness=1", "mode.sync_every=3", "trainer.max_steps=9", "rl.prompts_per_step=8",
            f"output.dir={tmp_path}/cut"]
    with stopped_after(monkeypatch, 4), pytest.raises(RunInterrupted):
        train(make_cfg(*args))
    assert [p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()] == ["step-00000006"]
    assert "SIGINT: RL step 4 is not one a resume can start from (the generator has only every mode.sync_every=3th " \
           "update's weights); training on to the next that is" in caplog.text
    resumed = train(make_cfg(*args, "resume=auto"))
    assert [s for s, _ in history(make_cfg().logger.tracking_uri, resumed.run_id, "train/reward")] == list(range(1, 10))


def test_step_metrics_every_n_steps_through_a_stop_and_resume_are_the_means_of_a_whole_runs_steps(make_cfg, tmp_path,
                                                                                                    monkeypatch):
    """trainer.log_every_n_steps=4, stopped by SIGINT after step 6 and resumed to step 9: train/reward is written at
    steps 4, 6 (the stop's checkpoint took the window cut short: nothing lost), 8 and 9 (the run's end), each the
    mean of an uninterrupted run's per-step rewards over its steps."""
    args = ["trainer.max_steps=9", "rl.prompts_per_step=8"]
    whole = train(make_cfg(*args, f"output.dir={tmp_path}/whole"))
    uri = make_cfg().logger.tracking_uri
    per_step = dict(history(uri, whole.run_id, "train/reward"))
    assert sorted(per_step) == list(range(1, 10))
    with stopped_after(monkeypatch, 6), pytest.raises(RunInterrupted):
        train(make_cfg(*args, "trainer.log_every_n_steps=4", f"output.dir={tmp_path}/cut"))
    assert [p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()] == ["step-00000006"]
    resumed = train(make_cfg(*args, "trainer.log_every_n_steps=4", f"output.dir={tmp_path}/cut", "resume=auto"))
    logged = history(uri, resumed.run_id, "train/reward")
    assert [step for step, _ in logged] == [4, 6, 8, 9]

    def mean(steps):
        return sum(per_step[s] for s in steps) / len(steps)

    assert [value for _, value in logged] == pytest.approx([mean([1, 2, 3, 4]), mean([5, 6]), mean([7, 8]), per_step[9]],
                                                           abs=1e-12)


def test_resume_refuses_a_different_config_naming_the_keys(make_cfg, tmp_path):
    train(make_cfg("trainer.max_steps=2", "checkpoint.every_n_steps=2", f"output.dir={tmp_path}/run"))
    with pytest.raises(ConfigError, match=r"^resume: .*\(rl.lr: 0.001 -> 0.0003\)"):
        train(make_cfg("trainer.max_steps=4", "rl.lr=3e-4", "resume=auto", f"output.dir={tmp_path}/run"))
    more = train(make_cfg("trainer.max_steps=4", "resume=auto", f"output.dir={tmp_path}/run"))  # max_steps may change
    assert more.module.updates == 4
    tags = MlflowClient(make_cfg().logger.tracking_uri).get_run(more.run_id).data.tags
    # the params keep their first values
    assert tags["rlhflab.changed_on_resume"] == "trainer.max_steps: 2 -> 4; checkpoint.every_n_steps: 2 -> null"
    # the output directory given as the checkpoint: it said "not a whole checkpoint (no manifest: a partial or foreign entry)"
    with pytest.raises(ConfigError, match=rf"^resume: '{tmp_path}/run' is a run's output directory, not a checkpoint; continue "
                                          rf"that run with resume=auto output.dir={tmp_path}/run, or start from its newest "
                                          rf"checkpoint with resume={tmp_path}/run/checkpoints/step-00000002 output.dir=<new dir>$"):
        train(make_cfg("trainer.max_steps=4", f"resume={tmp_path}/run", f"output.dir={tmp_path}/other"))


def test_resume_values_are_judged_before_the_directorys_checkpoints(make_cfg, tmp_path):
    """In a directory that holds checkpoints, resume=latest (or the checkpoints/ folder, or the directory itself)
    was refused as a new run that would mix with them: 'already holds another run's checkpoints'."""
    run = tmp_path / "run"
    train(make_cfg("trainer.max_steps=2", "checkpoint.every_n_steps=2", f"output.dir={run}"))
    for resume, message in [("latest", r"resume: no checkpoint directory 'latest'; give a checkpoints/step-\* directory, or resume=auto"),
                            (f"{run}/checkpoints", rf"resume: '{run}/checkpoints' is a folder of checkpoints; name one of its "
                                                   rf"step-\* directories \(the newest whole one: resume={run}/checkpoints/"
                                                   rf"step-00000002\), or continue its run with resume=auto output.dir={run}"),
                            (str(run), rf"resume: '{run}' is a run's output directory, not a checkpoint; continue that run")]:
        with pytest.raises(ConfigError, match=f"^{message}"):
            train(make_cfg("trainer.max_steps=4", f"resume={resume}", f"output.dir={run}"))


def test_a_resume_does_not_replace_a_policy_trained_past_the_step_budget(make_cfg, tmp_path):
    """A run stopped at step 2 (its checkpoint) and resumed to 4 without further checkpoints; resume=auto with
    trainer.max_steps=3 went on from step 2 and replaced the step-4 policy with one of step 3, and exited 0."""
    run = tmp_path / "run"
    train(make_cfg("trainer.max_steps=2", "checkpoint.every_n_steps=2", f"output.dir={run}"))
    train(make_cfg("trainer.max_steps=4", "checkpoint.every_n_steps=null", "resume=auto", f"output.dir={run}"))
    assert json.loads((run / "policy" / "rlhflab.json").read_text()) == {"rl_step": 4, "run_id": run_id_of(run)}
    weights = (run / "policy" / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match=rf"^trainer.max_steps=3: the run in {run} went on to RL step 4 after step-00000002, "
                                          rf"and its policy \({run}/policy\) would be replaced by one of step 3. Set "
                                          r"trainer.max_steps=4 or more, or start from step-00000002 in another directory"):
        train(make_cfg("trainer.max_steps=3", "resume=auto", f"output.dir={run}"))
    assert (run / "policy" / "model.safetensors").read_bytes() == weights
    assert train(make_cfg("trainer.max_steps=4", "resume=auto", f"output.dir={run}")).module.updates == 4  # the same budget: on


def test_a_policy_an_earlier_run_left_in_the_directory_does_not_bound_a_resume(make_cfg, tmp_path):
    """A run to step 4 then a new run in the same directory (another seed) stopped at step 2: resume=auto
    trainer.max_steps=3 was refused 'went on to RL step 4', the step of the earlier run's policy. (A new run is now
    refused such a directory; the earlier run's policy is written by hand, as one copied there would be.)"""
    run = tmp_path / "run"
    train(make_cfg("trainer.max_steps=2", "seed=3", "checkpoint.every_n_steps=2", f"output.dir={run}"))
    (run / "policy" / "rlhflab.json").write_text(json.dumps({"rl_step": 4, "run_id": "an-earlier-run"}))  # as if it had stopped
    assert train(make_cfg("trainer.max_steps=3", "seed=3", "resume=auto", f"output.dir={run}")).module.updates == 3


def test_a_new_line_of_training_is_refused_a_directory_that_holds_a_saved_policy(make_cfg, tmp_path, caplog):
    """A second run with the same output.dir, or resume=auto where the finished run kept no checkpoint, replaced the
    policy/ that run had saved without a word (only its MLflow copy was left). Each is one line before any run is
    made, and its first fix trains on from that policy."""
    run = tmp_path / "run"
    first = train(make_cfg("trainer.max_steps=2", f"output.dir={run}"))
    saved = tensors(run / "policy")
    policy = f"{run}/policy, RL step 2 of MLflow run {first.run_id}"
    tail = (rf", which this run would replace; give this run another output.dir \(to train on from that policy: "
            rf"model.sft_path={run}/policy output.dir=<new dir>\), or remove {run}/policy to replace it$")
    with pytest.raises(ConfigError, match=rf"^output.dir: {run} holds the policy a run saved \({policy}\){tail}"):
        train(make_cfg("trainer.max_steps=2", "seed=3", f"output.dir={run}"))
    with pytest.raises(ConfigError, match=rf"^resume=auto: {run}/checkpoints holds no checkpoint to continue, and {run} "
                                          rf"holds the policy a run saved \({policy}\){tail}"):
        with caplog.at_level(logging.INFO, logger="rlhflab"):
            train(make_cfg("trainer.max_steps=4", "resume=auto", f"output.dir={run}"))
    assert "starting a new run" not in caplog.text  # it said so, then refused it
    branch = tmp_path / "branch"
    train(make_cfg("trainer.max_steps=2", "checkpoint.every_n_steps=2", f"output.dir={branch}"))
    with pytest.raises(ConfigError, match=rf"^output.dir: {run} holds the policy a run saved"):
        train(make_cfg("trainer.max_steps=4", f"resume={branch}/checkpoints/step-00000002", f"output.dir={run}"))
    client = MlflowClient(make_cfg().logger.tracking_uri)
    assert len(client.search_runs([client.get_experiment_by_name("rlhflab").experiment_id])) == 2  # none for the refused
    assert all(torch.equal(saved[k], v) for k, v in tensors(run / "policy").items())
    on = train(make_cfg("trainer.max_steps=2", f"model.sft_path={run}/policy", f"output.dir={tmp_path}/on"))  # the fix
    assert on.module.updates == 2 and (tmp_path / "on" / "policy").is_dir()
    done = tmp_path / "done"  # a finished run with checkpoints: its policy is named, not 'another run's checkpoints'
    train(make_cfg("trainer.max_steps=2", "checkpoint.every_n_steps=2", f"output.dir={done}"))
    with pytest.raises(ConfigError, match=rf"^output.dir: {done} holds the policy a run saved .* or remove {done}/policy "
                                          rf"and {done}/checkpoints to replace them$"):
        train(make_cfg("trainer.max_steps=2", "checkpoint.every_n_steps=2", f"output.dir={done}"))
    lora = tmp_path / "lora"  # an adapter is no model.sft_path: the line says how to get one that is
    train(make_cfg("memory=lora", "trainer.max_steps=1", f"output.dir={lora}"))
    with pytest.raises(ConfigError, match=r"give this run another output.dir \(an adapter: to train on from it, save it "
                                          r"merged with output.merge_lora=true\), or remove "):
        train(make_cfg("memory=lora", "trainer.max_steps=1", f"output.dir={lora}"))


def test_resume_of_a_finished_run_without_checkpoints_says_there_is_nothing_to_resume(make_cfg, tmp_path):
    train(make_cfg("trainer.max_steps=2", f"output.dir={tmp_path}/b"))
    with pytest.raises(ConfigError, match=rf"^resume: '{tmp_path}/b' is a run's output directory with no checkpoints, so "
                                          rf"there is nothing to resume; start from its trained policy as a new run with "
                                          rf"model.sft_path={tmp_path}/b/policy"):
        train(make_cfg("trainer.max_steps=4", f"resume={tmp_path}/b", f"output.dir={tmp_path}/a"))


def test_a_resume_under_another_experiment_name_goes_on_in_its_own_experiment(make_cfg, tmp_path, caplog):
    """resume=auto logger.experiment_name=other continued the run in its experiment, but made an empty 'other',
    wrote it into mlflow_run.json and linked the run under its id."""
    run = tmp_path / "run"
    first = train(make_cfg("trainer.max_steps=2", "checkpoint.every_n_steps=2", f"output.dir={run}"))
    with caplog.at_level(logging.WARNING, logger="rlhflab"):
        cfg = make_cfg("trainer.max_steps=4", "resume=auto", "logger.experiment_name=other", f"output.dir={run}")
        resumed = train(cfg)
    client = MlflowClient(cfg.logger.tracking_uri)
    held = client.get_run(first.run_id).info.experiment_id
    assert resumed.run_id == first.run_id and client.get_experiment_by_name("other") is None
    assert json.loads((run / "mlflow_run.json").read_text())["experiment"] == client.get_experiment(held).name
    assert any(f"logger.experiment_name=other, but the run this resumes is in experiment '{client.get_experiment(held).name}'"
               in r.getMessage() for r in caplog.records)


def test_a_resume_on_edited_data_files_is_refused_and_a_branch_is_warned(make_cfg, tmp_path, caplog):
    """The prompts (or demonstrations) file cut from 900 to 600 rows between a stop and resume=auto: the run went on
    in the same MLflow run with its held-out set redrawn and its SFT reference retrained on other data."""
    example = Path(__file__).parents[1] / "examples" / "reverse"
    data = tmp_path / "train.jsonl"
    shutil.copy(example / "train.jsonl", data)
    own = ["task=prompts", f"task.path={data}", f"task.demonstrations_path={example}/demos.jsonl", "task.tokenizer=char",
           "task.max_new_tokens=4", "reward=function", f"reward.fn={example}/reward.py:correct_digits", "stages.sft.epochs=1",
           "rl.prompts_per_step=8", "rl.eval_every=0", "trainer.enable_progress_bar=false"]
    run = tmp_path / "run"
    train(make_cfg(*own, "trainer.max_steps=2", "checkpoint.every_n_steps=2", f"output.dir={run}", shrink=False))
    rows = [json.loads(line) for line in data.read_text().splitlines()]  # the same rows, keys in another order
    data.write_text("".join(json.dumps(dict(reversed(r.items()))) + "\n" for r in rows))
    assert train(make_cfg(*own, "trainer.max_steps=2", "resume=auto", f"output.dir={run}", shrink=False)).module.updates == 2
    data.write_text("".join(data.read_text().splitlines(keepends=True)[:600]))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rlhflab"), pytest.raises(ConfigError, match=rf"^resume: the data read from task.path differs from what {run}/checkpoints/"
                                          r"step-00000002 was trained on \(the files were edited\); restore them to go on, "
                                          rf"or start from it on the new data in another directory: resume={run}/checkpoints/step-00000002 "):
        train(make_cfg(*own, "trainer.max_steps=4", "resume=auto", f"output.dir={run}", shrink=False))
    assert not any("resume: continuing from" in r.getMessage() for r in caplog.records)  # said just before the refusal
    with caplog.at_level(logging.WARNING, logger="rlhflab"):
        branch = train(make_cfg(*own, "trainer.max_steps=3", f"resume={run}/checkpoints/step-00000002",
                                f"output.dir={tmp_path}/branch", shrink=False))
    assert branch.module.updates == 3
    assert any("resume: the data of task.path differs from what" in r.getMessage() for r in caplog.records)


def test_resume_refusal_says_which_settings_one_side_lacks():
    """A 2-rank DDP checkpoint resumed on one CPU: the strategy is a node on one side and a string on the other.
    The keys one side lacks read '(not set)'; they read 'None -> None' (flatten wrote a null as 'None', now 'null')."""
    from rlhflab.lit.checkpoint import differences

    saved = ("trainer:\n  devices: 2\n  max_steps: 80\n  strategy:\n    _target_: lightning.pytorch.strategies.DDPStrategy\n"
             "    process_group_backend: null\n")
    now = OmegaConf.create({"trainer": {"devices": 1, "max_steps": 120, "strategy": "auto"}})
    assert differences(saved, now) == [
        "trainer.devices: 2 -> 1", "trainer.strategy: (not set) -> auto",
        "trainer.strategy._target_: lightning.pytorch.strategies.DDPStrategy -> (not set)",
        "trainer.strategy.process_group_backend: null -> (not set)",
    ]  # trainer.max_steps may change


def test_resume_from_another_directorys_checkpoint_is_a_new_mlflow_run(make_cfg, tmp_path):
    """Continuing a run in its MLflow run is for its own newest checkpoint (a kill, then resume=auto). Into another
    directory, the steps after it are another line of training: logged into the old run they were dropped beside
    the steps it held. They go to a new run that names where it started."""
    def run(out: str, max_steps: int, resume: str):
        return train(make_cfg(f"trainer.max_steps={max_steps}", "checkpoint.every_n_steps=2", "checkpoint.keep=3",
                              f"resume={resume}", f"output.dir={tmp_path}/{out}"))

    def steps(run_id: str) -> list[int]:
        return [step for step, _ in history(uri, run_id, "train/reward")]

    first = run("a", 6, "null")
    uri, older = make_cfg().logger.tracking_uri, tmp_path / "a" / "checkpoints" / "step-00000004"
    rewards = history(uri, first.run_id, "train/reward")
    branch = run("b", 8, str(older))
    assert branch.run_id not in (first.run_id, None) and branch.run_id == run_id_of(tmp_path / "b")
    tags = MlflowClient(uri).get_run(branch.run_id).data.tags
    assert tags["rlhflab.resumed_from_run"] == first.run_id and tags["rlhflab.resumed_from"] == str(older.resolve())
    assert steps(branch.run_id) == [5, 6, 7, 8]  # none dropped
    assert history(uri, first.run_id, "train/reward") == rewards  # the first run is as it was
    # a directory's own newest checkpoint, named or found by auto, goes on in the run that wrote it
    assert run("b", 10, str(tmp_path / "b" / "checkpoints" / "step-00000008")).run_id == branch.run_id
    assert run("b", 12, "auto").run_id == branch.run_id
    assert steps(branch.run_id) == [5, 6, 7, 8, 9, 10, 11, 12]


def test_a_new_line_of_training_is_refused_a_directory_holding_another_runs_checkpoints(make_cfg, tmp_path):
    """Before, a new run (or a branch back to an older checkpoint) in a directory holding another run's checkpoints
    had its own deleted as they were written (checkpoint.keep keeps the highest steps: the other run's), and
    resume=auto then continued the other run. Now one line, before any model loads and before any MLflow run."""
    out = tmp_path / "a"
    first = train(make_cfg("trainer.max_steps=6", "checkpoint.every_n_steps=2", f"output.dir={out}"))
    held = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert held == ["step-00000004", "step-00000006"]
    shutil.rmtree(out / "policy")  # as a stopped run left it (a finished one's policy is named first)
    refusals = {
        "null": f"output.dir: {out} already holds another run's checkpoints (step-00000004 .. step-00000006); continue "
                f"that run with resume=auto, or give this run another output.dir (or remove {out}/checkpoints)",
        str(out / "checkpoints" / "step-00000004"): f"resume: {out}/checkpoints/step-00000004 is older than step-00000006 "
                f"beside it; start from it in another output.dir (resume={out}/checkpoints/step-00000004 "
                "output.dir=<new dir>), or continue from the newest with resume=auto",
    }
    for resume, refusal in refusals.items():
        with pytest.raises(ConfigError) as err:
            train(make_cfg("trainer.max_steps=8", "checkpoint.every_n_steps=2", f"resume={resume}", f"output.dir={out}"))
        assert str(err.value) == refusal
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == held
    client = MlflowClient(make_cfg().logger.tracking_uri)
    experiment = client.get_run(first.run_id).info.experiment_id
    assert [r.info.run_id for r in client.search_runs([experiment])] == [first.run_id]  # no run was made for either
    assert train(make_cfg("trainer.max_steps=8", "checkpoint.every_n_steps=2", "resume=auto", f"output.dir={out}")).run_id == first.run_id


def test_resume_auto_passes_over_a_damaged_checkpoint_and_refuses_when_all_are(make_cfg, tmp_path, caplog):
    """A damaged newest checkpoint is named and an older one continues. With every one damaged, resume=auto started a
    new run there, whose own checkpoints checkpoint.keep then deleted as below the damaged ones' steps."""
    from rlhflab.lit.checkpoint import WEIGHTS

    out = tmp_path / "a"
    args = ["checkpoint.every_n_steps=2", f"output.dir={out}"]
    first = train(make_cfg("trainer.max_steps=4", *args))
    step2, step4 = sorted((out / "checkpoints").iterdir())
    (step4 / WEIGHTS).write_bytes(b"")  # a disk that lost it
    again = train(make_cfg("trainer.max_steps=6", "resume=auto", *args))
    assert f"checkpoint {step4} is damaged ({WEIGHTS} is 0 bytes" in caplog.text
    assert again.run_id == first.run_id and again.module.updates == 6
    for path in (out / "checkpoints").iterdir():
        (path / WEIGHTS).write_bytes(b"")
    with pytest.raises(ConfigError) as err:
        train(make_cfg("trainer.max_steps=8", "resume=auto", *args))
    assert str(err.value) == (f"resume=auto: every checkpoint in {out}/checkpoints is damaged (named above); remove them to "
                              "start a new run there, or give another output.dir")


@pytest.mark.slow
def test_a_resume_that_changes_a_group_names_the_group(tmp_path, stage_cache):
    """resume=auto algo=grpo listed the 7 keys the group sets (algo._target_: ...RLOO -> ...GRPO; algo.kl_coef: ...),
    and a forgotten debug=default its settings in rl, stages and task, never the group the user changed."""
    from conftest import cli_run

    out = tmp_path / "run"
    args = ["debug=default", "trainer.enable_progress_bar=false", "trainer.max_steps=2", "checkpoint.every_n_steps=2", f"output.dir={out}",
            f"cache_dir={stage_cache}", f"logger.tracking_uri=sqlite:///{tmp_path}/mlflow.db"]
    with cli_run(args, tmp_path) as proc:
        output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    refusals = {
        "algo=grpo": f"error: resume: {out}/checkpoints/step-00000002 was made with other settings (algo: rloo -> grpo; "
                     "off_policy: behaviour -> decoupled); run with the same settings",
        "~debug": f"error: resume: {out}/checkpoints/step-00000002 was made with other settings (debug: default -> (none); rl.",
    }
    for change, start in refusals.items():
        with cli_run([*args, "resume=auto", change], tmp_path) as proc:
            output, _ = proc.communicate(timeout=300)
        (line,) = [l for l in output.splitlines() if l.startswith("error: ")]
        assert proc.returncode == 2 and line.startswith(start), line
        assert "algo._target_" not in line
    # A resume that trains further: MLflow keeps a param's first value (trainer.max_steps stayed 2, and nothing in the
    # run said it had trained to 3, nor with which command, nor where the resume's train.log went).
    with cli_run([*args, "resume=auto", "trainer.max_steps=3"], tmp_path) as proc:
        output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    run = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(run_id_of(out))
    assert run.data.params["trainer.max_steps"] == "2" and run.data.tags["rlhflab.changed_on_resume"] == "trainer.max_steps: 2 -> 3"
    first, resumed = run.data.tags["mlflow.note.content"].split("\n\nResumed at ")
    assert first.startswith(f"`python src/train.py {' '.join(args)}`")
    command = f"`python src/train.py {' '.join([*args, 'resume=auto', 'trainer.max_steps=3'])}`"
    assert resumed.startswith(f"{run.data.tags['rlhflab.resumed_at']}: {command} (changed: trainer.max_steps: 2 -> 3); Hydra output "
                              "directory (train.log, .hydra/): `"), resumed
    assert Path(resumed.split("`")[-2], "train.log").is_file()


def test_a_reward_that_fails_before_any_checkpoint_says_what_to_do(make_cfg, tmp_path, capsys, caplog):
    """Without a checkpoint the failure's line said only what failed, where a Ctrl-C says there is nothing to resume.
    It named no line of the function, and train.log had neither the line nor the function's traceback."""
    import rlhflab.train as entry

    fn = tmp_path / "early.py"
    fn.write_text("def ask(server):\n    raise OSError(f'{server} went away')\n\n\n"
                  "def score(prompts, completions, **columns):\n    return [ask('the reward server') for c in completions]\n")
    with pytest.raises(SystemExit):
        entry.main(make_cfg("reward=function", f"reward.fn={fn}:score", "trainer.max_steps=4"))
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"raised OSError: the reward server went away at {fn}:2 (on " in err, err
    assert err.endswith("; no checkpoint was written before it (set checkpoint.every_n_steps to keep some), so once fixed "
                        "the same command starts anew (the stages that finished are cached)"), err
    # train.log (the root logger's file, not the console: the line went to stderr) has the line and the traceback
    logged = [r for r in caplog.records if r.levelname == "ERROR" and getattr(r, "console", True) is False]
    assert len(logged) == 1 and logged[0].getMessage().startswith(err + "\nTraceback (most recent call last):")
    assert f'File "{fn}", line 6, in score' in logged[0].getMessage() and f'File "{fn}", line 2, in ask' in logged[0].getMessage()


def test_a_reward_function_edited_before_a_resume_is_said(make_cfg, tmp_path, caplog):
    """Only the data files were kept with a checkpoint: a reward function edited between a stop and resume=auto gave
    the run's steps after it another reward, without a word. Warned, not refused: fixing the function that failed a
    run and continuing is what that failure's line says to do."""
    fn = tmp_path / "words.py"
    fn.write_text("def score(prompts, completions, **columns):\n    return [float(c.count('good')) for c in completions]\n")
    args = ["reward=function", f"reward.fn={fn}:score", "checkpoint.every_n_steps=2"]
    first = train(make_cfg(*args, "trainer.max_steps=2"))
    with caplog.at_level(logging.WARNING, logger="rlhflab"):
        train(make_cfg(*args, "trainer.max_steps=3", "resume=auto"))  # the same file: nothing said (step 3 logged)
        assert not [r for r in caplog.records if "edited" in r.getMessage()]
        fn.write_text(fn.read_text().replace("float(", "2 * float("))  # step 3, from the step-2 checkpoint, again
        train(make_cfg(*args, "trainer.max_steps=4", "resume=auto"))
    (said,) = [r.getMessage() for r in caplog.records if "edited" in r.getMessage()]
    assert said == (f"resume: {fn} (reward.fn) was edited since {tmp_path}/run/checkpoints/step-00000002 was written; "
                    "RL steps after 2 use the edited function, those before it the old one (the steps after it that "
                    "the run logged are logged again: MLflow keeps both values of each)")
    # step 3 was trained on other rewards: both are in the history (they were logged once, the old function's)
    uri = make_cfg().logger.tracking_uri
    assert [s for s, _ in history(uri, first.run_id, "train/reward")] == [1, 2, 3, 3, 4]
    assert MlflowClient(uri).get_run(first.run_id).data.tags["rlhflab.edited_at_step"] == f"2: {fn} (reward.fn)"


def test_a_tag_the_store_did_not_take_goes_with_the_checkpoint_and_the_resume_writes_it(make_cfg, tmp_path, monkeypatch):
    """A resume that retrains on an edited reward function tags its run (rlhflab.edited_at_step), once: the next
    resume starts from a checkpoint written with the edited function and has nothing to say. When the store stopped
    answering at that tag, the run stopped at the next step with a checkpoint that kept its metrics but not the tag,
    and the resume that wrote the metrics never set it: the run's record lost which steps had another reward."""
    import rlhflab.train as entry

    fn = tmp_path / "words.py"
    fn.write_text("def score(prompts, completions, **columns):\n    return [float(c.count('good')) for c in completions]\n")
    args = ["reward=function", f"reward.fn={fn}:score", "checkpoint.every_n_steps=2", "logger.flush_every_s=0"]
    first = train(make_cfg(*args, "trainer.max_steps=2"))
    fn.write_text(fn.read_text().replace("float(", "2 * float("))
    writes = store_goes_away(monkeypatch, lambda m: False, tag=lambda key: key == "rlhflab.edited_at_step")
    with pytest.raises(SystemExit) as exit:
        entry.main(make_cfg(*args, "trainer.max_steps=4", "resume=auto"))
    assert exit.value.code == 1
    tag = f"2: {fn} (reward.fn)"
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000003"
    assert torch.load(checkpoint / "state.pt", weights_only=True)["unwritten_tags"] == {"rlhflab.edited_at_step": tag}
    for name in ("log_batch", "set_terminated", "set_tag", "log_text"):
        monkeypatch.setattr(MlflowClient, name, writes[name])  # it answers again
    assert train(make_cfg(*args, "trainer.max_steps=4", "resume=auto")).run_id == first.run_id
    run = MlflowClient(make_cfg().logger.tracking_uri).get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["rlhflab.edited_at_step"] == tag


def test_a_reward_that_fails_after_a_checkpoint_says_how_to_continue_and_resume_does(make_cfg, tmp_path, capsys):
    """A reward function (or its server) that fails mid-run: the error line named only the failure, though the run
    had a checkpoint to continue from once the cause is fixed. It now names the checkpoint and the command."""
    import rlhflab.train as entry

    fn = tmp_path / "flaky.py"
    fn.write_text("calls = []\n"
                  "def score(prompts, completions, **columns):\n"
                  "    calls.append(1)\n"
                  "    if len(calls) == 6:\n"
                  "        raise OSError('the reward server went away')\n"
                  "    return [float(c.count('good')) for c in completions]\n")
    out = tmp_path / "run"
    args = ["reward=function", f"reward.fn={fn}:score", "trainer.max_steps=8", "checkpoint.every_n_steps=2", f"output.dir={out}"]
    with pytest.raises(SystemExit) as exit:
        entry.main(make_cfg(*args))
    assert exit.value.code == 1
    newest = sorted((out / "checkpoints").iterdir())[-1]
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after MLflow's own lines about a new database
    assert err.startswith(f"error: reward function score (reward.fn={fn}:score) raised OSError: the reward server went away "
                          f"at {fn}:5 (on "), err
    assert err.endswith(f"; its newest checkpoint is {newest}: once fixed, the same command with resume=auto "
                        f"output.dir={out} continues from it"), err
    failed = run_id_of(out)
    client = MlflowClient(make_cfg().logger.tracking_uri)
    assert client.get_run(failed).info.status == "FAILED"
    from rlhflab.lit import checkpoint as ckpt

    before = ckpt.read(newest).state["elapsed"]  # seconds of RL and in all, up to the checkpoint
    assert 0 < before["rl_s"] < before["total_s"]
    done = train(make_cfg(*args, "resume=auto"))  # the function no longer fails: as the line says
    assert done.run_id == failed and client.get_run(failed).info.status == "FINISHED"
    tags = client.get_run(failed).data.tags  # a FINISHED run kept the failure's tag, and read as failed
    assert "rlhflab.error" not in tags and tags["rlhflab.error_before_resume"].startswith("RewardError: reward function score")
    assert [step for step, _ in history(make_cfg().logger.tracking_uri, failed, "train/reward")] == list(range(1, 9))
    # perf/rl_s and perf/total_s were the time since the resume; now the whole run's: the checkpoint's count, then more
    assert done.module.elapsed_before == before and done.metrics["perf/rl_s"] > before["rl_s"]
    assert done.metrics["perf/total_s"] > before["total_s"] + done.metrics["perf/stages_s"]
    # each evaluation's seconds of RL (the report's time axis), counted on across the resume as perf/rl_s is: the
    # axis was MLflow's timestamps, which count the time between the failure and the resume
    clock = history(make_cfg().logger.tracking_uri, failed, "eval/rl_s")
    gold = history(make_cfg().logger.tracking_uri, failed, "eval/gold_reward")
    assert [step for step, _ in clock] == [step for step, _ in gold] and 0 <= clock[0][1] < 10
    assert all(a <= b for (_, a), (_, b) in zip(clock, clock[1:])) and clock[-1][1] <= done.metrics["perf/rl_s"]


def store_goes_away(monkeypatch, when, tag=lambda key: False) -> dict:
    """From the first metrics write holding a row `when` picks (or the first tag whose key `tag` picks), the client's
    writes raise what MLflow raises for a
    server that refuses connections (seen against a killed `mlflow server`). Returns the real writes, and under
    "tries" the list of the writes the run tried since (each costs minutes of MLflow's retries against a real server;
    the system metrics thread's are its own, and not counted: under load it wrote 4 where the run wrote 2)."""
    from mlflow.exceptions import MlflowException

    refused = ("API request to http://127.0.0.1:5123/api/2.0/mlflow/runs/log-batch failed with exception "
               "HTTPConnectionPool(host='127.0.0.1', port=5123): Max retries exceeded with url: /api/2.0/mlflow/runs/"
               "log-batch (Caused by NewConnectionError(\"HTTPConnection(host='127.0.0.1', port=5123): Failed to "
               "establish a new connection: [Errno 111] Connection refused\"))")
    down = []
    writes = {name: getattr(MlflowClient, name) for name in ("log_batch", "set_terminated", "set_tag", "log_text")}

    def failing(name):
        def write(self, *args, **kwargs):
            if not down and (any(when(m) for m in kwargs.get("metrics") or ()) or (name == "set_tag" and tag(args[1]))):
                down.append(True)
            if down:
                if threading.current_thread() is threading.main_thread():  # the run's own tries: MLflow's system
                    tries.append(name)  # metrics thread writes every 10 s too, more of them the slower the machine
                raise MlflowException(refused)
            return writes[name](self, *args, **kwargs)
        return write

    for name in writes:
        monkeypatch.setattr(MlflowClient, name, failing(name))
    tries = []
    return {**writes, "tries": tries}


def test_a_lost_store_is_tried_once_more_at_the_end_not_again_for_the_system_metrics(tmp_path, monkeypatch):
    """MLflow's system metrics monitor writes, at its finish(), the samples its thread could not: one more write, in
    the run's thread, at a store that stopped answering (minutes of MLflow's retries against a real server). It came
    only when the run outlasted the 10 s sampling interval, so a loaded machine's suite saw 3 tries where the run
    made 2."""
    from mlflow.entities import Metric

    from rlhflab.tracking import MlflowTracker

    tracker = MlflowTracker(f"sqlite:///{tmp_path}/mlflow.db", "lost", flush_every_s=0)
    tracker.start(OmegaConf.create({"algo": {"name": "rloo"}}), {"algo": "rloo"}, [], tmp_path)
    assert tracker._system is not None
    tracker._system.mlflow_logger.data.append(Metric("system/cpu_utilization_percentage", 1.0, 0, 0))  # a sample kept
    writes = store_goes_away(monkeypatch, lambda m: m.key == "train/reward")
    tracker.log_metrics({"train/reward": 1.0}, step=1)  # the store is lost here
    assert tracker.lost is not None
    tracker.finish("FAILED")
    assert writes["tries"] == ["log_batch", "log_batch"], writes["tries"]  # where it was lost, and as the run ended


def test_a_tracking_store_that_stops_answering_stops_the_run_with_a_checkpoint_keeping_its_metrics(make_cfg, tmp_path,
                                                                                                     monkeypatch, capsys):
    """A tracking server down for longer than MLflow's retries: the run died at its next metrics write with a
    ~180-line chained traceback, no checkpoint (none was due), the buffered metrics lost and the run left RUNNING.
    Now it stops at the step boundary with a checkpoint that keeps the unwritten metrics, in one line, and a
    resume once the store answers writes them first: every step once. The failure is MLflow's own exception for
    a refused connection (seen against a killed `mlflow server`), raised by the client's writes."""
    import rlhflab.train as entry

    writes = store_goes_away(monkeypatch, lambda m: m.key == "train/reward" and m.step == 3)
    out = tmp_path / "run"
    args = ["trainer.max_steps=8", "logger.flush_every_s=0", f"output.dir={out}"]
    with pytest.raises(SystemExit) as exit:
        entry.main(make_cfg(*args))
    assert exit.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    checkpoint = out / "checkpoints" / "step-00000003"
    assert err == (f"error: mlflow: {make_cfg().logger.tracking_uri} stopped answering ([Errno 111] Connection refused); "
                   "the run stopped at RL step 3 with a checkpoint that keeps the 20 metric values it could not write; "
                   f"its newest checkpoint is {checkpoint}: once fixed, the same command with resume=auto "
                   f"output.dir={out} continues from it"), err
    kept = torch.load(checkpoint / "state.pt", weights_only=True)["unwritten_metrics"]
    assert any(key == "train/reward" and step == 3 for key, _, _, step in kept), kept
    for name in ("log_batch", "set_terminated", "set_tag", "log_text"):
        monkeypatch.setattr(MlflowClient, name, writes[name])  # it answers again
    run_id = run_id_of(out)
    uri = make_cfg().logger.tracking_uri
    assert MlflowClient(uri).get_run(run_id).info.status == "RUNNING"  # it could not be ended either
    assert train(make_cfg(*args, "resume=auto")).run_id == run_id
    assert MlflowClient(uri).get_run(run_id).info.status == "FINISHED"
    assert [step for step, _ in history(uri, run_id, "train/reward")] == list(range(1, 9))


def test_a_store_lost_in_the_stages_is_tried_once_more_as_the_run_ends_not_at_every_stage_end(make_cfg, tmp_path,
                                                                                             monkeypatch, capsys):
    """Each try against a server that is down costs MLflow's retries, ~4 minutes at its defaults. A store lost in stage
    sft was tried again at that stage's end, stage rm's end and the checkpoint: ~16 minutes before the run stopped at
    RL step 1. Now the metrics wait, unwritten, for the checkpoint, and the run's end tries once more."""
    import rlhflab.train as entry

    writes = store_goes_away(monkeypatch, lambda m: m.key.startswith("sft/"))
    out = tmp_path / "run"
    args = ["trainer.max_steps=4", "logger.flush_every_s=0", f"output.dir={out}", f"cache_dir={tmp_path}/cache"]
    with pytest.raises(SystemExit) as exit:
        entry.main(make_cfg(*args))
    assert exit.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "stopped answering ([Errno 111] Connection refused); the run stopped at RL step 1 with a checkpoint" in err, err
    assert writes["tries"] == ["log_batch", "log_batch"], writes["tries"]  # where it was lost, and as the run ended
    for name in ("log_batch", "set_terminated", "set_tag", "log_text"):
        monkeypatch.setattr(MlflowClient, name, writes[name])  # it answers again
    uri = make_cfg().logger.tracking_uri
    run_id = run_id_of(out)
    assert train(make_cfg(*args, "resume=auto")).run_id == run_id
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FINISHED" and "perf/param_bytes_trainable" in run.data.params  # not written then
    assert history(uri, run_id, "sft/loss") and [s for s, _ in history(uri, run_id, "train/reward")] == [1, 2, 3, 4]


@contextmanager
def unanswering_server():
    """A local port that takes each connection and closes it unanswered, as a tracking server that died does: MLflow's
    real client retries every request to it for minutes (urllib3's retries, a growing backoff). Yields its URL and
    the list of connections it took."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    taken, done = [], threading.Event()

    def serve():
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            taken.append(conn.getpeername())
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", taken
    finally:
        done.set()
        thread.join()
        server.close()


def signal_at_first_retry(monkeypatch) -> threading.Thread:
    """SIGINT to this process as soon as MLflow's client retries the run's write (the tracker says so), while the
    main thread waits in those retries."""
    from rlhflab.interrupts import STOP
    from rlhflab.tracking import MlflowTracker

    retried, real = threading.Event(), MlflowTracker.retrying

    def retrying(self, message):
        real(self, message)
        retried.set()

    monkeypatch.setattr(MlflowTracker, "retrying", retrying)

    def send():
        if retried.wait(300) and STOP.store is not None:
            os.kill(os.getpid(), signal.SIGINT)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender


@pytest.mark.parametrize("where", ["rl loop", "stage", "run's end"])
def test_a_signal_while_mlflow_retries_a_store_that_does_not_answer_gives_the_store_up_at_once(tmp_path, monkeypatch,
                                                                                                caplog, where):
    """A tracking server that went down: MLflow's client retried each write for ~4 minutes, and nothing was said until
    the retries ended. Ctrl-C in that time said it was stopping after this step, then waited them out (a second
    Ctrl-C stopped at once, without a checkpoint). Now the first retry is said at once, and a first signal gives the
    store up: the write ends, keeping its metrics (for the checkpoint, or the run's file), and the run's end tries
    nothing more. Where the signal stops: in the RL loop at the next step; in a stage at once; as the run ends, once
    it has ended (its status unwritten). Real MLflow client and urllib3 retries, against a port that answers nothing."""
    from mlflow.entities import Metric

    from rlhflab.interrupts import STOP
    from rlhflab.quiet import quiet_libraries
    from rlhflab.tracking import MlflowTracker

    quiet_libraries()  # (urllib3's retries, said by the tracker; train() calls it)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with unanswering_server() as (url, taken), STOP.installed():
            tracker = MlflowTracker(url, "gone", flush_every_s=0)
            tracker.run_id = "0" * 32  # its run was made while the server answered
            sender = signal_at_first_retry(monkeypatch)
            if where == "rl loop":
                with STOP.at_step_boundaries():
                    tracker.log_metrics({"train/reward": 1.0}, step=1)
                assert STOP.signum == signal.SIGINT  # the loop stops at its next step boundary, with a checkpoint
            elif where == "stage":
                with pytest.raises(RunInterrupted):
                    tracker.log_metrics({"sft/loss": 1.0}, step=1)
            else:
                tracker.pending.append(Metric("perf/total_s", 1.0, 0, 2))
                with STOP.ending_run():
                    tracker.finish("FINISHED")
                assert STOP.held == signal.SIGINT  # the caller acts on it once the run's end is over
            sender.join()
            tries = len(taken)
            tracker.finish("KILLED")  # tries nothing more: each try is MLflow's minutes of retries again
            assert len(taken) == tries and tries < 8, taken  # MLflow's 7 retries were not waited out
    finally:
        signal.signal(signal.SIGINT, before)
    assert tracker.abandoned and tracker.lost.endswith("; SIGINT did not wait for MLflow's retries"), tracker.lost
    assert len(tracker.pending) == 1  # kept: a checkpoint or the run's file holds it
    said = [m for m in caplog.messages if m.startswith(f"mlflow: {url} does not answer (")]
    assert said == [f"mlflow: {url} does not answer ({said[0].split('(', 1)[1].split(')')[0]}); MLflow retries for minutes "
                    "(MLFLOW_HTTP_REQUEST_MAX_RETRIES) before the run goes on without it; Ctrl-C stops the run now"], said
    assert not any("Retrying" in m for m in caplog.messages)  # urllib3's own lines stay unprinted


def test_ctrl_c_while_the_tracking_server_is_down_stops_the_run_with_a_checkpoint_a_resume_continues(
        make_cfg, tmp_path, monkeypatch, capsys):
    """The run's whole path: its tracking server goes down at RL step 3 (here the tracker's client is pointed at a
    port that answers nothing), the user presses Ctrl-C during MLflow's retries, and the run stops at that step's end
    with a checkpoint that keeps the metrics the store did not take, in one line that says the MLflow run is left
    RUNNING and why. With the store back, resume=auto continues it to FINISHED, every step logged once."""
    import rlhflab.train as entry
    from mlflow.tracking import MlflowClient as Client

    from rlhflab.tracking import MlflowTracker

    out, uri = tmp_path / "run", make_cfg().logger.tracking_uri
    args = ["trainer.max_steps=8", "logger.flush_every_s=0", f"output.dir={out}"]
    real = MlflowTracker.log_metrics
    with unanswering_server() as (url, taken):
        def log_metrics(self, metrics, step, again=False):
            if step == 3 and "train/reward" in metrics and self.tracking_uri != url:  # the server goes down
                self.tracking_uri, self._client = url, Client(url)
                signal_at_first_retry(monkeypatch)
            return real(self, metrics, step, again)

        monkeypatch.setattr(MlflowTracker, "log_metrics", log_metrics)
        before = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            with pytest.raises(SystemExit) as exit:
                entry.main(make_cfg(*args))
        finally:
            signal.signal(signal.SIGINT, before)
        assert exit.value.code == 130 and 0 < len(taken) < 8, taken
    line = capsys.readouterr().err.strip().splitlines()[-1]
    checkpoint = out / "checkpoints" / "step-00000003"  # the step whose write it was: its boundary came next
    assert re.fullmatch(rf"stopped: stopped by SIGINT; the MLflow run is left RUNNING, as {url} stopped answering "
                        r"\([^;]+; SIGINT did not wait for MLflow's retries\)\. Continue with the same command and "
                        rf"resume=auto output\.dir={out}", line), line
    kept = torch.load(checkpoint / "state.pt", weights_only=True)["unwritten_metrics"]
    assert {step for key, _, _, step in kept if key == "train/reward"} == {3}, kept
    run_id = run_id_of(out)
    assert MlflowClient(uri).get_run(run_id).info.status == "RUNNING"
    monkeypatch.setattr(MlflowTracker, "log_metrics", real)  # it answers again
    assert train(make_cfg(*args, "resume=auto")).run_id == run_id
    assert MlflowClient(uri).get_run(run_id).info.status == "FINISHED"
    assert [step for step, _ in history(uri, run_id, "train/reward")] == list(range(1, 9))


def test_a_tracking_store_gone_at_the_runs_end_leaves_its_metrics_in_a_file_that_resume_auto_writes(make_cfg, tmp_path,
                                                                                                    monkeypatch, capsys, caplog):
    """The store stops answering as the trained run writes its summaries: nothing is left to train, so the metrics it
    did not take go to a file named in one line, beside the saved policy. The MLflow run then stayed RUNNING for good:
    nothing wrote the file, and resume=auto refused the directory (a saved policy, no checkpoint). Now, once the store
    answers, resume=auto writes them, every step once, and ends the run FINISHED, training and loading nothing."""
    import rlhflab.train as entry

    writes = store_goes_away(monkeypatch, lambda m: m.key == "perf/total_s")
    out = tmp_path / "run"
    args = ["trainer.max_steps=2", "logger.flush_every_s=0", f"output.dir={out}"]
    with pytest.raises(SystemExit) as exit:
        entry.main(make_cfg(*args))
    assert exit.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    kept = json.loads((out / "unwritten_metrics.json").read_text())
    assert "perf/total_s" in {key for key, _, _, _ in kept["metrics"]}
    # the tag that says how perf/peak_mem_mb was measured, set after the store went: it was dropped without a word
    assert kept["tags"] == {"perf/mem_method": "tracked_bytes"}
    uri, run_id = make_cfg().logger.tracking_uri, run_id_of(out)
    # the warning said the run would stop at its next RL step with a checkpoint: RL had ended
    assert (f"mlflow: {uri} did not take the run's metrics ([Errno 111] Connection refused); RL has ended, so what was not "
            "written goes to unwritten_metrics.json in the output directory as the run ends") in caplog.messages
    assert err == (f"error: mlflow: {uri} stopped answering ([Errno 111] Connection refused); the run trained to the end "
                   f"(policy: {out}/policy), but its MLflow run {run_id} is not ended and {len(kept['metrics'])} metric values are in "
                   f"{out}/unwritten_metrics.json instead; once it answers, the same command with resume=auto "
                   f"output.dir={out} writes them and ends the run FINISHED"), err
    policy = (out / "policy" / "model.safetensors").read_bytes()
    with pytest.raises(TrackingLost) as err:  # still down: said, and the file kept
        train(make_cfg(*args, "resume=auto"))
    assert str(err.value) == (f"mlflow: {uri} still does not answer ([Errno 111] Connection refused); the {len(kept['metrics'])} metric "
                              f"values stay in {out}/unwritten_metrics.json and the MLflow run {run_id} is not ended")
    assert (out / "unwritten_metrics.json").is_file() and MlflowClient(uri).get_run(run_id).info.status == "RUNNING"
    assert [a.path for a in MlflowClient(uri).list_artifacts(run_id)] == ["config.yaml", "policy"]  # not generations.json
    for name in ("log_batch", "set_terminated", "set_tag", "log_text"):
        monkeypatch.setattr(MlflowClient, name, writes[name])  # it answers again
    done = train(make_cfg(*args, "resume=auto"))
    assert done.run_id == run_id and done.module is None and (out / "policy" / "model.safetensors").read_bytes() == policy
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FINISHED" and not (out / "unwritten_metrics.json").exists()
    assert [a.path for a in MlflowClient(uri).list_artifacts(run_id)] == ["config.yaml", "generations.json", "policy"]
    for key, value, _, step in kept["metrics"]:
        assert (step, value) in history(uri, run_id, key)
    assert run.data.tags["perf/mem_method"] == "tracked_bytes"
    assert [s for s, _ in history(uri, run_id, "train/reward")] == [1, 2]  # every step once
    assert done.metrics["perf/total_s"] == run.data.metrics["perf/total_s"]


def test_two_runs_started_in_the_same_second_get_their_own_directories(tmp_path):
    """Hydra's default run directory was outputs/<date>/<HH-MM-SS>: two runs a script started at once (`&`) shared
    it, and the second's policy/ and .hydra/config.yaml replaced the first's. It is now to the microsecond."""
    cmd = [sys.executable, TRAIN, "--cfg", "hydra", "--resolve"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    dirs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        dirs.append(next(line.split()[1] for line in out.splitlines() if line.strip().startswith("dir: outputs/")))
    assert dirs[0] != dirs[1], dirs


def test_a_second_run_in_a_directory_in_use_is_one_line(make_cfg, tmp_path):
    """The same output.dir twice at once overwrote the first run's policy/, checkpoints and mlflow_run.json while
    both trained. The run there holds a lock; another is refused before any model loads or MLflow run exists."""
    from rlhflab.train import LOCK_FILE

    out = tmp_path / "run"
    out.mkdir()
    # the first run, as far as the lock goes: another process that holds it (and wrote its pid)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys\n"
                               f"f = open({str(out / LOCK_FILE)!r}, 'a+'); fcntl.lockf(f, fcntl.LOCK_EX)\n"
                               "f.truncate(0); f.write(str(os.getpid())); f.flush(); print('held', flush=True)\n"
                               "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ConfigError) as err:
            train(make_cfg("trainer.max_steps=2", f"output.dir={out}"))
        assert str(err.value) == (f"output.dir: {out} is in use by another run (pid {holder.pid}); give this run another "
                                  "output.dir, or wait for that one to end")
        assert not (out / "mlflow_run.json").exists()
    finally:
        holder.kill()
        holder.wait()
    assert train(make_cfg("trainer.max_steps=2", f"output.dir={out}")).output_dir == out  # free once it ended


def test_resume_into_a_store_without_the_run_is_one_line_and_the_fix_it_gives_works(make_cfg, tmp_path, monkeypatch):
    """`resume=auto` started from another working directory (the default sqlite:///mlflow.db is relative to it),
    against another store, or after the run was deleted in the UI met MLflow's 'Run with id=... not found'
    traceback (or 'The run ... must be in the active state'). One line now, before any model loads."""
    out = tmp_path / "run"
    first = train(make_cfg("trainer.max_steps=2", "checkpoint.every_n_steps=2", f"output.dir={out}"))
    store = make_cfg().logger.tracking_uri
    assert json.loads((out / "mlflow_run.json").read_text())["tracking_uri"] == store
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    checkpoint = out / "checkpoints" / "step-00000002"
    relative = make_cfg("trainer.max_steps=4", "resume=auto", f"output.dir={out}")
    with open_dict(relative):
        relative.logger.tracking_uri = "sqlite:///mlflow.db"  # the default, from another directory
    with pytest.raises(ConfigError) as err:
        train(relative)
    assert str(err.value) == (f"resume: {checkpoint} continues a run, but its MLflow run {first.run_id} is not in "
                              f"sqlite:///mlflow.db (relative to {elsewhere}); it was logged to {store}; point "
                              "logger.tracking_uri (or MLFLOW_TRACKING_URI) at the store that holds it, or continue as a "
                              f"new MLflow run in another directory: resume={checkpoint} output.dir=<another dir>")
    forked = make_cfg("trainer.max_steps=3", f"resume={checkpoint}", f"output.dir={tmp_path}/branch")
    with open_dict(forked):
        forked.logger.tracking_uri = "sqlite:///mlflow.db"
    assert train(forked).module.updates == 3  # the second way out: a new run in this store, from the checkpoint
    MlflowClient(store).delete_run(first.run_id)
    with pytest.raises(ConfigError, match=rf"its MLflow run {first.run_id} was deleted in {store} \(mlflow runs restore "):
        train(make_cfg("trainer.max_steps=4", "resume=auto", f"output.dir={out}"))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_resume_of_a_finished_budget_keeps_the_checkpoint_policy_and_history(make_cfg, tmp_path, capfd, precision):
    """A checkpoint at the step budget (a run killed after its last checkpoint, or rerun with resume=auto):
    nothing is trained, and the policy saved and the closing numbers are the checkpoint's. Not on a terminal, the
    resume's log says nothing of MLflow fetching the run's generations table to append to it (its tqdm bar
    printed 'Downloading artifacts:   0%|          | 0/1 ...' three times into the log). The generations logged
    are the run's, each once. The final evaluation, which the checkpoint predates, is made again as the fit made it:
    under bf16-mixed, under the steps' autocast, with no fit to give it."""
    first = train(make_cfg("trainer.max_steps=2", "checkpoint.every_n_steps=2", f"output.dir={tmp_path}/run",
                           f"trainer.precision={precision}"))
    saved = {k: v.clone() for k, v in first.module.memory.policy.state_dict().items()}
    capfd.readouterr()
    again = train(make_cfg("trainer.max_steps=2", "resume=auto", f"output.dir={tmp_path}/run", f"trainer.precision={precision}"))
    assert "Downloading artifacts" not in capfd.readouterr().err
    assert again.module.updates == 2
    assert again.metrics["eval/gold_reward"] == first.metrics["eval/gold_reward"]
    assert again.metrics["eval/kl"] == first.metrics["eval/kl"]
    assert again.metrics["eval/gold_reward_before"] == first.metrics["eval/gold_reward_before"]
    now = again.module.memory.policy.state_dict()
    assert all(torch.equal(saved[k], now[k]) for k in saved)
    # the generations of step 0 (the checkpoint's) and of the final evaluation, beside the policy and in the run's
    # table, once: the resume lost step 0's, and MLflow's log_table appended the rest to the table the run held
    rows = json.loads((tmp_path / "run" / "generations.json").read_text())
    assert [row["rl_step"] for row in rows] == [0] * 4 + [2] * 4, rows
    client = MlflowClient(make_cfg().logger.tracking_uri)
    table = json.loads(Path(client.download_artifacts(first.run_id, "generations.json", str(tmp_path))).read_text())
    assert table["data"] == [list(row.values()) for row in rows], (len(table["data"]), len(rows))
    assert client.get_run(first.run_id).data.tags["mlflow.loggedArtifacts"] == '[{"path": "generations.json", "type": "table"}]'


def test_a_budget_below_the_checkpoint_is_refused_and_keeps_the_policy_trained_further(make_cfg, tmp_path):
    """A checkpoint at step 2, the run then trained on to 4 (no checkpoint there), then resume=auto with
    trainer.max_steps=1: 'nothing left to train' replaced the step-4 policy with step 2's, in the output directory
    and in the MLflow run whose curves end at step 4. Now one line, before any run or model."""
    out = tmp_path / "run"
    train(make_cfg("trainer.max_steps=2", "checkpoint.every_n_steps=2", f"output.dir={out}"))
    train(make_cfg("trainer.max_steps=4", "resume=auto", f"output.dir={out}"))
    policy = (out / "policy" / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match=r"^trainer.max_steps=1: .*step-00000002 is at RL step 2, past it.*max_steps=2 or more, "
                                          r"or start anew in another output.dir \(no checkpoint of step 1 or before is left\)$"):
        train(make_cfg("trainer.max_steps=1", "resume=auto", f"output.dir={out}"))
    assert (out / "policy" / "model.safetensors").read_bytes() == policy


def test_a_budget_below_the_newest_checkpoint_names_an_older_one_to_start_from_elsewhere(make_cfg, tmp_path):
    """'Set trainer.max_steps=8 or more, or resume=<an older checkpoint>': that older checkpoint, in the same
    directory, was then refused as older than the newest beside it. The line now names it and another directory,
    and its command runs."""
    out = tmp_path / "run"
    train(make_cfg("trainer.max_steps=6", "checkpoint.every_n_steps=2", "checkpoint.keep=3", f"output.dir={out}"))
    with pytest.raises(ConfigError) as err:
        train(make_cfg("trainer.max_steps=5", "resume=auto", f"output.dir={out}"))
    assert str(err.value).endswith(f"Set trainer.max_steps=6 or more, or start from step-00000004 in another directory: "
                                   f"resume={out}/checkpoints/step-00000004 output.dir=<new dir>"), err.value
    branch = train(make_cfg("trainer.max_steps=5", f"resume={out}/checkpoints/step-00000004", f"output.dir={tmp_path}/b"))
    assert branch.module.updates == 5


# ---- the stage cache --------------------------------------------------------------------------

def test_damaged_cached_weights_are_reported_and_rebuilt(make_cfg, tmp_path, caplog):
    cache = tmp_path / "cache"
    train(make_cfg("trainer.max_steps=1", f"cache_dir={cache}"))
    (entry,) = (cache / "stages").glob("sft-*")
    (entry / "model.safetensors").write_bytes(b"")  # zero-length
    with caplog.at_level(logging.WARNING):
        result = train(make_cfg("trainer.max_steps=1", f"cache_dir={cache}"))
    assert f"the cached entry {entry} is damaged (model.safetensors is 0 bytes" in caplog.text and "rebuilding" in caplog.text
    assert result.module.updates == 1 and (entry / "model.safetensors").stat().st_size > 0


def test_a_broken_reward_model_is_not_cached(make_cfg, tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises((StageFailed, NonFiniteError), match=r"^stage rm: .*(not cached|nothing was cached)"):
        train(make_cfg("trainer.max_steps=1", f"cache_dir={cache}", "stages.rm.lr=1e6"))
    assert not [p for p in (cache / "stages").glob("rm-*") if not p.name.startswith(".")]


def test_cache_keys_cover_seeds_and_not_the_cache_location(make_cfg, tmp_path, caplog):
    cfg = make_cfg()
    from omegaconf import OmegaConf, open_dict

    from rlhflab.config import validate

    task = validate(cfg).task
    model = OmegaConf.to_container(cfg.model, resolve=True)
    seed0 = ensure_base_model(model, task, tmp_path / "a")
    seed7 = ensure_base_model(model | {"init_seed": 7}, task, tmp_path / "a")
    assert seed0.path != seed7.path
    assert not torch.equal(tensors(Path(seed0.path))["lm_head.weight"], tensors(Path(seed7.path))["lm_head.weight"])
    train(make_cfg("trainer.max_steps=1", f"cache_dir={tmp_path}/a"))
    copy = tmp_path / "copied"
    shutil.copytree(tmp_path / "a", copy)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        train(make_cfg("trainer.max_steps=1", f"cache_dir={copy}"))
    assert "model: cached" in caplog.text and "stage sft: cached" in caplog.text and "stage rm: cached" in caplog.text


@pytest.mark.slow
def test_two_runs_started_at_once_on_a_fresh_cache_and_database_both_finish(tmp_path):
    env = {"RLHFLAB_CACHE": str(tmp_path / "cache"), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    args = [*SHRINK, "trainer.max_steps=2"]
    with cli_run([*args, f"output.dir={tmp_path}/a"], tmp_path, env) as a, cli_run([*args, f"output.dir={tmp_path}/b"], tmp_path, env) as b:
        codes = a.wait(timeout=400), b.wait(timeout=400)
        outputs = a.stdout.read(), b.stdout.read()
    assert codes == (0, 0), outputs[0][-2000:] + outputs[1][-2000:]
    assert sum("another run is building" in o for o in outputs) >= 1  # one waited for the other's stage
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("rlhflab").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"]


def test_training_a_finished_run_further_replaces_its_closing_summaries(make_cfg, tmp_path):
    """`resume=auto trainer.max_steps=<more>` on a finished run (DURABLE.md's "train further") kept the first finish's
    perf/rl_s, perf/total_s and perf/mean_*: they are logged at step 0, which the run already held, so the resume passed
    them over as steps it had logged, and the run (and the report) showed the 2-step run's times for 4 steps."""
    run = f"output.dir={tmp_path}/run"
    first = train(make_cfg("trainer.max_steps=2", "checkpoint.every_n_steps=2", run))
    more = train(make_cfg("trainer.max_steps=4", "checkpoint.every_n_steps=2", "resume=auto", run))
    assert more.run_id == first.run_id and more.module.updates == 4
    client = MlflowClient(make_cfg().logger.tracking_uri)
    shown = client.get_run(more.run_id).data.metrics
    for key in ("perf/rl_s", "perf/total_s", "perf/mean_step_s"):
        assert more.metrics[key] != first.metrics[key], key
        assert shown[key] == pytest.approx(more.metrics[key]), key
    # The same again, nothing left to train (a sweep's finished job under resume=auto): that process's closing values
    # replaced the run's (perf/stages_s became the cached load's 0.07 s, perf/rl_s moved at every rerun)
    train(make_cfg("trainer.max_steps=4", "checkpoint.every_n_steps=2", "resume=auto", run))
    again = client.get_run(more.run_id).data.metrics
    assert all(again[k] == shown[k] for k in ("perf/rl_s", "perf/total_s", "perf/stages_s", "perf/mean_step_s")), (again, shown)
