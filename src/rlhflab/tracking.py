"""MLflow tracking: one run per experiment holding every stage's metrics, the config and samples."""

from __future__ import annotations

import logging
import os

from lightning.pytorch.loggers import MLFlowLogger
from omegaconf import DictConfig, OmegaConf

from rlhflab.naming import PARENT_RUN_ENV, default_run_name

log = logging.getLogger(__name__)


def flatten(cfg: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= flatten(value, f"{name}.")
        else:
            out[name] = str(value)[:6000]  # MLflow's limit on a param value
    return out


class RunLogger(MLFlowLogger):
    """Lightning's MLflow logger bound to our run; it leaves ending the run to the tracker.

    Every stage (sft, rm, rl) gets its own Trainer; without this the first
    Trainer to finish would mark the whole run FINISHED.
    """

    def finalize(self, status: str = "success") -> None:
        pass


class MlflowTracker:
    """Owns the MLflow run of one `train(cfg)` call.

    tracking_uri: where runs go (default: sqlite:///mlflow.db in the working directory).
    experiment_name: the MLflow experiment that groups runs.
    run_name: null = "<algo>-<memory>-<mode>".
    synchronous: write each step's metrics before going on (false: through MLflow's background queue).
    """

    def __init__(self, tracking_uri: str, experiment_name: str = "rlhflab", run_name: str | None = None,
                 synchronous: bool = False) -> None:
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.synchronous = synchronous
        self.run_id: str | None = None

    @property
    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.tracking_uri)

    def start(self, cfg: DictConfig, tags: dict[str, str]) -> str:
        client = self.client
        experiment = client.get_experiment_by_name(self.experiment_name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(self.experiment_name)
        tags = dict(tags)
        if os.environ.get(PARENT_RUN_ENV):
            tags["mlflow.parentRunId"] = os.environ[PARENT_RUN_ENV]
        name = self.run_name or default_run_name(tags)
        run = client.create_run(experiment_id, run_name=name, tags=tags)
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in flatten(OmegaConf.to_container(cfg, resolve=True)).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(self.run_id, params=params[i : i + 100])
        client.log_text(self.run_id, OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
        log.info("mlflow: run %s (%s) in experiment '%s' at %s", self.run_id, name, self.experiment_name, self.tracking_uri)
        return self.run_id

    def lightning_logger(self) -> RunLogger:
        # Per-step metrics go through MLflow's background queue, so a slow store never blocks a step.
        return RunLogger(tracking_uri=self.tracking_uri, run_id=self.run_id, synchronous=self.synchronous)

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric
        import time

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def log_generations(self, rows: list[dict]) -> None:
        """A table (MLflow's table artifact) of sampled completions with their rewards."""
        if not rows:
            return
        table = {key: [row[key] for row in rows] for key in rows[0]}
        self.client.log_table(self.run_id, data=table, artifact_file="generations.json")

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def finish(self, status: str = "FINISHED") -> None:
        if self.run_id is not None:
            import mlflow

            mlflow.flush_async_logging()  # every queued step metric lands before the run ends
            self.client.set_terminated(self.run_id, status)
