"""Keep the console to what a researcher reads: our log, one progress bar per stage, real warnings."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import warnings

from rich.console import Console
from rich.logging import RichHandler

from rlhflab.interrupts import STOP


class ConsoleHandler(RichHandler):
    """Rich on a terminal (log lines above the progress bar); anywhere else (a file, a pipe, a cluster job's
    log) one plain line per record, unwrapped: Rich would wrap it at 80 columns and pad it with spaces,
    splitting paths and run ids that people grep for."""

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "console", True) is False:  # for train.log only (the error line main printed to stderr)
            return
        if self.console.is_terminal or self.console.is_jupyter:
            return super().emit(record)
        try:
            stamp = time.strftime("%X", time.localtime(record.created))
            self.console.file.write(f"[{stamp}] {record.levelname:<8} {self.format(record)}\n")
            self.console.file.flush()
        except BrokenPipeError:  # its reader is gone (| head, a pager quit): a stop, and no '--- Logging error ---'
            STOP.output_closed(self.console.file)
        except Exception:
            self.handleError(record)


class HydraConsoleHandler(logging.StreamHandler):
    """Hydra's own lines ('[HYDRA] Launching 2 jobs locally', a sweep's before and between its jobs) on stdout, as
    Hydra's default handler writes them (conf/hydra/hydra_logging/rlhflab.yaml). A closed pipe there (`-m ... | head`)
    printed '--- Logging error ---' and a BrokenPipeError traceback per line, and the sweep ran on to its end: now it
    is the stop ConsoleHandler's is."""

    def handleError(self, record: logging.LogRecord) -> None:
        if isinstance(sys.exc_info()[1], BrokenPipeError):
            STOP.output_closed(self.stream)
            return
        super().handleError(record)


def _reader_gone(console: Console) -> None:
    """Rich's Console.on_broken_pipe (the progress bars; log lines on a terminal), as ConsoleHandler's. Rich's own
    exits 1 (SystemExit): the run ended FAILED with `SystemExit: 1`, and without the checkpoint a stop writes."""
    console.quiet = True
    STOP.output_closed(console.file)


class _Once(logging.Filter):
    """Lightning's per-Trainer chatter: the device banner once per process, tips and stop notices never."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "litlogger" in message or message.startswith("`Trainer.fit` stopped"):
            return False
        if message.startswith(("GPU available", "TPU available", "HPU available", "💡")):
            if message in self.seen:
                return False
            self.seen.add(message)
        return True


_ONCE = _Once()


class _SaidByTheTracker(logging.Filter):
    """MLflow's SQLite store logs every failed request with its chained tracebacks (~45 lines) and then raises it.
    rlhflab says it once itself: a store that stopped answering (a full disk, a file gone) is a warning and a stop
    with a checkpoint (tracking.MlflowTracker), a refused request or an unopenable store its own error line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("SQLAlchemy database error")


_SAID = _SaidByTheTracker()


class _Retries(logging.Filter):
    """urllib3's lines below ERROR, its warning at each retry of a request to a tracking server that does not answer
    among them (MLflow's client retries for minutes), and the system metrics thread's at each sample: not printed,
    since the tracker says it once, with its cause. A retry of the run's own write (in the main thread) is told to the
    tracker of that write (`STOP.store`), which says so at once and lets a signal give the store up."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        store = STOP.store
        if store is not None and str(record.msg).startswith("Retrying") and threading.current_thread() is threading.main_thread():
            store.retrying(record.getMessage())
        return False


_RETRIES = _Retries()


def quiet_libraries() -> None:
    Console.on_broken_pipe = _reader_gone  # Rich's global console, which Lightning reconfigures at each stage
    # Lightning installs its own console handler; Hydra's root handler already prints its records.
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning.pytorch.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if name != "lightning.pytorch.utilities.rank_zero" and logging.getLogger().handlers:
            logger.handlers.clear()
            logger.propagate = True
        if _ONCE not in logger.filters:
            logger.addFilter(_ONCE)
    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # its start/stop notices
    # A tracking server that stopped answering: MLflow's client retries (MLFLOW_HTTP_REQUEST_MAX_RETRIES), urllib3
    # warns at each retry, and the system-metrics thread at each sample; the tracker says it once, with its cause.
    retries = logging.getLogger("urllib3.connectionpool")
    if _RETRIES not in retries.filters:
        retries.addFilter(_RETRIES)
    logging.getLogger("mlflow.system_metrics.system_metrics_monitor").setLevel(logging.ERROR)
    if not sys.stderr.isatty():  # a file, a pipe, a cluster job's log: MLflow's tqdm bars would be \r-noise in it
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # (a resume fetches generations.json)
    store_log = logging.getLogger("mlflow.store.db.utils")
    if _SAID not in store_log.filters:
        store_log.addFilter(_SAID)
    import transformers

    transformers.utils.logging.set_verbosity_error()  # a fresh reward/value head is expected, not news
    transformers.utils.logging.disable_progress_bar()
    # The reference and reward models are frozen in eval mode on purpose.
    warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode.*")
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    # Lightning 2.6 calls a torch pytree API that torch 2.13 deprecated, once per stage.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    # An RL prompt stream has no length by design: it ends at trainer.max_steps.
    warnings.filterwarnings("ignore", message=r".*Your `IterableDataset` has `__len__` defined.*")
    # GPT-2's Conv1D layers take LoRA transposed: peft sets fan_in_fan_out itself and says so.
    warnings.filterwarnings("ignore", message=r".*fan_in_fan_out is set to False but the target module is `Conv1D`.*")
    # peft still calls a transformers property deprecated in 5.x.
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*deprecated.*", category=FutureWarning)
