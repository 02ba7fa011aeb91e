"""A new MLflow store's empty copy made by a forked process beside the command line's imports (rlhflab.store_template)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import SHRINK, counting_migrations
from rlhflab import store_template
from rlhflab.cli import preflight
from rlhflab.store_template import end_aside, needs_template, start_aside
from rlhflab.tracking import ensure_experiment

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def children_ended():
    """Each child a test forks is ended and reaped with it, even when the test fails."""
    yield
    end_aside()


def test_the_preflight_names_each_jobs_store_and_cache_once(tmp_path):
    uri = f"sqlite:///{tmp_path}/m.db"
    assert preflight([f"logger.tracking_uri={uri}", f"cache_dir={tmp_path}/c"]) == [(uri, f"{tmp_path}/c")]
    assert preflight(["-m", "algo=rloo,grpo", f"logger.tracking_uri={uri}", f"cache_dir={tmp_path}/c",
                      f"output.dir={tmp_path}/out/${{hydra:job.num}}"]) == [(uri, f"{tmp_path}/c")]


def test_only_a_new_sqlite_store_without_the_caches_copy_needs_one(tmp_path):
    cache = tmp_path / "cache"
    template = needs_template(f"sqlite:///{tmp_path}/new.db", cache)
    assert template == cache / "mlflow" / f"empty-store-{__import__('mlflow').__version__}.db"
    assert needs_template(f"sqlite:///{tmp_path}/new.db", None) is None  # train(cfg) with no cache_dir
    assert needs_template("http://127.0.0.1:5000", cache) is None  # a server makes its own tables
    (tmp_path / "old.db").touch()
    assert needs_template(f"sqlite:///{tmp_path}/old.db", cache) is None  # a store that exists is opened, not made
    template.parent.mkdir(parents=True)
    template.touch()
    assert needs_template(f"sqlite:///{tmp_path}/new.db", cache) is None


@pytest.mark.mlflow_migrations
def test_a_forked_process_makes_the_empty_store_and_the_run_copies_it(tmp_path, monkeypatch):
    """The child runs MLflow's migrations; the run waits for it, keeps its store in the cache and copies it: no
    migration in the run's own process, and nothing left of the child."""
    made, cache = counting_migrations(monkeypatch), tmp_path / "cache"
    monkeypatch.chdir(tmp_path)
    template = needs_template(f"sqlite:///{tmp_path}/mlflow.db", cache)
    start_aside(template)
    (_, scratch), = store_template._aside.values()
    assert not cache.exists()  # the child works in a directory of its own; the cache is made when the run needs it
    assert ensure_experiment(f"sqlite:///{tmp_path}/mlflow.db", "rlhflab", cache) == "1"
    assert made == [] and store_template._aside == {} and not scratch.exists()
    assert [p.name for p in (cache / "mlflow").iterdir()] == [template.name]
    with sqlite3.connect(template) as kept:
        assert kept.execute("select count(*) from experiments").fetchone() == (0,)
    experiments = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_experiments()
    assert {(e.experiment_id, e.name) for e in experiments} == {("0", "Default"), ("1", "rlhflab")}


@pytest.mark.mlflow_migrations
def test_a_child_that_fails_leaves_the_run_to_make_its_store(tmp_path, monkeypatch):
    """A child that cannot make the store (here: a full disk) exits 1; the run migrates its store as it would without
    one, and keeps that copy."""
    made, cache = counting_migrations(monkeypatch), tmp_path / "cache"
    monkeypatch.chdir(tmp_path)
    template = needs_template(f"sqlite:///{tmp_path}/mlflow.db", cache)

    def full_disk(db: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_template, "make_empty_store", full_disk)
    start_aside(template)
    (_, scratch), = store_template._aside.values()
    assert ensure_experiment(f"sqlite:///{tmp_path}/mlflow.db", "rlhflab", cache) == "1"
    assert made == [str(tmp_path / "mlflow.db")] and template.is_file() and store_template._aside == {}
    assert not scratch.exists()


def test_at_exit_a_child_still_making_the_store_is_stopped_and_leaves_nothing(tmp_path, monkeypatch):
    """A run that ends before it opens its store (a config error found after the preflight): the child is stopped
    as by Ctrl-C, reaped, and its directory removed; the cache is never made."""
    ready_r, ready_w = os.pipe()

    def busy_store(db: Path) -> None:  # the child: its store half made, then busy until stopped
        db.write_bytes(b"half")
        os.write(ready_w, b"x")
        time.sleep(600)

    monkeypatch.setattr(store_template, "make_empty_store", busy_store)
    start_aside(tmp_path / "cache" / "mlflow" / "empty-store.db")
    (pid, scratch), = store_template._aside.values()
    assert os.read(ready_r, 1) == b"x" and (scratch / "empty.db").is_file()
    end_aside()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, 0)  # reaped
    assert store_template._aside == {} and not scratch.exists() and not (tmp_path / "cache").exists()


def test_the_command_lines_first_run_in_a_new_directory_migrates_nothing_itself(tmp_path):
    """`python src/train.py` in a new directory with a new cache: the store's empty copy is made beside the imports,
    so the run does not print MLflow's 'Creating initial MLflow database tables', and the cache keeps the copy."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RLHFLAB_CACHE")}
    env["TMPDIR"] = str(tmp_path / "tmp")  # where the child makes its store (tempfile), away from other tests' children
    (tmp_path / "tmp").mkdir()
    out = subprocess.run([sys.executable, str(ROOT / "src" / "train.py"), *SHRINK, "trainer.max_steps=1",
                          "stages.sft.epochs=1", "stages.rm.epochs=1", "hydra.verbose=rlhflab.store_template"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "the empty store's process ended (exit code 0)" in out.stdout + out.stderr, out.stderr[-3000:]
    assert "Creating initial MLflow database tables" not in out.stdout + out.stderr
    assert len(list((tmp_path / ".cache" / "rlhflab" / "mlflow").glob("empty-store-*.db"))) == 1
    assert MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_runs(["1"])[0].info.status == "FINISHED"
    assert list((tmp_path / "tmp").iterdir()) == []
