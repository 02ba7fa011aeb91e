"""Drawing for the sweep report: figures from prepared series, with every label inside the frame.

report.py decides what to show (which runs, their names, how they group, what a caption says);
this module only draws. Legends sit outside the axes, right of them, so they never cover a curve
or a point; point labels run towards the middle of the axes and bar labels get headroom, so the
frame never cuts them; `save` crops the file to everything drawn (bbox_inches="tight").
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

LINESTYLES = ("-", "--", ":", "-.")
LEGEND_ROWS = 20  # entries per legend column
NOTE_WIDTH = 24  # characters per line of a point label


@dataclass
class Curve:
    label: str
    x: list[float]
    y: list[float]


@dataclass
class Panel:
    ylabel: str
    curves: list[Curve] = field(default_factory=list)
    title: str = ""


@dataclass
class Point:
    x: float
    y: float
    note: str


@dataclass
class Bar:
    group: str  # the x tick the bar stands at, e.g. "rloo\nfull"
    label: str  # the legend entry that tells apart the runs of one group; "" where each group has one run
    value: float


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a server
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> None:
    fig.savefig(path, dpi=120, bbox_inches="tight", pad_inches=0.1)
    pyplot().close(fig)


def _styles(labels: list[str]) -> dict[str, dict]:
    """One colour per label (past the colour map's size, with another line style), the same in every panel."""
    unique = list(dict.fromkeys(labels))
    cmap = pyplot().get_cmap("tab10" if len(unique) <= 10 else "tab20")
    return {label: {"color": cmap(i % cmap.N), "linestyle": LINESTYLES[(i // cmap.N) % len(LINESTYLES)]}
            for i, label in enumerate(unique)}


def _legend_outside(ax, handles: list, labels: list[str], title: str | None = None) -> None:
    """Right of the axes, top-aligned, in columns of LEGEND_ROWS entries: never over the data. Made after
    the layout, it may reach past the figure's edge: `save` crops to everything drawn, so the file holds it."""
    if labels:
        ax.legend(handles, labels, title=title, loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0,
                  fontsize=7, title_fontsize=7, ncol=math.ceil(len(labels) / LEGEND_ROWS))


def lines(panels: list[Panel], xlabel: str, title: str, order: list[str] = ()):
    """Stacked panels sharing the x axis, one line per curve, one legend for all panels (in `order`, then
    in order of appearance)."""
    plt = pyplot()
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False, figsize=(7, 1.2 + 2.8 * len(panels)))
    axes = list(axes[:, 0])
    styles = _styles([*order, *(c.label for p in panels for c in p.curves)])
    handles = {}
    for ax, panel in zip(axes, panels):
        for c in panel.curves:
            (handles[c.label],) = ax.plot(c.x, c.y, marker="o" if len(c.x) <= 30 else None, markersize=3,
                                          linewidth=1.2, label=c.label, **styles[c.label])
        ax.set(ylabel=panel.ylabel, title=panel.title)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel(xlabel)
    fig.suptitle(title)
    fig.tight_layout()  # before the legend: a long legend would push the panels apart; `save` widens the file for it
    shown = [label for label in styles if label in handles]
    _legend_outside(axes[0], [handles[label] for label in shown], shown)
    return fig


def scatter(groups: dict[str, list[Point]], xlabel: str, ylabel: str, title: str, legend_title: str | None = None):
    """One colour per group, every point labelled with its note."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in groups.items():
        ax.scatter([p.x for p in points], [p.y for p in points], label=name, zorder=3)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.margins(0.1)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    for points in groups.values():  # after the limits are final: each label's side depends on them
        for p in points:
            _note_inside(ax, p)
    _legend_outside(ax, *ax.get_legend_handles_labels(), title=legend_title)
    return fig


def _note_inside(ax, p: Point) -> None:
    """Label a point on the side that faces the middle of the axes, so its text runs inwards, not off the frame."""
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    left, down = p.x > (x0 + x1) / 2, p.y > (y0 + y1) / 2
    ax.annotate(textwrap.fill(p.note, NOTE_WIDTH), (p.x, p.y), textcoords="offset points",
                xytext=(-4 if left else 4, -4 if down else 4), ha="right" if left else "left",
                va="top" if down else "bottom", fontsize=7)


def bars(bars: list[Bar], ylabel: str, title: str, legend_title: str | None = None):
    """Bars side by side per group (one colour per label when bars carry labels), each with its value on top."""
    plt = pyplot()
    groups = {g: [b for b in bars if b.group == g] for g in dict.fromkeys(b.group for b in bars)}
    labelled = any(b.label for b in bars)
    colours = {label: style["color"] for label, style in _styles([b.label for b in bars]).items()} if labelled else {}
    rotate = len(bars) > 8  # values written upright would run into each other
    fig, ax = plt.subplots(figsize=(min(16, max(4.0, 0.45 * len(bars) + 0.4 * len(groups) + 2)), 4))
    width = 0.8 / max(len(members) for members in groups.values())
    shown = {}
    for gi, members in enumerate(groups.values()):
        for k, b in enumerate(members):
            x = gi + (k - (len(members) - 1) / 2) * width  # the group's bars centred on its tick
            shown.setdefault(b.label, _bar(ax, x, width, b, colours.get(b.label, "tab:blue"), rotate))
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set(ylabel=ylabel, title=title)
    ax.margins(y=0.2 if rotate else 0.1)  # headroom for the values above the tallest bar
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    if labelled:
        _legend_outside(ax, list(shown.values()), list(shown), title=legend_title)
    return fig


def _bar(ax, x: float, width: float, b: Bar, colour, rotate: bool):
    container = ax.bar([x], [b.value], width * 0.95, color=colour, label=b.label)
    ax.bar_label(container, [_value(b.value)], fontsize=7, padding=2, rotation=90 if rotate else 0)
    return container


def _value(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
