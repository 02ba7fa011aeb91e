"""rlhflab's Hydra callback that groups a sweep under one MLflow parent run.

Registered in conf/train.yaml under `hydra.callbacks.mlflow_sweep`. Hydra's
plugin scanner imports this package at every start, so nothing heavy
(mlflow, torch) is imported at module level.
"""

from hydra_plugins.rlhflab_mlflow.callback import MlflowSweepCallback

__all__ = ["MlflowSweepCallback"]
