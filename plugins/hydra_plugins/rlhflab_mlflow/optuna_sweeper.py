"""hydra-optuna-sweeper's sweeper, ending a study none of whose trials finished as a grid sweep with failed jobs ends.

Imported by Hydra's plugin scan at every start: the sweeper's module imports Optuna only when it is made.
"""

from __future__ import annotations

import logging

try:
    from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
except ModuleNotFoundError as err:  # hydra-optuna-sweeper is the dev extra's: `pip install -e .` or `.[bench]` lacks it
    if not (err.name or "").startswith("hydra_plugins.hydra_optuna_sweeper"):
        raise
    # Hydra's plugin scan warned 'Error importing ... Plugin is incompatible with this Hydra version or buggy' at every
    # start then (and into the error lines vs_trl.py's preflight passes on). Without it the class below is no plugin
    # and never made: hydra/sweeper=rlhflab_optuna cannot compose without hydra-optuna-sweeper's `optuna` schema.
    OptunaSweeper = object

log = logging.getLogger(__name__)


class _SaidByTheCallback(logging.Filter):
    """A failed trial's job returns no objective, and hydra-optuna-sweeper logged 'Failed experiment: Return value
    must be float-castable. Got 'None'.' for each, beside the callback's own line with the job's real error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Failed experiment: Return value must be float-castable. Got 'None'")


_SAID = _SaidByTheCallback()


class RlhflabOptunaSweeper(OptunaSweeper):
    """With every trial failed (rlhflab's preset lets a failed trial be recorded and the study go on,
    max_failure_rate=1.0), Optuna's `study.best_trial` raised 'ValueError: No trials are completed yet' after the
    last one: a traceback, exit 1, and the sweep's MLflow parent FAILED with no summary and no list of the jobs'
    errors. The sweep now ends as a grid sweep whose jobs failed: the parent FINISHED with sweep/failed_jobs, each
    job's error listed by the MLflow callback."""

    def sweep(self, arguments):
        logging.getLogger("hydra_plugins.hydra_optuna_sweeper._impl").addFilter(_SAID)  # once, however often it sweeps
        try:
            return super().sweep(arguments)
        except ValueError as err:
            if "No trials are completed yet" not in str(err):
                raise
            log.error("optuna: no trial finished, so the study has no best trial; each trial's error is listed below")
