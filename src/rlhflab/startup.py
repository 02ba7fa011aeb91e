"""The command line's process and Python's cyclic garbage collector.

Importing torch, Lightning, transformers and MLflow makes ~600,000 objects and almost no cyclic garbage, yet the
collector walks the whole heap each time it has grown by a quarter: 9 full collections, 2.4 s of `python src/train.py`'s
start on a 2-core EPYC. At exit Python's finalization walks it again, 3.5 s between a run's last line and the shell
prompt. So `src/train.py` turns the collector off for its imports (`pause`); once a run has imported and built what
lives until it ends, `resume` moves those objects to the permanent generation (gc.freeze) and turns the collector back
on, which then walks only what training makes; at exit `freeze_at_exit` leaves the finalization nothing old to walk.
Frozen objects are freed as usual when their last reference goes; only cycles among them wait for the process's end.
A forked generator (mode=async) then writes no collector bookkeeping into the pages it shares with the learner, which
is gc.freeze's documented use. A process that did not `pause` (train(cfg) called from Python, the tests) is left as
it is."""

from __future__ import annotations

import atexit
import gc

_paused = False


def pause() -> None:
    """No cyclic collection while the process imports (the command line's first lines); `resume` ends it."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True
    atexit.register(freeze_at_exit)  # registered first, so it runs last of the exit handlers (MLflow's end its runs)


def resume() -> None:
    """What the process made so far to the permanent generation, and the collector on again (after `pause`)."""
    global _paused
    if _paused:
        gc.collect()  # once (0.3-0.7 s): the imports' few cycles freed, not frozen (3-11 MB of a run's peak memory)
        gc.freeze()
        gc.enable()
        _paused = False


def freeze_at_exit() -> None:
    """Python's finalization has no old objects to walk: they are freed by their reference counts as modules go."""
    gc.freeze()
