"""MLflow tracking: one run per experiment holding every stage's metrics, the config, samples and the policy.

A run is named by what it changed (rlhflab.naming.run_name), carries its lineage
(entry point, git commit, user, command-line overrides, Hydra output directory,
the cached models it used) and never holds a credential: every URI is redacted.
A resumed run continues the same MLflow run, and a metric step it already logged
is not logged twice.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import re
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import MLFlowLogger
from omegaconf import DictConfig, OmegaConf

from rlhflab.errors import ConfigError, RunInterrupted, StoreAbandoned, WriteFailed
from rlhflab.interrupts import STOP
from rlhflab.naming import (ERROR_TAG, MAX_TAG, PARENT_RUN_ENV, PROCESS_TAG, RUN_RECORD, STOP_TAG, SWEEP_TAG, SWEPT_ENV, absolute_uri,
                            behind_server, check_server, default_run_name, import_mlflow, named_run, process_gone,
                            process_identity, ready_artifact_store, redact, sqlite_path)
from rlhflab.store_template import keep_template, seed_store

log = logging.getLogger(__name__)

UNWRITTEN = "unwritten_metrics.json"  # in the output directory: what a store that stopped answering at the end did not take

EXPERIMENT_KIND = "custom_model_development"  # MLflow 3's classic training view, not GenAI's traces and judges
# The runs table as rlhflab opens it: sorted by the gold reward, its column shown first. MLflow's UI reads a view from
# an experiment tag `mlflow.sharedViewState.<key>` when the URL names the key (viewStateShareKey), and picks the
# training (not GenAI) view from the URL's workflowType.
VIEW_KEY = "rlhflab-gold"
VIEW_STATE = {"orderByKey": "metrics.`eval/gold_reward`", "orderByAsc": False,
              "selectedColumns": ["metrics.`eval/gold_reward`", "metrics.`eval/gold_reward_before`", "metrics.`train/kl`",
                                  "tags.`algo`", "tags.`memory`", "tags.`mode`"]}  # MLflow's column keys: name in backticks
EXPERIMENT_NOTE = ("RLHF runs from rlhflab (python src/train.py). Each run holds its stages (sft, rm) and RL; "
                   "eval/gold_reward is the task's own judgement of held-out completions.")


def hydra_run_dir() -> Path | None:
    """Hydra's run (or sweep job) directory, where train.log and .hydra/ go; None when Hydra does not run us."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir).resolve() if HydraConfig.initialized() else None


def param_text(value) -> str:
    """A param's value as config.yaml and the command line write it (null, true, ["a", "b"]), not Python's None,
    True, ['a', 'b']; secrets redacted, cut at MLflow's limit on a param value."""
    if value is None or isinstance(value, (bool, list, tuple, dict)):
        text = json.dumps(value, ensure_ascii=False, default=str)
    else:
        text = str(value)
    return redact(text)[:6000]


def flatten(cfg: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= flatten(value, f"{name}.")
        else:
            out[name] = param_text(value)
    return out


# RL step metrics reduced over trainer.log_every_n_steps steps (MlflowTracker.log_step) by their largest value, and by
# their last (a count so far); every other by the mean.
WINDOW_MAX = ("perf/peak_mem_mb", "perf/activation_peak_mb")
WINDOW_LAST = ("train/skipped_batches",)


class RunLogger(MLFlowLogger):
    """Lightning's MLflow logger bound to our run: its metrics go through the tracker's buffer, and it leaves
    ending the run to the tracker.

    Every stage (sft, rm, rl) gets its own Trainer; without this the first
    Trainer to finish would mark the whole run FINISHED. A Trainer's end (finalize) writes what is buffered.
    """

    def __init__(self, tracker: "MlflowTracker") -> None:
        super().__init__(tracking_uri=tracker.tracking_uri, run_id=tracker.run_id)
        self.tracker = tracker
        self._experiment_id = tracker.experiment_id

    @property
    @rank_zero_experiment
    def experiment(self):
        """The tracker's client. Lightning asks for it at every Trainer's setup, and MLFlowLogger's own asked the store
        for the run each time: a server that had stopped answering ended the stage in a traceback."""
        return self.tracker.client

    def log_metrics(self, metrics, step=None) -> None:
        self.tracker.log_metrics(metrics, step or 0)

    def log_step(self, metrics: dict, step: int) -> None:
        """An RL step's metrics, reduced over trainer.log_every_n_steps RL steps (`MlflowTracker.log_step`)."""
        self.tracker.log_step(metrics, step)

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        """Through the tracker, as every write: MLFlowLogger's own met a store that had stopped answering with its
        traceback."""
        self.tracker.log_params(dict(params))

    def save(self) -> None:
        """Lightning calls this after every `self.log` step: the tracker writes when its interval is due, not here."""

    def flush(self) -> None:
        """Write every buffered metric now (a checkpoint is being written)."""
        self.tracker.flush()

    def finalize(self, status: str = "success") -> None:
        self.tracker.flush()


@contextmanager
def store_lock(tracking_uri: str):
    """Serialise the first use of a SQLite store: two processes creating a fresh database at once race
    in MLflow's schema migration (one dies with 'duplicate column name')."""
    db = sqlite_path(tracking_uri)
    if db is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{db}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def artifact_home(tracking_uri: str, name: str) -> str | None:
    """Where a new experiment of a SQLite store keeps its runs' files: mlruns/<its name> beside the database. MLflow's
    default, ./mlruns of the working directory, put them wherever the first run happened to start (a store given as
    sqlite:////abs/mlflow.db from another directory: its files there, apart from it). None for other stores
    (a server, a database: their own default)."""
    db = sqlite_path(tracking_uri)
    if db is None:
        return None
    return str(db.expanduser().resolve().parent / "mlruns" / (re.sub(r"[^\w.-]+", "_", name).strip("._") or "experiment"))


def ensure_experiment(tracking_uri: str, name: str, cache_dir=None) -> str:
    """The id of experiment `name`, created if missing, with rlhflab's kind (training view), description and
    gold-reward view. One made elsewhere (a sweep's parent, an older rlhflab, by hand) gets the kind and view as
    this one has them; a user's own description stays. The client is made under the store lock: making one
    creates (migrates) a fresh SQLite database, or copies `cache_dir`'s empty one (seed_store)."""
    import_mlflow()  # the sweep's parent may make the experiment first
    from mlflow.tracking import MlflowClient

    tags = {"mlflow.experimentKind": EXPERIMENT_KIND, "mlflow.note.content": EXPERIMENT_NOTE,
            f"mlflow.sharedViewState.{VIEW_KEY}": json.dumps(VIEW_STATE)}
    check_server(tracking_uri)  # the command line's preflight did too; train(cfg) may be called without it
    db = sqlite_path(tracking_uri)
    if db is not None and db.is_dir():  # MLflow retried 'unable to open database file' for ~100 s, printing each retry
        raise ConfigError(f"logger.tracking_uri: '{redact(tracking_uri)}' names a directory, not a database file; give a "
                          f"file in it, e.g. logger.tracking_uri=sqlite:///{(db / 'mlflow.db').absolute()}")
    opened = False
    try:
        with store_lock(tracking_uri):
            new = db is not None and not db.exists()
            seeded = new and cache_dir is not None and seed_store(db, cache_dir)
            client = MlflowClient(tracking_uri)
            experiment = client.get_experiment_by_name(name)
            opened = True
            if new and not seeded and cache_dir is not None:
                keep_template(db, cache_dir)
            if experiment is None:
                try:
                    return client.create_experiment(name, artifact_location=artifact_home(tracking_uri, name), tags=tags)
                except Exception:  # another process (not under this lock: a server's other client) created it first
                    experiment = client.get_experiment_by_name(name)
            check_artifact_store(tracking_uri, experiment)
            for key, value in tags.items():
                if experiment.tags.get(key) != value and not (key == "mlflow.note.content" and key in experiment.tags):
                    client.set_experiment_tag(experiment.experiment_id, key, value)
            return experiment.experiment_id
    except Exception as err:
        if opened:
            raise
        # The store cannot be opened: a config error, whatever raised it. MLflow 3 refuses its file store
        # ('./mlruns', file:...); a database URI's driver is not installed (postgresql: ModuleNotFoundError); a
        # sqlite path runs through a file; databricks has no credentials.
        why = error_text(err)
        if isinstance(err, ImportError):
            why += " (the store's database driver; pip install it)"
        elif isinstance(err, OSError) and sqlite_path(tracking_uri) is not None:  # its directory, or the lock file beside it
            why += "; give a database file in a directory this user can write, e.g. logger.tracking_uri=sqlite:///mlflow.db"
        elif why.endswith("database or disk is full"):  # as it makes its tables
            why += "; make room on its disk, or give a database on another (logger.tracking_uri=sqlite:///<path>)"
        raise ConfigError(f"logger.tracking_uri: MLflow cannot open '{redact(tracking_uri)}' (from MLFLOW_TRACKING_URI or "
                          f"logger.tracking_uri=): {redact(why)}") from None


def check_artifact_store(tracking_uri: str, experiment) -> None:
    """An experiment made through an MLflow server (`mlflow server --backend-store-uri sqlite:///mlflow.db`) keeps
    its runs' files behind that server (mlflow-artifacts:/...). The same database opened directly (sqlite:///...)
    made the run, then failed on its first file (config.yaml) in MLflow's 49-line MlflowException."""
    if behind_server(experiment.artifact_location, tracking_uri):
        raise ConfigError(f"logger.experiment_name={experiment.name}: its runs' files are kept behind an MLflow server "
                          f"({experiment.artifact_location}), and {redact(tracking_uri)} is not one; log through that "
                          "server (logger.tracking_uri=http://HOST:PORT), or to another experiment "
                          "(logger.experiment_name=<new name>)")


def log_param_batches(client, run_id: str, params: list) -> None:
    for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
        client.log_batch(run_id, params=params[i : i + 100])


def store_failed(err: BaseException) -> bool:
    """The store did not answer or failed on its side (a server down past MLflow's retries, a 5xx, a SQLite file
    gone or locked too long), as opposed to refusing a request (a bad value), which is a bug to raise."""
    from mlflow.exceptions import MlflowException

    if isinstance(err, MlflowException):
        return err.error_code in ("INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "DEADLINE_EXCEEDED")
    return isinstance(err, OSError) or type(err).__name__ in ("OperationalError", "ConnectionError", "Timeout")


def error_text(err: BaseException) -> str:
    """An error of the store on one line: MLflow's message (or the exception's type and words), without SQLAlchemy's
    link to its FAQ, its advice on a write a query flushed (MLflow's metrics batch), and the statement with the run's
    values (a CREATE TABLE, or an INSERT of 40 rows, in which the error's own words were lost)."""
    from mlflow.exceptions import MlflowException

    text = " ".join(str(err.message if isinstance(err, MlflowException) else f"{type(err).__name__}: {err}").split())
    text = re.sub(r" ?\(Background on this error at: [^)]*\)", "", text)
    return re.sub(r"\(raised as a result of Query-invoked autoflush;[^)]*\) ?| ?\[SQL: .*", "", text)


def network_cause(text: str) -> str | None:
    """The OS's words in an HTTP failure that nests urllib3's in requests' in MLflow's ('API request to ... failed
    with exception HTTPConnectionPool(...): Max retries exceeded ... [Errno 111] Connection refused'), or in urllib3's
    retry warning ("... broken by 'ConnectionResetError(104, 'Connection reset by peer')'"), or None."""
    text = re.sub(r"\w+Error\((-?\d+), '([^']*)'\)", r"[Errno \1] \2", text)
    cause = re.search(r"\[Errno -?\d+\] [^'\"()]+|Read timed out|Connection aborted|Remote end closed connection", text)
    return cause.group(0).strip(" .") if cause else None


def store_error(err: BaseException) -> str:
    """One line of why, without the address's credentials."""
    text = error_text(err)
    return redact(network_cause(text) or text[:300])


def end_runs_gone(client, experiment_id: str, by: str) -> list:
    """The experiment's runs (a sweep's parent too) left RUNNING by a process that is gone: SIGKILL and the OOM killer
    run no exit hook, and such a run stayed RUNNING for good (after its first checkpoint, until a resume continued it;
    a sweep's parent always); so does a process whose tracking store stopped answering (it could not end its run).
    Ended KILLED, with why in rlhflab.stopped; each one said in a warning (with
    the command that continues a run that has checkpoints). Only what PROCESS_TAG says is certainly gone
    (naming.process_gone): a run on another machine, or from before the tag, is left as it is. `by`: the run or sweep
    that ends them. -> the runs ended."""
    ended = []
    for run in client.search_runs([experiment_id], "attributes.status = 'RUNNING'"):
        tags = run.data.tags
        if run.info.run_id == by or not process_gone(tags.get(PROCESS_TAG)):
            continue
        client.set_tag(run.info.run_id, STOP_TAG, "its process ended without ending it (SIGKILL, the OOM killer, or a "
                                                  f"tracking store that stopped answering); ended by the next run in its experiment, {by}")
        client.set_terminated(run.info.run_id, "KILLED")
        ended.append(run)
        out = tags.get("rlhflab.output_dir")
        again = "" if SWEEP_TAG in tags or not out or not any(Path(out, "checkpoints").glob("step-*")) else \
            f"; resume=auto output.dir={out} continues it from its newest checkpoint"
        log.warning("mlflow: %s %s (%s), left RUNNING by a process that is gone (SIGKILL, or a store that stopped answering), is ended KILLED%s",
                    "the sweep" if SWEEP_TAG in tags else "run", run.info.run_id, run.info.run_name, again)
    return ended


class MlflowTracker:
    """Owns the MLflow run of one `train(cfg)` call.

    tracking_uri: where runs go (default: sqlite:///mlflow.db in the working directory).
    experiment_name: the MLflow experiment that groups runs.
    run_name: null = the algorithm and the command-line overrides (e.g. "online_dpo async staleness=2").
    flush_every_s: metrics are buffered and written in one batch at most this often (0: at once). Each write
      to a SQLite store costs milliseconds of Python, most of it per batch (a tiny model's RL step takes ~40 ms);
      a write happens in the training loop, not in a background thread that would hold the GIL while the
      step runs. What is buffered is written at every stage end, checkpoint and run end (finish).
    window_steps: RL step metrics (`log_step`) are written once per this many RL steps, reduced over them
      (trainer.log_every_n_steps; train sets it).
    """

    def __init__(self, tracking_uri: str, experiment_name: str = "rlhflab", run_name: str | None = None,
                 flush_every_s: float = 1.0) -> None:
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.flush_every_s = flush_every_s
        self.run_id: str | None = None
        self.logged_steps: dict[str, int] = {}
        self.pending: list = []  # mlflow.entities.Metric rows not written yet
        self.pending_tags: dict[str, str] = {}  # tags set once the store stopped answering (perf/mem_method at the end)
        self.flushed_at = time.monotonic()
        self.window_steps = 1
        self._window: dict[str, list] = {}  # metric -> [sum (a peak's largest, a count's last), steps] not written yet
        self._window_base: int | None = None  # the step the window's steps follow: the last written, or the first's before
        self._window_step = 0  # the window's last step
        self._keys: dict[str, str] = {}  # metric name -> the name MLflow accepts
        self._client = None
        self._system = None
        self.experiment_id: str | None = None
        # Why the store stopped answering (a server down past MLflow's own retries, a SQLite file gone), or None.
        # What was not written stays in `pending`; the RL stage then stops with a checkpoint that keeps it
        # (lit/checkpoint.Checkpointer), and a resume writes it first.
        self.lost: str | None = None
        # what then happens, for the warning (rl_ended: no RL step is left to stop at)
        self.when_lost = "the run stops at its next RL step with a checkpoint that keeps what was not written"
        # A signal gave the store up while it did not answer (StoreAbandoned): nothing more is tried in this process.
        self.abandoned = False
        self._retried: str | None = None  # why MLflow retries the write the run's thread is in (urllib3's cause), or None
        self._said_retrying = False
        # MLflow prints "View run ... at <tracking URI>" when a run against a server ends, password and all;
        # the closing line of a run gives a redacted link instead.
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")

    @property
    def client(self):
        if self._client is None:
            import_mlflow()
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(self.tracking_uri)
        return self._client

    def cannot_continue(self, run_id: str, output_dir: Path) -> str | None:
        """Why the run `run_id` (a checkpoint's) cannot be continued in this store, or None: it is not there (another
        store, a relative sqlite path from another directory, a database deleted) or it was deleted."""
        import_mlflow()  # a resume's first MLflow call
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException as err:
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            run = None
        if run is not None and run.info.lifecycle_stage != "deleted":
            return None
        here = redact(self.tracking_uri)
        if absolute_uri(self.tracking_uri) != self.tracking_uri:  # a relative sqlite path
            here += f" (relative to {Path.cwd()})"
        if run is not None:
            return f"its MLflow run {run_id} was deleted in {here} (mlflow runs restore --run-id {run_id} brings it back)"
        try:
            then = json.loads((output_dir / RUN_RECORD).read_text())["tracking_uri"]
        except (OSError, ValueError, KeyError):
            then = None
        return f"its MLflow run {run_id} is not in {here}" + (f"; it was logged to {then}" if then else "")

    def start(self, cfg: DictConfig, tags: dict[str, str], overrides: list[str], output_dir: Path,
              resume_run_id: str | None = None) -> str:
        """Create the run (or reopen `resume_run_id`), with params, the config, lineage and a description."""
        import_mlflow()  # a run's first MLflow call: without what no run uses
        from mlflow.tracking.context.registry import resolve_tags

        if resume_run_id:  # in its own experiment: another logger.experiment_name made an empty one, and the link and
            # mlflow_run.json named it. (The store holds the run: no first use to serialise, see ensure_experiment.)
            client = self.client
            self.experiment_id = client.get_run(resume_run_id).info.experiment_id
            held = client.get_experiment(self.experiment_id).name
            if held != self.experiment_name:
                log.warning("mlflow: logger.experiment_name=%s, but the run this resumes is in experiment '%s' and goes "
                            "on there", self.experiment_name, held)
                self.experiment_name = held
            client.set_tag(resume_run_id, PROCESS_TAG, process_identity())  # before RUNNING: this process runs it now
            client.update_run(resume_run_id, status="RUNNING")
            self.run_id = resume_run_id
            self.logged_steps = self._logged_steps()
            resumed = client.get_run(resume_run_id)
            ready_artifact_store(resumed.info.artifact_uri)
            ended = resumed.data.tags
            for tag in (ERROR_TAG, STOP_TAG):  # the failure or stop it goes on from: kept apart, so a run that
                if ended.get(tag):  # finishes does not read as failed or stopped
                    client.set_tag(self.run_id, f"{tag}_before_resume", ended[tag])
                    client.delete_tag(self.run_id, tag)
            self._record_resume(cfg, overrides, ended)
            log.info("mlflow: resuming run %s at %s", self.run_id, redact(self.tracking_uri))
            self._start_system_metrics()
            return self.run_id
        experiment_id = self.experiment_id = ensure_experiment(self.tracking_uri, self.experiment_name,
                                                               OmegaConf.select(cfg, "cache_dir"))
        client = self.client  # after: a fresh SQLite store is made under ensure_experiment's lock
        tags = {k: redact(str(v)) for k, v in tags.items()}
        if os.environ.get(PARENT_RUN_ENV):
            tags["mlflow.parentRunId"] = os.environ[PARENT_RUN_ENV]
        command = " ".join(["python src/train.py", *map(redact, overrides)])
        tags |= {"rlhflab.overrides": " ".join(map(redact, overrides)), "rlhflab.output_dir": str(output_dir),
                 PROCESS_TAG: process_identity(),
                 "mlflow.note.content": f"`{command}`\n\nHydra output directory: `{output_dir}`"}
        hydra_dir = hydra_run_dir()
        if hydra_dir is not None and hydra_dir != Path(output_dir).resolve():  # output.dir moved the run: train.log,
            # .hydra/ stay in Hydra's own directory, which the run would otherwise name nowhere
            tags |= {"rlhflab.hydra_dir": str(hydra_dir),
                     "mlflow.note.content": f"`{command}`\n\nOutput directory (output.dir): `{output_dir}`\n\n"
                                            f"Hydra output directory (train.log, .hydra/): `{hydra_dir}`"}
        swept = json.loads(os.environ.get(SWEPT_ENV) or "{}") if os.environ.get(PARENT_RUN_ENV) else {}
        name = redact(named_run(self.run_name, tags.get("algo", ""), overrides, swept) or default_run_name(tags))
        run = client.create_run(experiment_id, run_name=name, tags=resolve_tags(tags))  # + source, git commit, user
        self.run_id = run.info.run_id
        ready_artifact_store(run.info.artifact_uri)
        from mlflow.entities import Param

        log_param_batches(client, self.run_id, [Param(k, v) for k, v in flatten(OmegaConf.to_container(cfg, resolve=True)).items()])
        with self.artifact_store("config.yaml"):  # before anything trains: a full artifact disk is said now
            client.log_text(self.run_id, redact(OmegaConf.to_yaml(cfg, resolve=True)), "config.yaml")
        log.info("mlflow: run %s (%s) in experiment '%s' at %s", self.run_id, name, self.experiment_name, redact(self.tracking_uri))
        self._start_system_metrics()
        return self.run_id

    def end_left_running(self, output_dir: Path) -> str | None:
        """The MLflow run that output_dir's mlflow_run.json names, where it is still RUNNING in this store: its process
        died without a word (SIGKILL, a lost machine) before its first checkpoint, so no resume will ever continue it,
        and it stayed RUNNING for good. This new run in the same directory (started; the directory is ours: output_lock)
        ends it KILLED, with what ended it in rlhflab.stopped, and names it in its own tag rlhflab.replaces_run
        (mlflow_run.json is about to name this run instead). -> its run id, or None where there was none."""
        from mlflow.exceptions import MlflowException

        try:
            record = json.loads((Path(output_dir) / RUN_RECORD).read_text())
            old, then = str(record["run_id"]), record["tracking_uri"]
        except (OSError, ValueError, KeyError, TypeError):  # no record (a new directory), or not one we can read
            return None
        if old == self.run_id or then != redact(absolute_uri(self.tracking_uri)):  # a run in another store is left alone
            return None
        ended = None

        def write():
            nonlocal ended
            try:
                run = self.client.get_run(old)
            except MlflowException as err:
                if err.error_code == "RESOURCE_DOES_NOT_EXIST":
                    return
                raise
            if run.info.status != "RUNNING" or run.info.lifecycle_stage == "deleted":
                return
            self.client.set_tag(old, STOP_TAG, f"its process died without a word (SIGKILL or a lost machine) before its "
                                               f"first checkpoint; ended by the next run in {output_dir}, {self.run_id}")
            self.client.set_terminated(old, "KILLED")
            self.client.set_tag(self.run_id, "rlhflab.replaces_run", old)
            ended = old

        self._write(f"end of the run {old} left RUNNING", write)
        if ended:
            log.warning("mlflow: run %s, left RUNNING in %s by a process that died before its first checkpoint (SIGKILL?), "
                        "is ended KILLED; this run is tagged rlhflab.replaces_run=%s", old, output_dir, old)
        return ended

    def end_runs_gone(self) -> None:
        """end_runs_gone, by this run: what a process that is gone left RUNNING in its experiment (a store that cannot
        search so, or stops answering, leaves them as they were; the run goes on)."""
        try:
            self._write("end of the runs left RUNNING by a process that is gone",
                        lambda: end_runs_gone(self.client, self.experiment_id, self.run_id))
        except Exception as err:
            log.warning("mlflow: could not look for runs left RUNNING (%s)", " ".join(str(err).split())[:200])

    def _record_resume(self, cfg: DictConfig, overrides: list[str], tags: dict[str, str]) -> None:
        """What this resume is, where the UI shows it: MLflow keeps a param's first value, so the values the resume
        changed (trainer.max_steps to train further, logger.*, ...) are the tag rlhflab.changed_on_resume, and each
        resume's command (and Hydra directory, where its train.log is) is added to the run's description."""
        from mlflow.entities import Param

        client, at = self.client, time.strftime("%Y-%m-%d %H:%M:%S")
        held = client.get_run(self.run_id).data.params
        now = flatten(OmegaConf.to_container(cfg, resolve=True))
        changed = [f"{k}: {held[k]} -> {v}" for k, v in now.items() if k in held and held[k] != v and k != "resume"]
        # keys the first run's version did not have
        log_param_batches(client, self.run_id, [Param(k, v) for k, v in now.items() if k not in held])
        if changed:
            client.set_tag(self.run_id, "rlhflab.changed_on_resume", "; ".join(changed)[:MAX_TAG])
        elif "rlhflab.changed_on_resume" in tags:  # an earlier resume's changes, which this one put back
            client.delete_tag(self.run_id, "rlhflab.changed_on_resume")
        command = " ".join(["python src/train.py", *map(redact, overrides)])
        hydra_dir = hydra_run_dir()
        line = f"Resumed at {at}: `{command}`" + (f" (changed: {'; '.join(changed)})" if changed else "") + (
            f"; Hydra output directory (train.log, .hydra/): `{hydra_dir}`" if hydra_dir is not None else "")
        note = tags.get("mlflow.note.content", "")
        text = redact(f"{note}\n\n{line}" if note else line)
        if len(text) > MAX_TAG:  # many resumes: the first command and the newest resume
            text = f"{note.split(chr(10) * 2 + 'Resumed at ')[0]}\n\n(earlier resumes left out)\n\n{redact(line)}"[-MAX_TAG:]
        client.set_tag(self.run_id, "mlflow.note.content", text)
        client.set_tag(self.run_id, "rlhflab.resumed_at", at)

    def log_again_after(self, step: int) -> None:
        """The steps after `step` are logged again, not passed over as the ones the run holds: a resume whose reward
        function was edited retrains them on other values (MLflow then keeps both values of each)."""
        self.logged_steps = {key: min(last, step) for key, last in self.logged_steps.items()}

    def _logged_steps(self) -> dict[str, int]:
        """The last step of every metric the run already holds."""
        client = self.client
        keys = client.get_run(self.run_id).data.metrics
        return {key: max(m.step for m in client.get_metric_history(self.run_id, key)) for key in keys}

    def _start_system_metrics(self) -> None:
        """CPU, memory, disk and network (and GPU with pynvml) every 10 s, as mlflow.start_run(log_system_metrics=True)."""
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._system = SystemMetricsMonitor(self.run_id, sampling_interval=10, samples_before_logging=1,
                                                resume_logging=bool(self.logged_steps), tracking_uri=self.tracking_uri)
            self._system.start()
        except Exception as err:  # e.g. psutil missing: a warning, not a failed run
            log.warning("mlflow: system metrics are off (%s)", err)
            self._system = None

    def lightning_logger(self) -> RunLogger:
        return RunLogger(self)

    def log_metrics(self, metrics: dict[str, float], step: int = 0, again: bool = False) -> None:
        """Buffer `metrics` at `step`, stamped now; write the buffer when flush_every_s has passed. A step the run
        already holds (a resumed run re-running the steps after its checkpoint) is not logged twice, unless `again`:
        the run's closing summaries (step 0), which a resume that trains a finished run further replaces (MLflow
        shows a step's newest value)."""
        from mlflow.entities import Metric
        if self.run_id is None:  # not rank 0 of a distributed run: rank 0 writes
            return

        now = int(time.time() * 1000)
        for key, value in metrics.items():
            if again or step > self.logged_steps.get(key, -1):
                self.pending.append(Metric(self._metric_key(key), float(value), now, step))
        if time.monotonic() - self.flushed_at >= self.flush_every_s:
            self.flush()

    def log_step(self, metrics: dict[str, float], step: int) -> None:
        """An RL step's metrics. With window_steps n > 1 (trainer.log_every_n_steps) each metric is written once for
        the RL steps up to each multiple of n, at the last of them: their mean (as TRL's logging_steps), a peak's
        largest (WINDOW_MAX), a count's last (WINDOW_LAST). Every flush (a checkpoint, a stage's end, the run's end)
        writes the steps so far first, so a window cut short is written at its last step, and nothing is lost."""
        if self.window_steps <= 1:
            return self.log_metrics(metrics, step)
        if self.run_id is None:  # not rank 0 of a distributed run: rank 0 writes
            return
        if self._window_base is None:
            self._window_base = step - 1
        for key, value in metrics.items():
            value, slot = float(value), self._window.get(key)
            if slot is None:
                self._window[key] = [value, 1]
            elif key in WINDOW_MAX:
                slot[0], slot[1] = max(slot[0], value), 1
            elif key in WINDOW_LAST:
                slot[0] = value
            else:
                slot[0] += value
                slot[1] += 1
        self._window_step = step
        if step // self.window_steps > self._window_base // self.window_steps:
            self._close_window()

    def _close_window(self) -> None:
        """Buffer the window's reduced metrics at its last step (`log_step`)."""
        if not self._window:
            return
        window, self._window = self._window, {}
        self._window_base = self._window_step
        self.log_metrics({key: total / steps for key, (total, steps) in window.items()}, self._window_step)

    def _metric_key(self, key: str) -> str:
        """MLflow takes letters, digits and `_/. -` in a metric's name (a reward function's name may hold others);
        each name is checked once, not at every step."""
        clean = self._keys.get(key)
        if clean is None:
            clean = self._keys[key] = re.sub(r"[^a-zA-Z0-9_/. -]+", "", key)
            if clean != key:
                log.warning("mlflow: metric %r is logged as %r (MLflow allows letters, digits and _/. - in names)", key, clean)
        return clean

    def flush(self, again: bool = False) -> None:
        """Write every buffered metric (MLflow takes at most 1000 per batch). What the store does not take stays
        buffered (see `lost`). Once the store stopped answering, they wait (for a checkpoint, or the run's end, which
        tries `again`): each try against a server that is down costs MLflow's retries, ~4 minutes at its defaults."""
        self._close_window()
        self.flushed_at = time.monotonic()
        if not self.pending or self.run_id is None or (self.lost is not None and (not again or self.abandoned)):
            return
        rows, self.pending = self.pending, []
        client, written = self.client, 0

        def keep_the_rest():  # before anything logged since, in step order
            self.pending[:0] = rows[written:]

        with self.writing("metrics", keep_the_rest):
            for written in range(0, len(rows), 1000):
                client.log_batch(self.run_id, metrics=rows[written : written + 1000])

    @contextmanager
    def writing(self, what: str, on_lost=lambda: None):
        """A write to the store. When the store does not answer (after MLflow's own retries) or fails on its side,
        the run goes on without it: `on_lost()` keeps what was not written, `lost` says why (warned once), and the
        RL stage stops at its next step with a checkpoint. A request the store refuses (a bad value) still raises.
        While it waits on a store that does not answer (`stuck`), a signal gives the store up at once, as if
        MLflow's retries had ended: a stop waited minutes for them, however often it said it was stopping."""
        main = threading.current_thread() is threading.main_thread()  # (the only thread a signal's handler runs in)
        if main:
            outer, STOP.store, self._retried = STOP.store, self, None
        try:
            yield
        except StoreAbandoned as err:  # a first signal: the stop goes on as the handler said, without the store
            self._give_up(what, on_lost, str(err))
        except RunInterrupted as err:  # a signal that stops at once (outside the RL loop, or a second one)
            why = self.stuck()
            if why is not None:
                self._give_up(what, on_lost, str(StoreAbandoned(err.signum, why)))
            raise
        except Exception as err:
            if not store_failed(err):
                raise
            self._lose(what, on_lost, store_error(err))
        finally:
            if main:
                STOP.store, self._retried = outer, None

    def _lose(self, what: str, on_lost, why: str) -> None:
        on_lost()
        if self.lost is None:
            log.warning("mlflow: %s did not take the run's %s (%s); %s", redact(self.tracking_uri), what, why, self.when_lost)
        self.lost = why

    def _give_up(self, what: str, on_lost, why: str) -> None:
        self.abandoned = True
        self._lose(what, on_lost, why)

    def retrying(self, message: str) -> None:
        """MLflow's client retries the write the run's thread is in (urllib3's warning, `message`): said once, as it
        begins, with its cause; a signal now gives the store up (`stuck`)."""
        self._retried = network_cause(message) or "MLflow's client retries its request"
        if not self._said_retrying:
            self._said_retrying = True
            log.warning("mlflow: %s does not answer (%s); MLflow retries for minutes (MLFLOW_HTTP_REQUEST_MAX_RETRIES) "
                        "before the run goes on without it; Ctrl-C stops the run now", redact(self.tracking_uri),
                        self._retried)

    def stuck(self) -> str | None:
        """Why the write the run's thread is in waits on a store that does not answer (MLflow retries it), or None.
        Only a retry tells: a write that is merely long (a policy's upload) is the store answering."""
        return self._retried

    def _write(self, what: str, write, skipped=lambda: None) -> None:
        """A write other than metrics (which stay buffered for the checkpoint): not tried once the store stopped
        answering (`skipped()` says what was left out), else tried as `writing` says."""
        if self.lost is not None:
            skipped()
            return
        with self.writing(what, skipped):
            write()

    def replay(self, rows: list, tags: dict) -> int:
        """What a stopped run kept because the store did not take it (a checkpoint's or UNWRITTEN's), written first
        on resume: its metric `rows` (`unwritten`; a step the run already holds is not logged twice), then its
        `tags`. Returns how many metric values were new."""
        from mlflow.entities import Metric

        new = [Metric(key, value, timestamp, step) for key, value, timestamp, step in rows
               if step > self.logged_steps.get(key, -1)]
        self.pending += new
        self.flush()
        for key, value in tags.items():
            self.set_tag(key, value)
        return len(new)

    def rl_ended(self) -> None:
        """RL's last step is done (its final evaluation, the summaries, the policy are left): a store lost from here
        is met by train, which writes what it did not take to UNWRITTEN. The last steps' window is buffered now, at
        their time, not at the next flush's."""
        self._close_window()
        self.when_lost = f"RL has ended, so what was not written goes to {UNWRITTEN} in the output directory as the run ends"

    def write_unwritten(self, run_id: str, rows: list, tags: dict) -> int:
        """Reopen `run_id`, a run that trained to the end but whose store stopped answering as it ended, and write
        what train's UNWRITTEN file kept (`ended_unwritten`): its metric `rows` as a resume replays them, then its
        `tags`. Returns how many metric values were new; a store that still does not answer leaves `lost` set."""
        self.run_id = run_id
        self.logged_steps = self._logged_steps()
        return self.replay(rows, tags)

    def unwritten(self) -> list[list]:
        """The buffered metrics as plain rows (key, value, timestamp, step), for a checkpoint."""
        self._close_window()
        return [[m.key, m.value, m.timestamp, m.step] for m in self.pending]

    def ended_unwritten(self) -> dict:
        """What a run that trained to the end could not write as it ended, for UNWRITTEN: its metrics and its tags."""
        return {"metrics": self.unwritten(), "tags": dict(self.pending_tags)}

    def log_params(self, params: dict[str, str]) -> None:
        """Params not logged yet (a resumed run keeps the values it started with)."""
        from mlflow.entities import Param
        if self.run_id is None:  # not rank 0 of a distributed run: rank 0 writes
            return

        def write():
            have = self.client.get_run(self.run_id).data.params
            log_param_batches(self.client, self.run_id, [Param(k, param_text(v)) for k, v in params.items() if k not in have])

        self._write("params", write, lambda: log.warning("mlflow: params not logged (the store stopped answering): %s",
                                                          redact(", ".join(f"{k}={v}" for k, v in params.items()))))

    def log_generations(self, rows: list[dict]) -> None:
        """A table (MLflow's table artifact) of sampled completions with their rewards: every row the run sampled (a
        resume's rows are the checkpoint's and on), so it replaces what the run held before. Written as MLflow's
        `log_table` writes one (pandas' split JSON, and the run's tag of table artifacts), without pandas: its import
        at the run's end was 62-70 MB of the run's peak memory (import_mlflow), and `log_table` appended the rows to
        those a run held, so a resumed run's table held its rows twice."""
        if self.run_id is None:  # not rank 0 of a distributed run: rank 0 writes
            return
        if not rows:
            return
        from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS

        def cell(value):  # as pandas writes a non-finite float: null (json.dumps wrote NaN, which is not JSON)
            return None if isinstance(value, float) and not math.isfinite(value) else value

        table = {"columns": list(rows[0]), "data": [[cell(row[key]) for key in rows[0]] for row in rows]}

        def write():
            self.client.log_text(self.run_id, json.dumps(table, ensure_ascii=False), "generations.json")
            entry = {"path": "generations.json", "type": "table"}  # what makes MLflow's UI show it as a table
            logged = json.loads(self.client.get_run(self.run_id).data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]"))
            if entry not in logged:
                self.client.set_tag(self.run_id, MLFLOW_LOGGED_ARTIFACTS, json.dumps([*logged, entry]))

        lost = "; the output directory's generations.json holds the same rows"
        self._write_artifact("generations.json", write, lost,
                             lambda: log.warning("mlflow: generations.json not logged (the store stopped answering)%s", lost))

    def log_artifacts(self, path: Path, artifact_path: str) -> None:
        if self.run_id is None:  # not rank 0 of a distributed run: rank 0 writes
            return
        later = (f"; it is in {path}, and once there is room MLFLOW_TRACKING_URI={redact(absolute_uri(self.tracking_uri))} "
                 f"mlflow artifacts log-artifacts --local-dir {path} --run-id {self.run_id} --artifact-path {artifact_path} logs it")
        self._write_artifact(f"{artifact_path}/", lambda: self.client.log_artifacts(self.run_id, str(path), artifact_path), later,
                             lambda: log.warning("mlflow: %s/ not logged (the store stopped answering); it is in %s", artifact_path, path))

    def _write_artifact(self, what: str, write, warn: str, skipped) -> None:
        """An artifact written at the run's end: as `_write` says for the tracking store, and as `artifact_store`
        says (with `warn`) for the artifact store's disk."""
        def guarded():
            with self.artifact_store(what, warn):
                write()

        self._write(f"artifact {what}", guarded, skipped)

    @contextmanager
    def artifact_store(self, what: str, warn: str | None = None):
        """Around the copy of `what` into the run's artifacts. MLflow keeps them in the experiment's artifact store
        (for a SQLite store, mlruns/<experiment> beside the database; artifact_home), not in mlflow.db:
        that store's disk being full (read-only, failing) is not the tracking store stopping. What was copied of
        `what` is removed (a half-copied policy would load as garbage). Then, with `warn` (the run's end), a warning
        that adds `warn`, and the run goes on; without (its start), WriteFailed, one line, before anything trains."""
        try:
            yield
        except Exception as err:
            # the disk, in a directory of this machine (asked only then: a server that is down retries for minutes)
            where = self._artifact_dir() if WriteFailed.storage_errno(err) else None
            if where is None:
                raise
            target = where / what.rstrip("/")
            if target.is_dir():
                shutil.rmtree(target, ignore_errors=True)
            else:
                target.unlink(missing_ok=True)
            # said after the removal: the space left is what a retry has
            failed = WriteFailed.of(err, f"mlflow: the run's {what}", target,
                                    f"make room on that disk (experiment '{self.experiment_name}' keeps its runs' files there)")
            if warn is None:
                raise failed from None
            log.warning("%s%s", failed, warn)

    def _artifact_dir(self) -> Path | None:
        """The run's artifact directory where it is a directory of this machine (a local or file: store), else None."""
        from urllib.parse import urlparse

        try:
            uri = urlparse(self.client.get_run(self.run_id).info.artifact_uri)
        except Exception:  # noqa: BLE001 - the store itself not answering: as before, `writing` says so
            return None
        return Path(uri.path) if uri.scheme in ("", "file") else None

    def set_tag(self, key: str, value: str) -> None:
        if self.run_id is None:  # not rank 0 of a distributed run: rank 0 writes
            return
        text = redact(str(value))
        self.pending_tags.pop(key, None)
        self._write(f"tag {key}", lambda: self.client.set_tag(self.run_id, key, text),
                    lambda: self.pending_tags.__setitem__(key, text))  # a run that ended so writes it later

    def url(self, table: bool = False) -> str | None:
        """The run's page in an MLflow UI served from this tracking URI (default port), in the training
        view; `table`: the experiment's runs table sorted by gold reward instead."""
        if self.run_id is None:
            return None
        experiment_id = self.experiment_id or self.client.get_run(self.run_id).info.experiment_id
        base = self.tracking_uri if self.tracking_uri.startswith("http") else "http://127.0.0.1:5000"
        page = f"{redact(base.rstrip('/'))}/#/experiments/{experiment_id}"
        if table:
            return f"{page}/runs?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"
        return f"{page}/runs/{self.run_id}?workflowType=machine_learning"

    def finish(self, status: str = "FINISHED") -> None:
        """End the run with `status` (FINISHED, FAILED, KILLED); safe to call twice."""
        if self.run_id is None:
            return
        system, self._system = self._system, None
        if system is not None and self.abandoned:  # its thread may be in MLflow's retries too: stopped, not waited for
            system._shutdown_event.set()  # (a daemon thread, which ends with the process)
        elif system is not None:
            if self.lost is not None:  # its finish() writes the samples its thread could not: one more try, in this
                system.mlflow_logger.flush = lambda: None  # thread, at a store that stopped answering (MLflow's retries)
            system.finish()
        self.flush(again=True)  # every buffered metric lands before the run ends (a store that stopped answering: one more try)
        if system is not None and not self.lost:  # (each try at a store that stopped answering costs MLflow's retries)
            try:  # one more sample at the end: a run shorter than the 10 s interval had no system metrics at all
                system.collect_metrics()
                system.publish_metrics(system.aggregate_metrics())
                system.mlflow_logger.flush()
            except Exception as err:  # noqa: BLE001 - a warning: the run's own metrics are written
                log.warning("mlflow: the last system metrics were not logged (%s)", err)
        if self.pending or self.abandoned:
            return  # not taken: the run stays RUNNING, and what is buffered goes to a checkpoint or a file (train)
        with self.writing(f"end ({status})"):
            self.client.set_terminated(self.run_id, status)
            self.lost = None  # it answered again, and took every metric
