"""Your own functions named in a config (`package.module:function` or `path/to/file.py:function`),
and calling them the way TRL calls reward functions."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

from rlhflab.errors import ConfigError, RewardError, no_such_file


FLOAT32_MAX = 3.4028234663852886e38  # rewards are float32 tensors


def load_callable(spec: str, key: str) -> Callable:
    """The function `spec` names; one-line ConfigError naming `key` when it cannot be had."""
    module_name, sep, attr = str(spec).rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}: {spec!r} is not 'module:function' or 'path/to/file.py:function'")
    try:
        if module_name.endswith(".py") or "/" in module_name:
            path = Path(module_name).expanduser()
            if not path.is_file():
                raise ConfigError(f"{key}: {no_such_file(path)} (from {spec!r}); give an existing .py file or an importable module")
            name = f"rlhflab_user_{path.stem}_{abs(hash(str(path.resolve())))}"
            module = sys.modules.get(name)
            if module is None:
                folder = str(path.resolve().parent)
                if folder not in sys.path:  # its own imports of files beside it, as `python file.py` finds them;
                    sys.path.append(folder)  # last, so it shadows nothing installed
                loader_spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(loader_spec)
                sys.modules[name] = module  # before exec: pickling (a spawned generator) finds it again
                loader_spec.loader.exec_module(module)
                for imported, origin in imported_elsewhere(path):
                    raise ConfigError(f"{key}: '{path}' imports '{imported}', which is beside it, but this process already "
                                      f"has a '{imported}' from {origin} (a module name is imported once per process, e.g. "
                                      "by another reward file); rename one of them")
        else:
            here = str(Path.cwd())
            if "" not in sys.path and here not in sys.path:  # a package beside you, as `python -m` would find it;
                sys.path.append(here)                      # last, so it shadows nothing installed
            module = importlib.import_module(module_name)
    except ConfigError:
        raise
    except Exception as err:
        said = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        missing = getattr(err, "name", None) if isinstance(err, ModuleNotFoundError) else None
        if missing is not None and (module_name == missing or module_name.startswith(missing + ".")):  # the name itself
            raise ConfigError(f"{key}: cannot import {module_name!r} ({said}); check the name, or give "
                              "path/to/file.py:function") from None
        # It was found, and its own code failed (an import of a package not installed, a syntax error): the name is fine.
        raise ConfigError(f"{key}: {module_name!r} was found, but importing it failed{_where(err)} ({said}); "
                          + ("install that package" if missing else "fix that code")) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        functions = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                           and getattr(v, "__module__", None) == module.__name__)
        raise ConfigError(f"{key}: {module_name!r} has no function {attr!r}; "
                          + (f"its functions are {', '.join(functions)}" if functions else "it defines no functions"))
    return fn


def source_keys(functions: list[tuple[str, Callable]]) -> dict[str, str]:
    """A hash of the file that defines each (setting, function), by `<file> (<setting>)`: a checkpoint keeps them,
    so a resume says that a function was edited since (its steps before used the old one). A function whose file
    cannot be read (a builtin, a C extension) is left out."""
    import hashlib

    keys = {}
    for key, fn in functions:
        try:
            path = Path(inspect.getsourcefile(inspect.unwrap(fn)))
            keys[f"{path} ({key})"] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        except (TypeError, OSError):
            continue
    return keys


def imported_elsewhere(path: Path) -> list[tuple[str, str]]:
    """(name, its file) for each module `path` imports whose file is beside it, but which the process holds from
    another place: two reward files in two folders, each importing its own helpers.py, both got the first's."""
    import ast

    folder = path.resolve().parent
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return []
    names = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    names |= {node.module.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module}
    clashes = []
    for name in sorted(names):
        beside = (folder / f"{name}.py").is_file() or (folder / name / "__init__.py").is_file()
        origin = getattr(sys.modules.get(name), "__file__", None)
        if beside and origin and not Path(origin).resolve().is_relative_to(folder):
            clashes.append((name, origin))
    return clashes


def _where(err: BaseException) -> str:
    """' at <file>:<line>', the user's code where an import failed or a function raised: the innermost frame outside
    Python's own library and the installed packages (a ValueError from NumPy is placed at the user's line that called
    it), else the innermost outside importlib and this file."""
    import sysconfig
    import traceback

    if isinstance(err, SyntaxError) and err.filename:
        return f" at {err.filename}:{err.lineno}"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "importlib" not in f.filename
              and not f.filename.startswith("<frozen") and Path(f.filename).resolve() != Path(__file__).resolve()]
    libraries = tuple({str(Path(sysconfig.get_paths()[k]).resolve()) for k in ("stdlib", "purelib", "platlib")})
    own = [f for f in frames if not str(Path(f.filename).resolve()).startswith(libraries)]
    frame = (own or frames or [None])[-1]
    return f" at {frame.filename}:{frame.lineno}" if frame else ""


def traceback_text(err: BaseException, skip: int = 0) -> str:
    """The traceback of `err` without its first `skip` frames (rlhflab's own call of the user's function), for
    train.log: the error's one line names the innermost frame; the file keeps the whole of it."""
    import traceback

    tb = err.__traceback__
    for _ in range(skip):
        tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb
    return "".join(traceback.format_exception(type(err), err, tb)).rstrip()


async def _awaited(awaitable):
    return await awaitable


# What TRL gives a reward function beside prompts, completions and the dataset's columns: each completion's token ids
# (up to and including its EOS) and the trainer's state (global_step, max_steps). reward=function gives them to a
# function that names them or takes **kwargs; task.gold_fn judges held-out text and is given neither.
GIVEN = ("completion_ids", "trainer_state")


def takes(fn: Callable, name: str) -> bool:
    """fn has a parameter `name`, or **kwargs."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C function: given nothing it might not take
        return False
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def check_signature(fn: Callable, key: str, columns: list[str], source: str, given: tuple[str, ...] = ()) -> None:
    """fn can be called as call_reward calls it, fn(prompts=..., completions=..., **columns), with the columns of
    `source` (a split's file), and `given` (GIVEN, for reward functions) where it takes them: one that cannot (no
    **kwargs beside a column, or a parameter the file has no column for) failed in its TypeError once the MLflow run
    was made, the model loaded and SFT trained."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: left to its call
        return
    try:
        signature.bind(prompts=[], completions=[], **{c: [] for c in columns},
                       **{g: None for g in given if takes(fn, g)})
    except TypeError as err:
        name = getattr(fn, "__name__", "the function")
        missing = re.search(r"missing a required argument: '(\w+)'", str(err))
        if missing and missing.group(1) in GIVEN and missing.group(1) not in given:
            arg = missing.group(1)
            raise ConfigError(f"{key}: {name}{signature} needs {arg}, which reward functions are given (reward.fn, "
                              f"reward.fns, as in TRL) but {key} is not: it is called with prompts, completions and the "
                              f"columns of {source}; give {arg} a default (e.g. None)") from None
        raise ConfigError(f"{key}: {name}{signature} cannot be called as {name}(prompts=..., completions=..., **columns) "
                          f"with the columns of {source} ({', '.join(columns) or 'none'}): {err}; take prompts and "
                          "completions by name, and **kwargs for the columns it does not use") from None


def call_reward(fn: Callable, name: str, prompts: list, completions: list, kwargs: dict, rows: list[int] | None,
                source: str | None = None, no_none: str | None = None) -> "torch.Tensor":
    """fn's values as an (n,) float tensor (NaN where it returned None: it does not apply there, as in TRL), or a
    one-line RewardError naming `name` (the function and its setting, e.g. "reward function score
    (reward.fn=rewards.py:score)") and the row. `rows`: each prompt's row in `source` (e.g. "the held-out
    prompts of 'eval.jsonl' (task.eval_path)"), the file whose columns reached `fn`. `no_none`: why None is refused
    here, and the fix (task.gold_fn: its mean over a None was NaN)."""
    n = len(completions)
    of = f" of {source}" if source else ""

    def row(i: int) -> str:
        return (f"row {rows[i]}" if rows is not None else f"completion {i}") + of

    try:
        values = fn(prompts=prompts, completions=completions, **kwargs)
        if inspect.isawaitable(values):  # an `async def` function, as TRL takes them: its coroutine, run to its end
            values = asyncio.run(_awaited(values))
    except Exception as err:
        failed = RewardError(f"{name} raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                             f"{_where(err)} (on {n} completions{of}; first prompt {str(prompts[0])[:60]!r})")
        failed.detail = traceback_text(err, skip=1)  # from the function's own frame on; main writes it to train.log
        raise failed from None
    if isinstance(values, (str, bytes, dict)):  # a str was read as one reward per character, a dict by its keys
        raise RewardError(f"{name} returned {type(values).__name__}, not a list of numbers (on {n} "
                          f"completions{of}; first prompt {str(prompts[0])[:60]!r})")
    try:
        values = list(values)
    except TypeError:
        raise RewardError(f"{name} returned {type(values).__name__}, not a list of numbers") from None
    if len(values) != n:
        raise RewardError(f"{name} returned {len(values)} values for {n} completions; return one per completion")
    out = []
    for i, v in enumerate(values):
        if v is None and no_none:
            raise RewardError(f"{name} returned None for {row(i)} (prompt {str(prompts[i])[:60]!r}); {no_none}")
        if v is None:  # TRL's convention: the function does not apply to this completion
            out.append(math.nan)
            continue
        try:
            if isinstance(v, (str, bytes)):  # '0.5' is text: a number the function meant, or a label it did not
                raise TypeError
            v = float(v)
        except (TypeError, ValueError):
            v = f"{type(v).__name__} {str(v)[:40]!r}"
        if isinstance(v, str) or not math.isfinite(v) or abs(v) > FLOAT32_MAX:  # 1e39 was inf in the float32 batch
            past = not isinstance(v, str) and math.isfinite(v)
            if past:
                v = f"{v:g}, past float32's {FLOAT32_MAX:.3g},"
            raise RewardError(f"{name} returned {v} for {row(i)} (prompt {str(prompts[i])[:60]!r}, "
                              f"completion {str(completions[i])[:60]!r}); return a finite number"
                              + (" float32 holds" if past else "") + ", or None where it does not apply")
        out.append(v)
    import torch

    return torch.tensor(out, dtype=torch.float32)
