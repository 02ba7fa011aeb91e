"""Where a Python program's peak RSS goes, by package: the resident memory each imported module's loading added.

    python benchmarks/import_rss.py [--top N] [--json FILE] -- SCRIPT [ARGS...]
    python benchmarks/import_rss.py -- src/train.py reward=rule trainer.max_steps=30

Runs SCRIPT in this process (as `python SCRIPT ARGS`) and measures, around every module's load (its creation and
the execution of its body, `importlib._bootstrap._load_unlocked`), how much the process's RSS grew. A module's own
share excludes the modules it imported while loading; each package's figure is the sum of its modules' own shares.
What the program allocates outside any import (models, tensors, allocator pools) is the rest of the peak.
Only this process is measured: processes the program starts (rlhflab's async generator, a reference process)
are not; benchmarks/vs_trl.py reports a process tree's PSS for those.

Printed: the peak RSS (VmHWM), RSS at start, the total added by imports, the rest, and the packages that added
the most, each with the module whose code first imported it. Used in the README to say where rlhflab's peak RSS
goes against TRL's (issue 14): `--json` keeps the full table.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
from collections import Counter
from pathlib import Path

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb(statm) -> float:
    statm.seek(0)
    return int(statm.read().split()[1]) * _PAGE / 2**20


def peak_rss_mb() -> float:
    """This process's own peak RSS (VmHWM). Not ru_maxrss: a child forked from a large parent (pytest, a shell
    holding a model) reports the parent's RSS at the fork as its own ru_maxrss, even after exec."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def importer() -> str:
    """The module whose code runs the import statement: the first frame outside the import system and this file."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen") or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return "?" if frame is None else frame.f_globals.get("__name__", "?")


class ImportMeter:
    """Wraps the import system's module loader; records each module's own RSS growth while it loads."""

    def __init__(self) -> None:
        self.statm = open("/proc/self/statm", "rb", buffering=0)
        self.own: Counter[str] = Counter()      # module name -> MB added by its own load (children excluded)
        self.first_importer: dict[str, str] = {}  # top-level package -> the module whose code first imported it
        self.stack: list[list] = []              # [name, start MB, children's MB] of the loads in progress
        self._orig = None

    def install(self) -> None:
        import importlib._bootstrap as bootstrap  # the frozen import system itself; its functions look this up

        self._orig = orig = bootstrap._load_unlocked

        def load(spec):
            name = spec.name
            top = name.split(".")[0]
            if top not in self.first_importer:
                self.first_importer[top] = importer()
            frame = [name, rss_mb(self.statm), 0.0]
            self.stack.append(frame)
            try:
                return orig(spec)
            finally:
                self.stack.pop()
                total = rss_mb(self.statm) - frame[1]
                self.own[name] += total - frame[2]
                if self.stack:
                    self.stack[-1][2] += total

        bootstrap._load_unlocked = load

    def uninstall(self) -> None:
        import importlib._bootstrap as bootstrap

        if self._orig is not None:
            bootstrap._load_unlocked = self._orig

    def by_package(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for name, mb in self.own.items():
            out[name.split(".")[0]] += mb
        return out


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(usage="import_rss.py [--top N] [--json FILE] -- SCRIPT [ARGS...]", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--top", type=int, default=20, help="packages to print (default 20)")
    p.add_argument("--json", type=Path, default=None, help="write every package's and module's MB here")
    if "--" not in argv and not {"-h", "--help"} & set(argv):  # argparse said only 'unrecognized arguments: ...'
        p.error("give the program after --, e.g. import_rss.py -- src/train.py reward=rule")
    a = p.parse_args(argv[:cut])  # --help here: the whole docstring
    if a.top < 0:  # a negative count dropped the last rows without a word
        p.error(f"--top {a.top}: give 0 or more")
    if a.json is not None:  # found only when it was written, after the whole program: a traceback, the JSON lost
        if a.json.is_dir():
            p.error(f"--json {a.json}: a directory; give a file path")
        if not a.json.parent.is_dir() or not os.access(a.json.parent, os.W_OK | os.X_OK):
            p.error(f"--json {a.json}: {a.json.parent} is not a writable directory")
    script, *args = argv[cut + 1:] or [None]
    if script is None or not Path(script).is_file():
        raise SystemExit(f"import_rss.py: no script file {script!r} after --" if script else "import_rss.py: no script after --")
    meter = ImportMeter()
    start = rss_mb(meter.statm)
    t0 = time.perf_counter()
    sys.argv = [script, *args]
    sys.path[0] = str(Path(script).resolve().parent)  # as `python SCRIPT` sets it
    meter.install()
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # exit as `python SCRIPT` would: a message goes to stderr with status 1
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        meter.uninstall()
        wall = time.perf_counter() - t0
        peak = peak_rss_mb()
        packages = meter.by_package()
        imported = sum(packages.values())
        lines = [f"peak RSS {peak:.0f} MB: {start:.0f} MB at start + {imported:.0f} MB by imports "
                 f"({len(meter.own)} modules) + {peak - start - imported:.0f} MB the rest; {wall:.1f} s",
                 f"{'package':24s} {'MB':>7s}  first imported by"]
        for top, mb in packages.most_common(a.top):
            lines.append(f"{top:24s} {mb:7.1f}  {meter.first_importer.get(top, '?')}")
        print("\n".join(lines), file=sys.stderr, flush=True)
        if a.json:
            a.json.write_text(json.dumps({"script": script, "args": args, "peak_rss_mb": peak, "start_mb": start,
                                          "imports_mb": imported, "exit_code": code,
                                          "packages_mb": dict(packages.most_common()),
                                          "first_importer": meter.first_importer,
                                          "modules_mb": dict(meter.own.most_common())}, indent=1))
    raise SystemExit(code)


if __name__ == "__main__":
    main()
