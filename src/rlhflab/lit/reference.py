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
- fastest (what `auto` picks where these can run): the process and the thread taking turns over the first
  steps, each timed, the faster kept (the thread unless the process is over 5% faster: it holds more memory).

With mode.split_generation (the default) the process also samples the last rows of each batch (half at first, then
as many as make both parts end together: SplitRows) while the learner samples the first
(rollout/lean.lean_generate_split: the same tokens and log-probs bit for bit), on the policy's parameters, moved to
shared memory before the fork so that it reads each update's weights. Sync online DPO
on vs_trl's settings (2026-12-04, 300 steps, 3 interleaved pairs): 32.0-32.7 ms a step against 33.9-35.9 without,
its generation 10.7-11.2 against 12.0-12.6 ms.

The process runs one torch thread: GNU OpenMP's thread pool does not survive a fork, and a child of a learner that
had run multi-threaded ops hung at its first parallel op (a 2-thread learner's reference forward, 2026-12-04).
"""

from __future__ import annotations

import atexit
import logging
import os
import statistics
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
import torch.multiprocessing as mp

from rlhflab.rollout.async_source import POLL_S, die_with_parent, end_child, ignore_stop_signals, stop_signals_held
from rlhflab.rollout.lean import SPLIT_MIN_ROWS, _sample
from rlhflab.rollout.sources import autocast_as, current_autocast
from rlhflab.shm import share_in_place

Result = Callable[[], torch.Tensor]
log = logging.getLogger(__name__)


class ReferenceCrashed(RuntimeError):
    """The reference process failed or died; the message holds its traceback where there is one."""


class ReferenceThread:
    """mode.reference=thread: the reference's forward in a second thread of the learner."""

    name = "thread"
    generating = None  # it samples nothing: the learner's thread samples every row

    def __init__(self, reference: Callable[..., torch.Tensor], policy=None) -> None:  # policy: the process's only
        self.reference = reference
        # Autocast's cast cache is one for all threads, and a thread leaving its outermost autocast empties it: the
        # worker's calls, each under autocast, would empty it under the learner's policy forward, whose length groups
        # share their casts of the trainable weights (rl_module._by_length). One level of nesting that the worker
        # never leaves keeps its calls from being the outermost.
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlhflab-reference",
                                       initializer=torch.autocast_increment_nesting)

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


def _generate_rows(policy, query, state, offset: int, batch_rows: int, *settings) -> tuple:
    """Rows offset.. of a batch of batch_rows sampled by `lean_generate`'s loop from the learner's generator state
    (lean_generate_split's other part) -> (response, log-probs or None) as numpy arrays. Outside autocast, as the
    lean loop runs only there: the learner asks for rows only where it samples outside autocast itself (a 32-true
    run), and this process, forked inside a training step, would otherwise keep whatever autocast that step had."""
    torch.set_rng_state(torch.from_numpy(state))
    with torch.inference_mode(), torch.autocast("cpu", enabled=False):
        response, logprobs = _sample(policy, torch.from_numpy(query), *settings, offset=offset, batch_rows=batch_rows)
    return response.numpy(), None if logprobs is None else logprobs.numpy()


def _reference_main(reference, policy, conn, parent: int) -> None:
    ignore_stop_signals()  # the learner's to handle: it finishes its step, then closes us
    die_with_parent(parent)
    torch.set_num_threads(1)  # one thread: see the module's doc
    with torch.no_grad():
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the learner closed its end
                return
            if msg is None:
                return
            kind, args = msg
            try:
                if kind == "generate":
                    started = time.perf_counter()
                    out = (*_generate_rows(policy, *args), time.perf_counter() - started)
                else:
                    out = reference(*(torch.from_numpy(a) for a in args)).numpy()
            except Exception:
                conn.send(("error", traceback.format_exc()))
                return
            conn.send(("ok", out))


class SplitRows:
    """How a batch's sampling is shared between the learner (its first rows) and the reference's process (the rest),
    for rollout/lean.lean_generate_split: `cut(rows)` is where, `took(rows, learner_s, process_s)` moves it.

    Half each at first; after each batch the cut moves toward both parts ending together, by half the rows the
    parts' times differ by (as a share of their sum), at most an eighth of the batch a step, each part keeping a
    quarter of the rows (and SPLIT_MIN_ROWS: a part of fewer rows samples other floats, lean_generate_split). A
    core's speed moves in plateaus of seconds (docs/MEASUREMENTS.md, "fastest's turns"): with halves fixed,
    the learner waited for a process whose core ran its half in 12.0-13.6 ms against the learner's 7.7-8.4 (sync
    online DPO, vs_trl's settings). Any cut gives the whole batch's tokens bit for bit (lean_generate_split). Kept
    per batch size: evaluation's batches are another size, and a part's time is mostly fixed cost on small models,
    so the balancing share is not the same. A batch too small for two such parts (rollout/hf.py splits none) stays
    at half.
    """

    def __init__(self, sample: Callable[..., Callable]) -> None:
        self.sample = sample  # ReferenceProcess.generate
        self.cuts: dict[int, int] = {}

    def cut(self, rows: int) -> int:
        return self.cuts.get(rows, rows // 2)

    def __call__(self, *args) -> Callable:
        return self.sample(*args)

    def took(self, rows: int, learner_s: float, process_s: float) -> None:
        least = max(SPLIT_MIN_ROWS, rows // 4)
        if rows - least < least:
            return
        step = max(1, rows // 8)
        move = round(rows * (process_s - learner_s) / max(learner_s + process_s, 1e-9) / 2)
        self.cuts[rows] = min(max(self.cut(rows) + max(-step, min(step, move)), least), rows - least)


class ReferenceProcess:
    """mode.reference=process: the reference's forward in a forked process (CPU).

    reference(query, response, mask) -> (n, R) log-probs runs there on the learner's memory as forked. With a
    `policy` (mode.split_generation) it also samples the last rows of each batch (`generate`, SplitRows,
    rollout/lean.lean_generate_split): the policy's parameters are moved to shared memory before the fork (a memfd,
    shm.share_in_place: a container's small /dev/shm does not limit it), so it samples from the weights of each step's
    update, which writes them in place. A failure there reaches the learner at its result with the traceback, a death
    within a poll interval; closing or the learner dying ends it.
    """

    name = "process"

    def __init__(self, reference: Callable[..., torch.Tensor], policy=None) -> None:
        self.policy = policy
        self.split = SplitRows(self.generate)
        if policy is not None:
            share_in_place(policy.parameters())  # into a memfd (shm.py): the parameter and its optimizer keep it
        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_reference_main,
                                args=(reference, policy, child, os.getpid()),
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

    def _send(self, msg) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, ConnectionResetError):
            raise self._died() from None

    def submit(self, query: torch.Tensor, response: torch.Tensor, mask: torch.Tensor) -> Result:
        self._send(("reference", tuple(t.detach().cpu().numpy() for t in (query, response, mask))))
        return lambda: torch.from_numpy(self._result())

    @property
    def generating(self) -> SplitRows | None:
        """`lean_generate_split`'s other part: the process samples rows there (None: it has no policy)."""
        return self.split if self.policy is not None else None

    def generate(self, query: torch.Tensor, state: torch.Tensor, offset: int, batch_rows: int, *settings) -> Callable:
        """Start sampling `query`, rows offset.. of a batch of batch_rows, from generator state `state`; returns
        the callable that waits for its (response, log-probs or None) numpy arrays and the seconds it sampled."""
        self._send(("generate", (query.numpy(), state.numpy(), offset, batch_rows, *settings)))
        return self._result

    def _result(self):
        while not self.conn.poll(POLL_S):
            if not self.proc.is_alive():
                raise self._died()
        try:
            kind, payload = self.conn.recv()
        except (EOFError, ConnectionResetError):
            raise self._died() from None
        if kind == "error":
            raise ReferenceCrashed(f"reference process failed:\n{payload}")
        return payload

    def close(self) -> None:
        if self.proc is None:
            return
        atexit.unregister(self.close)
        end_child(self.proc, lambda: self.conn.send(None), "mode sync: reference")
        self.conn.close()
        self.proc = None


class ReferenceFastest:
    """mode.reference=fastest (what auto picks where a reference can run beside the update): the process and the
    thread each timed over the first steps, and the faster kept for the rest of the run. What is timed is what the
    choice changes: the step's generation (which the process shares with mode.split_generation) and the update's
    policy forward with the reference's beside it.

    Which is faster follows the host: on an Intel Xeon the process's sync online DPO pair took ~5 ms against the
    thread's ~9 (py-spy, 2026-12-04), on an AMD EPYC the two were level, and the thread was the faster there for
    RLOO in one run. Both compute the same numbers, so the choice changes the speed only. The two take turns over
    the first 2 (TRIAL + 1) steps, the process first, forked at the first step as mode.reference=process forks it
    (a fork after a few steps held ~30 MB more of the tree's PSS: the learner's pages written since); each one's
    first step is not counted (the fork; warm-up). They take turns because the host's speed moves in plateaus
    longer than a trial: in blocks (the process's 4 steps, then the thread's) a plateau's edge between them decided,
    and sync online DPO at vs_trl's settings kept the thread in 3 of 4 runs (process medians 23.5-26.4 ms against
    14.8 in the fourth) though the process is ~17% faster over a run (2,290 against 1,925 completions/s,
    benchmarks/vs_trl_epyc_a6b4a12.md). The medians of the counted steps decide, and the other ends: the process
    only where its median is below (1 - MARGIN) of the thread's, since it holds more memory (its pages the learner
    writes after the fork: the tree's PSS 30-40 MB above the thread's on the tiny model, of which ~21 MB within the
    first steps after the fork); where they are level, the thread. A run too short to try both keeps the one it
    has.
    """

    name = "fastest"
    TRIAL = 4  # timed steps of each
    MARGIN = 0.05  # how much faster the process must be to be kept over the thread (it costs memory)

    def __init__(self, reference: Callable[..., torch.Tensor], policy=None) -> None:
        self.reference = reference
        self.workers: dict[str, ReferenceThread | ReferenceProcess] = {"process": ReferenceProcess(reference, policy)}
        self.trying = "process"
        self.times: dict[str, list[float]] = {"process": [], "thread": []}
        self.chosen: str | None = None

    @property
    def worker(self) -> ReferenceThread | ReferenceProcess:
        """The one that computes this step's reference."""
        return self.workers[self.chosen or self.trying]

    def submit(self, query: torch.Tensor, response: torch.Tensor, mask: torch.Tensor) -> Result:
        return self.worker.submit(query, response, mask)

    @property
    def generating(self):
        """The process's part of the sampling while it is tried or kept (ReferenceProcess.generating), else None."""
        return self.worker.generating

    def observe(self, seconds: float) -> str | None:
        """The wall time of a step's generation and pair (the update's policy forward and the reference's beside
        it); returns the one kept, once it is chosen (at that step), else None."""
        if self.chosen is not None:
            return None
        self.times[self.trying].append(seconds)
        if min(len(t) for t in self.times.values()) <= self.TRIAL:
            if "thread" not in self.workers:
                self.workers["thread"] = ReferenceThread(self.reference)
            self.trying = "thread" if self.trying == "process" else "process"  # take turns: both see the same host
            return None
        median = {name: statistics.median(t[1:]) for name, t in self.times.items()}
        self.chosen = "process" if median["process"] < (1 - self.MARGIN) * median["thread"] else "thread"
        self.workers.pop("process" if self.chosen == "thread" else "thread").close()
        log.info("mode.reference=fastest: generation, then the update's policy forward with the reference's beside it, "
                 "took %.1f ms with a thread, %.1f ms with a forked process (medians of %d steps each): the %s from "
                 "here (the process where it is over %d%% faster: it holds more memory)",
                 1e3 * median["thread"], 1e3 * median["process"], self.TRIAL, self.chosen, round(100 * self.MARGIN))
        return self.chosen

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()


WORKERS = {"thread": ReferenceThread, "process": ReferenceProcess, "fastest": ReferenceFastest}
