"""Errors a user can act on, each a one-line message (the entry point prints it as `error: ...`).

In a run of several ranks, distributed.as_rank_error adds `rank` ('rank 1 of 2', printed before the message)
and `quiet` (another rank says it); an error raised by every rank on one shared decision sets `shared`."""


class ConfigError(ValueError):
    """Bad input. The message is one line: the config key or file, what is wrong, and the fix."""


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


class RankLost(RuntimeError):
    """In a run of several ranks, another rank failed or was killed; this one stopped with it."""


class TrackingLost(RuntimeError):
    """The MLflow store stopped answering. `checkpointed`: the RL stage stopped (every rank together) with a
    checkpoint that keeps what the store did not take; otherwise the run had ended and wrote it to a file."""

    def __init__(self, message: str, checkpointed: bool) -> None:
        super().__init__(message)
        self.checkpointed = self.shared = checkpointed


class RunInterrupted(BaseException):
    """SIGINT or SIGTERM asked the run to stop. A BaseException, like KeyboardInterrupt, so that no
    `except Exception` on the way up swallows it; unlike KeyboardInterrupt, Lightning re-raises it."""

    def __init__(self, signum: int) -> None:
        import signal

        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
