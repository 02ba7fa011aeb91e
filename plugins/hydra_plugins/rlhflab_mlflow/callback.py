"""One MLflow parent run per Hydra sweep; every job's run becomes its nested child.

How it fits together:
- on_multirun_start creates the parent run (tag `rlhflab.sweep=1`) in the
  experiment and at the tracking URI of the composed config's `logger`.
- on_job_start puts the parent's id in RLHFLAB_MLFLOW_PARENT_RUN_ID; the job's
  MlflowTracker reads it and tags its own run `mlflow.parentRunId`.
- on_job_end finds the run the job made and tags it with the job number and
  overrides. A job that raised is recorded as a FAILED child (one is created
  when the job failed before its tracker made a run, e.g. a ConfigError) and
  its JobReturn is turned into a completed job with no value, because Hydra's sweepers re-raise
  a failed job's exception and would end the sweep (and skip
  on_multirun_end) at the first bad configuration.
- on_multirun_end writes the best child into the parent and marks it FINISHED.
  If the sweep dies first, an atexit hook marks the parent KILLED (a signal stopped its job) or FAILED; so
  does rank 0's watch when it ends a job of several ranks (and the sweep) with os._exit.

The job-to-run match is by start time after on_job_start, which is exact for
launchers that run jobs one at a time in this process (Hydra's basic launcher).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from rlhflab.naming import (
    ERROR_TAG, MAX_TAG, OBJECTIVE, PARENT_RUN_ENV, PROCESS_TAG, RUN_RECORD, SWEPT_ENV, RUN_TAG_GROUPS, SWEEP_BEST_RUN_NAME_TAG, SWEEP_CONTINUED_BY_TAG,
    SWEEP_JOB_TAG, SWEEP_METRIC_TAG, SWEEP_MOVED_FROM_TAG, SWEEP_OBJECTIVE_TAG,
    SWEEP_OVERRIDES_TAG, SWEEP_TAG, clipped, default_run_name, run_name, home_expanded, import_mlflow, model_tag, named_run,
    process_identity, redact, short_override,
)

log = logging.getLogger("rlhflab.sweep")




def tracking_uri(config: DictConfig) -> str | None:
    """The config's logger.tracking_uri as the job's run sees it (a leading `~` expanded, as schema.check does)."""
    uri = OmegaConf.select(config, "logger.tracking_uri")
    return home_expanded(uri) if uri else uri


class MlflowSweepCallback(Callback):
    """Groups a Hydra multirun under one MLflow parent run.

    metric: child metric that picks the best job; null = the config's `optimized_metric`, or with a KL budget
        (`kl_budget`, as experiment=sweep_optuna sets) the objective the sweeper was told (train.objective), which
        each job's run then records as `sweep/objective`.
    direction: maximize or minimize `metric`; null = the sweeper's `direction` if it has one, else maximize.
    """

    def __init__(self, metric: str | None = None, direction: str | None = None) -> None:
        self.metric = metric
        self.direction = direction
        self.parent_run_id: str | None = None
        self.failed: list[str] = []
        self._uri: str | None = None
        self._job_started_ms = 0
        self._job: DictConfig | None = None  # the running job's config (between on_job_start and on_job_end)
        self._job_dir: Path | None = None  # its output directory (on_job_start), where mlflow_run.json names its run
        self._claimed: set[str] = set()
        self.swept: dict[str, str] = {}  # what the sweep varies (swept_params), for its jobs' run names
        self.objective: str | None = None  # OBJECTIVE in words, where jobs return a KL-penalised metric

    # ---- Hydra hooks --------------------------------------------------------------------

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._uri = tracking_uri(config)
        if not self._uri:
            log.warning("mlflow sweep: no logger.tracking_uri in the config; the sweep gets no parent run")
            return
        optimized = OmegaConf.select(config, "optimized_metric") or "eval/gold_reward"
        budget = OmegaConf.select(config, "kl_budget")
        if self.metric is None and budget is not None:  # what the jobs return to the sweeper (train.objective)
            self.metric = OBJECTIVE
            self.objective = f"{optimized} less {OmegaConf.select(config, 'kl_penalty')} per nat of eval/kl above {budget}"
        self.metric = self.metric or optimized
        self.direction = self.direction or str(OmegaConf.select(config, "hydra.sweeper.direction") or "maximize")
        import_mlflow()  # the sweep's first MLflow call
        from mlflow.tracking.context.registry import resolve_tags

        try:
            experiment_id = self._experiment_id(config)  # first, under the store lock (it may create the database)
        except Exception as err:
            if not _one_line_error(err):
                raise
            # A store that cannot be opened stops the sweep before any job, in one line as a run's would
            # (through Hydra it was a traceback); SystemExit passes Hydra's handler.
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        client = self._client()
        swept = self.swept = swept_params(config)
        run = client.create_run(experiment_id, run_name=sweep_name(config, swept), tags=resolve_tags(_sweep_tags(config, swept)))
        self.parent_run_id = run.info.run_id
        client.log_text(self.parent_run_id, OmegaConf.to_yaml(config), "sweep_config.yaml")
        atexit.register(self._abandon)
        self._end_runs_gone(client, experiment_id)
        from rlhflab import distributed  # (torch: only once a sweep with a parent starts)

        distributed.at_watch_exit(self._abandon)  # a rank failed and rank 0's watch ends the sweep with os._exit
        log.info("mlflow sweep: parent run %s (%s) at %s", self.parent_run_id, run.info.run_name, self._uri)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self.parent_run_id is None:
            return  # a single run (RUN mode) or a sweep without tracking
        os.environ[PARENT_RUN_ENV] = self.parent_run_id
        os.environ[SWEPT_ENV] = json.dumps(self.swept)
        self._job_started_ms = int(time.time() * 1000)
        self._job = config
        # Its directory, read now: at exit (_abandon) Hydra has cleared its config, and 'output.dir=runs/${hydra:job.num}'
        # no longer resolves (an InterpolationResolutionError in the atexit hook, which left the parent RUNNING)
        try:
            out = OmegaConf.select(config, "output.dir") or OmegaConf.select(config, "hydra.runtime.output_dir")
            self._job_dir = Path(out) if out else None
        except Exception:
            self._job_dir = None
        job_uri = tracking_uri(config)
        if job_uri != self._uri:
            log.warning("mlflow sweep: job logs to %s, the parent is at %s; it will not be nested", job_uri, self._uri)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if self.parent_run_id is None:
            return
        os.environ.pop(PARENT_RUN_ENV, None)
        os.environ.pop(SWEPT_ENV, None)
        self._job = None
        client = self._client()
        child, overrides = self._tag_child(client, config)
        if job_return.status == JobStatus.FAILED:
            self._record_failure(client, config, job_return, child, overrides)
        elif self.objective and child is not None and isinstance(job_return.return_value, (int, float)):
            client.log_metric(child.info.run_id, OBJECTIVE, float(job_return.return_value))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.parent_run_id is None:
            return
        client = self._client()
        self._summarise(client)
        client.set_terminated(self.parent_run_id, "FINISHED")
        atexit.unregister(self._abandon)
        from rlhflab import distributed

        distributed.at_watch_exit(self._abandon, register=False)
        if self.failed:
            log.warning("mlflow sweep: %d job(s) failed:\n  %s", len(self.failed), "\n  ".join(self.failed))
        log.info("mlflow sweep: done; report with: %s", self._report_command())

    # ---- helpers ------------------------------------------------------------------------

    def _end_runs_gone(self, client, experiment_id: str) -> None:
        """rlhflab.tracking.end_runs_gone, by this sweep: a sweep SIGKILLed (the OOM killer) skipped the exit hook that
        ends its parent, which stayed RUNNING for good with the job its process was running. Never stops this sweep."""
        from rlhflab.tracking import end_runs_gone

        try:
            end_runs_gone(client, experiment_id, self.parent_run_id)
        except Exception as err:  # a store that cannot search so: the sweep goes on, those runs as they were
            log.warning("mlflow sweep: could not look for runs left RUNNING (%s)", " ".join(str(err).split())[:200])

    def _client(self):
        import_mlflow()
        from mlflow.tracking import MlflowClient

        return MlflowClient(self._uri)

    def _experiment_id(self, config: DictConfig) -> str:
        from rlhflab.tracking import ensure_experiment

        return ensure_experiment(self._uri, OmegaConf.select(config, "logger.experiment_name") or "rlhflab",
                                 OmegaConf.select(config, "cache_dir"))

    def _find_child(self, client, config: DictConfig):
        """The run this job's tracker created: the first unclaimed child started after on_job_start."""
        experiment = client.get_experiment_by_name(OmegaConf.select(config, "logger.experiment_name") or "rlhflab")
        if experiment is None:
            return None
        runs = client.search_runs(
            [experiment.experiment_id],
            f"tags.mlflow.parentRunId = '{self.parent_run_id}' and attributes.start_time >= {self._job_started_ms}",
            order_by=["attributes.start_time ASC"],
        )
        for run in runs:
            if run.info.run_id not in self._claimed:
                self._claimed.add(run.info.run_id)
                return run
        return self._continued_child(client, config)

    def _continued_child(self, client, config: DictConfig):
        """A job that continued its own run (resume=auto: a job stopped in an earlier sweep), which its directory's
        mlflow_run.json names once the job has started: moved under this sweep's parent, its first parent in the tag
        rlhflab.sweep.moved_from, this parent in the parent it left (rlhflab.sweep.continued_by). It stayed under the first sweep's parent, and this one's summary and report left
        it out (sweep/jobs counted only the jobs that started anew)."""
        record = self._job_dir / RUN_RECORD if self._job_dir else None
        try:
            if record is None or record.stat().st_mtime * 1000 < self._job_started_ms:
                return None  # no run, or not this job's (a new run that failed before it wrote one)
            run = client.get_run(json.loads(record.read_text())["run_id"])
        except Exception:  # unreadable, or a run the store does not hold: as no run
            return None
        if run.info.run_id in self._claimed:
            return None
        self._claimed.add(run.info.run_id)
        before = run.data.tags.get("mlflow.parentRunId")
        if before != self.parent_run_id:
            client.set_tag(run.info.run_id, "mlflow.parentRunId", self.parent_run_id)
            if before:  # the run names the first parent; each parent names the sweep that took its runs on
                if SWEEP_MOVED_FROM_TAG not in run.data.tags:
                    client.set_tag(run.info.run_id, SWEEP_MOVED_FROM_TAG, before)
                client.set_tag(before, SWEEP_CONTINUED_BY_TAG, self.parent_run_id)
            run = client.get_run(run.info.run_id)
        return run

    def _tag_child(self, client, config: DictConfig):
        """(the job's run, or None; its overrides): the run tagged with its job number and overrides."""
        child = self._find_child(client, config)
        overrides = " ".join(OmegaConf.to_container(config.hydra.overrides.task))
        if child is not None:
            client.set_tag(child.info.run_id, SWEEP_JOB_TAG, str(config.hydra.job.num))
            client.set_tag(child.info.run_id, SWEEP_OVERRIDES_TAG, overrides[:MAX_TAG])
        return child, overrides

    def _record_failure(self, client, config: DictConfig, job_return: JobReturn, child, overrides: str) -> None:
        error = job_return._return_value  # the public getter re-raises it
        message = f"{type(error).__name__}: {error}"
        exc_info = None if _one_line_error(error) else (type(error), error, error.__traceback__)
        log.error("mlflow sweep: job #%s (%s) failed: %s", config.hydra.job.num, overrides, message, exc_info=exc_info)
        if child is None:  # failed before its tracker made a run: make one so the failure shows
            child = self._create_failed_child(client, config, overrides)
        elif child.info.status == "RUNNING":
            client.set_terminated(child.info.run_id, "FAILED")
        client.set_tag(child.info.run_id, ERROR_TAG, message[:MAX_TAG])
        self.failed.append(f"#{config.hydra.job.num} {overrides}: {message.splitlines()[0] if message else ''}")
        # Let the sweep go on: sweepers re-raise a FAILED job's exception when they read its result.
        # Optuna's sweeper tells a None result as a FAILED trial (NaN would crash its tell());
        # the basic sweeper ignores the value.
        job_return.status = JobStatus.COMPLETED
        job_return.return_value = None

    def _create_failed_child(self, client, config: DictConfig, overrides: str):
        experiment_id = self._experiment_id(config)
        choices = config.hydra.runtime.choices
        tags = {group: str(choices.get(group)) for group in RUN_TAG_GROUPS if choices.get(group) is not None}
        if OmegaConf.select(config, "model") is not None:
            tags["model"] = model_tag(config.model)  # as its run would have been tagged
        tags |= {
            "staleness": str(OmegaConf.select(config, "staleness")),
            "mlflow.parentRunId": self.parent_run_id,
            SWEEP_JOB_TAG: str(config.hydra.job.num),
            SWEEP_OVERRIDES_TAG: overrides[:MAX_TAG],
        }
        # named as the job's own run would have been (MlflowTracker.start): 'rloo-full-sync' beside its siblings'
        # 'rloo max_prompt_tokens=1 ...' said nothing of what the failed job was
        task = list(OmegaConf.to_container(config.hydra.overrides.task))
        name = (named_run(OmegaConf.select(config, "logger.run_name"), tags.get("algo", ""), task, self.swept)
                or default_run_name(tags) or f"job{config.hydra.job.num}")
        run = client.create_run(experiment_id, run_name=name, tags=tags)
        client.set_terminated(run.info.run_id, "FAILED")
        return client.get_run(run.info.run_id)

    def _report_command(self) -> str:
        """The report's command line for this sweep (its store named where it is not the report's default)."""
        store = "" if self._uri in (None, "sqlite:///mlflow.db") else f" tracking_uri={shlex.quote(redact(self._uri))}"
        return f"python src/report.py sweep={self.parent_run_id}{store}"

    def _summarise(self, client, ended: str = "FINISHED") -> None:
        """Best child by `metric` into the parent's tags, metrics and description; `ended`: how the sweep ended."""
        from mlflow.entities import Metric

        children = client.search_runs(
            [client.get_run(self.parent_run_id).info.experiment_id],
            f"tags.mlflow.parentRunId = '{self.parent_run_id}'",
        )
        # in job order: of runs tied on the metric (gold moves in steps of 1/256) the first is best, as Optuna's
        # best trial is; search_runs gives the newest first, and the parent named a later job than Optuna printed
        finished = sorted((r for r in children if r.info.status == "FINISHED"), key=_job_number)
        if self.metric == "eval/gold_reward" and not any(self.metric in r.data.metrics for r in finished):
            self.metric = "eval/reward"  # a task without task.gold_fn: what its runs report, and train.objective returns
        scored = [r for r in finished if self.metric in r.data.metrics]
        sign = -1.0 if self.direction.lower().startswith("min") else 1.0
        best = max(scored, key=lambda r: sign * r.data.metrics[self.metric], default=None)
        if finished and not scored:  # a typo (metric=eval/gold): no best run, and not a word said
            logged = sorted(set().union(*(r.data.metrics for r in finished)))
            log.warning("mlflow sweep: no finished job logged %s, so the parent has no best run; the metric is "
                        "hydra.callbacks.mlflow_sweep.metric (or optimized_metric), e.g. one of %s", self.metric,
                        ", ".join(k for k in logged if k.startswith("eval/")) or ", ".join(logged[:10]))
        now = int(time.time() * 1000)
        metrics = [Metric("sweep/jobs", len(children), now, 0), Metric("sweep/failed_jobs", len(self.failed), now, 0)]
        tags = {SWEEP_METRIC_TAG: self.metric, "rlhflab.sweep.direction": self.direction}
        if self.objective:
            tags[SWEEP_OBJECTIVE_TAG] = self.objective
        note = f"{len(children)} job{'' if len(children) == 1 else 's'}, {len(self.failed)} failed."
        if best is not None:
            value = best.data.metrics[self.metric]
            metrics.append(Metric(f"best/{self.metric}", value, now, 0))
            tags |= {"rlhflab.sweep.best_run_id": best.info.run_id, SWEEP_BEST_RUN_NAME_TAG: best.info.run_name}
            what = f" ({self.objective})" if self.objective else ""
            note = f"Best {self.metric}{what}: {value:.4f} ({best.info.run_name}, {best.info.run_id}). " + note
        if ended != "FINISHED":
            note += f" The sweep was {'stopped' if ended == 'KILLED' else 'ended by an error'} before its last job."
        tags["mlflow.note.content"] = note + f" Report: `{self._report_command()}`"
        client.log_batch(self.parent_run_id, metrics=metrics)
        for key, value in tags.items():
            client.set_tag(self.parent_run_id, key, value)

    def _abandon(self) -> None:
        """atexit: the sweep ended without on_multirun_end. KILLED when a signal stopped its job (Ctrl-C, SIGTERM: the
        job's run is KILLED, or was not made yet), FAILED otherwise (an exception). The stopped job's run gets its job tags."""
        from rlhflab.interrupts import STOP

        if self.parent_run_id is None:
            return
        if STOP.lost:  # the job's store stopped answering: each try here was MLflow's retries again, minutes at exit
            log.warning("mlflow sweep: the sweep %s is left RUNNING, as %s; the next run or sweep in its experiment "
                        "on this machine ends it KILLED", self.parent_run_id, STOP.lost)
            return
        client = self._client()
        if client.get_run(self.parent_run_id).info.status != "RUNNING":
            return
        try:
            child = self._tag_child(client, self._job)[0] if self._job is not None else None
        except Exception as err:  # whatever it was, the parent is still ended below (RUNNING forever otherwise)
            log.warning("mlflow sweep: could not find the stopped job's run (%s)", " ".join(str(err).split())[:200])
            child = None
        # A signal stopped the job: its run is KILLED, or it had none yet (a Ctrl-C as the job started, which
        # ended the parent FAILED, as a crash would)
        stopped = STOP.requested or (child is not None and client.get_run(child.info.run_id).info.status == "KILLED")
        ended = "KILLED" if stopped else "FAILED"
        try:  # what ran until then: a stopped sweep's parent had no sweep/jobs, best run or note
            self._summarise(client, ended)
        except Exception as err:  # the store itself may be why it ended: still end the parent
            log.warning("mlflow sweep: could not summarise the jobs so far (%s)", " ".join(str(err).split())[:200])
        client.set_terminated(self.parent_run_id, ended)


def _job_number(run) -> int:
    job = run.data.tags.get(SWEEP_JOB_TAG, "")
    return int(job) if job.isdigit() else 1 << 30


def swept_params(config: DictConfig) -> dict[str, str]:
    """What the sweep varies: the sweeper's `params` and the command line's sweep overrides (`algo=ppo,rloo`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = OmegaConf.select(config, "hydra.sweeper.params")
    swept = {str(k): str(v) for k, v in (OmegaConf.to_container(params) if params is not None else {}).items()}
    overrides = OverridesParser.create().parse_overrides(list(OmegaConf.to_container(config.hydra.overrides.task)))
    for override in overrides:
        key = override.get_key_element().lstrip("+~")
        if override.is_sweep_override():
            swept[key] = str(override.input_line).partition("=")[2]  # as typed: a,b / range(1,3)
        else:  # one value on the command line fixes a key the preset sweeps (experiment=sweep_memory memory=lora)
            swept.pop(key, None)
    return swept


def sweep_name(config: DictConfig, swept: dict[str, str]) -> str:
    """`<experiment or 'sweep'> <what is swept> <what every job shares> <date>_<time>` (the time from the sweep
    dir), e.g. `sweep algo=ppo,rloo async staleness=1 2025-01-31_12-00-00`: the command line's other settings,
    named as a run names them (run_name), so that two sweeps of the same grid are told apart by more than time."""
    prefix = Path(OmegaConf.select(config, "hydra.runtime.choices.experiment") or "sweep").name
    what = " ".join(short_override(f"{key}={compact_search(value)}") for key, value in swept.items())
    shared = [o for o in OmegaConf.to_container(config.hydra.overrides.task)
              if o.partition("=")[0].lstrip("+~") not in (*swept, "experiment")]
    algo = next((o.partition("=")[2] for o in shared if o.lstrip("+~").startswith("algo=")), "")
    when = "_".join(Path(str(config.hydra.sweep.dir)).parts[-2:])
    if not re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d.*", when):  # hydra.sweep.dir=runs/ablation: each sweep there
        when = time.strftime("%Y-%m-%d_%H-%M-%S")  # was named '... runs_ablation', alike but for its id
    return " ".join(part for part in (prefix, clipped(what, 200), clipped(run_name(algo, shared).strip(), 100), when) if part)


def compact_search(value: str) -> str:
    """An Optuna search as a name shows it: tag(log, interval(0.005, 0.5)) -> log[0.005,0.5], interval(a, b) ->
    [a,b]. The whole expression made the parent's name and its report's directory
    (reports/sweep_optuna_kl_coef=tag_log,_interval_0.005,_0.5_lr=tag_log,...) hard to read; the tag
    rlhflab.sweep.params keeps it as written."""

    interval = r"interval\(\s*([^,()]+?)\s*,\s*([^,()]+?)\s*\)"
    value = re.sub(rf"tag\(\s*log\s*,\s*{interval}\s*\)", r"log[\1,\2]", value)
    return re.sub(interval, r"[\1,\2]", value)


def sweep_overrides(config: DictConfig) -> str:
    """The sweep's command line: the task's overrides, then Hydra's own (the sweeper, a narrowed grid, n_trials) but
    the `hydra.mode=MULTIRUN` of -m. Without those, `experiment=sweep_algos 'hydra.sweeper.params.algo="rloo,grpo"'`
    was recorded (and its report's summary said) `experiment=sweep_algos`, the preset's 7 algorithms, and an Optuna
    search on the command line lost the sweeper it needs."""
    hydra = OmegaConf.select(config, "hydra.overrides.hydra")
    own = [o for o in (OmegaConf.to_container(hydra) if hydra is not None else []) if o != "hydra.mode=MULTIRUN"]
    return " ".join([*OmegaConf.to_container(config.hydra.overrides.task), *own])


def _sweep_tags(config: DictConfig, swept: dict[str, str]) -> dict[str, str]:
    experiment = OmegaConf.select(config, "hydra.runtime.choices.experiment")
    return {
        SWEEP_TAG: "1",
        PROCESS_TAG: process_identity(),
        "rlhflab.sweep.dir": os.path.abspath(str(config.hydra.sweep.dir)),
        SWEEP_OVERRIDES_TAG: sweep_overrides(config)[:MAX_TAG],
        "rlhflab.sweep.params": json.dumps(swept)[:MAX_TAG],
        "rlhflab.sweep.sweeper": str(OmegaConf.select(config, "hydra.sweeper._target_")),
        # only where a preset was chosen (it was the string 'None' without one)
        **({"rlhflab.sweep.experiment": str(experiment)} if experiment is not None else {}),
    }


def _one_line_error(error: BaseException) -> bool:
    """rlhflab's ConfigError messages, and the others a run ends with in one line (a reward function's error, a
    NaN, a lost rank: errors.ONE_LINE), are complete in one line; a traceback would only hide them (a job's
    RewardError was ~40 lines of Hydra's)."""
    from rlhflab.errors import ONE_LINE

    return isinstance(error, ONE_LINE)
