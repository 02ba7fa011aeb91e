"""Sweeps end to end: the sweep configs compose, a -m sweep nests its jobs under one MLflow
parent run (failed jobs included, the sweep going on), the report reads it back, and the same
works against a real `mlflow server` over HTTP."""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from conftest import NEOX_LINEAR, ROOT, compose_cfg, save_tiny_neox
from rlhflab.config import validate
from rlhflab.naming import RUN_TAG_GROUPS

SWEEPS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("sweep_*.yaml"))
# A sweep job in a few seconds: 2 RL steps on tiny data, one epoch per stage.
TINY = [
    "trainer.max_steps=2", "rl.prompts_per_step=4", "rl.eval_every=0", "stages.sft.epochs=1",
    "stages.rm.epochs=1", "task.num_demonstrations=64", "task.num_preference_pairs=64",
    "task.num_eval_prompts=4", "trainer.enable_progress_bar=false",
]


@dataclass
class Sweep:
    uri: str
    cwd: Path
    output: str


def run_sweep(cwd: Path, uri: str, cache: Path, *overrides: str, home: Path | None = None, tiny=tuple(TINY)) -> Sweep:
    """`-m` with MLFLOW_TRACKING_URI=uri; `home` is its HOME, for a uri with `~` (Sweep.uri has it expanded)."""
    env = {k: v for k, v in os.environ.items() if k != "RLHFLAB_MLFLOW_PARENT_RUN_ID"}
    env |= {"MLFLOW_TRACKING_URI": uri, "RLHFLAB_CACHE": str(cache), "OMP_WAIT_POLICY": "PASSIVE"}
    if home:
        env["HOME"], uri = str(home), uri.replace("~", str(home))
    out = subprocess.run(
        [sys.executable, str(ROOT / "src" / "train.py"), "-m", *overrides, *tiny],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return Sweep(uri, cwd, out.stdout + out.stderr)


def sweep_runs(client: MlflowClient):
    """(the one parent, its children sorted by job number)."""
    experiment = client.get_experiment_by_name("rlhflab")
    parents = client.search_runs([experiment.experiment_id], "tags.`rlhflab.sweep` = '1'")
    assert len(parents) == 1
    children = client.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'")
    return parents[0], sorted(children, key=lambda r: int(r.data.tags["rlhflab.sweep.job"]))


# ---- the configs --------------------------------------------------------------------------


def compose_sweep(name: str):
    """The config of `experiment=<name>` with its hydra node (mode, sweeper, callbacks)."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=[f"experiment={name}"], return_hydra_config=True)


def sweep_jobs(name: str) -> list[list[str]]:
    """The basic sweeper's job list: the cartesian product of hydra.sweeper.params."""
    params = compose_sweep(name).hydra.sweeper.params or {}
    axes = [[f"{key}={value}" for value in str(values).split(",")] for key, values in params.items()]
    return [list(job) for job in itertools.product(*axes)]


@pytest.mark.parametrize("name", [s for s in SWEEPS if s != "sweep_optuna"])
def test_grid_sweeps_are_multirun_and_every_job_validates(name):
    cfg = compose_sweep(name)
    assert cfg.hydra.mode.name == "MULTIRUN" and cfg.hydra.callbacks.mlflow_sweep
    missing = []
    for job in sweep_jobs(name):
        try:
            validate(compose_cfg([f"experiment={name}", *job], shrink=False))
        except MissingConfigException as err:  # an option that does not exist yet (mode=async, memory=lora)
            missing.append(str(err).splitlines()[0])
    if missing:
        pytest.skip(f"{name}: {len(missing)} job(s) need options not implemented yet, e.g. {missing[0]}")


def test_optuna_preset_searches_existing_keys_in_memory():
    cfg = compose_sweep("sweep_optuna")
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and sweeper.storage is None
    assert sweeper.direction == "maximize" and cfg.hydra.mode.name == "MULTIRUN"
    for key in sweeper.params:  # a typo here would only fail once a trial runs
        assert OmegaConf.select(cfg, key) is not None, key
    validate(compose_cfg(["experiment=sweep_optuna"], shrink=False))


# ---- a sweep on SQLite --------------------------------------------------------------------


@pytest.fixture(scope="module")
def sqlite_sweep(tmp_path_factory, stage_cache) -> Sweep:
    """rloo and grpo with seeds 1 and 2, each seed 1 job in an output directory that another run is using (this
    process holds its lock: a ConfigError at the job's start, before its MLflow run): two failures, two runs. (What
    the config and the files decide, a value the schema or the plug-ins reject, a directory that holds another run's
    checkpoints, stops the whole sweep before it starts.)"""
    import fcntl

    from rlhflab.train import LOCK_FILE

    cwd = tmp_path_factory.mktemp("sweep")
    held = []
    for job in (0, 2):
        (cwd / "out" / str(job)).mkdir(parents=True)
        held.append(open(cwd / "out" / str(job) / LOCK_FILE, "a+"))
        fcntl.lockf(held[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
        held[-1].write(str(os.getpid()))
        held[-1].flush()
    try:
        return run_sweep(cwd, f"sqlite:///{cwd}/mlflow.db", stage_cache, "algo=rloo,grpo", "seed=1,2",
                         f"output.dir={cwd}/out/${{hydra:job.num}}")
    finally:
        for handle in held:
            handle.close()


@pytest.mark.slow
def test_sweep_jobs_are_children_of_one_parent(sqlite_sweep):
    client = MlflowClient(sqlite_sweep.uri)
    parent, children = sweep_runs(client)
    assert [r.data.tags["rlhflab.sweep.job"] for r in children] == ["0", "1", "2", "3"]
    failed, finished = children[0::2], children[1::2]  # seed=1 is each algo's first job
    # Job 0 failed and job 1 still ran: the sweep went on after a failure.
    assert [r.info.status for r in children] == ["FAILED", "FINISHED", "FAILED", "FINISHED"]
    assert [r.data.tags["algo"] for r in children] == ["rloo", "rloo", "grpo", "grpo"]
    for run in finished:
        for key in ("eval/gold_reward", "eval/kl", "train/kl", "perf/samples_per_s", "perf/total_s"):
            assert key in run.data.metrics, key
    for run in failed:  # failed at its start, before the job's tracker made a run: the callback made this one
        assert run.data.tags["rlhflab.error"].startswith("ConfigError: output.dir: ")
        assert f"is in use by another run (pid {os.getpid()})" in run.data.tags["rlhflab.error"]
        assert not run.data.metrics
    for bad, good in zip(failed, finished):  # tagged alike, so a search by tag finds both
        assert {g: bad.data.tags.get(g) for g in RUN_TAG_GROUPS} == {g: good.data.tags.get(g) for g in RUN_TAG_GROUPS}
    assert parent.info.status == "FINISHED"
    # The parent says what was swept, in its name and tags, and carries the lineage a single run has.
    assert parent.info.run_name.startswith("sweep algo=rloo,grpo seed=1,2 "), parent.info.run_name
    assert json.loads(parent.data.tags["rlhflab.sweep.params"]) == {"algo": "rloo,grpo", "seed": "1,2"}
    assert {"mlflow.user", "mlflow.source.name"} <= set(parent.data.tags)
    assert "rlhflab.sweep.experiment" not in parent.data.tags  # no preset: it was the string 'None'
    # The sweep made the experiment: it opens in MLflow's training view like one a single run makes.
    experiment = client.get_experiment_by_name("rlhflab")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    assert parent.data.tags["rlhflab.sweep.best_run_id"] in {r.info.run_id for r in finished}
    assert parent.data.metrics["sweep/jobs"] == 4 and parent.data.metrics["sweep/failed_jobs"] == 2
    best = max(r.data.metrics["eval/gold_reward"] for r in finished)
    assert parent.data.metrics["best/eval/gold_reward"] == pytest.approx(best)


def test_a_sweep_of_a_task_without_gold_fn_is_judged_by_its_reward(tmp_path, stage_cache):
    """Own prompts and reward without task.gold_fn: each run reports eval/reward (and a sweeper gets it), but the
    parent had no best child and the report no quality column and no reward plots: both looked for eval/gold_reward."""
    from rlhflab.report import main as report

    ex = ROOT / "examples" / "reverse"
    sweep = run_sweep(tmp_path, f"sqlite:///{tmp_path}/m.db", stage_cache, "algo=rloo,grpo", "task=prompts",
                      f"task.path={ex}/train.jsonl", f"task.eval_path={ex}/eval.jsonl", f"task.demonstrations_path={ex}/demos.jsonl",
                      "task.tokenizer=char", "task.max_new_tokens=4", "task.num_eval_prompts=8", "reward=function",
                      f"reward.fn={ex}/reward.py:correct_digits", "stages.sft.epochs=1",
                      tiny=("trainer.max_steps=2", "rl.prompts_per_step=4", "rl.eval_every=0", "trainer.enable_progress_bar=false"))
    client = MlflowClient(sweep.uri)
    parent, children = sweep_runs(client)
    rewards = {r.info.run_id: r.data.metrics["eval/reward"] for r in children}
    assert parent.data.metrics["best/eval/reward"] == max(rewards.values())
    assert rewards[parent.data.tags["rlhflab.sweep.best_run_id"]] == max(rewards.values())
    result = report([f"sweep={parent.info.run_id}", f"tracking_uri={sweep.uri}", f"out_dir={tmp_path}/report"])
    assert {"gold_vs_step.png", "gold_vs_time.png", "gold_vs_kl.png"} <= {p.name for p in result.files}
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "- best eval/reward: " in summary and "| reward (eval; the task has no gold_fn) |" in summary
    assert "reward (eval; the task has no gold_fn) at each evaluation against RL step" in summary


def test_a_sweep_jobs_run_is_named_by_its_path_as_apart_from_the_other_jobs(tmp_path, stage_cache):
    """`reward.fn=/x/a/reward.py:f,/y/a/reward.py:f`: each job knew only its own value, and both runs were named
    'rloo fn=reward.py:correct_digits'. The sweep tells each job what it varies."""
    ex = ROOT / "examples" / "reverse"
    for where in ("x", "y"):
        (tmp_path / where / "a").mkdir(parents=True)
        shutil.copy(ex / "reward.py", tmp_path / where / "a" / "reward.py")
    fns = ",".join(f"{tmp_path}/{where}/a/reward.py:correct_digits" for where in ("x", "y"))
    sweep = run_sweep(tmp_path, f"sqlite:///{tmp_path}/m.db", stage_cache, f"reward.fn={fns}", "task=prompts",
                      f"task.path={ex}/train.jsonl", f"task.eval_path={ex}/eval.jsonl", f"task.demonstrations_path={ex}/demos.jsonl",
                      "task.tokenizer=char", "task.max_new_tokens=4", "task.num_eval_prompts=4", "reward=function",
                      "stages.sft.epochs=1",
                      tiny=("trainer.max_steps=1", "rl.prompts_per_step=4", "rl.eval_every=0", "trainer.enable_progress_bar=false"))
    parent, children = sweep_runs(MlflowClient(sweep.uri))
    assert [next(p for p in r.info.run_name.split() if p.startswith("fn=")) for r in children] == \
        ["fn=x/a/reward.py:correct_digits", "fn=y/a/reward.py:correct_digits"]
    assert parent.info.run_name.startswith("sweep fn=x/a/reward.py:correct_digits,y/a/reward.py:correct_digits ")


def test_a_jobs_reward_function_error_is_one_line_in_the_sweep_as_in_a_run(tmp_path, stage_cache):
    """A job's RewardError (one of the errors a run ends with in one line) came with ~40 lines of Hydra's traceback
    in a sweep, a ConfigError with one."""
    ex = ROOT / "examples" / "reverse"
    (tmp_path / "boom.py").write_text("def score(prompts, completions, **kw):\n    raise ValueError('boom')\n")
    sweep = run_sweep(tmp_path, f"sqlite:///{tmp_path}/m.db", stage_cache, f"reward.fn={tmp_path}/boom.py:score", "task=prompts",
                      f"task.path={ex}/train.jsonl", f"task.demonstrations_path={ex}/demos.jsonl", "task.tokenizer=char",
                      "task.max_new_tokens=4", "task.num_eval_prompts=4", "reward=function", "stages.sft.epochs=1",
                      tiny=("trainer.max_steps=1", "rl.prompts_per_step=4", "rl.eval_every=0", "trainer.enable_progress_bar=false"))
    parent, (child,) = sweep_runs(MlflowClient(sweep.uri))
    assert child.info.status == "FAILED" and child.data.tags["rlhflab.error"].startswith(f"RewardError: reward function score "
                                                                                         f"(reward.fn={tmp_path}/boom.py:score) raised ValueError: boom")
    assert "Traceback" not in sweep.output and f"failed: RewardError: reward function score (reward.fn={tmp_path}/boom.py:score) raised ValueError: boom" in sweep.output


def test_an_optimized_metric_no_run_logs_fails_each_job_in_words_and_the_parent_says_why_it_has_no_best(tmp_path,
                                                                                                          stage_cache):
    """optimized_metric=perf/gld: Optuna said 'no trial finished ... each trial's error is listed below' and listed
    none; the parent said '1 jobs, 0 failed' with no best run, and a callback metric typo ended the same, silently.
    (An eval/ name no run logs, eval/gld, is refused before the sweep: tests/test_cli.py's BAD_VALUES.)"""
    sweep = run_sweep(tmp_path, f"sqlite:///{tmp_path}/m.db", stage_cache, "seed=0", "optimized_metric=perf/gld")
    parent, (child,) = sweep_runs(MlflowClient(sweep.uri))
    assert child.data.tags["rlhflab.error"].startswith("ConfigError: optimized_metric=perf/gld: the run logs no such "
                                                       "value at its end; give one of ")
    assert "eval/gold_reward" in child.data.tags["rlhflab.error"]
    assert parent.data.metrics["sweep/failed_jobs"] == 1
    assert "mlflow sweep: no finished job logged perf/gld, so the parent has no best run" in sweep.output
    assert "rlhflab.sweep.best_run_id" not in parent.data.tags


def test_of_children_tied_on_the_metric_the_parent_names_the_first_job_as_optuna_does(tmp_path):
    """Two trials at gold 0.03125 (gold moves in steps of 1/256): Optuna printed job 1, the parent named job 2 (the
    newest first, as search_runs gives them)."""
    from hydra_plugins.rlhflab_mlflow.callback import MlflowSweepCallback

    client = MlflowClient(f"sqlite:///{tmp_path}/m.db")
    experiment = client.create_experiment("x")
    parent = client.create_run(experiment).info.run_id
    for job, gold in enumerate((0.01, 0.03125, 0.03125)):
        child = client.create_run(experiment, start_time=1_000 + job,  # the jobs one after another
                                  tags={"mlflow.parentRunId": parent, "rlhflab.sweep.job": str(job)})
        client.log_metric(child.info.run_id, "eval/gold_reward", gold)
        client.set_terminated(child.info.run_id, "FINISHED")
    callback = MlflowSweepCallback(metric="eval/gold_reward", direction="maximize")
    callback.parent_run_id = parent
    callback._summarise(client)
    best = client.get_run(client.get_run(parent).data.tags["rlhflab.sweep.best_run_id"])
    assert best.data.tags["rlhflab.sweep.job"] == "1"


def _identity_of_an_ended_process() -> str:
    """The PROCESS_TAG a process wrote before it ended (a real process, gone by the time this returns)."""
    code = "from rlhflab.naming import process_identity; print(process_identity())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip()


def test_a_process_is_gone_only_where_this_machine_can_tell():
    from rlhflab.naming import process_gone, process_identity

    ended, here = _identity_of_an_ended_process(), process_identity()
    assert process_gone(ended) and not process_gone(here)
    reused = json.loads(here) | {"start": "1"}  # this pid, but another process's start: the pid was reused
    assert process_gone(json.dumps(reused))
    for key, value in (("boot", "another-boot"), ("pid_ns", "pid:[1]")):  # another machine (or restart), a container
        assert not process_gone(json.dumps(json.loads(ended) | {key: value})), key
    for key in ("boot", "start", "pid_ns"):  # a platform without /proc said less: nothing to tell by
        assert not process_gone(json.dumps({k: v for k, v in json.loads(ended).items() if k != key})), key
    assert not any(process_gone(tag) for tag in (None, "", "garbage", "[1]", '{"pid": "x"}'))


def test_the_next_run_ends_what_a_gone_process_left_running_and_nothing_else(tmp_path, caplog):
    """A sweep SIGKILLed (the OOM killer) skipped the exit hook that ends its parent: the parent and the job it was
    running stayed RUNNING for good, as did a run SIGKILLed after its first checkpoint until a resume. The next run or
    sweep in the experiment ends them KILLED, with why; a run whose process may still run (this one's, another
    machine's, one from before the tag) is left alone."""
    from rlhflab.naming import PROCESS_TAG, STOP_TAG, process_identity
    from rlhflab.tracking import end_runs_gone

    client = MlflowClient(f"sqlite:///{tmp_path}/m.db")
    experiment = client.create_experiment("rlhflab")
    gone, here = _identity_of_an_ended_process(), process_identity()
    elsewhere = json.dumps(json.loads(gone) | {"boot": "another-machine"})

    def run(process: str | None, parent: str | None = None, status: str = "RUNNING", **tags) -> str:
        tags |= {"rlhflab.sweep": "1"} if parent is None else {"mlflow.parentRunId": parent} if parent else {}
        made = client.create_run(experiment, tags=tags | ({PROCESS_TAG: process} if process else {})).info.run_id
        if status != "RUNNING":
            client.set_terminated(made, status)
        return made

    (tmp_path / "a" / "checkpoints" / "step-00000004").mkdir(parents=True)
    killed = run(gone)
    killed_jobs = [run(gone, killed, status) for status in ("FINISHED", "RUNNING")]
    job_elsewhere = run(elsewhere, killed)  # a job another launcher ran on another machine: it may still run
    alive, other_machine, untagged, finished = run(here), run(elsewhere), run(None), run(gone, status="FINISHED")
    single = run(gone, "", **{"rlhflab.output_dir": str(tmp_path / "a")})  # a run alone, with a checkpoint
    by = run(here, "")
    with caplog.at_level("WARNING", logger="rlhflab.tracking"):
        assert sorted(r.info.run_id for r in end_runs_gone(client, experiment, by)) == sorted([killed, killed_jobs[1], single])
    runs = (killed, *killed_jobs, job_elsewhere, alive, other_machine, untagged, finished, single, by)
    assert [client.get_run(r).info.status for r in runs] == ["KILLED", "FINISHED", "KILLED", "RUNNING", "RUNNING", "RUNNING",
                                                             "RUNNING", "FINISHED", "KILLED", "RUNNING"]
    for ended in (killed, killed_jobs[1], single):
        assert client.get_run(ended).data.tags[STOP_TAG] == ("its process ended without ending it (SIGKILL, the OOM killer, or a "
                                                             f"tracking store that stopped answering); ended by the next run in its experiment, {by}")
    said = sorted(r.getMessage() for r in caplog.records)
    assert len(said) == 3 and all(", left RUNNING by a process that is gone (SIGKILL, or a store that stopped answering), is ended KILLED" in s for s in said)
    assert any(s.startswith(f"mlflow: the sweep {killed} (") for s in said)
    assert any(s.startswith(f"mlflow: run {single} (") and s.endswith(
        f"; resume=auto output.dir={tmp_path / 'a'} continues it from its newest checkpoint") for s in said)


@pytest.mark.parametrize("signalled", [True, False])
def test_a_sweep_stopped_before_its_jobs_run_was_made_ends_killed_not_failed(tmp_path, monkeypatch, signalled):
    """A Ctrl-C as a job started, before its tracker made its run: the job had no KILLED run to tell a stop from a
    crash by, and the parent ended FAILED, 'ended by an error'."""
    from hydra_plugins.rlhflab_mlflow.callback import MlflowSweepCallback
    from rlhflab.interrupts import STOP

    uri = f"sqlite:///{tmp_path}/m.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("rlhflab")
    callback = MlflowSweepCallback(metric="eval/gold_reward", direction="maximize")
    callback._uri, callback.parent_run_id = uri, client.create_run(experiment).info.run_id
    callback._job = OmegaConf.create({"hydra": {"overrides": {"task": ["algo=grpo"]}, "job": {"num": 1}}})
    callback._job_started_ms = int(time.time() * 1000)
    monkeypatch.setattr(STOP, "signum", signal.SIGINT if signalled else None)
    callback._abandon()
    parent = client.get_run(callback.parent_run_id)
    assert parent.info.status == ("KILLED" if signalled else "FAILED")
    assert ("The sweep was stopped before its last job." in parent.data.tags["mlflow.note.content"]) == signalled


@pytest.mark.parametrize("one_line", [True, False])
def test_a_failed_jobs_unexpected_error_is_logged_whole_and_a_one_line_error_alone(tmp_path, caplog, monkeypatch, one_line):
    """A job's ConfigError is complete in its line (a traceback would bury it); anything else is shown with its
    traceback. Both jobs get a FAILED run with the error, and the sweep goes on."""
    from hydra.core.utils import JobReturn, JobStatus

    from hydra_plugins.rlhflab_mlflow.callback import MlflowSweepCallback
    from rlhflab.errors import ConfigError

    uri = f"sqlite:///{tmp_path}/m.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("rlhflab")
    callback = MlflowSweepCallback(metric="eval/gold_reward", direction="maximize")
    callback._uri, callback.parent_run_id = uri, client.create_run(experiment).info.run_id
    config = OmegaConf.create({"hydra": {"overrides": {"task": ["algo=grpo"]}, "job": {"num": 0},
                                         "runtime": {"choices": {"algo": "grpo"}}}, "staleness": 0})
    from rlhflab.naming import PARENT_RUN_ENV, SWEPT_ENV

    for key in (PARENT_RUN_ENV, SWEPT_ENV):  # on_job_start sets them for the job: put back after the test, whatever happens
        monkeypatch.delenv(key, raising=False)
    callback.on_job_start(config)
    error = ConfigError("cache_dir: it is a file; give a directory") if one_line else RuntimeError("an engine died")
    job = JobReturn(status=JobStatus.FAILED, _return_value=error)
    with caplog.at_level("ERROR"):
        callback.on_job_end(config, job)
    assert job.status == JobStatus.COMPLETED and job.return_value is None  # the sweep goes on
    (record,) = [r for r in caplog.records if "mlflow sweep: job #0 (algo=grpo) failed" in r.getMessage()]
    assert (record.exc_info is None) == one_line
    (child,) = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{callback.parent_run_id}'")
    assert child.info.status == "FAILED" and child.data.tags["rlhflab.error"] == f"{type(error).__name__}: {error}"


@pytest.mark.slow
def test_report_writes_plots_and_table_and_logs_them_to_the_parent(sqlite_sweep, tmp_path):
    from rlhflab.report import main as report

    client = MlflowClient(sqlite_sweep.uri)
    parent, children = sweep_runs(client)
    result = report([f"sweep={parent.info.run_name}", f"tracking_uri={sqlite_sweep.uri}", f"out_dir={tmp_path}/report"])
    names = {p.name for p in result.files}
    plots = {"gold_vs_step.png", "gold_vs_time.png", "train_curves.png", "gold_vs_kl.png", "samples_per_s.png"}
    assert {"summary.md"} | plots <= names
    assert ("peak_mem.png" in names) != any(s.startswith("peak_mem.png: skipped") for s in result.skipped)
    for path in result.files:
        assert path.stat().st_size > 0
    summary = (tmp_path / "report" / "summary.md").read_text()
    table = [line for line in summary.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(children)  # header + one row per child
    assert sum("FAILED" in row for row in table) == 2
    for name in names - {"summary.md"}:  # each plot listed with what it shows, and shown
        assert f"- `{name}`: " in summary and f"]({name})" in summary
    # Both finished runs scored with the reward model: the training curves say so.
    assert "reward-model score (standardised)" in result.captions["train_curves.png"]
    # One finished run per algo x memory: plain bars, none averaged, none needing a label.
    assert result.captions["samples_per_s.png"].endswith("one run each")
    logged = {a.path for a in client.list_artifacts(parent.info.run_id, "report")}
    assert {f"report/{n}" for n in names} == logged


# ---- a sweep against a real tracking server -----------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listens(proc: subprocess.Popen, port: int) -> bool:
    """A process of `proc`'s tree (the server forks its workers) listens on `port`."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        return False
    for process in tree:
        try:
            if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in process.net_connections(kind="tcp")):
                return True
        except psutil.Error:
            continue
    return False


def wait_healthy(url: str, port: int, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> bool:
    """True once `proc` answers /health on its own socket; False when `port` was taken before it could bind it (by
    another xdist worker's server, which may answer /health meanwhile); any other end fails the test. A server that
    could not bind says so at once but may take its time to exit (on a loaded machine it outlived the wait), so the
    log is read first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "already in use" in log.read_text():
            return False
        if proc.poll() is not None:
            pytest.fail(f"mlflow server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200 and listens(proc, port):
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"mlflow server not healthy after {timeout:.0f}s:\n{log.read_text()[-3000:]}")


@contextmanager
def running_mlflow_server(tmp_path: Path, ports=None):
    """`mlflow server` on a free local port, SQLite backend in tmp_path; always terminated. A port picked free is not
    reserved until the server binds it: where another process took it first, the next port is tried (3 in all)."""
    ports = ports or iter(free_port, None)
    for attempt in range(3):
        port, log = next(ports), tmp_path / f"server-{attempt}.log"
        cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{tmp_path}/server.db",
               "--artifacts-destination", str(tmp_path / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1"]
        # Without MLflow's job execution (on by default in the pinned MLflow: a huey consumer and a job runner, two more
        # processes importing MLflow beside the server's worker, for GenAI jobs no test runs).
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with open(log, "w") as out:
            # Its own session, so that SIGTERM reaches the server and the workers it forks.
            proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            if wait_healthy(url, port, proc, log):
                yield url
                return
        finally:
            stop_group(proc)
    pytest.fail(f"mlflow server: 3 ports in a row were taken before it could bind them; see {tmp_path}/server-*.log")


@pytest.fixture
def mlflow_server(tmp_path, monkeypatch):
    """`mlflow server` on a free local port (running_mlflow_server)."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")  # a proxy in the environment must not see these calls
    with running_mlflow_server(tmp_path) as url:
        yield url


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (it forks its workers), then kill what is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass  # it had ended (a port taken before it could bind)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # all gone
    proc.wait()


@pytest.mark.slow
def test_sweep_against_a_tracking_server(tmp_path, stage_cache, monkeypatch):
    """A good job and one that fails inside train() (its cache's models/ is a file): the tracker marks that run FAILED.
    That failure was a traceback; it is now one line naming cache_dir.

    The server's first port is held by another process, as when free_port()'s port (released before the server
    binds it) is taken by another xdist worker's server: running_mlflow_server moves to the next port. Before, this
    server failed to bind and the other one answered /health in its place."""
    not_a_dir = tmp_path / "not_a_dir"
    (not_a_dir / "models").parent.mkdir()
    (not_a_dir / "models").write_text("")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with running_mlflow_server(tmp_path, iter([busy, free_port()])) as server:
            assert not server.endswith(f":{busy}") and "already in use" in (tmp_path / "server-0.log").read_text()
            sweep = run_sweep(tmp_path, server, stage_cache, "algo=rloo", f"cache_dir={stage_cache},{not_a_dir}")
            parent, children = sweep_runs(MlflowClient(server))
    assert parent.info.status == "FINISHED" and len(children) == 2
    good, bad = children
    assert good.info.status == "FINISHED" and "eval/gold_reward" in good.data.metrics
    assert bad.info.status == "FAILED" and bad.data.tags["rlhflab.error"] == (
        f"ConfigError: cache_dir: '{not_a_dir / 'models'}' is a file; give a directory you can write (cache_dir=<dir>, "
        "or RLHFLAB_CACHE)")
    assert bad.data.params["cache_dir"] == str(not_a_dir)  # the job's own run (it logged its config), not the callback's
    assert "Traceback" not in sweep.output
    # Its closing line names the store to report from (it said only sweep=<id>, which reads ./mlflow.db).
    assert f"report with: python src/report.py sweep={parent.info.run_id} tracking_uri={server}\n" in sweep.output
    # The server's database read directly: its runs' files are behind the server (mlflow-artifacts:/...), and MLflow's
    # 49-line MlflowException came after the run was made (the report's, after it had drawn the plots).
    direct = f"sqlite:///{tmp_path}/server.db"
    out = subprocess.run([sys.executable, str(ROOT / "src" / "train.py"), f"logger.tracking_uri={direct}", *TINY],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "RLHFLAB_CACHE": str(stage_cache)})
    assert out.returncode == 2 and out.stderr.startswith(
        "error: logger.experiment_name=rlhflab: its runs' files are kept behind an MLflow server (mlflow-artifacts:/"), out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert len(MlflowClient(direct).search_runs([parent.info.experiment_id])) == 3  # no run made
    from rlhflab.report import main as report

    with pytest.raises(SystemExit, match=r"^error: tracking_uri: the sweep keeps its files behind an MLflow server "
                                         r"\(mlflow-artifacts:/.*\), and sqlite:.* is not one; report through that server .*log_artifacts=false$"):
        report([f"sweep={parent.info.run_id}", f"tracking_uri={direct}", f"out_dir={tmp_path}/report"])
    assert not (tmp_path / "report").exists()


def kill_server(url: str) -> None:
    """SIGKILL the `mlflow server` that listens at `url`, and the workers of its process group: a server that died."""
    import psutil

    port = int(url.rsplit(":", 1)[1])
    for process in psutil.process_iter():
        try:
            if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in process.net_connections(kind="tcp")):
                os.killpg(os.getpgid(process.pid), signal.SIGKILL)
                return
        except (psutil.Error, ProcessLookupError):
            continue
    pytest.fail(f"no process listens at {url}")


@pytest.mark.slow
def test_ctrl_c_in_a_sweep_whose_tracking_server_died_stops_at_once_and_leaves_the_parent_to_the_next_sweep(
        tmp_path, stage_cache, monkeypatch):
    """The tracking server dies in a sweep's job, and the user presses Ctrl-C once the run says MLflow retries: the
    job waited out MLflow's retries (~4 minutes) at its next write, and again as it ended, then the sweep's exit hook
    asked the dead server for its parent (minutes more, then a traceback). Now the job stops at the step's end with
    its checkpoint, and the exit hook leaves the parent RUNNING, in one line each; the next sweep in the experiment,
    with the server back, ends the parent and the job's run KILLED."""
    from conftest import cli_run, wait_for

    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    env = {"RLHFLAB_CACHE": str(stage_cache), "OMP_WAIT_POLICY": "PASSIVE"}
    # A kill that lands inside one of the run's requests (more likely on a loaded machine, whose server answers
    # slowly) breaks that request instead: the run says the store did not take it and stops at its next step, with
    # no retries to press Ctrl-C in (seen once, under load). That is not this test's case, so it starts again.
    for attempt in range(3):
        base = tmp_path / f"attempt-{attempt}"
        base.mkdir()
        lines: list[str] = []
        port = free_port()
        with running_mlflow_server(base, iter([port, free_port(), free_port()])) as url:
            sweep = ["-m", "seed=0,1", *TINY, f"logger.tracking_uri={url}", "trainer.max_steps=100000", "rl.eval_every=1",
                     "output.dir=runs/${hydra:job.num}"]
            with cli_run(sweep, base, env) as proc:
                reader = threading.Thread(target=lambda lines=lines: [lines.append(line) for line in proc.stdout],
                                          daemon=True)  # this attempt's list
                reader.start()
                wait_for(lambda: any("eval after 2 RL steps" in line for line in lines), 300, "the first job's RL", proc)
                kill_server(url)
                retries, broken = f"mlflow: {url} does not answer (", f"mlflow: {url} did not take the run's"
                wait_for(lambda: any(retries in line or broken in line for line in lines), 120,
                         "the run's word that MLflow retries", proc)
                if not any(retries in line for line in lines):
                    continue
                os.killpg(proc.pid, signal.SIGINT)
                rc = proc.wait(timeout=120)  # (MLflow's retries alone take ~4 minutes)
                reader.join(timeout=30)
        break
    else:
        pytest.fail("the server's kill landed inside one of the run's requests 3 times in a row")
    output = "".join(lines)
    assert rc == 130 and "Traceback" not in output, output[-3000:]
    lost = rf"{re.escape(url)} stopped answering \([^;]+; SIGINT did not wait for MLflow's retries\)"
    assert re.search(rf"stopped: stopped by SIGINT; the MLflow run is left RUNNING, as {lost}, and the sweep stops "
                     r"here\. Continue this job alone: python src/train.py seed=0 .* resume=auto output\.dir=runs/0\n",
                     output), output[-3000:]
    said = re.search(rf"mlflow sweep: the sweep (\w+) is left RUNNING, as {lost}; the next run or sweep in its "
                     "experiment on this machine ends it KILLED", output)
    assert said, output[-3000:]
    assert list((base / "runs" / "0" / "checkpoints").glob("step-*")) and not (base / "runs" / "1").exists()
    with running_mlflow_server(base, iter([port, free_port(), free_port()])) as again:  # the server is back
        out = subprocess.run([sys.executable, str(ROOT / "src" / "train.py"), "-m", "seed=2", *TINY,
                              f"logger.tracking_uri={again}", "trainer.max_steps=1", "output.dir=runs/again"],
                             cwd=base, env=os.environ | env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-3000:]
        runs = {r.info.run_id: r for r in MlflowClient(again).search_runs(
            [MlflowClient(again).get_experiment_by_name("rlhflab").experiment_id])}
    assert runs[said.group(1)].info.status == "KILLED"
    assert sorted(r.info.status for r in runs.values()) == ["FINISHED", "FINISHED", "KILLED", "KILLED"]


@pytest.mark.parametrize("given", [None, "ablation"])
def test_a_job_that_failed_before_its_run_is_named_as_its_run_would_have_been(tmp_path, stage_cache, given):
    """A job that fails before its tracker made a run (here train()'s reading of the given SFT policy's tokenizer,
    which it lacks) gets a child made by the callback: it was named 'rloo-full-sync', its siblings by their command
    lines. With logger.run_name given, every child was named that alone."""
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2)).save_pretrained(tmp_path / "bare")  # no tokenizer
    sweep = run_sweep(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", stage_cache, f"model.sft_path={tmp_path}/bare,null",
                      *([f"logger.run_name={given}"] if given else []))
    parent, (failed, good) = sweep_runs(MlflowClient(sweep.uri))
    assert failed.info.status == "FAILED" and good.info.status == "FINISHED"
    assert "no tokenizer can be read" in failed.data.tags["rlhflab.error"]
    if given:
        assert [failed.info.run_name, good.info.run_name] == ["ablation sft_path=bare", "ablation sft_path=null"]
        return
    assert failed.info.run_name.startswith("rloo sft_path=bare ")
    assert good.info.run_name == failed.info.run_name.replace("sft_path=bare", "sft_path=null")


@pytest.mark.parametrize("args, line", [
    (["-m", "mode.reference=thread", "memory=full,lora"], "error: mode.reference=thread: memory=lora computes the reference "
     "with the policy's own modules (its adapter off); use mode.reference=learner (or auto) (sweep job: "
     "mode.reference=thread memory=lora)"),
    (["-m", "model.arch.hidden_size=32,30"], "error: model.arch: transformers cannot build a model of it "),
    # LoRA targets the model does not have: one line once the models had loaded, in each job's FAILED child
    (["-m", "memory=lora,hydra", "memory.target_modules=[nope]"], "error: memory.target_modules: none of "
     "LlamaForCausalLM's decoder layers has a module it names (their linear modules: down_proj, gate_proj, k_proj, "
     "o_proj, q_proj, up_proj, v_proj); "),
    (["experiment=sweep_memory", "algo=ppo", "model.dtype=float16"], "error: model.dtype=float16: memory=full would train "
     "whole weights in float16, "),
    (["experiment=sweep_optuna", "memory=lora", "mode.reference=thread"], "error: mode.reference=thread: memory=lora "),
    # the parent run is in the first job's experiment: a child in another was found by neither its summary nor the
    # report ('0 jobs')
    (["-m", "logger.experiment_name=a,b"], "error: logger.experiment_name: a sweep's runs are the children of one parent "
     "run, in one experiment of one store, but its jobs log to a and b; run one sweep for each (sweep job: "
     "logger.experiment_name=b)"),
])
def test_a_sweep_with_a_job_it_cannot_run_or_nest_stops_before_it_starts(tmp_path, args, line):
    """What train() checks before it loads a model (the plug-ins' checks, model.arch on the meta device) passed the
    preflight's schema check: the sweep started, and each such job failed at its start as a FAILED child, where
    docs/SWEEPS.md promises one line naming the job before any job runs or any MLflow run is made."""
    out = subprocess.run([sys.executable, str(ROOT / "src" / "train.py"), *args], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"})
    assert out.returncode == 2 and out.stderr.startswith(line), out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert "sweep job: " in out.stderr and not (tmp_path / "mlflow.db").exists() and not (tmp_path / "multirun").exists()


def test_a_sweep_with_lora_targets_a_given_model_lacks_stops_before_it_starts(tmp_path):
    """memory.target_modules=[nope] beside a model given by path passed the preflight: the sweep started, and each
    job failed as a FAILED child once its model loaded. Its config is read and judged before the sweep starts, as
    model.arch's model is."""
    given = save_tiny_neox(tmp_path / "neox")
    out = subprocess.run([sys.executable, str(ROOT / "src" / "train.py"), "-m", "seed=0,1", "memory=lora",
                          f"model.sft_path={given}", "memory.target_modules=[nope]", "reward=rule"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db",
                              "RLHFLAB_CACHE": str(tmp_path / "cache")})
    assert out.returncode == 2 and out.stderr.startswith(
        f"error: memory.target_modules: none of GPTNeoXForCausalLM's decoder layers has a module it names (their linear "
        f"modules: {NEOX_LINEAR}); "), out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "(sweep job: seed=0 memory=lora " in out.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "multirun").exists()
    assert not (tmp_path / "cache").exists()


def test_a_key_the_swept_groups_default_lacks_is_one_line_with_hydras_fix(tmp_path, capsys, monkeypatch):
    """Hydra composes a sweep's own config from the command line without its sweeps (memory=full, the default, for
    memory=lora,hydra): each job had memory.target_modules and passed the preflight, then Hydra stopped with 6 lines,
    "Key 'target_modules' not in 'FullMemory'". `++` adds the key there and sets it in each job."""
    from rlhflab.cli import preflight

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        preflight(["-m", "memory=lora,hydra", "memory.target_modules=[q_proj,v_proj]"])
    assert capsys.readouterr().err == (
        "error: memory.target_modules=[q_proj,v_proj]: memory=full has no memory.target_modules, and Hydra composes "
        "the sweep's own config from that default before its jobs (memory=lora,hydra left out); write "
        "++memory.target_modules=[q_proj,v_proj], which adds it there and sets it in every job\n")
    preflight(["-m", "memory=lora,hydra", "++memory.target_modules=[q_proj,v_proj]"])  # returns: the sweep may start
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("left", ["policy", "checkpoints/step-00000004"])
def test_a_rerun_of_a_sweep_into_its_jobs_directories_stops_before_it_starts(tmp_path, capsys, left):
    """A job's output.dir that holds another run's checkpoints or saved policy (the same -m command with
    'output.dir=runs/${hydra:job.num}' run twice) is refused as a single run's is, before the sweep starts: each job
    failed at its start as a FAILED child. The same with resume=auto, where the job finished without a checkpoint."""
    from rlhflab.cli import preflight

    (tmp_path / "runs" / "1" / left).mkdir(parents=True)
    with pytest.raises(SystemExit):
        preflight(["-m", "seed=0,1", f"output.dir={tmp_path}/runs/${{hydra:job.num}}"])
    said = capsys.readouterr().err
    assert said.startswith(f"error: output.dir: {tmp_path}/runs/1 ") and " (sweep job: seed=1 output.dir=" in said, said
    assert said.count("\n") == 1 and ("the policy a run saved" if left == "policy" else "checkpoints (step-00000004)") in said
    resumed = ["-m", "seed=0,1", f"output.dir={tmp_path}/runs/${{hydra:job.num}}", "resume=auto"]
    if left != "policy":
        preflight(resumed)  # the job goes on from its checkpoint
        return
    # A finished job without a checkpoint: the sweep began, that job failed as a FAILED child of a new parent (its line
    # said to give it another output.dir), and the stopped jobs went on under the first sweep's parent
    with pytest.raises(SystemExit):
        preflight(resumed)
    said = capsys.readouterr().err
    assert said.startswith(f"error: resume=auto: {tmp_path}/runs/1 holds the policy a run saved ({tmp_path}/runs/1/policy) "
                           "and no checkpoint to continue, so this sweep would refuse that job; sweep only the values "
                           "that have not run "), said
    assert said.count("\n") == 1 and " (sweep job: seed=1 output.dir=" in said, said


def test_a_sweep_continued_with_other_values_in_its_jobs_directories_stops_before_it_starts(tmp_path, capsys):
    """`-m seed=5,0 ... resume=auto` after `-m seed=0,1 ...`: job 0 (seed=5) continues the directory of the seed=0 job.
    The preflight passed it, and each such job was refused at its start ('resume: ... was made with other settings'),
    a FAILED child of a new parent. Here a real checkpoint (ckpt.write) of the first sweep's job 0 is in runs/0."""
    from omegaconf import OmegaConf, open_dict

    import torch

    from rlhflab.cli import preflight
    from rlhflab.lit import checkpoint as ckpt

    runs = tmp_path / "runs"
    for number, seed in enumerate((0, 1)):
        made = compose_cfg([f"seed={seed}"], shrink=False)
        with open_dict(made):
            made.output.dir, made.resume = str(runs / str(number)), "auto"
        ckpt.write(ckpt.directory(runs / str(number)), 4, {"w": torch.zeros(2)}, {}, {"updates": 4},
                   OmegaConf.to_yaml(made, resolve=True), keep=2)
    sweep = ["-m", f"output.dir={runs}/${{hydra:job.num}}", "resume=auto"]
    preflight([*sweep, "seed=0,1"])  # the same values: each job goes on from its own checkpoint
    with pytest.raises(SystemExit):
        preflight([*sweep, "seed=5,0"])
    said = capsys.readouterr().err
    assert said.startswith(f"error: resume=auto: {runs}/0/checkpoints/step-00000004 was made with other settings ("), said
    assert "; seed: 0 -> 5; " in said and ("), so this sweep would refuse that job; continue a sweep with the values it was "
                                            "made with, in the same order (job N continues the directory of job N), and sweep "
                                            "new values without resume=auto in new directories (sweep job: ") in said, said
    assert said.count("\n") == 1 and said.endswith(" seed=5)\n"), said


def test_an_optuna_sweep_from_the_command_line_is_checked_and_the_plugins_own_config_is_refused(capsys):
    """hydra/sweeper=rlhflab_optuna with the search on the command line has no params of its own: the preflight's
    read of them was 'Input cfg is not an OmegaConf config object (dict)'. hydra/sweeper=optuna minimized the gold
    reward (hydra-optuna-sweeper's default direction) and named the worst trial the best."""
    from rlhflab.cli import preflight

    preflight(["-m", "hydra/sweeper=rlhflab_optuna", "algo.kl_coef=interval(0.01,0.1)", "hydra.sweeper.n_trials=2"])
    with pytest.raises(SystemExit):
        preflight(["-m", "hydra/sweeper=optuna", "algo.kl_coef=interval(0.01,0.1)"])
    assert capsys.readouterr().err.startswith("error: hydra/sweeper=optuna: hydra-optuna-sweeper's own defaults minimize, "
                                              "and rlhflab's objective (the gold reward) is to be maximized; use "
                                              "hydra/sweeper=rlhflab_optuna")


def test_an_optuna_study_whose_every_trial_failed_ends_as_a_grid_sweep_does(tmp_path):
    """Optuna's study.best_trial raised 'ValueError: No trials are completed yet' after the last failed trial: exit 1,
    a traceback, and the parent FAILED with no summary and no list of the trials' errors."""
    not_a_dir = tmp_path / "not_a_dir"
    not_a_dir.mkdir()
    (not_a_dir / "models").write_text("")  # each trial fails inside train()
    sweep = run_sweep(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", not_a_dir, "experiment=sweep_optuna",
                      "hydra.sweeper.n_trials=2", f"cache_dir={not_a_dir}")  # run_sweep: exit 0
    parent, children = sweep_runs(MlflowClient(sweep.uri))
    assert parent.info.status == "FINISHED" and parent.data.metrics["sweep/failed_jobs"] == 2
    assert [r.info.status for r in children] == ["FAILED", "FAILED"]
    assert "no trial finished" in sweep.output and "2 job(s) failed" in sweep.output
    assert "No trials are completed yet" not in sweep.output
    assert "float-castable" not in sweep.output  # Optuna's line for each failed trial, beside the job's real error


@pytest.mark.slow
def test_optuna_preset_runs_trials_as_children_and_optimises_the_kl_penalised_gold(tmp_path, stage_cache):
    """Also a store given as sqlite:///~/...: the parent run was in ./~/mlflow.db and each trial's in
    $HOME/mlflow.db, so no trial nested under it."""
    sweep = run_sweep(tmp_path, "sqlite:///~/mlflow.db", stage_cache,
                      "experiment=sweep_optuna", "hydra.sweeper.n_trials=2", "kl_budget=0.0", "kl_penalty=0.01",
                      home=tmp_path)
    parent, children = sweep_runs(MlflowClient(sweep.uri))
    assert len(children) == 2 and all(r.info.status == "FINISHED" for r in children)
    # The sweeper saw gold - 0.01 * KL (budget 0): its best value is the best trial's penalised gold.
    best = max(r.data.metrics["eval/gold_reward"] - 0.01 * max(0.0, r.data.metrics["eval/kl"]) for r in children)
    reported = float(re.search(r"Best value: (\S+)", sweep.output).group(1))
    assert reported == pytest.approx(best, abs=1e-6)
    # MLflow's parent names the same best trial, by the same objective, which each trial's run records; before,
    # it named the best plain gold (over the KL budget, where the sweep meant to penalise it) and the report too
    for r in children:
        penalised = r.data.metrics["eval/gold_reward"] - 0.01 * max(0.0, r.data.metrics["eval/kl"])
        assert r.data.metrics["sweep/objective"] == pytest.approx(penalised, abs=1e-6)
    assert parent.data.tags["rlhflab.sweep.metric"] == "sweep/objective"
    assert parent.data.tags["rlhflab.sweep.experiment"] == "sweep_optuna"
    assert parent.data.metrics["best/sweep/objective"] == pytest.approx(best, abs=1e-6)
    (winner,) = [r for r in children if r.data.metrics["sweep/objective"] == parent.data.metrics["best/sweep/objective"]]
    assert parent.data.tags["rlhflab.sweep.best_run_id"] == winner.info.run_id
    from rlhflab.report import main as report

    summary = report([f"sweep={parent.info.run_id}", f"tracking_uri={sweep.uri}", f"out_dir={tmp_path / 'report'}",
                      "log_artifacts=false"]).files[0].read_text()
    assert f"- best sweep/objective (eval/gold_reward less 0.01 per nat of eval/kl above 0.0): {best:.4f}" in summary
    assert "| objective |" in summary


def test_a_sigkilled_sweep_is_ended_killed_by_the_next_sweep_which_continues_its_job(tmp_path, stage_cache):
    """SIGKILL (the OOM killer) runs no exit hook: the sweep's parent and its job's run stayed RUNNING for good, even
    after the job was continued under a new sweep. The next sweep ends them KILLED as it starts; the job's run then
    continues (resume=auto) in its own run, under the new parent, and names the process that runs it now."""
    from conftest import cli_run, wait_for
    from rlhflab.naming import PROCESS_TAG, STOP_TAG

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = {"MLFLOW_TRACKING_URI": uri, "RLHFLAB_CACHE": str(stage_cache), "OMP_WAIT_POLICY": "PASSIVE"}
    lines: list[str] = []
    sweep = ["-m", "algo=rloo", *TINY, "rl.eval_every=1", "checkpoint.every_n_steps=2", "output.dir=runs/${hydra:job.num}"]
    with cli_run([*sweep, "trainer.max_steps=100000"], tmp_path, env) as proc:
        reader = threading.Thread(target=lambda: [lines.append(line) for line in proc.stdout], daemon=True)
        reader.start()
        wait_for(lambda: any("eval after 3 RL steps" in line for line in lines), 300, "the job's third step", proc)
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        reader.join(timeout=30)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("rlhflab").experiment_id
    (parent,) = client.search_runs([experiment], "tags.`rlhflab.sweep` = '1'")
    (job,) = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")  # no job tags: its
    assert (parent.info.status, job.info.status) == ("RUNNING", "RUNNING")  # end never came, as SIGKILL leaves them
    from rlhflab.report import main as report

    report([f"sweep={parent.info.run_id}", f"tracking_uri={uri}", f"out_dir={tmp_path}/report"])  # it said 'still running'
    assert (f"`{parent.info.run_id}` at `{uri}`, RUNNING; but its process is gone (SIGKILL, or a store that stopped answering): jobs after the last child "
            "never ran, and the next run or sweep in its experiment ends it KILLED") in (tmp_path / "report" / "summary.md").read_text()
    # The newest checkpoint the job wrote before the kill: on a loaded machine the kill came after step 4's, and
    # resume=auto with trainer.max_steps=4 was refused (a checkpoint past the budget), so the job's run stayed KILLED.
    step = max(int(n) for n in re.findall(r"checkpoint: \S+/step-(\d+)", "".join(lines)))
    with cli_run([*sweep, f"trainer.max_steps={step + 2}", "resume=auto"], tmp_path, env) as proc:
        output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    for what, run in (("the sweep", parent), ("run", job)):
        assert (f"mlflow: {what} {run.info.run_id} ({run.info.run_name}), left RUNNING by a process that is gone (SIGKILL, or a store that stopped answering), "
                "is ended KILLED") in output
    new = [p for p in client.search_runs([experiment], "tags.`rlhflab.sweep` = '1'") if p.info.run_id != parent.info.run_id]
    ended, continued = client.get_run(parent.info.run_id), client.get_run(job.info.run_id)
    assert ended.info.status == "KILLED" and ended.data.tags[STOP_TAG].startswith("its process ended without ending it")
    assert [p.info.status for p in new] == ["FINISHED"]
    assert continued.info.status == "FINISHED" and continued.data.tags["mlflow.parentRunId"] == new[0].info.run_id
    assert STOP_TAG not in continued.data.tags and "stopped_before_resume" in " ".join(continued.data.tags)
    assert json.loads(continued.data.tags[PROCESS_TAG])["pid"] == proc.pid  # the second sweep's process, which ran it
    assert [m.step for m in client.get_metric_history(job.info.run_id, "train/loss")][-2:] == [step + 1, step + 2]


@pytest.mark.slow
def test_ctrl_c_stops_the_sweep_marks_it_killed_and_says_how_to_continue_the_job(tmp_path, stage_cache):
    """Ctrl-C in a sweep's job: the job checkpoints and the sweep stops (no further job starts). The parent was
    marked FAILED, as for a crash, and the line said 'Continue with the same command and resume=auto
    output.dir=<the job's dir>': the same `-m` command would send every job to that one directory. Now the parent
    is KILLED and the line gives the job's own command, which continues it in its MLflow run."""
    from conftest import cli_run, wait_for

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = {"MLFLOW_TRACKING_URI": uri, "RLHFLAB_CACHE": str(stage_cache), "OMP_WAIT_POLICY": "PASSIVE"}
    lines: list[str] = []
    sweep = ["-m", "algo=rloo,grpo", *TINY, "trainer.max_steps=100000", "rl.eval_every=1", "output.dir=runs/${hydra:job.num}"]
    with cli_run(sweep, tmp_path, env) as proc:
        reader = threading.Thread(target=lambda: [lines.append(line) for line in proc.stdout], daemon=True)
        reader.start()
        wait_for(lambda: any("eval after 2 RL steps" in line for line in lines), 300, "the first job's RL", proc)
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=120)
        reader.join(timeout=30)
    output = "".join(lines)
    assert rc == 130, output[-3000:]
    client = MlflowClient(uri)
    parent, children = sweep_runs(client)
    assert parent.info.status == "KILLED"
    assert [(c.data.tags["algo"], c.info.status) for c in children] == [("rloo", "KILLED")]  # grpo never started
    # what ran until the stop is summarised, as at a sweep's end (the parent had no sweep/jobs and no note)
    assert parent.data.metrics["sweep/jobs"] == 1 and parent.data.metrics["sweep/failed_jobs"] == 0
    assert parent.data.tags["mlflow.note.content"] == (f"1 job, 0 failed. The sweep was stopped before its last job. "
                                                       f"Report: `python src/report.py sweep={parent.info.run_id} tracking_uri={uri}`")
    (stopped,) = [line for line in output.splitlines() if line.startswith("stopped: ")]
    command = stopped.partition("Continue this job alone: ")[2]
    assert command.startswith("python src/train.py algo=rloo ") and "hydra.mode=RUN resume=auto output.dir=" in command, stopped
    assert command.count("output.dir=") == 1 and command.endswith(" output.dir=runs/0"), stopped  # the
    # sweep's own 'output.dir=runs/$\{hydra\:job.num\}' (as Hydra keeps it) was given before the job's
    step = int(re.search(r"checkpoint: \S+/step-(\d+)", output).group(1))
    args = shlex.split(command)[2:] + [f"trainer.max_steps={step + 2}"]  # the job's command, with a budget it ends at
    out = subprocess.run([sys.executable, str(ROOT / "src" / "train.py"), *args], cwd=tmp_path, env=os.environ | env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = client.get_run(children[0].info.run_id)
    assert resumed.info.status == "FINISHED"  # the job's own run, still the sweep's child
    assert sweep_runs(client)[0].info.run_id == parent.info.run_id  # and no new sweep
    assert [m.step for m in client.get_metric_history(resumed.info.run_id, "train/loss")] == list(range(1, step + 3))
    from rlhflab.report import main as report

    report([f"sweep={parent.info.run_id}", f"tracking_uri={uri}", f"out_dir={tmp_path}/report"])
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert f"`{parent.info.run_id}` at `{uri}`, KILLED; stopped by a signal: jobs after the last child never ran" in summary
    # The whole sweep again with resume=auto, stopped in the job it continues: its atexit hook read the job's
    # 'output.dir=runs/${hydra:job.num}' after Hydra had cleared its config (an InterpolationResolutionError), and the
    # new parent stayed RUNNING forever
    again = [*sweep, "resume=auto", "checkpoint.every_n_steps=2"]
    lines.clear()
    with cli_run(again, tmp_path, env) as proc:
        reader = threading.Thread(target=lambda: [lines.append(line) for line in proc.stdout], daemon=True)
        reader.start()
        wait_for(lambda: any(f"eval after {step + 3} RL steps" in line for line in lines), 300, "the continued job's RL", proc)
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=120)
        reader.join(timeout=30)
    output = "".join(lines)
    assert rc == 130 and "Traceback" not in output and "Exception ignored" not in output, output[-3000:]
    experiment = client.get_experiment_by_name("rlhflab").experiment_id
    parents = lambda: client.search_runs([experiment], "tags.`rlhflab.sweep` = '1'", order_by=["attributes.start_time ASC"])
    second = parents()[1]
    assert second.info.status == "KILLED"
    assert client.get_run(resumed.info.run_id).data.tags["mlflow.parentRunId"] == second.info.run_id  # moved there
    stopped_at = int(re.findall(r"checkpoint: \S+/step-(\d+)", output)[-1])
    # Once more, to the end: the job that ran goes on in its run, the other starts, both under the last parent. The
    # job that went on stayed under the first parent, and the new one's summary and report left it out.
    final = [*again, f"trainer.max_steps={stopped_at + 2}"]
    final.remove("trainer.max_steps=100000")
    out = subprocess.run([sys.executable, str(ROOT / "src" / "train.py"), *final], cwd=tmp_path, env=os.environ | env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    third = parents()[2]
    moved = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{third.info.run_id}'")
    assert sorted((r.data.tags["algo"], r.info.status) for r in moved) == [("grpo", "FINISHED"), ("rloo", "FINISHED")]
    assert resumed.info.run_id in [r.info.run_id for r in moved]  # the same run, now this sweep's child
    assert client.get_run(resumed.info.run_id).data.tags["rlhflab.sweep.moved_from"] == parent.info.run_id  # the first
    assert third.info.status == "FINISHED" and client.get_run(third.info.run_id).data.metrics["sweep/jobs"] == 2
    # The second parent's one run moved on: its report said no job of it had begun
    with pytest.raises(SystemExit) as stop:
        report([f"sweep={second.info.run_id}", f"tracking_uri={uri}", f"out_dir={tmp_path}/report2"])
    assert str(stop.value.code).endswith(f"has no child runs left: a sweep continued it with resume=auto, and its jobs' "
                                         f"runs moved to that one's parent {third.info.run_id}; report that: python "
                                         f"src/report.py sweep={third.info.run_id}"), stop.value.code


@pytest.mark.parametrize("experiment, params, task, name", [
    (None, None, ["algo=rloo,online_dpo", "mode=async", "staleness=1", "logger.tracking_uri=sqlite:///x.db"],
     "sweep algo=rloo,online_dpo async staleness=1 2026-11-26_14-56-52-040795"),
    # an Optuna search, compact ('kl_coef=tag(log, interval(0.005, 0.5))' made reports/..._tag_log,_interval_0.005,_0.5...)
    ("sweep_optuna", {"algo.kl_coef": "tag(log, interval(0.005, 0.5))", "rl.lr": "interval(1.0e-4, 3.0e-3)"},
     ["experiment=sweep_optuna", "algo=remax", "kl_budget=1.5"],
     "sweep_optuna kl_coef=log[0.005,0.5] lr=[1.0e-4,3.0e-3] remax kl_budget=1.5 2026-11-26_14-56-52-040795"),
    # a list of paths: each value by its last part ('sft_path=policy' lost the first path and the list)
    (None, None, ["model.sft_path=/runs/a/policy,/runs/b/step-3", "trainer.max_steps=10"],
     "sweep sft_path=a/policy,step-3 max_steps=10 2026-11-26_14-56-52-040795"),
    # two saved policies ('sft_path=policy,policy'), and two paths alike but for a parent
    (None, None, ["model.sft_path=/m/0/policy,/m/1/policy"], "sweep sft_path=0/policy,1/policy 2026-11-26_14-56-52-040795"),
    (None, None, ["model.sft_path=/m/0/policy/merged"], "sweep sft_path=policy/merged 2026-11-26_14-56-52-040795"),
    (None, None, ["model.sft_path=/x/a/ckpt,/y/a/ckpt"], "sweep sft_path=x/a/ckpt,y/a/ckpt 2026-11-26_14-56-52-040795"),
    # what the jobs share, past 100 characters: cut between settings, not mid-value ('fn=reward.py:')
    (None, None, ["algo=rloo,grpo", "task=prompts", "task.path=examples/reverse/train.jsonl", "task.tokenizer=char",
                  "reward=function", "reward.fn=examples/reverse/reward.py:correct_digits"],
     "sweep algo=rloo,grpo prompts path=examples/reverse/train.jsonl tokenizer=char function ... 2026-11-26_14-56-52-040795"),
    # a preset's grid narrowed on the command line: the 1-job sweep was named for the preset's 15 jobs
    ("sweep_memory", {"algo": "ppo,rloo,remax,online_dpo,grpo", "memory": "full,lora,hydra"},
     ["experiment=sweep_memory", "memory=lora", "algo=rloo"], "sweep_memory rloo lora 2026-11-26_14-56-52-040795"),
    ("sweep_memory", {"algo": "ppo,rloo,remax,online_dpo,grpo", "memory": "full,lora,hydra"},
     ["experiment=sweep_memory", "memory=lora"], "sweep_memory algo=ppo,rloo,remax,online_dpo,grpo lora 2026-11-26_14-56-52-040795"),
])
def test_a_sweeps_name_says_what_its_jobs_share_from_the_command_line(experiment, params, task, name):
    """`-m algo=rloo,online_dpo` and `-m algo=rloo,online_dpo mode=async staleness=1` were both named `sweep
    algo=rloo,online_dpo <time>`: two sweeps told apart in MLflow's run list (and in reports/) by the time only.
    The settings every job shares follow what is swept, named as a run names them."""
    from hydra_plugins.rlhflab_mlflow.callback import sweep_name, swept_params

    config = OmegaConf.create({"hydra": {"runtime": {"choices": {"experiment": experiment}},
                                         "sweep": {"dir": "multirun/2026-11-26/14-56-52-040795"},
                                         "overrides": {"task": task}, "sweeper": {"params": params}}})
    assert sweep_name(config, swept_params(config)) == name
    config.hydra.sweep.dir = "runs/ablation"  # a fixed sweep dir: each sweep there was named '... runs_ablation'
    assert re.fullmatch(re.escape(name.rpartition(" ")[0]) + r" \d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", sweep_name(config, swept_params(config)))


@pytest.mark.parametrize("hydra, task, recorded", [
    # a preset's grid narrowed on the command line: recorded as 'experiment=sweep_algos trainer.max_steps=50', the
    # command of the preset's 7 algorithms; the summary's 'sweep overrides' line said the same
    (['hydra.sweeper.params.algo="rloo,grpo"'], ["experiment=sweep_algos", "trainer.max_steps=50"],
     'experiment=sweep_algos trainer.max_steps=50 hydra.sweeper.params.algo="rloo,grpo"'),
    # an Optuna search on the command line: without its sweeper, its interval is refused by the basic one
    (["hydra/sweeper=rlhflab_optuna", "hydra.sweeper.n_trials=2", "hydra.mode=MULTIRUN"], ["algo.kl_coef=interval(0.01,0.1)"],
     "algo.kl_coef=interval(0.01,0.1) hydra/sweeper=rlhflab_optuna hydra.sweeper.n_trials=2"),
    (["hydra.mode=MULTIRUN"], ["algo=rloo,remax"], "algo=rloo,remax"),  # -m's own: the sweep is one anyway
])
def test_the_parents_overrides_are_the_sweeps_whole_command_line(hydra, task, recorded):
    from hydra_plugins.rlhflab_mlflow.callback import _sweep_tags

    config = OmegaConf.create({"hydra": {"runtime": {"choices": {"experiment": None}}, "sweep": {"dir": "multirun/x"},
                                         "overrides": {"hydra": hydra, "task": task},
                                         "sweeper": {"_target_": "BasicSweeper", "params": None}}})
    assert _sweep_tags(config, {})["rlhflab.sweep.overrides"] == recorded
