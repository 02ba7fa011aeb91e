"""Keep the console to what a researcher reads: our log, Lightning's progress bar, real warnings."""

from __future__ import annotations

import logging
import warnings


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()


def quiet_libraries() -> None:
    # Lightning installs its own console handler; Hydra's root handler already prints its records.
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        if logging.getLogger().handlers:
            logger.handlers.clear()
            logger.propagate = True
        logger.addFilter(_DropTips())
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DropTips())
    import transformers

    transformers.utils.logging.set_verbosity_error()  # a fresh reward/value head is expected, not news
    transformers.utils.logging.disable_progress_bar()
    # The reference and reward models are frozen in eval mode on purpose.
    warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode.*")
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    # peft still calls a transformers property deprecated in 5.x.
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*deprecated.*", category=FutureWarning)
