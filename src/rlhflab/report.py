"""Report on a sweep: read the parent run's children from MLflow, write plots and a Markdown table.

    python src/report.py sweep=<parent run id (or its first characters) | parent run name | latest> [tracking_uri=...] [out_dir=...]

Everything goes to `out_dir` (default reports/<parent run name, spaces as _>/) and is logged as
artifacts of the parent run under `report/`. A plot whose metrics no child has
is skipped, and the Markdown says so. Plots name runs by the overrides the sweep
varied and never average runs into one line, point or bar (report_plots draws them).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from rlhflab import report_plots as plots
from rlhflab.naming import (
    ERROR_TAG,
    HYDRA_ESCAPE,
    NOT_IN_NAMES,
    OBJECTIVE,
    PROCESS_TAG,
    SWEEP_BEST_RUN_NAME_TAG,
    SWEEP_CONTINUED_BY_TAG,
    SWEEP_JOB_TAG,
    SWEEP_METRIC_TAG,
    SWEEP_OBJECTIVE_TAG,
    SWEEP_OVERRIDES_TAG,
    SWEEP_TAG,
    behind_server,
    home_expanded,
    import_mlflow,
    process_gone,
    redact,
    short_override,
    sqlite_path,
)
from rlhflab.report_plots import Bar, Curve, Panel, Point

GOLD, EVAL_KL, TRAIN_KL, TRAIN_REWARD = "eval/gold_reward", "eval/kl", "train/kl", "train/reward"
THROUGHPUT, PEAK_MEM, TOTAL_S = "perf/mean_samples_per_s", "perf/peak_mem_mb", "perf/total_s"
RL_S, OVERLAP = "perf/rl_s", "perf/mean_overlap_eff"
DEFAULTS = {"sweep": None, "tracking_uri": None, "out_dir": None, "log_artifacts": "true", "baseline": None}
# Axis names. train/reward is what the run optimised: a reward model's standardised score (reward=model)
# or the task rule's value (reward=rule); keyed by the run's `reward` tag.
GOLD_AXIS, STEP_AXIS = "gold reward (eval)", "RL step (optimizer updates)"
EVAL_REWARD = "eval/reward"  # what a run reports where its task has no gold_fn


def quality_metric(runs) -> str:
    """What the report judges runs by: eval/gold_reward, or where no run has it (a task without task.gold_fn)
    eval/reward, as train.objective returns to a sweeper and the sweep's parent picks its best child by."""
    has = lambda key: any(key in r.data.metrics for r in runs)  # noqa: E731
    return EVAL_REWARD if not has(GOLD) and has(EVAL_REWARD) else GOLD


def quality_words(key: str) -> str:
    return "gold reward" if key == GOLD else "reward (eval; the task has no gold_fn)"
TIME_AXIS = "seconds of RL since the first evaluation"
RL_CLOCK = "eval/rl_s"  # seconds of RL at each evaluation, a resumed run's stop left out (runs before 2026-11-27: none)
REWARD_AXIS = {"model": "reward-model score (standardised)", "rule": "reward",
               "function": "your reward functions' weighted sum"}  # ('reward', as a rule's: it said nothing)


@dataclass
class Report:
    out_dir: Path
    files: list[Path] = field(default_factory=list)
    captions: dict[str, str] = field(default_factory=dict)  # file name -> what the plot shows, for summary.md
    skipped: list[str] = field(default_factory=list)  # one line per plot left out, with the reason
    children: int = 0  # the sweep's own runs (the table also lists the baseline's)
    quality: str = GOLD  # quality_metric of the runs
    baseline: list[str] = field(default_factory=list)  # the baseline sweep, then each run it could not be matched for


# ---- finding the runs ---------------------------------------------------------------------


def find_sweep(client, sweep: str, key: str = "sweep"):
    """The parent run: by id, by a prefix of its id (4+ characters, as MLflow's UI shows them), by run name
    (the newest of that name), or `latest`. Anything that is not a sweep's parent is one line saying what it is,
    named by `key` (sweep, or baseline)."""
    from mlflow.exceptions import MlflowException

    if re.fullmatch(r"[0-9a-f]{32}", sweep):
        try:
            run = client.get_run(sweep)
        except MlflowException:
            raise SystemExit(f"error: {key}={sweep}: no run of that id at {client.tracking_uri}; "
                             "give tracking_uri= if the sweep logged elsewhere") from None
        if run.data.tags.get(SWEEP_TAG) != "1":
            raise SystemExit(_not_a_sweep(run, key, sweep))
        return run
    prefix = re.fullmatch(r"[0-9a-f]{4,31}", sweep)  # the first characters of a run id
    experiment_ids = [e.experiment_id for e in client.search_experiments()]
    parents = client.search_runs(experiment_ids, f"tags.`{SWEEP_TAG}` = '1'",
                                 order_by=["attributes.start_time DESC"], max_results=5000)
    if sweep == "latest":  # the newest with a job: a sweep that failed before its first job left an empty parent
        found = next(([r] for r in parents if client.search_runs([r.info.experiment_id],
                      f"tags.mlflow.parentRunId = '{r.info.run_id}'", max_results=1)), parents[:1])
        if found and found[0] is not parents[0]:
            print(f"sweep=latest: {found[0].info.run_name} ({found[0].info.run_id}); the {parents.index(found[0])} newer "
                  "sweep parent run(s) have no job runs", file=sys.stderr)
    else:
        found = [r for r in parents if r.info.run_name == sweep][:1]  # the newest of that name
        if not found and prefix:
            found = [r for r in parents if r.info.run_id.startswith(sweep)]
            if len(found) > 1:
                ids = ", ".join(r.info.run_id for r in found[:3]) + (", ..." if len(found) > 3 else "")
                raise SystemExit(f"error: {key}={sweep}: {len(found)} sweep parent runs start so ({ids}); "
                                 "give more of the id")
    if found:
        return found[0]
    # Not a parent: a job's or a single run's name (the newest of it) or id prefix is told as its full id is.
    others = [] if "'" in sweep else client.search_runs(
        experiment_ids, f"attributes.run_name = '{sweep}'", order_by=["attributes.start_time DESC"], max_results=1)
    if not others and prefix:
        others = client.search_runs(experiment_ids, f"attributes.run_id LIKE '{sweep}%'", max_results=2)
        others = others[:len(others) == 1]  # several runs start so: none is meant more than another
    if others:
        raise SystemExit(_not_a_sweep(others[0], key, sweep))
    if not parents:
        raise SystemExit(f"error: {key}={sweep}: {client.tracking_uri} holds no sweep; python src/train.py -m ... makes one")
    short = "; an id prefix needs 4 characters or more" if re.fullmatch(r"[0-9a-f]{1,3}", sweep) else ""
    raise SystemExit(f"error: {key}={sweep}: no sweep parent run of that id or name at {client.tracking_uri}{short}")


def _not_a_sweep(run, key: str, ref: str) -> str:
    """One line for a run that is not a sweep's parent: a job (name its parent) or a single run."""
    parent = run.data.tags.get("mlflow.parentRunId")
    named = f"run {run.info.run_name!r}" + (f" ({run.info.run_id})" if ref != run.info.run_id else "")
    return (f"error: {key}={ref}: {named} is "
            + (f"one job of a sweep; give its parent, {key}={parent}" if parent else
               "a single run, not a sweep; python src/train.py -m ... makes a sweep"))


def child_runs(client, parent) -> list:
    return client.search_runs(
        [parent.info.experiment_id],
        f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
        order_by=["attributes.start_time ASC"],
        max_results=5000,
    )


def _label(run) -> str:
    """`<run name> #<job>`: a run in the table, or where the sweep varied nothing."""
    job = run.data.tags.get(SWEEP_JOB_TAG)
    return run.info.run_name + (f" #{job}" if job is not None else "")


# ---- the table ----------------------------------------------------------------------------


def varied_overrides(runs) -> dict[str, str]:
    """Per run id, the job overrides that are not shared by every child (what the sweep varied)."""
    split = {r.info.run_id: r.data.tags.get(SWEEP_OVERRIDES_TAG, "").split() for r in runs}
    common = set.intersection(*(set(v) for v in split.values())) if split else set()
    return {run_id: " ".join(o for o in ov if o not in common) for run_id, ov in split.items()}


def summary_rows(runs, key: str = GOLD) -> list[dict]:
    varied = varied_overrides(runs)
    rows = []
    for run in runs:
        tags, metrics = run.data.tags, run.data.metrics
        rows.append({
            "run": _label(run),
            "status": run.info.status,
            **{k: tags.get(k, "") for k in ("algo", "memory", "mode", "staleness")},
            "gold": metrics.get(key),
            # a run of a sweep judged by gold whose own task has no gold_fn: its reward showed nowhere
            "eval_reward": metrics.get(EVAL_REWARD) if key == GOLD and metrics.get(GOLD) is None else None,
            "kl": metrics.get(EVAL_KL, metrics.get(TRAIN_KL)),
            "objective": metrics.get(OBJECTIVE),
            "samples_per_s": metrics.get(THROUGHPUT, metrics.get("perf/samples_per_s")),
            "overlap": metrics.get(OVERLAP),
            "rl_s": metrics.get(RL_S),
            "peak_mem_mb": metrics.get(PEAK_MEM),
            "total_s": metrics.get(TOTAL_S),
            "speedup": None,
            "t_target": None,
            "varied": HYDRA_ESCAPE.sub(r"\1", varied[run.info.run_id]),  # as typed: reward.py:exact, not reward.py\:exact
            "error": tags.get(ERROR_TAG, ""),
        })
    return rows


COLUMNS = [  # (row key, header, number format)
    ("run", "run", None), ("status", "status", None), ("algo", "algo", None), ("memory", "memory", None),
    ("mode", "mode", None), ("staleness", "staleness", None), ("gold", "gold reward", ".3f"),
    ("eval_reward", "reward (eval; runs without a gold_fn)", ".3f"),
    ("kl", "KL", ".3f"), ("objective", "objective", ".3f"), ("samples_per_s", "samples/s", ".1f"), ("overlap", "overlap eff", ".2f"),
    ("peak_mem_mb", "peak mem MB", ".1f"), ("rl_s", "RL s", ".1f"), ("total_s", "wall-clock s", ".1f"),
    ("speedup", "RL speedup vs baseline", ".2f"), ("t_target", "RL s to baseline's final gold", ".1f"),
    ("varied", "overrides", None), ("error", "error", None),
]


def _cell(value, fmt: str | None, limit: int | None = 200) -> str:
    """A table cell: '–' for no value, at most `limit` characters (None: all; a cut one ends in '…')."""
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        return "–"
    text = (format(value, fmt) if fmt else str(value)).replace("\n", " ")
    if limit is not None and len(text) > limit:
        text = text[:limit - 1] + "…"
    return text.replace("|", "\\|")


# Cells kept whole: a failed job's error ends in its fix, which a cut at 200 characters dropped mid-word
WHOLE_CELLS = {"error"}


def markdown_table(rows: list[dict], key: str = GOLD) -> str:
    # Drop columns no row fills (e.g. peak memory before it is measured, errors in a clean sweep).
    cols = [c for c in COLUMNS if any(_cell(r[c[0]], c[2]) != "–" for r in rows)] or COLUMNS[:2]
    if key != GOLD:  # the runs' eval/reward: 'gold reward' and 'final gold' say what they are not
        cols = [(k, quality_words(key) if k == "gold" else h.replace("gold", "reward"), f) for k, h, f in cols]
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r[k], f, None if k in WHOLE_CELLS else 200) for k, _, f in cols) + " |" for r in rows]
    return "\n".join(lines)


def _by_time(client, run, key: str) -> list:
    return sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: (m.timestamp, m.step))


def _seconds(client, run, history: list) -> list[float]:
    """Seconds of RL since the run's first evaluation at each of `history` (its evaluations): the run's own RL clock
    (RL_CLOCK), which leaves out the time a resumed run was stopped; MLflow's timestamps for a run that has none."""
    clock = {m.step: m.value for m in client.get_metric_history(run.info.run_id, RL_CLOCK)}
    if history and all(m.step in clock for m in history):
        return [clock[m.step] - clock[history[0].step] for m in history]
    return [(m.timestamp - history[0].timestamp) / 1000 for m in history]


def rl_seconds_to_gold(client, run, target: float, key: str = GOLD) -> float | None:
    """Seconds from the first evaluation (the start of RL) until `key` (eval/gold_reward) first reaches `target`."""
    history = _by_time(client, run, key)
    return next((t for m, t in zip(history, _seconds(client, run, history)) if m.value >= target), None)


# What a baseline run shares with the run it is compared to: all but mode and staleness, what a comparison is about.
BASELINE_MATCH = ("algo", "memory", "model", "reward", "task")


def compare_to_baseline(client, runs, rows, baseline_runs, quality: str = GOLD) -> list[str]:
    """Side by side with a baseline sweep (e.g. sync) of the same algorithms: RL speedup and time to reach the
    baseline's final gold reward, against the one finished baseline run of the same BASELINE_MATCH tags. Returns
    a line per finished run that has several (the baseline also varied e.g. rl.lr: none of them is picked) or none."""
    finished = [r for r in baseline_runs if r.info.status == "FINISHED"]
    unmatched = []
    for run, row in zip(runs, rows):
        if run.info.status != "FINISHED":
            continue
        key = {t: run.data.tags.get(t) for t in BASELINE_MATCH}
        same = [b for b in finished if all(b.data.tags.get(t) == v for t, v in key.items())]
        shared = ", ".join(f"{t}={v}" for t, v in key.items() if v is not None)
        if len(same) > 1:
            unmatched.append(f"{row['run']}: {len(same)} baseline runs match ({shared}), so none is compared")
        elif not same:  # e.g. the baseline swept other algos, or its run of this one failed
            unmatched.append(f"{row['run']}: no finished baseline run has {shared}, so it is not compared")
        if len(same) != 1:
            continue
        b = same[0]
        row["speedup"] = b.data.metrics.get(RL_S, math.nan) / run.data.metrics.get(RL_S, math.nan)
        target = b.data.metrics.get(quality)
        row["t_target"] = rl_seconds_to_gold(client, run, target, quality) if target is not None else None
    return unmatched


# ---- the plots: what each shows (report_plots draws) ---------------------------------------


def run_labels(runs, baseline_ids=frozenset()) -> dict[str, str]:
    """Per run id, its name in legends: what the sweep varied, short keys (`algo=rloo lr=0.001`), leaving out
    where things are logged; else its run name and job. Unique: a repeated name gets the run id's start."""
    varied, labels = varied_overrides(runs), {}
    for run in runs:
        rid = run.info.run_id
        label = " ".join(short_override(o) for o in varied[rid].split() if not o.lstrip("+~").startswith(NOT_IN_NAMES))
        label = (label or _label(run)) + (" (baseline)" if rid in baseline_ids else "")
        labels[rid] = label if label not in labels.values() else f"{label} [{rid[:6]}]"
    return labels


def _without(label: str, *keys: str) -> str:
    """A run's label less the `key=value` parts a plot already shows (by colour or by group)."""
    return " ".join(t for t in label.split() if t.partition("=")[0] not in keys)


def step_curves(client, runs, labels, key: str) -> list[Curve]:
    """`key` per run against the RL step it was logged at."""
    curves = []
    for run in runs:
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: (m.step, m.timestamp))
        if history:
            curves.append(Curve(labels[run.info.run_id], [m.step for m in history], [m.value for m in history]))
    return curves


def time_curves(client, runs, labels, key: str) -> list[Curve]:
    """`key` per run against seconds since its first value (for eval/gold_reward: the evaluation before RL)."""
    curves = []
    for run in runs:
        history = _by_time(client, run, key)
        if history:
            curves.append(Curve(labels[run.info.run_id], _seconds(client, run, history), [m.value for m in history]))
    return curves


def _axis(key: str) -> str:
    return GOLD_AXIS if key == GOLD else "reward (eval)"


def gold_vs_step(client, runs, labels, path: Path, key: str = GOLD) -> str | None:
    curves = step_curves(client, runs, labels, key)
    if not curves:
        return None
    fig = plots.lines([Panel(_axis(key), curves)], STEP_AXIS, f"{_axis(key).split(' (')[0].capitalize()} vs RL step",
                      list(labels.values()))
    plots.save(fig, path)
    return f"{quality_words(key)} at each evaluation against RL step (optimizer updates), one line per run"


def gold_vs_time(client, runs, labels, path: Path, key: str = GOLD) -> str | None:
    curves = time_curves(client, runs, labels, key)
    if not curves:
        return None
    fig = plots.lines([Panel(_axis(key), curves)], TIME_AXIS, f"{_axis(key).split(' (')[0].capitalize()} vs RL time",
                      list(labels.values()))
    plots.save(fig, path)
    return f"{quality_words(key)} at each evaluation against seconds of RL since the run's first evaluation " \
           "(the start of RL; stages sft/rm, and the time a resumed run was stopped, left out), one line per run"


def reward_panels(client, runs, labels) -> list[Panel]:
    """train/reward, one panel per `reward` tag: a reward model's standardised score and a rule's value
    are different scales, so they do not share an axis."""
    kinds: dict[str, list] = defaultdict(list)
    for run in runs:
        kinds[run.data.tags.get("reward", "?")].append(run)
    return [Panel(REWARD_AXIS.get(kind, "reward"), step_curves(client, of_kind, labels, TRAIN_REWARD),
                  TRAIN_REWARD + (f" (reward={kind})" if len(kinds) > 1 else "")) for kind, of_kind in kinds.items()]


def training_curves(client, runs, labels, path: Path) -> str | None:
    rewards = [p for p in reward_panels(client, runs, labels) if p.curves]
    kl = Panel("KL to reference (nats)", step_curves(client, runs, labels, TRAIN_KL), TRAIN_KL)
    panels = rewards + [kl] * bool(kl.curves)
    if not panels:
        return None
    plots.save(plots.lines(panels, STEP_AXIS, "Training curves", list(labels.values())), path)
    scales = " or ".join(p.ylabel for p in rewards) + (", a panel each" if len(rewards) > 1 else "")
    shown = [f"{TRAIN_REWARD} (as {scales})"] * bool(rewards) + [TRAIN_KL] * bool(kl.curves)
    return f"{' and '.join(shown)} against RL step, one line per run"


def frontier(runs, labels, path: Path, key: str = GOLD) -> str | None:
    """Final gold reward vs final KL, one point per child coloured by algo: the reward/KL trade-off."""
    by_algo: dict[str, list[Point]] = defaultdict(list)
    for run in runs:
        m = run.data.metrics
        if key in m and EVAL_KL in m:
            # Name a point by what the sweep varied besides the algo (e.g. kl_coef=0.1), else by its run.
            note = _without(labels[run.info.run_id], "algo") or _label(run)
            by_algo[run.data.tags.get("algo", "?")].append(Point(m[EVAL_KL], m[key], note))
    if not by_algo:
        return None
    fig = plots.scatter(by_algo, "KL to reference (eval, nats)", _axis(key), f"{_axis(key).split(' (')[0].capitalize()} vs KL",
                        legend_title="algo")
    plots.save(fig, path)
    return f"final {quality_words(key)} against final KL, one point per run, coloured by algo, labelled by its other overrides"


def _group(row: dict) -> str:
    return f"{row['algo']}\n{row['memory']}"


def bar_groups(runs, rows, labels, key: str) -> tuple[list[Bar], str]:
    """One bar per run that has `key`, grouped by algo x memory: nothing is averaged. Where a group holds
    several runs (the sweep varied something else too), each bar is labelled with that run's other varied
    overrides, and the note (for the title and summary.md) says how many share a group and what tells them apart."""
    items = [(run, row) for run, row in zip(runs, rows) if row[key] is not None and not math.isnan(row[key])]
    crowd = max(Counter(_group(row) for _, row in items).values(), default=0)
    if crowd <= 1:
        return [Bar(_group(row), "", row[key]) for _, row in items], ""
    bars = [Bar(_group(row), _without(labels[run.info.run_id], "algo", "memory") or row["run"], row[key])
            for run, row in items]
    keys = sorted({t.partition("=")[0] for b in bars for t in b.label.split() if "=" in t}) or ["run"]
    return bars, f"one bar per run, up to {crowd} runs per algo x memory, told apart by {', '.join(keys)}"


def bar_chart(runs, rows, labels, key: str, ylabel: str, path: Path) -> str | None:
    bars, note = bar_groups(runs, rows, labels, key)
    if not bars:
        return None
    title = f"{ylabel} per algo x memory" + (f"\n{note}" if note else "")
    plots.save(plots.bars(bars, ylabel, title, legend_title="other overrides" if note else None), path)
    return f"final {ylabel} per algo x memory" + (f": {note}" if note else ", one run each")


# ---- putting it together ------------------------------------------------------------------


def gather(client, parent, baseline=None, report: Report | None = None) -> tuple[list, list[dict], dict[str, str]]:
    """The children (then the baseline's), their table rows, their legend names; what the summary says of the
    baseline goes to `report`."""
    runs = _children(client, parent, "sweep")
    base_runs = _children(client, baseline, "baseline") if baseline is not None else []
    key = quality_metric(runs + base_runs)
    rows = summary_rows(runs, key)
    if report is not None:
        report.children, report.quality = len(runs), key
    if baseline is not None:
        unmatched = compare_to_baseline(client, runs, rows, base_runs, key)
        if report is not None:
            report.baseline = [f"{baseline.info.run_name}, {len(base_runs)} runs (shown below the sweep's), matched on the "
                               f"{', '.join(BASELINE_MATCH[:-1])} and {BASELINE_MATCH[-1]} tags", *unmatched]
        base_rows = summary_rows(base_runs, key)
        for row in base_rows:
            row["run"] += " (baseline)"
        rows += base_rows
    runs = runs + base_runs
    return runs, rows, run_labels(runs, {r.info.run_id for r in base_runs})


def _children(client, parent, key: str) -> list:
    """A sweep's child runs; none (it was stopped or died before its first job began) is one line, not an empty report."""
    runs = child_runs(client, parent)
    later = parent.data.tags.get(SWEEP_CONTINUED_BY_TAG)
    if not runs and later:  # it said no job had begun: they had, and moved to the sweep that continued them
        raise SystemExit(f"error: {key}: sweep {parent.info.run_name!r} ({parent.info.run_id}, {parent.info.status}) "
                         f"has no child runs left: a sweep continued it with resume=auto, and its jobs' runs moved to "
                         f"that one's parent {later}; report that: python src/report.py {key}={later}")
    if not runs:
        raise SystemExit(f"error: {key}: sweep {parent.info.run_name!r} ({parent.info.run_id}, {parent.info.status}) "
                         "has no child runs: no job of it began, so there is nothing to report")
    return runs


def write_report(client, parent, out_dir: Path, baseline=None) -> Report:
    report = Report(out_dir)
    runs, rows, labels = gather(client, parent, baseline, report)
    out_dir.mkdir(parents=True, exist_ok=True)
    key = report.quality
    figures = [  # (file, what it needs, draw: returns its caption, or None where no run has what it needs)
        ("gold_vs_step.png", key, lambda p: gold_vs_step(client, runs, labels, p, key)),
        ("gold_vs_time.png", key, lambda p: gold_vs_time(client, runs, labels, p, key)),
        ("train_curves.png", f"{TRAIN_REWARD} or {TRAIN_KL}", lambda p: training_curves(client, runs, labels, p)),
        ("gold_vs_kl.png", f"{key} and {EVAL_KL}", lambda p: frontier(runs, labels, p, key)),
        ("peak_mem.png", PEAK_MEM, lambda p: bar_chart(runs, rows, labels, "peak_mem_mb", "peak memory (MB)", p)),
        ("samples_per_s.png", THROUGHPUT, lambda p: bar_chart(runs, rows, labels, "samples_per_s", "samples/s", p)),
    ]
    for name, needs, draw in figures:
        caption = draw(out_dir / name)
        if caption:
            report.files.append(out_dir / name)
            report.captions[name] = caption
        else:
            report.skipped.append(f"{name}: skipped, no child run has {needs}")
    md = out_dir / "summary.md"
    md.write_text(_markdown(client, parent, runs, rows, report))
    report.files.insert(0, md)
    return report


def _markdown(client, parent, runs, rows, report: Report) -> str:
    tags = parent.data.tags
    failed = sum(r.info.status == "FAILED" for r in runs[:report.children])
    stopped = {"KILLED": "; stopped by a signal: jobs after the last child never ran",
               "FAILED": "; the sweep died: jobs after the last child never ran",
               "RUNNING": "; still running"}.get(parent.info.status, "")
    if parent.info.status == "RUNNING" and process_gone(tags.get(PROCESS_TAG)):  # SIGKILLed: no hook ended it
        stopped = ("; but its process is gone (SIGKILL, or a store that stopped answering): jobs after the last child never ran, and the next run or sweep "
                   "in its experiment ends it KILLED")
    lines = [
        f"# {'' if parent.info.run_name.lower().startswith('sweep') else 'Sweep '}{parent.info.run_name}",  # not "Sweep sweep"
        "",
        f"- parent run: `{parent.info.run_id}` at `{client.tracking_uri}`, {parent.info.status}{stopped}",
        f"- sweep overrides: `{tags.get(SWEEP_OVERRIDES_TAG, '')}`",
        f"- children: {report.children} ({failed} failed)",
    ]
    if report.baseline:
        lines.append(f"- baseline: {report.baseline[0]}")
        lines += [f"  - {line}" for line in report.baseline[1:]]
    if tags.get(SWEEP_BEST_RUN_NAME_TAG):
        metric = tags.get(SWEEP_METRIC_TAG, GOLD)
        best = parent.data.metrics.get(f"best/{metric}")
        what = f" ({tags[SWEEP_OBJECTIVE_TAG]})" if tags.get(SWEEP_OBJECTIVE_TAG) else ""
        lines.append(f"- best {metric}{what}: {_cell(best, '.4f')} ({tags[SWEEP_BEST_RUN_NAME_TAG]})")
    lines += ["", "KL is the final eval/kl (train/kl where a run has no eval/kl).", "", markdown_table(rows, report.quality), ""]
    lines += ["## Plots", ""] + [f"- `{name}`: {caption}" for name, caption in report.captions.items()]
    lines += [f"- {s}" for s in report.skipped] + [""]
    lines += [f"![{Path(name).stem}]({name})" for name in report.captions]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str], prog: str = "python src/report.py") -> dict[str, str | None]:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Plots and a Markdown table for a sweep's child runs; logged to the parent run.",
        epilog="keys: sweep (required: parent run id or its first characters, run name, or 'latest'), tracking_uri "
               "(default MLFLOW_TRACKING_URI or sqlite:///mlflow.db), out_dir (default reports/<sweep name>), "
               "log_artifacts (true/false), baseline (a sweep of the same algos to compare with, e.g. the sync runs)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args, given = dict(DEFAULTS), set()
    for item in parser.parse_args(argv).overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in DEFAULTS:
            parser.error(f"{item!r}: expected key=value with key one of {', '.join(DEFAULTS)}")
        if key in given:  # the last one won, without a word
            parser.error(f"{key}= is given twice ({args[key]!r} and {value!r}); give it once")
        args[key] = value
        given.add(key)
    if not args["sweep"]:
        parser.error("sweep=<parent run id | run name | latest> is required")
    if args["log_artifacts"].lower() not in BOOLEANS:  # a typo ('ture') turned the upload off without a word
        parser.error(f"log_artifacts={args['log_artifacts']}: give true or false")
    return args


BOOLEANS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def main(argv: list[str], prog: str = "python src/report.py") -> Report:
    import_mlflow()  # as a run imports it: the report uses neither pandas nor pyarrow
    from mlflow.tracking import MlflowClient

    args = parse_args(argv, prog)
    uri = home_expanded(args["tracking_uri"] or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db")
    db = sqlite_path(uri)
    if db is not None and not db.is_file():
        # MLflow would make an empty database there (in the wrong directory, most likely) and find no sweep in it.
        raise SystemExit(f"error: tracking_uri: no MLflow database at {uri}; run the report where the sweep ran, "
                         "or give tracking_uri=sqlite:////path/to/mlflow.db (or set MLFLOW_TRACKING_URI)")
    if "://" not in uri and not uri.startswith("databricks"):  # a plain path: MLflow's file store, which it refuses
        raise SystemExit(f"error: tracking_uri: '{uri}' is a path, not an MLflow store URI; for a SQLite database give "
                         f"tracking_uri=sqlite:///{uri}")
    client = MlflowClient(uri)
    parent = find_sweep(client, args["sweep"])
    # Sweep names say what was swept (`sweep algo=ppo,rloo 2025-01-31_12-00-00`): a folder name without spaces.
    out_dir = Path(home_expanded(args["out_dir"])) if args["out_dir"] else \
        Path("reports") / re.sub(r"[^\w.,=+-]+", "_", parent.info.run_name)
    if out_dir.exists() and not out_dir.is_dir():
        raise SystemExit(f"error: out_dir: {out_dir} is a file; give a directory (made if missing), or leave out_dir "
                         "out for reports/<sweep name>")
    from rlhflab.errors import ConfigError
    from rlhflab.schema import writable_dir

    try:  # under a file (out_dir=<file>/x): a NotADirectoryError traceback; a directory it cannot write
        writable_dir("out_dir", out_dir, make=False)
    except ConfigError as err:
        raise SystemExit(f"error: {err}") from None
    baseline = find_sweep(client, args["baseline"], "baseline") if args["baseline"] else None
    if baseline is not None and baseline.info.run_id == parent.info.run_id:  # every speedup 1.00
        raise SystemExit(f"error: baseline={args['baseline']}: is the sweep itself; give another sweep to compare with "
                         "(e.g. the sync runs of the same algos)")
    upload = BOOLEANS[args["log_artifacts"].lower()]
    if upload and behind_server(parent.info.artifact_uri, uri):
        # a sweep run through an MLflow server, its database read directly: MLflow's traceback after the plots
        raise SystemExit(f"error: tracking_uri: the sweep keeps its files behind an MLflow server "
                         f"({parent.info.artifact_uri}), and {redact(uri)} is not one; report through that server "
                         "(tracking_uri=http://HOST:PORT), or keep the report here only: log_artifacts=false")
    report = write_report(client, parent, out_dir, baseline)
    if upload:
        client.log_artifacts(parent.info.run_id, str(out_dir), "report")
    for path in report.files:
        print(f"wrote {path}")
    for line in report.skipped:
        print(line)
    return report


def cli(argv: list[str], prog: str = "python src/report.py") -> Report:
    """main() from the command line: a refusal (its one `error: ...` line) exits 2, as train.py's bad input does; it
    exited 1, which reads as a report that failed."""
    try:
        return main(argv, prog)
    except SystemExit as stop:
        if not isinstance(stop.code, str):
            raise
        print(stop.code, file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":  # python -m rlhflab.report: as python src/report.py (it did nothing and exited 0)
    cli(sys.argv[1:], prog="python -m rlhflab.report")
