"""Errors a user can act on, each a one-line message (the entry point prints it as `error: ...`).

In a run of several ranks, distributed.as_rank_error adds `rank` ('rank 1 of 2', printed before the message)
and `quiet` (another rank says it); an error raised by every rank on one shared decision sets `shared`."""

from __future__ import annotations

import errno
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path


class ConfigError(ValueError):
    """Bad input. The message is one line: the config key or file, what is wrong, and the fix."""


def no_such_file(path) -> str:
    """`no such file '<path>'`, saying where a relative path was looked for: the working directory, which is not
    the repository root where the README's relative paths (examples/...) are."""
    where = "" if Path(path).is_absolute() else f" (relative to {Path.cwd()})"
    return f"no such file '{path}'{where}"


def chosen(group: str, default: str) -> str:
    """`group=option` as the run chose it (Hydra's runtime choices, in a job), else `group=default`: the errors of a
    class several options build (generator=vllm_own_gpu builds generator=vllm's) name the one the user gave."""
    from hydra.core.hydra_config import HydraConfig

    choice = HydraConfig.get().runtime.choices.get(group) if HydraConfig.initialized() else None
    return f"{group}={choice or default}"


class StageFailed(RuntimeError):
    """A training stage produced something unusable (not finite, or no better than chance); it was not cached."""


class NonFiniteError(RuntimeError):
    """A NaN or Inf in a loss, reward, reward-model output or gradient; the message names the step and quantity.
    `weights_step`: the RL step whose weights gave the value (a checkpoint of them is not a good one), or None.
    `shared`: every rank decided it together (one line for all of them)."""

    def __init__(self, message: str, weights_step: int | None = None, shared: bool = False) -> None:
        super().__init__(message)
        self.weights_step = weights_step
        self.shared = shared


class DivergedWeights(NonFiniteError):
    """Sampling met NaN/Inf logits: the weights themselves have blown up (the RL module names the step).
    `version`: the policy version sampled with, where it is not the learner's own (an async generator)."""

    def __init__(self, message: str, version: int | None = None) -> None:
        super().__init__(message, None)
        self.version = version


class RewardError(RuntimeError):
    """A reward function raised, returned the wrong number of values, or a non-finite one (named with its row)."""


class WriteFailed(RuntimeError):
    """A file rlhflab writes (a checkpoint, the policy, a cache entry) could not be written: its disk is full, over a
    quota or a file-size limit, read-only or failing. One line: the file, the cause, the space left on its disk."""

    # What says the disk, not the data: full, over quota, a file-size limit (ulimit -f), read-only, failing.
    ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO})

    @classmethod
    def storage_errno(cls, err: BaseException) -> int | None:
        """The errno in `err` or the errors it chains that says the disk (ERRNOS), else None. torch.save's own
        error only chains it (write through a file object, or it has no errno at all); safetensors says it as
        '(os error N)'."""
        code, seen = None, set()
        while err is not None and id(err) not in seen and code is None:
            seen.add(id(err))
            found = re.search(r"\(os error (\d+)\)", str(err))
            code = err.errno if isinstance(err, OSError) else int(found.group(1)) if found else None
            err = err.__cause__ or err.__context__
        return code if code in cls.ERRNOS else None

    @classmethod
    def of(cls, err: BaseException, what: str, path, fix: str = "make room on that disk") -> WriteFailed | None:
        """`err`, raised while writing `path`, as `what: could not write PATH: CAUSE (N free on its disk); FIX`,
        or None where no storage error is in it."""
        code = cls.storage_errno(err)
        if code is None:
            return None
        return cls(f"{what}: could not write {path}: {os.strerror(code)} ({_free(Path(path))} free on its disk); {fix}")


@contextmanager
def writing(what: str, path, fix: str = "make room on that disk"):
    """Around the writing of `path` (clean up partial files inside it, so the space left is what a retry has):
    a storage error leaves it as WriteFailed, one line; any other error as it was."""
    try:
        yield
    except Exception as err:
        failed = WriteFailed.of(err, what, path, fix)
        if failed is None:
            raise
        raise failed from None


def _free(path: Path) -> str:
    """The space left on the disk that holds `path` (its nearest existing parent), e.g. '960 KiB'."""
    while not path.exists() and path != path.parent:
        path = path.parent
    free = shutil.disk_usage(path).free
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if free >= size:
            return f"{free / size:.1f} {unit}"
    return f"{free} B"


class RankLost(RuntimeError):
    """In a run of several ranks, another rank failed or was killed; this one stopped with it."""


class TrackingLost(RuntimeError):
    """The MLflow store stopped answering. `checkpointed`: the RL stage stopped (every rank together) with a
    checkpoint that keeps what the store did not take; otherwise the run had ended and wrote it to a file."""

    def __init__(self, message: str, checkpointed: bool) -> None:
        super().__init__(message)
        self.checkpointed = self.shared = checkpointed


# What a run ends with in one line (`error: ...`), its message complete: a traceback would only hide it.
ONE_LINE = (ConfigError, StageFailed, NonFiniteError, RewardError, RankLost, TrackingLost, WriteFailed)


class RunInterrupted(BaseException):
    """SIGINT or SIGTERM asked the run to stop, or SIGPIPE (its output pipe was closed: interrupts.output_closed).
    A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way up swallows it; unlike
    KeyboardInterrupt, Lightning re-raises it."""

    def __init__(self, signum: int) -> None:
        import signal

        why = " (its output pipe was closed)" if signum == signal.SIGPIPE else ""
        super().__init__(f"stopped by {signal.Signals(signum).name}{why}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM, 141 for SIGPIPE


class StoreAbandoned(BaseException):
    """A first SIGINT or SIGTERM came while the run's thread waited on a tracking store that did not answer (MLflow's
    retries, minutes at its defaults): raised by the signal handler into that write, which gives the store up
    (MlflowTracker.writing) while the stop goes on as a first signal's does. A BaseException, so that no `except
    Exception` in MLflow, requests or urllib3 takes it for a failed request."""

    def __init__(self, signum: int, why: str) -> None:
        import signal

        super().__init__(f"{why}; {signal.Signals(signum).name} did not wait for MLflow's retries")
        self.signum = signum
