"""Names shared by the package, the Hydra sweep plugin (plugins/) and the report: one home.

Imported by Hydra's plugin scan at every start, so it imports nothing heavy.
"""

from __future__ import annotations

# Set by the sweep callback so that each job's run becomes a child of the sweep's parent run.
PARENT_RUN_ENV = "RLHFLAB_MLFLOW_PARENT_RUN_ID"
# Tag on a sweep's parent run.
SWEEP_TAG = "rlhflab.sweep"
# Config groups whose choice every run carries as a tag of the same name.
RUN_TAG_GROUPS = ("algo", "memory", "mode", "model", "reward", "task")
# The groups a default run name is made of.
RUN_NAME_GROUPS = ("algo", "memory", "mode")


def default_run_name(tags: dict[str, str]) -> str:
    """`<algo>-<memory>-<mode>` from a run's tags (those present)."""
    return "-".join(tags[k] for k in RUN_NAME_GROUPS if k in tags)

# Tags the sweep callback writes and the report reads.
SWEEP_JOB_TAG = f"{SWEEP_TAG}.job"  # on a child: its job number
SWEEP_OVERRIDES_TAG = f"{SWEEP_TAG}.overrides"  # on a child: its overrides; on the parent: the sweep's
SWEEP_METRIC_TAG = f"{SWEEP_TAG}.metric"  # on the parent: the metric that picks the best child
SWEEP_BEST_RUN_NAME_TAG = f"{SWEEP_TAG}.best_run_name"
