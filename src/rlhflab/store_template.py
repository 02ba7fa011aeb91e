"""An empty MLflow SQLite store kept in the cache, copied for every new store; the first one made beside the imports.

MLflow gives a new SQLite store its tables by running its ~50 migrations (alembic): 1.2-2.7 s of Python on a 2-core
machine, paid by every new directory's first run. rlhflab keeps a copy of an empty store, one per MLflow version, in
`cache_dir` (`store_template`), and a new store is a copy of it (`seed_store`, milliseconds; MLflow then opens it as
usual: its schema check, its own default experiment).

The first run with a cache has no copy yet. Its command line knows the store and the cache once its config is
composed (the preflight), ~5 s before the run opens the store, while it imports torch, Lightning and MLflow on one
core. `make_aside` forks a process there that makes an empty store on the other core; `seed_store` waits for it and
keeps it in the cache. A child that fails leaves nothing, and the run migrates its store itself, as without one.

Light: the standard library only (MLflow is imported by the forked child, and by `keep_template`'s callers, who
have it already).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

_aside: dict[Path, tuple[int, Path]] = {}  # template -> (pid, directory) of the child making its store (make_aside)


@functools.cache
def mlflow_version() -> str:
    """The installed MLflow's version, from its metadata (2-7 ms: not imported; read once a process)."""
    from importlib.metadata import version

    return version("mlflow")


def store_template(cache_dir) -> Path:
    """Where `cache_dir` keeps an empty SQLite store with this MLflow's tables (one per MLflow version: the schema
    check of another version refuses it)."""
    return Path(cache_dir).expanduser() / "mlflow" / f"empty-store-{mlflow_version()}.db"


def copy_database(source: Path, target: Path) -> None:
    """A consistent copy of SQLite database `source` (sqlite3's backup API: not a file copy that could catch a
    write half done), opened read-only."""
    import sqlite3
    from contextlib import closing
    from urllib.parse import quote

    uri = f"file:{quote(str(Path(source).absolute()))}?mode=ro"  # quoted: a '?' or '#' in the path
    with closing(sqlite3.connect(uri, uri=True)) as src, closing(sqlite3.connect(target)) as dst:
        src.backup(dst)


def seed_store(db: Path, cache_dir) -> bool:
    """Make the new SQLite store `db` a copy of `cache_dir`'s empty one (under the store lock; `db` does not exist),
    after the child making that copy (make_aside) is done. False when there is no copy (the first store made with
    this cache, or its child failed) or it cannot be copied: MLflow makes the store itself, as without one. Never
    over a store that appeared meanwhile."""
    import sqlite3

    template = store_template(cache_dir)
    wait_aside(template, cache_dir)
    if not template.is_file():
        return False
    part = db.with_name(f".{db.name}.{os.getpid()}.part")
    try:
        copy_database(template, part)
        os.link(part, db)  # whole, and only if db is still missing
        return True
    except FileExistsError:
        return False
    except (OSError, sqlite3.Error) as err:
        log.debug("mlflow: a new store from %s failed (%s); MLflow makes it", template, err)
        return False
    finally:
        part.unlink(missing_ok=True)


def keep_template(db: Path, cache_dir) -> None:
    """Keep a copy of the store MLflow just made (its tables, before any experiment of rlhflab's) in `cache_dir`, without
    the default experiment (MLflow makes that, with its artifact location in the working directory, as it opens
    each store): the next new store is a copy of it (seed_store)."""
    import sqlite3
    from contextlib import closing

    template = store_template(cache_dir)
    if template.exists():
        return
    part = template.with_name(f"{template.name}.{os.getpid()}.part")
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        copy_database(db, part)
        with closing(sqlite3.connect(part)) as con, con:  # closed, and committed before that
            con.execute("DELETE FROM experiments")
        os.replace(part, template)  # whole or not at all, whichever process is first
    except (OSError, sqlite3.Error) as err:  # a read-only or full cache: every new store is migrated, as without one
        log.debug("mlflow: could not keep an empty store in %s (%s)", template, err)
    finally:
        part.unlink(missing_ok=True)


def make_empty_store(db: Path) -> None:
    """A new SQLite store at `db` made by MLflow's migrations, silently (the forked child's work: make_aside)."""
    from rlhflab.naming import import_mlflow

    import_mlflow()
    for name in ("mlflow", "alembic"):  # 'Creating initial MLflow database tables...': the run's own store says nothing
        logging.getLogger(name).setLevel(logging.WARNING)
    from mlflow.tracking import MlflowClient

    MlflowClient(f"sqlite:///{db}").get_experiment_by_name("Default")  # the first query makes the tables


def needs_template(tracking_uri: str, cache_dir) -> Path | None:
    """The copy a run of this store and cache would make by MLflow's migrations: its path, where the store is a new
    SQLite database and the cache has no copy yet; else None."""
    from rlhflab.naming import sqlite_path

    db = sqlite_path(tracking_uri)
    if db is None or cache_dir is None or db.exists():
        return None
    template = store_template(cache_dir)
    return None if template.exists() else template


def make_aside(stores) -> None:
    """For each (tracking_uri, cache_dir) whose run would migrate a new store (needs_template), fork a process that
    makes an empty store in a directory of its own under the system's temporary directory (make_empty_store) while
    this one goes on; seed_store keeps it in the cache when the run opens its store, so a run that stops before
    then (a config error found later) leaves no cache behind. Only where this process has one thread (a fork copies
    only the caller's) and is the first rank (the ranks Lightning starts run the same command line)."""
    if os.environ.get("RANK", "0") != "0" or os.environ.get("LOCAL_RANK", "0") != "0" or threading.active_count() > 1:
        return
    for uri, cache_dir in stores:
        template = needs_template(uri, cache_dir)
        if template is not None and template not in _aside:
            start_aside(template)


def start_aside(template: Path) -> None:
    """Fork the process that makes `template`'s empty store (make_aside)."""
    import tempfile

    scratch = Path(tempfile.mkdtemp(prefix="rlhflab-mlflow-"))
    pid = os.fork()
    if pid == 0:  # the child: never returns, never runs the parent's exit handlers or flushes its buffers
        code = 1
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # end_aside's stop, whatever the parent's handler
            make_empty_store(scratch / "empty.db")
            code = 0
        except BaseException:  # Ctrl-C, a full disk: no store, and the run migrates its own
            pass
        finally:
            os._exit(code)
    if not _aside:
        atexit.register(end_aside)
    _aside[template] = pid, scratch
    log.debug("mlflow: process %d makes an empty store for %s beside the imports", pid, template)


def wait_aside(template: Path, cache_dir) -> None:
    """Wait for the child making `template`'s empty store (make_aside), if there is one, and keep what it made."""
    made = _aside.pop(template, None)
    if made is None:
        return
    pid, scratch = made
    try:
        t0 = time.perf_counter()
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        log.debug("mlflow: the empty store's process ended (exit code %d) %.2f s after the run asked for it", code,
                  time.perf_counter() - t0)
        if code == 0:
            keep_template(scratch / "empty.db", cache_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def end_aside() -> None:
    """At exit (a run that ended before opening its store): each child still making a store is stopped as Ctrl-C
    would stop it, reaped, and its directory removed."""
    while _aside:
        _, (pid, scratch) = _aside.popitem()
        try:
            os.kill(pid, signal.SIGINT)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        shutil.rmtree(scratch, ignore_errors=True)
