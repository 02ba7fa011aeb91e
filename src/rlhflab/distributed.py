"""Which process this is, and the few collectives rlhflab needs (no-ops in a single process).

Lightning starts ranks 1..N-1 at the first `Trainer.fit` by running the same command again
(LOCAL_RANK, NODE_RANK and WORLD_SIZE in their environment), so every rank runs the whole of
`train(cfg)`: the stages, RL and the saving. The process group exists from that first fit on.
Rank 0 alone talks to MLflow and writes files; decisions every rank must share (a cache hit,
a stop, a non-finite value) go through these helpers so that no rank waits for another forever.

When a run of several ranks fails, each rank's `error:` line names the rank, and a rank whose collective
failed because another rank is gone says so in one line (`as_rank_error`). Rank 0 watches the ranks it
launched (`_watch`, in place of Lightning's observer, which SIGKILLed rank 0 five seconds after any other
rank exited non-zero: its MLflow run stayed RUNNING, with nothing said, even while it wrote a checkpoint).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable

import torch

from rlhflab.errors import RankLost


# What Lightning's launcher puts in rank 0's environment when it starts the other ranks.
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


# How often rank 0 looks at the ranks it launched, and how long a failed rank's peers get to end the run
# themselves (a collective that fails at once, an agreed stop) before rank 0's watch ends it.
WATCH_EVERY_S = 0.5
GRACE_S = 10.0

_end_lock = threading.Lock()
_end_owner: str | None = None  # who ends this job after a failure: "run" (its own unwinding) or "watch"
_job = 0  # which job of this process (a sweep runs several): a watch ends with its job
_at_watch_exit: list[Callable[[], None]] = []  # run before the watch ends this process: os._exit runs no atexit hook


def at_watch_exit(fn: Callable[[], None], register: bool = True) -> None:
    """Run `fn` if rank 0's watch ends this process: its os._exit runs no atexit hook, such as the one that ends a
    sweep's parent run (register `fn` with atexit as well, for every other end). register=False takes it back."""
    if register:
        _at_watch_exit.append(fn)
    elif fn in _at_watch_exit:
        _at_watch_exit.remove(fn)


def claim_end(owner: str) -> bool:
    """True if `owner` ("run": this rank's own stop or error; "watch": rank 0's watch of the ranks it launched)
    ends this job: the first to ask, or the same one again. The other then says nothing (one closing line)."""
    global _end_owner
    with _end_lock:
        if _end_owner is None:
            _end_owner = owner
        return _end_owner == owner


@contextmanager
def one_job(on_lost: Callable[[str], None] = lambda status: None,
            how_to_continue: Callable[[], str] = lambda: ""):
    """A job that may start ranks (every `train(cfg)`): afterwards its process group is gone and the
    launcher's variables are as before, so the next job of a sweep in this process starts its own ranks
    (Lightning launches none while LOCAL_RANK is set, and would reuse a group whose peers have exited).
    `on_lost(status)` (mark the MLflow run FAILED, or KILLED where the ranks were stopped by a signal) runs if a
    launched rank fails while this rank does not end; `how_to_continue()` ends the line said when the ranks were stopped
    by a signal (resume=auto, or nothing to resume where no checkpoint was written)."""
    global _end_owner, _launched, _job
    from lightning.pytorch.strategies.launchers import subprocess_script as launcher

    before = {k: os.environ.get(k) for k in LAUNCH_VARS}
    _end_owner, _launched, _job = None, None, _job + 1
    observer = getattr(launcher, "_launch_process_observer", None)  # absent in another Lightning: its own stays
    if observer is not None:
        launcher._launch_process_observer = lambda procs: _start_watch(procs, on_lost, how_to_continue)
    try:
        yield
    finally:
        if observer is not None:
            launcher._launch_process_observer = observer
        if initialized():
            torch.distributed.destroy_process_group()
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_launched: list | None = None  # the rank processes this one launched (Lightning's launcher's list)


def _start_watch(procs: list, on_lost: Callable[[str], None], how_to_continue: Callable[[], str]) -> None:
    """Instead of Lightning's observer: a thread of rank 0 that watches the ranks it launched."""
    global _launched
    _launched = procs
    threading.Thread(target=_watch, args=(procs, on_lost, _job, how_to_continue), daemon=True, name="rlhflab-rank-watch").start()


def _watch(procs: list, on_lost: Callable[[str], None], job: int, how_to_continue: Callable[[], str]) -> None:
    """Until every launched rank exits 0. When one exits otherwise, this rank usually ends the run itself: its
    next collective fails at once (gloo; as_rank_error), or the exit was an agreed stop it is acting on too
    (writing the checkpoint). If it has not begun to end within GRACE_S (busy in a long forward, or waiting in an
    NCCL collective that never returns), the watch ends it: the run FAILED, one line, the other ranks killed. Ranks
    stopped by SIGINT/SIGTERM outside the RL loop (Ctrl-C to the process group while they start up: rank 0 waits in
    the process group's set-up, where no Python handler runs) are a stop: the run KILLED, exit 130/143, as one rank's."""
    while True:
        time.sleep(WATCH_EVERY_S)
        codes = [p.poll() for p in procs]
        if all(code == 0 for code in codes) or job != _job:
            return
        if any(codes):
            break
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and _end_owner is None:
        time.sleep(WATCH_EVERY_S)
    if job != _job or not claim_end("watch"):
        return  # this rank is ending the run itself
    lost = _lost(procs)  # before the kills below, which would read as more failures
    codes = [p.poll() for p in procs]
    stops = {_stopped_by(code) for code in codes if code}
    signum = stops.pop() if len(stops) == 1 and None not in stops else None  # every failed rank stopped by one signal
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)  # as Lightning: a rank stuck in a collective does not answer SIGTERM
    status = "KILLED" if signum else "FAILED"
    try:
        on_lost(status)
        said = f"; the MLflow run is {status}"
    except Exception as err:  # the tracking store gone too: still say what happened, and end
        said = f"; the MLflow run could not be marked {status} ({type(err).__name__}: {err})"
    for fn in list(_at_watch_exit):
        try:
            fn()
        except Exception as err:  # (nor must a hook)
            print(f"warning: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
    if signum:
        try:
            how = how_to_continue()
        except Exception:  # (a hint must not keep the ranks from ending)
            how = ""
        print(f"stopped: {lost}; rank 0 stopped the run{said}{how}", file=sys.stderr, flush=True)
        os._exit(128 + signum)
    print(f"error: {lost}; rank 0 stopped the run{said}", file=sys.stderr, flush=True)
    os._exit(1)


def _stopped_by(code: int) -> int | None:
    """The signal (SIGINT, SIGTERM) that stopped a rank exiting with `code`, or None."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        if code in (-signum, 128 + signum):
            return int(signum)
    return None


def _lost(procs: list, wait_s: float = 0.0) -> str | None:
    """'rank 1 of 2 exited with code 1 (its error is above)' for the launched ranks that failed, or None."""
    deadline = time.monotonic() + wait_s
    while True:
        codes = [p.poll() for p in procs]
        if any(codes) or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    node = int(os.environ.get("NODE_RANK", 0)) * (len(procs) + 1)
    world = world_size() if initialized() else len(procs) + 1
    said = []
    for i, code in enumerate(codes):
        if not code:
            continue
        name = f"rank {node + i + 1} of {world}"
        if code < 0:
            how = signal.Signals(-code).name
            said.append(f"{name} was killed by {how}" + (" (out of memory?)" if -code == signal.SIGKILL else ""))
        elif code - 128 in (signal.SIGINT, signal.SIGTERM):
            said.append(f"{name} was stopped by {signal.Signals(code - 128).name} (exit code {code})")
        else:
            said.append(f"{name} exited with code {code} (its error is above)")
    return ", ".join(said) or None


def as_rank_error(err: BaseException) -> BaseException:
    """What this rank reports of `err`, which ends its run. In a run of several ranks the message gets
    `rank R of N: ` (`err.rank`), and a collective that failed because another rank is gone (gloo's
    'Connection closed by peer', an NCCL error) becomes one line, RankLost, instead of a traceback. An error
    every rank raised on one shared decision (`err.shared`, e.g. a non-finite loss) is said by rank 0 alone
    (`err.quiet` elsewhere). Call it while the process group exists."""
    if not claim_end("run"):
        time.sleep(GRACE_S * 30)  # rank 0's watch is ending this process (os._exit): say nothing more
    if not initialized() or world_size() == 1:
        return err
    where = f"rank {rank()} of {world_size()}"
    if _collective_failed(err):
        lost = _lost(_launched, wait_s=GRACE_S) if _launched and is_main() else None
        detail = str(err).split("] ", 1)[-1].split(". ")[0]  # gloo: '[.../pair.cc:553] Connection closed by peer ...'
        err = RankLost(f"{lost}; this rank stopped with it" if lost else
                       f"another rank stopped first (its own error line says why, or its log): {type(err).__name__}: {detail}")
    try:
        err.rank = where
        err.quiet = bool(getattr(err, "shared", False)) and not is_main()
    except AttributeError:  # an exception type that takes no attributes is a traceback anyway
        pass
    return err


def _collective_failed(err: BaseException) -> bool:
    """Raised by a collective whose peer is gone: a torch.distributed error, gloo's RuntimeError, or any
    error raised inside torch.distributed (DDP's gradient all-reduce fails inside backward); never rlhflab's own."""
    if type(err).__module__.startswith("rlhflab"):
        return False
    if isinstance(err, getattr(torch.distributed, "DistError", ())) or "gloo" in str(err):
        return True
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and f"torch{os.sep}distributed{os.sep}" in tb.tb_frame.f_code.co_filename


def initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank() -> int:
    """This process's global rank (valid once the process group exists; 0 in a single process)."""
    return torch.distributed.get_rank() if initialized() else int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


def world_size() -> int:
    return torch.distributed.get_world_size() if initialized() else 1


def is_main() -> bool:
    """Rank 0, also before the process group exists (a launched rank has LOCAL_RANK or NODE_RANK > 0)."""
    if initialized():
        return torch.distributed.get_rank() == 0
    if "RANK" in os.environ:
        return int(os.environ["RANK"]) == 0
    if int(os.environ.get("SLURM_NTASKS", 1)) > 1:  # hydra/launcher=slurm: SLURM starts every rank
        return int(os.environ.get("SLURM_PROCID", 0)) == 0
    return int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(os.environ.get("NODE_RANK", 0)) == 0


def _device() -> torch.device:
    """Where collective tensors must live: the current GPU under NCCL, else the CPU."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if initialized():
        torch.distributed.barrier()


def broadcast(value):
    """Rank 0's `value` on every rank (any picklable object)."""
    if not initialized():
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def gather(value) -> list:
    """Every rank's `value`, in rank order, on every rank."""
    if not initialized():
        return [value]
    out = [None] * world_size()
    torch.distributed.all_gather_object(out, value)
    return out


def all_true(flag: bool) -> bool:
    """True only if `flag` holds on every rank."""
    if not initialized():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return bool(t.item())


def any_true(flag: bool) -> bool:
    return not all_true(not flag)


def mean(values: dict[str, float]) -> dict[str, float]:
    """Each value's mean over ranks (every rank must pass the same keys in the same order)."""
    if not initialized() or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_device())
    torch.distributed.all_reduce(t)
    return {k: float(v) / world_size() for k, v in zip(keys, t.tolist())}


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """A tensor's element-wise sum over ranks (itself on one rank): e.g. a batch statistic (F.masked_whiten's total)."""
    if not initialized():
        return t
    out = t.detach().to(_device(), copy=True)
    torch.distributed.all_reduce(out)
    return out.to(t.device)


def total(value: float) -> float:
    """The sum of `value` over ranks."""
    return float(all_sum(torch.tensor([float(value)], dtype=torch.float64)).item())
