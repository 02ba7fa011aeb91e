"""Sync mode's reference forward beside the update's own policy forward: `mode.reference=thread` or `process`.

Both run the same function on the same rows as the learner would (`RLHFModule._reference_logprobs`), under
its autocast and grad mode (the thread is handed them; the process forks the learner's thread with them), so
the numbers are the learner's. They differ in what they share with the update's forward:

- thread: one process, one GIL. On a small model each op's Python dispatch holds it, so the two forwards
  partly take turns (the tiny model's 64-row pair: 4.8 and 4.3 ms alone, 7.5 ms side by side).
- process: a forked process of its own, with its own GIL (the same pair: 5.0-5.2 ms). It sees the learner's
  memory as it was at the fork, copy on write; only the rows and the log-probs cross a pipe. Its own pages
  stayed at 50-90 MB on the 113M model (smaps Private_*, 5 GRPO steps), the whole tree within 30 MB of the
  thread's peak PSS.
- fastest (what `auto` picks where these can run): the process, then the thread, each timed over the first
  steps, the faster kept (the thread unless the process is over 5% faster: the process holds more memory).
"""

from __future__ import annotations

import atexit
import logging
import os
import statistics
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
import torch.multiprocessing as mp

from rlhflab.rollout.async_source import POLL_S, die_with_parent, end_child, ignore_stop_signals, stop_signals_held
from rlhflab.rollout.sources import autocast_as, current_autocast

Result = Callable[[], torch.Tensor]
log = logging.getLogger(__name__)


class ReferenceCrashed(RuntimeError):
    """The reference process failed or died; the message holds its traceback where there is one."""


class ReferenceThread:
    """mode.reference=thread: the reference's forward in a second thread of the learner."""

    name = "thread"

    def __init__(self, reference: Callable[..., torch.Tensor]) -> None:
        self.reference = reference
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlhflab-reference")

    def submit(self, query: torch.Tensor, response: torch.Tensor, mask: torch.Tensor) -> Result:
        # Autocast and grad mode are per thread: run under the caller's, as the learner's own call would. (Without
        # this, trainer.precision=bf16-mixed computed the reference in float32 here against bfloat16 autocast in the
        # learner: a KL of 3e-4 at RL step 1, where policy and reference are the same model and it is exactly 0.)
        state = current_autocast(), torch.is_grad_enabled()
        return self.pool.submit(self._call, state, query, response, mask).result

    def _call(self, state, *rows: torch.Tensor) -> torch.Tensor:
        autocast, grad = state
        with autocast_as(autocast), torch.set_grad_enabled(grad):
            return self.reference(*rows)

    def close(self) -> None:
        self.pool.shutdown()


def _reference_main(reference, conn, parent: int, threads: int) -> None:
    ignore_stop_signals()  # the learner's to handle: it finishes its step, then closes us
    die_with_parent(parent)
    torch.set_num_threads(threads)
    with torch.no_grad():
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the learner closed its end
                return
            if msg is None:
                return
            try:
                out = reference(*(torch.from_numpy(a) for a in msg))
            except Exception:
                conn.send(("error", traceback.format_exc()))
                return
            conn.send(("ok", out.numpy()))


class ReferenceProcess:
    """mode.reference=process: the reference's forward in a forked process (CPU).

    reference(query, response, mask) -> (n, R) log-probs runs there on the learner's memory as forked. A failure
    there reaches the learner at its result with the traceback, a death within a poll interval; closing or the
    learner dying ends it.
    """

    name = "process"

    def __init__(self, reference: Callable[..., torch.Tensor]) -> None:
        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_reference_main, args=(reference, child, os.getpid(), torch.get_num_threads()),
                                daemon=True, name="rlhflab-reference")
        with stop_signals_held():
            self.proc.start()
        child.close()
        # Before multiprocessing's own exit handler, which would SIGTERM (ignored here) and then wait forever for a
        # process a learner that failed before its teardown never closed.
        atexit.register(self.close)

    def _died(self) -> ReferenceCrashed:
        self.proc.join(timeout=POLL_S)
        return ReferenceCrashed(f"reference process died (exit code {self.proc.exitcode}) without a traceback")

    def submit(self, query: torch.Tensor, response: torch.Tensor, mask: torch.Tensor) -> Result:
        try:
            self.conn.send(tuple(t.detach().cpu().numpy() for t in (query, response, mask)))
        except (BrokenPipeError, ConnectionResetError):
            raise self._died() from None
        return self._result

    def _result(self) -> torch.Tensor:
        while not self.conn.poll(POLL_S):
            if not self.proc.is_alive():
                raise self._died()
        try:
            kind, payload = self.conn.recv()
        except (EOFError, ConnectionResetError):
            raise self._died() from None
        if kind == "error":
            raise ReferenceCrashed(f"reference process failed:\n{payload}")
        return torch.from_numpy(payload)

    def close(self) -> None:
        if self.proc is None:
            return
        atexit.unregister(self.close)
        end_child(self.proc, lambda: self.conn.send(None), "mode sync: reference")
        self.conn.close()
        self.proc = None


class ReferenceFastest:
    """mode.reference=fastest (what auto picks where a reference can run beside the update): the process and the
    thread each timed over the first steps, and the faster kept for the rest of the run.

    Which is faster follows the host: on an Intel Xeon the process's sync online DPO pair took ~5 ms against the
    thread's ~9 (py-spy, 2026-12-04), on an AMD EPYC the two were level, and the thread was the faster there for
    RLOO in one run. Both compute the same numbers, so the choice changes the speed only. The process runs the
    steps up to TRIAL + 1, forked at the first as mode.reference=process forks it (a fork after a few steps held
    ~30 MB more of the tree's PSS: the learner's pages written since); then the thread as many steps, the process
    idle; each one's first step is not counted (the fork; warm-up). The medians of the rest decide, and the other
    ends: the process only where its median is below (1 - MARGIN) of the thread's, since it holds more memory (its
    pages the learner writes after the fork: the tree's PSS 30-40 MB above the thread's on the tiny model, of
    which ~21 MB within the first steps after the fork); where they are level, the thread. A run too short to try
    both keeps the one it has.
    """

    name = "fastest"
    TRIAL = 4  # timed steps of each
    MARGIN = 0.05  # how much faster the process must be to be kept over the thread (it costs memory)

    def __init__(self, reference: Callable[..., torch.Tensor]) -> None:
        self.reference = reference
        self.workers: dict[str, ReferenceThread | ReferenceProcess] = {"process": ReferenceProcess(reference)}
        self.trying = "process"
        self.times: dict[str, list[float]] = {"process": [], "thread": []}
        self.chosen: str | None = None

    @property
    def worker(self) -> ReferenceThread | ReferenceProcess:
        """The one that computes this step's reference."""
        return self.workers[self.chosen or self.trying]

    def submit(self, query: torch.Tensor, response: torch.Tensor, mask: torch.Tensor) -> Result:
        return self.worker.submit(query, response, mask)

    def observe(self, seconds: float) -> str | None:
        """The wall time of a step's pair (the update's policy forward and the reference's beside it); returns the
        one kept, once it is chosen (at that step), else None."""
        if self.chosen is not None:
            return None
        times = self.times[self.trying]
        times.append(seconds)
        if len(times) <= self.TRIAL:
            return None
        if self.trying == "process":
            self.workers["thread"] = ReferenceThread(self.reference)
            self.trying = "thread"
            return None
        median = {name: statistics.median(t[1:]) for name, t in self.times.items()}
        self.chosen = "process" if median["process"] < (1 - self.MARGIN) * median["thread"] else "thread"
        self.workers.pop("process" if self.chosen == "thread" else "thread").close()
        log.info("mode.reference=fastest: the update's policy forward with the reference's beside it took %.1f ms in "
                 "a thread, %.1f ms with a forked process (medians of %d steps each): the %s from here (the "
                 "process where it is over %d%% faster: it holds more memory)",
                 1e3 * median["thread"], 1e3 * median["process"], self.TRIAL, self.chosen, round(100 * self.MARGIN))
        return self.chosen

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()


WORKERS = {"thread": ReferenceThread, "process": ReferenceProcess, "fastest": ReferenceFastest}
