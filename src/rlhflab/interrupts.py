"""SIGINT and SIGTERM: stop at the next safe point, or at once.

While the RL loop runs (`at_step_boundaries()`), a first signal only sets a flag: the
loop finishes its step, writes a checkpoint and raises RunInterrupted. Anywhere else
(loading, a training stage) the signal raises RunInterrupted at once, and so does a
second signal. Lightning composes its own SIGTERM handler with ours; the SIGTERMException
it raises (a SystemExit with no code, which would report success) is converted too.

A closed output pipe is the same request (`output_closed`): the reader of `python src/train.py | head` (grep -m,
a pager) has what it wanted and is gone. Python ignores SIGPIPE, so the write raises BrokenPipeError instead.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from contextlib import contextmanager

from rlhflab.errors import RunInterrupted, StoreAbandoned

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)
AGAIN_S = 0.01  # how soon a stop that a finalizer swallowed is raised again (StopRequest._unraisable)


class StopRequest:
    """The process-wide record of a stop request."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.polling = False
        # Set while the loop trains on to a step it can checkpoint (the first signal landed on one it cannot):
        # check() lets it go on; a second signal still stops at once.
        self.finishing = False
        # Whether this job's MLflow run exists (train() sets it; main() clears it per job): a stop before it
        # has no run to mark KILLED or resume. Here, not on the exception: a repeated signal raises a new one.
        self.run_made = False
        # The process whose handlers are installed: a child forked from it (the async generator) has a copy of this
        # object, and its own write to a closed pipe is its learner's to act on.
        self.pid: int | None = None
        # Set while the MLflow run is being ended (`ending_run`): the first signal there is held (`held`: which) until it
        # has ended, and the caller then acts on `signum`.
        self.ending = False
        self.held: int | None = None
        # The status the job's MLflow run was ended with (None: not ended, e.g. its store stopped answering).
        self.ended: str | None = None
        # Why the job's MLflow run could not be ended, when its store stopped answering (train sets it), or None.
        self.lost: str | None = None
        # The tracker whose write the main thread is in (MlflowTracker.writing), or None: its stuck() says whether the
        # store has not answered it (MLflow's retries), in which case a first signal gives that store up (StoreAbandoned).
        self.store = None
        # A stop raised where Python only prints it (`_unraisable`), to raise again once out of there (`_again`).
        self.again: int | None = None
        self._alarm_before = None
        # The output pipe closed while no job ran (a sweep's own [HYDRA] lines): the next job stops as it starts.
        self.closed_before = False
        self._hook_before = sys.unraisablehook

    def _handle(self, signum: int, frame) -> None:
        # A write the store has not answered (MLflow retries for minutes): the stop does not wait for it (StoreAbandoned).
        stuck = self.store.stuck() if self.store is not None else None
        if self.ending and self.held is None:  # interrupted there, the run stayed RUNNING with its last metrics unwritten
            self.held = signum
            self.signum = self.signum or signum
            if stuck:
                log.warning("%s received: the MLflow store does not answer (%s), so the run is left unended",
                            signal.Signals(signum).name, stuck)
                raise StoreAbandoned(signum, stuck)
            log.warning("%s received: ending the MLflow run first (send it again to stop at once)", signal.Signals(signum).name)
            return
        if self.signum is not None or not self.polling:
            self.signum = signum
            raise RunInterrupted(signum)
        self.signum = signum
        from rlhflab import distributed  # loaded with the RL loop this branch runs in

        # Rank 0 speaks for every rank: Ctrl-C reaches them all, and the line was printed once per rank. A signal
        # that reached another rank alone still stops every rank, and rank 0's checkpoint and stop lines say so.
        log.log(logging.WARNING if distributed.is_main() else logging.INFO,
                "%s received: stopping after this step with a checkpoint (send it again to stop at once)",
                signal.Signals(signum).name)
        if stuck:
            raise StoreAbandoned(signum, stuck)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def check(self) -> None:
        """Raise RunInterrupted if a stop was asked for (and the loop is not training on to a checkpoint)."""
        if self.signum is not None and not self.finishing:
            raise RunInterrupted(self.signum)

    @contextmanager
    def installed(self):
        """Handle SIGINT and SIGTERM for the block (the main thread only), then restore the old handlers."""
        if self.closed_before:  # the reader left before this job (a sweep's lines): the stop a job has, at its start
            self.signum, self.closed_before = signal.SIGPIPE, False
            raise RunInterrupted(signal.SIGPIPE)
        self.signum, self.polling, self.finishing, self.ending, self.held, self.ended = None, False, False, False, None, None
        self.lost = None
        previous = {s: signal.getsignal(s) for s in SIGNALS}
        outer, self.pid = self.pid, os.getpid()
        for s in SIGNALS:
            signal.signal(s, self._handle)
        ours = getattr(sys.unraisablehook, "__self__", None) is self  # (main's, around train's)
        if not ours:
            self._hook_before, sys.unraisablehook = sys.unraisablehook, self._unraisable
        try:
            yield self
        finally:
            if not ours:
                sys.unraisablehook = self._hook_before
                if self.again is not None:  # the stop it waited to raise is under way some other way: no alarm after
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    signal.signal(signal.SIGALRM, self._alarm_before or signal.SIG_DFL)
                    self.again = None
            self.pid = outer
            for s, handler in previous.items():
                signal.signal(s, handler)

    def output_closed(self, stream) -> None:
        """A write to `stream` (stdout, stderr) found its pipe closed by its reader: SIGPIPE's stop, as SIGINT's
        (at the next step boundary with a checkpoint, else at once; KILLED, exit 141). Once: the stream, and the
        other where 2>&1 made it the same pipe, then write to /dev/null (no more errors, nor at exit's flush).
        Before, the BrokenPipeError went on to Rich, which exited 1: the run ended FAILED, `SystemExit: 1`."""
        silence(stream)
        if self.pid is None:  # no job runs (a sweep before its first job, or between two): the next one stops at once
            self.closed_before = True
            return
        if self.pid != os.getpid() or self.signum is not None:  # a forked child, no run here, or a stop under way
            return
        self.signum = signal.SIGPIPE
        if self.ending:
            self.held = signal.SIGPIPE
        now = not (self.polling or self.ending) and threading.current_thread() is threading.main_thread()
        from rlhflab import distributed

        log.log(logging.WARNING if distributed.is_main() else logging.INFO,  # (to train.log: the console is gone)
                "the output pipe was closed (SIGPIPE): stopping %s", "now" if now else "after this step with a checkpoint")
        if now:  # (another thread's write leaves it to the main thread's next check, as a signal would)
            raise RunInterrupted(signal.SIGPIPE)

    def _unraisable(self, unraisable) -> None:
        """sys.unraisablehook: a stop raised at once inside a finalizer (a weakref callback the garbage collector ran,
        a __del__) was printed as 'Exception ignored in ...' with its traceback, and lost: Ctrl-C in stage sft trained
        on. It is raised again shortly, from SIGALRM's handler (`_again`), once Python is out of there."""
        err = unraisable.exc_value
        if not isinstance(err, RunInterrupted) or self.pid != os.getpid():
            self._hook_before(unraisable)  # anything else: as before (Python's own print, pytest's record)
            return
        if self.again is None:
            self.again = err.signum
            self._alarm_before = signal.signal(signal.SIGALRM, self._again)
        signal.setitimer(signal.ITIMER_REAL, AGAIN_S)

    def _again(self, signum: int, frame) -> None:
        """SIGALRM's handler while a stop waits to be raised again (`_unraisable`): raised, unless the alarm came while
        Python was still in that hook (then once more, a little later)."""
        while frame is not None:
            if frame.f_code is StopRequest._unraisable.__code__:
                signal.setitimer(signal.ITIMER_REAL, AGAIN_S)
                return
            frame = frame.f_back
        again, self.again = self.again, None
        signal.signal(signal.SIGALRM, self._alarm_before or signal.SIG_DFL)
        if again is not None:
            raise RunInterrupted(again)

    def take_back(self) -> None:
        """Handle SIGINT and SIGTERM ourselves again inside a fit (checkpoint.SignalsOurs, at on_train_start):
        Lightning composes its own SIGTERM handler with ours, and under several ranks it broadcasts from inside
        that handler, which can meet a rank in the middle of another collective. Lightning restores the old
        handlers after fit."""
        for s in SIGNALS:
            signal.signal(s, self._handle)

    def agreed(self, tracking_lost: bool = False) -> tuple[int | None, bool]:
        """What every rank stops for, in one collective at a step boundary (every rank must call this at the same
        point): the signal any rank received, or None; and whether any rank's tracking store stopped answering
        (rank 0's: it alone writes to MLflow)."""
        from rlhflab import distributed

        asked = distributed.gather((self.signum, tracking_lost))
        received = [s for s, _ in asked if s is not None]
        if received:
            distributed.claim_end("run")  # every rank stops here: rank 0's watch leaves it to write its checkpoint
        return (received[0] if received else None), any(lost for _, lost in asked)

    @contextmanager
    def ending_run(self):
        """While the block ends the MLflow run (tracker.finish: its last metrics, then its status), a first signal or a
        closed output pipe waits for its end: stopped there, the run stayed RUNNING. A second signal stops at once (a
        store that does not answer: MLflow's retries). The caller acts on `signum` once the block has ended."""
        self.ending, self.held = True, None
        try:
            yield
        finally:
            self.ending = False

    @contextmanager
    def at_step_boundaries(self):
        """Within the block a first signal waits for the loop's next `check()`."""
        self.polling = True
        try:
            yield
        finally:
            self.polling = False


STOP = StopRequest()


def silence(stream) -> None:
    """Point `stream`'s file descriptor at /dev/null, and stdout's and stderr's where they are the same pipe."""
    try:
        fd = stream.fileno()
        closed = os.fstat(fd)
    except (AttributeError, OSError, ValueError):  # not a file (a test's capture), or gone
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for std in {fd, 1, 2}:
            try:
                if std == fd or os.path.samestat(os.fstat(std), closed):
                    os.dup2(devnull, std)
            except OSError:
                pass
    finally:
        os.close(devnull)


def as_interrupt(err: BaseException) -> RunInterrupted | None:
    """The RunInterrupted that `err` stands for (Lightning's SIGTERMException), or None. An error raised while a stop
    was on its way out stands for it too: a stop raised inside threading's Condition.wait left its lock released, and
    the `with` around it then raised 'RuntimeError: release unlocked lock' in its place (a sweep's job stopped in stage
    sft ended FAILED with that error, not KILLED, once in ~40 suite runs). That error is logged, not dropped."""
    seen: set[int] = set()
    cause = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        stop = cause if isinstance(cause, RunInterrupted) else (
            RunInterrupted(signal.SIGTERM) if type(cause).__name__ == "SIGTERMException" else
            # (one that left its write in the instant the write ends, before MlflowTracker.writing could take it)
            RunInterrupted(cause.signum) if isinstance(cause, StoreAbandoned) else None)
        if stop is not None:
            if cause is not err:
                log.info("%s: %s, raised as the stop went through it (the stop is what ended the run)", type(err).__name__, err)
            return stop
        cause = cause.__context__
    return None
