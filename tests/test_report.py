"""The sweep report on fake MLflow data (no training): how runs are named and grouped in the plots,
that nothing is averaged silently, and that every label stays inside its axes."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest

from conftest import ROOT
from rlhflab import report_plots as plots
from rlhflab.naming import SWEEP_JOB_TAG, SWEEP_OVERRIDES_TAG
from rlhflab.report import bar_groups, run_labels, summary_rows, time_curves, write_report

STEPS, EVAL_EVERY = 40, 10


def fake_run(job: int, overrides: str, tags: dict[str, str], gold: float, kl: float, start_ms: int = 0):
    """A finished child as MlflowClient.search_runs returns it, with curves for its FakeClient."""
    tags = {"memory": "full", "mode": "sync", "staleness": "0", "reward": "model", **tags,
            SWEEP_JOB_TAG: str(job), SWEEP_OVERRIDES_TAG: overrides}
    metrics = {"eval/gold_reward": gold, "eval/kl": kl, "train/kl": kl, "perf/mean_samples_per_s": 100.0 + 50 * job,
               "perf/peak_mem_mb": 20.0 + job, "perf/rl_s": 30.0, "perf/total_s": 40.0}
    info = SimpleNamespace(run_id=f"{job:032x}", run_name=f"{tags['algo']}-{tags['memory']}-{tags['mode']}",
                           status="FINISHED", start_time=start_ms)
    run = SimpleNamespace(info=info, data=SimpleNamespace(tags=tags, metrics=metrics, params={}))
    pace = 1000 * (1 + job % 3)  # ms per RL step: the runs differ in speed
    point = lambda v, s: SimpleNamespace(value=v, step=s, timestamp=start_ms + 10_000 + s * pace)  # noqa: E731
    run.history = {
        "eval/gold_reward": [point(gold * s / STEPS, s) for s in range(0, STEPS + 1, EVAL_EVERY)],
        "train/reward": [point(math.log1p(s) * (1 + job / 10), s) for s in range(1, STEPS + 1)],
        "train/kl": [point(kl * s / STEPS, s) for s in range(1, STEPS + 1)],
    }
    return run


class FakeClient:
    """The MlflowClient calls the report makes, over a parent and its children in memory."""

    tracking_uri = "sqlite:///fake.db"

    def __init__(self, children):
        self.children = children

    def search_runs(self, experiment_ids, query, order_by=None, max_results=None):
        return self.children

    def get_metric_history(self, run_id, key):
        return next(r for r in self.children if r.info.run_id == run_id).history.get(key, [])


def fake_parent(overrides: str):
    info = SimpleNamespace(run_id="f" * 32, run_name="sweep_fake", experiment_id="0", status="FINISHED")
    return SimpleNamespace(info=info, data=SimpleNamespace(tags={SWEEP_OVERRIDES_TAG: overrides}, metrics={}))


def staleness_sweep(lrs=("0.001",)):
    """algo=rloo,ppo mode=async staleness=1,2 rl.lr=<lrs>: several runs per algo x memory."""
    runs = []
    for job, (algo, staleness, lr) in enumerate(itertools.product(("rloo", "ppo"), ("1", "2"), lrs)):
        overrides = f"algo={algo} mode=async staleness={staleness} rl.lr={lr} trainer.enable_progress_bar=false"
        runs.append(fake_run(job, overrides, {"algo": algo, "mode": "async", "staleness": staleness},
                             gold=0.3 + 0.1 * job, kl=1.0 + job))
    return runs


def test_runs_are_named_by_what_the_sweep_varied_with_short_keys():
    labels = run_labels(staleness_sweep(lrs=("0.001", "0.01")))
    assert list(labels.values())[:2] == ["algo=rloo staleness=1 lr=0.001", "algo=rloo staleness=1 lr=0.01"]
    assert len(set(labels.values())) == len(labels)


def test_a_sweep_jobs_escaped_values_show_as_typed_in_the_table_and_legends():
    """Hydra's sweeper escapes ':' in a job's values: the table showed 'task.gold_fn=reward.py\\:exact'."""
    runs = [fake_run(j, f"algo=rloo task.gold_fn={fn}", {"algo": "rloo"}, gold=0.5, kl=1.0)
            for j, fn in enumerate(("reward.py\\:exact", "reward.py\\:close"))]
    assert [r["varied"] for r in summary_rows(runs)] == ["task.gold_fn=reward.py:exact", "task.gold_fn=reward.py:close"]
    assert list(run_labels(runs).values()) == ["gold_fn=reward.py:exact", "gold_fn=reward.py:close"]


def test_the_tables_headers_name_the_metric_the_runs_are_judged_by():
    """Without a gold_fn the quality column is the runs' eval/reward; with one, the headers stay as they were
    (the change made 'RL s to baseline's final gold' into '... final gold reward')."""
    from rlhflab.report import EVAL_REWARD, markdown_table

    rows = summary_rows(staleness_sweep(lrs=("0.001",)))
    rows[0]["t_target"] = 1.0
    assert "| gold reward |" in markdown_table(rows) and "| RL s to baseline's final gold |" in markdown_table(rows)
    header = markdown_table(rows, EVAL_REWARD).splitlines()[0]
    assert "| reward (eval; the task has no gold_fn) |" in header and "| RL s to baseline's final reward |" in header


def test_a_failed_jobs_error_is_whole_in_the_table_with_its_fix():
    """The table cut every cell at 200 characters: a failed job's error lost its fix mid-word ('download it where
    the hub is reacha'), and a resume=auto refusal (~600 characters) kept only what was wrong."""
    from rlhflab.naming import ERROR_TAG
    from rlhflab.report import markdown_table

    runs = staleness_sweep(lrs=("0.001",))[:2]
    runs[1].info.status = "FAILED"
    runs[1].data.metrics.clear()
    error = ("ConfigError: model.name_or_path: 'nonexistent-org/nope' is not in the local Hugging Face cache and the "
             "hub cannot be reached ([Errno -2] Name or service not known); download it where the hub is reachable "
             "(hf download nonexistent-org/nope) or give a local directory")
    runs[1].data.tags[ERROR_TAG] = error
    assert len(error) > 200 and f"| {error} |" in markdown_table(summary_rows(runs)).splitlines()[3]


def test_a_run_without_gold_in_a_sweep_judged_by_gold_shows_its_eval_reward():
    """In a sweep where one job's task has a gold_fn and another's not, the second's eval/reward showed nowhere."""
    from rlhflab.report import markdown_table

    runs = staleness_sweep(lrs=("0.001",))[:2]
    del runs[1].data.metrics["eval/gold_reward"]
    runs[1].data.metrics["eval/reward"] = 0.625
    runs[0].data.metrics["eval/reward"] = 0.125  # beside its gold: not shown twice
    table = markdown_table(summary_rows(runs)).splitlines()
    assert "| gold reward | reward (eval; runs without a gold_fn) |" in table[0]
    assert "| 0.300 | – |" in table[2] and "| – | 0.625 |" in table[3]
    assert "runs without a gold_fn" not in markdown_table(summary_rows(staleness_sweep()))  # all with gold: no column


def test_several_runs_per_bar_group_get_one_labelled_bar_each_never_a_mean():
    runs = staleness_sweep(lrs=("0.001", "0.01"))
    rows = summary_rows(runs)
    bars, note = bar_groups(runs, rows, run_labels(runs), "samples_per_s")
    assert len(bars) == len(runs) == 8  # one bar per run, none averaged away
    assert [b.value for b in bars] == [r["samples_per_s"] for r in rows]
    rloo = [b.label for b in bars if b.group == "rloo\nfull"]
    assert rloo == ["staleness=1 lr=0.001", "staleness=1 lr=0.01", "staleness=2 lr=0.001", "staleness=2 lr=0.01"]
    assert note == "one bar per run, up to 4 runs per algo x memory, told apart by lr, staleness"


def test_one_run_per_bar_group_gets_a_plain_bar():
    runs = [fake_run(i, f"algo={a}", {"algo": a}, 0.5, 1.0) for i, a in enumerate(("rloo", "ppo", "grpo"))]
    bars, note = bar_groups(runs, summary_rows(runs), run_labels(runs), "peak_mem_mb")
    assert note == ""
    assert [(b.group, b.label) for b in bars] == [("rloo\nfull", ""), ("ppo\nfull", ""), ("grpo\nfull", "")]


def test_report_on_fake_runs_says_how_bars_group_and_lists_every_plot(tmp_path):
    runs = staleness_sweep(lrs=("0.001", "0.01"))
    runs[-1].data.tags["reward"] = "rule"  # one run optimised the rule: its own train/reward panel
    runs[-2].data.tags["reward"] = "function"  # one its own functions' (it was 'as reward', as the rule's)
    client = FakeClient(runs)
    report = write_report(client, fake_parent("mode=async"), tmp_path)
    names = ["summary.md", "gold_vs_step.png", "gold_vs_time.png", "train_curves.png", "gold_vs_kl.png",
             "peak_mem.png", "samples_per_s.png"]
    assert [p.name for p in report.files] == names and not report.skipped
    assert all(p.stat().st_size > 0 for p in report.files)
    md = (tmp_path / "summary.md").read_text()
    assert md.startswith("# sweep_fake\n")  # the parent's name, which says "sweep" once
    assert md.count("one bar per run, up to 4 runs per algo x memory, told apart by lr, staleness") == 2
    assert ("(as reward-model score (standardised) or your reward functions' weighted sum or reward, a panel each)"
            in report.captions["train_curves.png"]), report.captions["train_curves.png"]
    for name in names[1:]:
        assert f"- `{name}`: " in md and f"]({name})" in md
    assert sum(line.startswith("| ") for line in md.splitlines()) == 1 + len(runs)


def test_time_axis_starts_at_each_runs_first_evaluation():
    runs = staleness_sweep()
    curves = time_curves(FakeClient(runs), runs, run_labels(runs), "eval/gold_reward")
    assert [c.x[0] for c in curves] == [0.0] * len(runs)
    assert curves[1].x[-1] == 2 * curves[0].x[-1]  # job 1 steps at half job 0's pace


def test_time_axis_leaves_out_the_time_a_resumed_run_was_stopped():
    """The axis was MLflow's timestamps: a run stopped overnight and resumed had a line with a night in it (and the
    async table's 'RL s to baseline's final gold' counted it). Each evaluation's eval/rl_s, the run's own RL clock,
    leaves it out; a run from before eval/rl_s keeps the timestamps."""
    from rlhflab.report import rl_seconds_to_gold

    runs = staleness_sweep()
    resumed = runs[0]
    gold = resumed.history["eval/gold_reward"]
    night = 8 * 3600 * 1000
    for m in gold[len(gold) // 2:]:  # stopped halfway, resumed 8 hours later
        m.timestamp += night
    clock = [SimpleNamespace(value=0.5 + m.step * 1.0, step=m.step, timestamp=m.timestamp) for m in gold]
    resumed.history["eval/rl_s"] = clock
    curves = time_curves(FakeClient(runs), runs, run_labels(runs), "eval/gold_reward")
    assert curves[0].x == [m.step * 1.0 for m in gold]  # 1 s per step, from 0, without the night
    assert curves[1].x[-1] == (runs[1].history["eval/gold_reward"][-1].timestamp - runs[1].history["eval/gold_reward"][0].timestamp) / 1000
    assert rl_seconds_to_gold(FakeClient(runs), resumed, gold[-1].value) == gold[-1].step * 1.0


# ---- every label inside the frame -----------------------------------------------------------


def _outside(fig, texts, ax) -> list[str]:
    """The texts whose drawn extent leaves the axes."""
    fig.canvas.draw()
    box = ax.get_window_extent()
    out = []
    for t in texts:
        e = t.get_window_extent()
        if e.x0 < box.x0 - 0.5 or e.x1 > box.x1 + 0.5 or e.y0 < box.y0 - 0.5 or e.y1 > box.y1 + 0.5:
            out.append(t.get_text())
    return out


def test_point_labels_stay_inside_the_axes():
    corners = [plots.Point(x, y, "staleness=4 lr=0.001 kl_coef=0.3 seed=7") for x in (0.0, 10.0) for y in (0.0, 1.0)]
    groups = {"rloo": corners, "ppo": [plots.Point(5.0, 0.5, "middle")]}
    fig = plots.scatter(groups, "KL", "gold", "frontier")
    ax = fig.axes[0]
    assert _outside(fig, ax.texts, ax) == []
    plots.pyplot().close(fig)


@pytest.mark.parametrize("n", [3, 12])
def test_bar_values_stay_inside_the_axes(n):
    bars = [plots.Bar(f"g{i % 3}", f"staleness={i}" if n > 3 else "", 10.0 ** (i % 4)) for i in range(n)]
    fig = plots.bars(bars, "samples/s", "title")
    ax = fig.axes[0]
    labels = [t for t in ax.texts if t.get_text()]
    assert len(labels) == n and _outside(fig, labels, ax) == []
    plots.pyplot().close(fig)


def test_legend_of_many_runs_sits_outside_the_axes_and_in_the_file(tmp_path):
    curves = [plots.Curve(f"lr={i}", [0, 1, 2], [0, i, 2 * i]) for i in range(25)]
    fig = plots.lines([plots.Panel("gold", curves)], "step", "title")
    fig.canvas.draw()
    ax, legend = fig.axes[0], fig.axes[0].get_legend()
    assert len(legend.get_texts()) == 25
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1  # right of the curves, not over them
    right = legend.get_window_extent().x1 - fig.bbox.x0  # pixels at the figure's dpi
    dpi = fig.dpi
    plots.save(fig, tmp_path / "lines.png")
    from PIL import Image

    assert Image.open(tmp_path / "lines.png").size[0] >= right / dpi * 120  # the saved file holds the whole legend


def test_a_sweep_is_found_by_id_prefix_name_or_latest_and_anything_else_is_one_line(tmp_path, monkeypatch, capsys):
    """find_sweep against a real SQLite store: the parent by its id, its first characters, its name or
    `latest`; a job's id, a single run's id, an unknown id and an ambiguous prefix each end in one line."""
    import uuid

    from mlflow.tracking import MlflowClient

    from rlhflab.naming import SWEEP_TAG
    from rlhflab.report import find_sweep

    ids = iter(["abcd1111" + "0" * 24, "abcd2222" + "0" * 24, "abcd2222" + "1" * 24, "ef" * 16])
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(next(ids)))  # run ids chosen to share prefixes
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("rlhflab")
    old = client.create_run(experiment, run_name="sweep a", tags={SWEEP_TAG: "1"}, start_time=1)
    new = client.create_run(experiment, run_name="sweep b", tags={SWEEP_TAG: "1"}, start_time=2)
    job = client.create_run(experiment, run_name="rloo", tags={"mlflow.parentRunId": new.info.run_id}, start_time=3)
    single = client.create_run(experiment, run_name="grpo", start_time=4)
    monkeypatch.undo()
    for ref, parent in [(old.info.run_id, old), ("abcd1", old), ("abcd2222", new), ("sweep a", old), ("latest", new)]:
        assert find_sweep(client, ref).info.run_id == parent.info.run_id, ref

    def error(ref: str) -> str:
        with pytest.raises(SystemExit) as stop:
            find_sweep(client, ref)
        assert "\n" not in str(stop.value)
        return str(stop.value)

    assert error(job.info.run_id).endswith(f"run 'rloo' is one job of a sweep; give its parent, sweep={new.info.run_id}")
    assert error(single.info.run_id).endswith("run 'grpo' is a single run, not a sweep; python src/train.py -m ... makes a sweep")
    assert "no run of that id" in error("0" * 32)
    assert error("abcd").startswith("error: sweep=abcd: 2 sweep parent runs start so (")  # the job's abcd2222... is no parent
    # A job's or a single run's first characters or name are told as their full id is (they got the generic line).
    assert error("efef").endswith(f"run 'grpo' ({single.info.run_id}) is a single run, not a sweep; python src/train.py "
                                  "-m ... makes a sweep")
    assert error("grpo") == error("efef").replace("sweep=efef", "sweep=grpo")
    assert error("rloo").endswith(f"is one job of a sweep; give its parent, sweep={new.info.run_id}")
    assert error("0000") == f"error: sweep=0000: no sweep parent run of that id or name at {client.tracking_uri}"
    assert error("nosuch") == f"error: sweep=nosuch: no sweep parent run of that id or name at {client.tracking_uri}"
    assert error("7a1").endswith("; an id prefix needs 4 characters or more")
    # A sweep that failed before its first job (a bad sweeper setting, before the preflight checked it) left an empty
    # parent, newest of all: `latest` took it and the report said it had no child runs.
    empty = client.create_run(experiment, run_name="sweep c", tags={SWEEP_TAG: "1"}, start_time=5)
    client.set_terminated(empty.info.run_id, "FAILED")
    assert find_sweep(client, "latest").info.run_id == new.info.run_id
    assert "the 1 newer sweep parent run(s) have no job runs" in capsys.readouterr().err


def test_no_database_or_no_sweep_in_it_is_one_line_and_makes_no_database(tmp_path, monkeypatch):
    """In a directory without mlflow.db, MLflow made an empty database there and the report said 'no sweep parent
    run of that id or name': now the missing database is named and none is made; a store with no sweep says so."""
    from mlflow.tracking import MlflowClient

    from rlhflab.report import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(SystemExit) as stop:
        main(["sweep=latest"])
    assert str(stop.value).startswith("error: tracking_uri: no MLflow database at sqlite:///mlflow.db; run the report where")
    assert not (tmp_path / "mlflow.db").exists()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    client.create_run(client.create_experiment("rlhflab"), run_name="rloo")  # a single run, no sweep
    with pytest.raises(SystemExit) as stop:
        main(["sweep=latest"])
    assert str(stop.value) == "error: sweep=latest: sqlite:///mlflow.db holds no sweep; python src/train.py -m ... makes one"
    monkeypatch.setenv("HOME", str(tmp_path))  # tracking_uri=sqlite:///~/mlflow.db: the shell leaves it so
    with pytest.raises(SystemExit) as stop:
        main(["sweep=latest", "tracking_uri=sqlite:///~/mlflow.db"])
    assert str(stop.value).startswith(f"error: sweep=latest: sqlite:///{tmp_path}/mlflow.db holds no sweep")
    assert not (tmp_path / "~").exists()  # MLflow made ./~/mlflow.db and read that


class TwoSweepClient(FakeClient):
    """A sweep and its baseline: search_runs answers each parent's query with its own children."""

    def __init__(self, sweeps: dict[str, list]):
        super().__init__([r for runs in sweeps.values() for r in runs])
        self.sweeps = sweeps

    def search_runs(self, experiment_ids, query, order_by=None, max_results=None):
        return next(runs for parent, runs in self.sweeps.items() if parent in query)


def test_a_baseline_run_is_the_one_of_the_same_algo_and_memory_and_an_ambiguous_one_is_said(tmp_path):
    """`baseline=`: runs were matched by the algo tag alone, so async rloo (memory=full) was compared with the
    sync sweep's last rloo, memory=hydra (1.44x, against 1.13x beside full); and the summary counted the
    baseline's runs among the sweep's children."""
    base = [fake_run(j, f"algo=rloo memory={m}", {"algo": "rloo", "memory": m}, gold=0.5, kl=1.0)
            for j, m in enumerate(("full", "lora", "hydra"))]
    base += [fake_run(3 + j, f"algo=grpo rl.lr={lr}", {"algo": "grpo"}, gold=0.5, kl=1.0) for j, lr in enumerate(("1e-3", "3e-3"))]
    for run, rl_s in zip(base, (45.0, 63.0, 57.0, 40.0, 40.0)):
        run.data.metrics["perf/rl_s"] = rl_s
    ours = [fake_run(10 + j, f"algo={a} mode=async", {"algo": a, "mode": "async"}, gold=0.6, kl=1.0) for j, a in
            enumerate(("rloo", "grpo"))]
    for run in ours:
        run.info.run_id = f"{int(run.info.run_id, 16) + 100:032x}"
    client = TwoSweepClient({"f" * 32: ours, "e" * 32: base})
    baseline = fake_parent("algo=rloo,grpo memory=full,lora,hydra")
    baseline.info.run_id, baseline.info.run_name = "e" * 32, "sweep_sync"
    report = write_report(client, fake_parent("algo=rloo,grpo mode=async"), tmp_path, baseline)
    rows = [line for line in report.files[0].read_text().splitlines() if line.startswith("| ")]
    speedup = {line.split(" | ")[0]: line.split(" | ")[-3] for line in rows[1:]}
    assert speedup["| rloo-full-async #10"] == f"{45.0 / 30.0:.2f}"  # beside sync rloo, memory=full
    assert speedup["| grpo-full-async #11"] == "–"  # two sync grpo runs (rl.lr) fit: neither is picked
    summary = report.files[0].read_text()
    assert "- children: 2 (0 failed)" in summary
    assert "- baseline: sweep_sync, 5 runs (shown below the sweep's), matched on the algo, memory, model, reward and task tags" in summary
    assert "grpo-full-async #11: 2 baseline runs match (algo=grpo, memory=full, reward=model), so none is compared" in summary
    # An algo the baseline has no finished run of was left out of the comparison without a word.
    ours.append(fake_run(12, "algo=ppo mode=async", {"algo": "ppo", "mode": "async"}, gold=0.6, kl=1.0))
    ours[-1].info.run_id = f"{212:032x}"
    client = TwoSweepClient({"f" * 32: ours, "e" * 32: base})
    summary = write_report(client, fake_parent("algo=rloo,grpo,ppo mode=async"), tmp_path, baseline).files[0].read_text()
    assert "  - ppo-full-async #12: no finished baseline run has algo=ppo, memory=full, reward=model, so it is not compared" in summary
    assert "rloo-full-async #10: no" not in summary


def test_the_reports_own_settings_fail_in_one_line_naming_their_key(tmp_path, monkeypatch):
    """baseline= that matches nothing said 'sweep=...'; log_artifacts=ture turned the upload off without a word; a
    plain path as the tracking URI, and out_dir= an existing file, were tracebacks; a sweep given as its own
    baseline showed a speedup of 1.00 everywhere; a key given twice kept the last without a word."""
    from mlflow.tracking import MlflowClient

    from rlhflab.naming import SWEEP_TAG
    from rlhflab.report import main

    monkeypatch.chdir(tmp_path)
    # absolute: MLflow keeps one store per URI in a process, and sqlite:///mlflow.db may be another test's
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    parent = client.create_run(client.create_experiment("rlhflab"), run_name="sweep a", tags={SWEEP_TAG: "1"})
    (tmp_path / "notes.md").write_text("")

    def error(*args: str) -> str:
        with pytest.raises(SystemExit) as stop:
            main(["sweep=latest", *args])
        return str(stop.value)

    assert error("baseline=nosuch").startswith("error: baseline=nosuch: no sweep parent run of that id or name")
    assert error(f"baseline={parent.info.run_id}").startswith(f"error: baseline={parent.info.run_id}: is the sweep itself")
    assert error("tracking_uri=mlflow.db") == ("error: tracking_uri: 'mlflow.db' is a path, not an MLflow store URI; for a "
                                                "SQLite database give tracking_uri=sqlite:///mlflow.db")
    assert error("out_dir=notes.md").startswith("error: out_dir: notes.md is a file; give a directory")
    assert error("out_dir=notes.md/x").startswith(  # a NotADirectoryError traceback
        f"error: out_dir: '{tmp_path}/notes.md' is a file, so 'notes.md/x' cannot be a directory; give a directory")
    # A sweep stopped before its first job wrote an empty report and exited 0.
    assert error() == (f"error: sweep: sweep 'sweep a' ({parent.info.run_id}, RUNNING) has no child runs: no job of it "
                       "began, so there is nothing to report")
    assert not (tmp_path / "reports").exists()
    with pytest.raises(SystemExit) as stop:  # argparse's usage line, then the error (exit 2)
        main(["sweep=latest", "log_artifacts=ture"])
    assert stop.value.code == 2
    with pytest.raises(SystemExit) as stop:
        main(["sweep=latest", "sweep=other"])
    assert stop.value.code == 2


def test_python_m_runs_the_report_and_points_train_at_its_entry_point(tmp_path):
    """`python -m rlhflab.report sweep=latest` and `python -m rlhflab.train` did nothing and exited 0."""
    import subprocess
    import sys

    report = subprocess.run([sys.executable, "-m", "rlhflab.report"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert report.returncode == 2 and "sweep=<parent run id | run name | latest> is required" in report.stderr
    assert report.stderr.startswith("usage: python -m rlhflab.report ")  # not the other entry point's usage
    for entry in (["-m", "rlhflab.report"], [str(ROOT / "src" / "report.py")]):  # a refusal exited 1, as a failure does
        refused = subprocess.run([sys.executable, *entry, "sweep=nope"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
        assert refused.returncode == 2 and refused.stderr.startswith("error: tracking_uri: no MLflow database at "), refused.stderr
    train = subprocess.run([sys.executable, "-m", "rlhflab.train"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert train.returncode == 2 and train.stderr.strip().splitlines()[-1].startswith(
        "error: rlhflab.train is the library src/train.py runs; run python src/train.py")
