"""Report on a sweep: read the parent run's children from MLflow, write plots and a Markdown table.

    python src/report.py sweep=<parent run id | parent run name | latest> [tracking_uri=...] [out_dir=...]

Everything goes to `out_dir` (default reports/<parent run name>/) and is logged as
artifacts of the parent run under `report/`. A plot whose metrics no child has
is skipped, and the Markdown says so.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from rlhflab.naming import SWEEP_BEST_RUN_NAME_TAG, SWEEP_JOB_TAG, SWEEP_METRIC_TAG, SWEEP_OVERRIDES_TAG, SWEEP_TAG

GOLD, EVAL_KL, TRAIN_KL = "eval/gold_reward", "eval/kl", "train/kl"
THROUGHPUT, PEAK_MEM, TOTAL_S = "perf/mean_samples_per_s", "perf/peak_mem_mb", "perf/total_s"
RL_S, OVERLAP = "perf/rl_s", "perf/mean_overlap_eff"
DEFAULTS = {"sweep": None, "tracking_uri": None, "out_dir": None, "log_artifacts": "true", "baseline": None}


@dataclass
class Report:
    out_dir: Path
    files: list[Path] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # one line per plot left out, with the reason


# ---- finding the runs ---------------------------------------------------------------------


def find_sweep(client, sweep: str):
    """The parent run, by id, by run name (the newest of that name), or `latest`."""
    if re.fullmatch(r"[0-9a-f]{32}", sweep):
        return client.get_run(sweep)
    experiment_ids = [e.experiment_id for e in client.search_experiments()]
    query = f"tags.`{SWEEP_TAG}` = '1'"
    if sweep != "latest":
        query += f" and tags.`mlflow.runName` = '{sweep}'"
    runs = client.search_runs(experiment_ids, query, order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        raise SystemExit(f"error: sweep={sweep}: no sweep parent run of that id or name at {client.tracking_uri}")
    return runs[0]


def child_runs(client, parent) -> list:
    return client.search_runs(
        [parent.info.experiment_id],
        f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
        order_by=["attributes.start_time ASC"],
        max_results=5000,
    )


# ---- the table ----------------------------------------------------------------------------


def varied_overrides(runs) -> dict[str, str]:
    """Per run id, the job overrides that are not shared by every child (what the sweep varied)."""
    split = {r.info.run_id: r.data.tags.get(SWEEP_OVERRIDES_TAG, "").split() for r in runs}
    common = set.intersection(*(set(v) for v in split.values())) if split else set()
    return {run_id: " ".join(o for o in ov if o not in common) for run_id, ov in split.items()}


def summary_rows(runs) -> list[dict]:
    varied = varied_overrides(runs)
    rows = []
    for run in runs:
        tags, metrics = run.data.tags, run.data.metrics
        job = tags.get(SWEEP_JOB_TAG)
        rows.append({
            "run": run.info.run_name + (f" #{job}" if job is not None else ""),
            "status": run.info.status,
            **{k: tags.get(k, "") for k in ("algo", "memory", "mode", "staleness")},
            "gold": metrics.get(GOLD),
            "kl": metrics.get(EVAL_KL, metrics.get(TRAIN_KL)),
            "samples_per_s": metrics.get(THROUGHPUT, metrics.get("perf/samples_per_s")),
            "overlap": metrics.get(OVERLAP),
            "rl_s": metrics.get(RL_S),
            "peak_mem_mb": metrics.get(PEAK_MEM),
            "total_s": metrics.get(TOTAL_S),
            "speedup": None,
            "t_target": None,
            "varied": varied[run.info.run_id],
            "error": tags.get("rlhflab.error", ""),
        })
    return rows


COLUMNS = [  # (row key, header, number format)
    ("run", "run", None), ("status", "status", None), ("algo", "algo", None), ("memory", "memory", None),
    ("mode", "mode", None), ("staleness", "staleness", None), ("gold", "gold reward", ".3f"),
    ("kl", "KL", ".3f"), ("samples_per_s", "samples/s", ".1f"), ("overlap", "overlap eff", ".2f"),
    ("peak_mem_mb", "peak mem MB", ".1f"), ("rl_s", "RL s", ".1f"), ("total_s", "wall-clock s", ".1f"),
    ("speedup", "RL speedup vs baseline", ".2f"), ("t_target", "RL s to baseline's final gold", ".1f"),
    ("varied", "overrides", None), ("error", "error", None),
]


def _cell(value, fmt: str | None) -> str:
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        return "–"
    text = format(value, fmt) if fmt else str(value)
    return text.replace("|", "\\|").replace("\n", " ")[:200]


def markdown_table(rows: list[dict]) -> str:
    # Drop columns no row fills (e.g. peak memory before it is measured, errors in a clean sweep).
    cols = [c for c in COLUMNS if any(_cell(r[c[0]], c[2]) != "–" for r in rows)] or COLUMNS[:2]
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r[k], f) for k, _, f in cols) + " |" for r in rows]
    return "\n".join(lines)


def rl_seconds_to_gold(client, run, target: float) -> float | None:
    """Seconds from the first evaluation (the start of RL) until eval/gold_reward first reaches `target`."""
    history = sorted(client.get_metric_history(run.info.run_id, GOLD), key=lambda m: (m.timestamp, m.step))
    for m in history:
        if m.value >= target:
            return (m.timestamp - history[0].timestamp) / 1000
    return None


def compare_to_baseline(client, runs, rows, baseline_runs) -> None:
    """Side by side with a baseline sweep (e.g. sync) of the same algorithms: RL speedup and
    time to reach the baseline's final gold reward, matched by the `algo` tag."""
    base = {r.data.tags.get("algo"): r for r in baseline_runs if r.info.status == "FINISHED"}
    for run, row in zip(runs, rows):
        b = base.get(row["algo"])
        if b is None or run.info.status != "FINISHED":
            continue
        row["speedup"] = b.data.metrics.get(RL_S, math.nan) / run.data.metrics.get(RL_S, math.nan)
        row["t_target"] = rl_seconds_to_gold(client, run, b.data.metrics[GOLD])


# ---- the plots ----------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a server
    import matplotlib.pyplot as plt

    return plt


def _label(run) -> str:
    job = run.data.tags.get(SWEEP_JOB_TAG)
    return run.info.run_name + (f" #{job}" if job is not None else "")


def plot_gold_vs_time(client, runs, path: Path) -> bool:
    """eval/gold_reward history against seconds since each child started (stages sft/rm included)."""
    curves = []
    for run in runs:
        history = sorted(client.get_metric_history(run.info.run_id, GOLD), key=lambda m: (m.timestamp, m.step))
        if history:
            t = [(m.timestamp - run.info.start_time) / 1000 for m in history]
            curves.append((_label(run), t, [m.value for m in history]))
    if not curves:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, t, v in curves:
        ax.plot(t, v, marker="o", label=label)
    ax.set(xlabel="wall-clock since run start (s)", ylabel="gold reward (eval)", title="Gold reward vs wall-clock")
    return _finish(fig, ax, path)


def _finish(fig, ax, path: Path) -> bool:
    """Legend, grid, save, close: the same for every line and scatter plot."""
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return True


def _short(override: str) -> str:
    """`algo.kl_coef=0.1` -> `kl_coef=0.1`: short labels for crowded plots."""
    key, _, value = override.partition("=")
    return f"{key.rsplit('.', 1)[-1]}={value}"


def plot_frontier(runs, path: Path) -> bool:
    """Final gold reward vs final KL, one point per child coloured by algo: the reward/KL trade-off."""
    varied = varied_overrides(runs)
    by_algo: dict[str, list] = defaultdict(list)
    for run in runs:
        if GOLD in run.data.metrics and EVAL_KL in run.data.metrics:
            # Name a point by what the sweep varied besides the algo (e.g. algo.kl_coef=0.1), else by its run.
            note = " ".join(_short(o) for o in varied[run.info.run_id].split() if not o.startswith("algo=")) or _label(run)
            by_algo[run.data.tags.get("algo", "?")].append((run.data.metrics[EVAL_KL], run.data.metrics[GOLD], note))
    if not by_algo:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for algo, points in by_algo.items():
        ax.scatter([p[0] for p in points], [p[1] for p in points], label=algo)
        for kl, gold, note in points:
            ax.annotate(note, (kl, gold), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set(xlabel="KL to reference (eval, nats)", ylabel="gold reward (eval)", title="Gold reward vs KL")
    ax.margins(x=0.2, y=0.08)  # room for the labels of the outermost points
    return _finish(fig, ax, path)


def plot_bars(rows: list[dict], key: str, ylabel: str, path: Path) -> bool:
    """Mean of a final metric per algo x memory (several staleness values or seeds average out)."""
    groups: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        if row[key] is not None and not math.isnan(row[key]):
            groups[f"{row['algo']}\n{row['memory']}"].append(row[key])
    if not groups:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(groups) + 2), 4))
    names = list(groups)
    ax.bar(names, [sum(v) / len(v) for v in groups.values()], color="tab:blue")
    ax.set(ylabel=ylabel, title=f"{ylabel} per algo x memory")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---- putting it together ------------------------------------------------------------------


def write_report(client, parent, out_dir: Path, baseline=None) -> Report:
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(out_dir)
    runs = child_runs(client, parent)
    rows = summary_rows(runs)
    if baseline is not None:
        base_runs = child_runs(client, baseline)
        compare_to_baseline(client, runs, rows, base_runs)
        rows += summary_rows(base_runs)
        for row in rows[len(runs):]:
            row["run"] += " (baseline)"
        runs = runs + base_runs
    plots = [
        ("gold_vs_time.png", GOLD, lambda p: plot_gold_vs_time(client, runs, p)),
        ("gold_vs_kl.png", f"{GOLD} and {EVAL_KL}", lambda p: plot_frontier(runs, p)),
        ("peak_mem.png", PEAK_MEM, lambda p: plot_bars(rows, "peak_mem_mb", "peak memory (MB)", p)),
        ("samples_per_s.png", THROUGHPUT, lambda p: plot_bars(rows, "samples_per_s", "samples/s", p)),
    ]
    for name, needs, plot in plots:
        if plot(out_dir / name):
            report.files.append(out_dir / name)
        else:
            report.skipped.append(f"{name}: skipped, no child run has {needs}")
    md = out_dir / "summary.md"
    md.write_text(_markdown(client, parent, runs, rows, report))
    report.files.insert(0, md)
    return report


def _markdown(client, parent, runs, rows, report: Report) -> str:
    tags = parent.data.tags
    failed = sum(r.info.status == "FAILED" for r in runs)
    lines = [
        f"# Sweep {parent.info.run_name}",
        "",
        f"- parent run: `{parent.info.run_id}` at `{client.tracking_uri}`",
        f"- sweep overrides: `{tags.get(SWEEP_OVERRIDES_TAG, '')}`",
        f"- children: {len(runs)} ({failed} failed)",
    ]
    if tags.get(SWEEP_BEST_RUN_NAME_TAG):
        metric = tags.get(SWEEP_METRIC_TAG, GOLD)
        best = parent.data.metrics.get(f"best/{metric}")
        lines.append(f"- best {metric}: {_cell(best, '.4f')} ({tags[SWEEP_BEST_RUN_NAME_TAG]})")
    lines += ["", "KL is the final eval/kl (train/kl where a run has no eval/kl).", "", markdown_table(rows), ""]
    lines += [f"![{p.stem}]({p.name})" for p in report.files]
    lines += [f"- {s}" for s in report.skipped]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> dict[str, str | None]:
    parser = argparse.ArgumentParser(
        prog="python src/report.py",
        description="Plots and a Markdown table for a sweep's child runs; logged to the parent run.",
        epilog="keys: sweep (required: parent run id, run name, or 'latest'), tracking_uri "
               "(default MLFLOW_TRACKING_URI or sqlite:///mlflow.db), out_dir (default reports/<sweep name>), "
               "log_artifacts (true/false), baseline (a sweep of the same algos to compare with, e.g. the sync runs)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = dict(DEFAULTS)
    for item in parser.parse_args(argv).overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in DEFAULTS:
            parser.error(f"{item!r}: expected key=value with key one of {', '.join(DEFAULTS)}")
        args[key] = value
    if not args["sweep"]:
        parser.error("sweep=<parent run id | run name | latest> is required")
    return args


def main(argv: list[str]) -> Report:
    from mlflow.tracking import MlflowClient

    args = parse_args(argv)
    client = MlflowClient(args["tracking_uri"] or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db")
    parent = find_sweep(client, args["sweep"])
    out_dir = Path(args["out_dir"] or Path("reports") / parent.info.run_name)
    baseline = find_sweep(client, args["baseline"]) if args["baseline"] else None
    report = write_report(client, parent, out_dir, baseline)
    if args["log_artifacts"].lower() in ("1", "true", "yes"):
        client.log_artifacts(parent.info.run_id, str(out_dir), "report")
    for path in report.files:
        print(f"wrote {path}")
    for line in report.skipped:
        print(line)
    return report
