"""Names shared by the package, the Hydra sweep plugin (plugins/) and the report: one home; with them the URIs
of MLflow stores (sqlite_path, redact, check_server).

Imported by Hydra's plugin scan at every start, so it imports nothing heavy.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections import Counter

# Set by the sweep callback so that each job's run becomes a child of the sweep's parent run.
# The evaluations a run's closing metrics hold (train's: the gold reward, or the reward where the task has no gold_fn,
# before and after, and the KL), what optimized_metric may name of them: checked before the run, a typo (eval/gld)
# trained the whole run, or every job of a sweep, and then failed
EVAL_METRICS = ("eval/gold_reward", "eval/gold_reward_before", "eval/reward", "eval/reward_before", "eval/kl")
PARENT_RUN_ENV = "RLHFLAB_MLFLOW_PARENT_RUN_ID"
# Set by it too: what the sweep varies (JSON {key: values as typed}), so that a job names its value as apart from
# its siblings' (/x/a/policy beside /y/a/policy is x/a/policy, not a/policy as each job alone would say).
SWEPT_ENV = "RLHFLAB_SWEPT_PARAMS"
# Tag on a sweep's parent run.
SWEEP_TAG = "rlhflab.sweep"
# Config groups whose choice every run carries as a tag of the same name.
RUN_TAG_GROUPS = ("algo", "memory", "mode", "model", "reward", "task")
# The groups a default run name is made of.
RUN_NAME_GROUPS = ("algo", "memory", "mode")


def model_tag(model) -> str:
    """The run's `model` tag: the preset's name, or, where a preset that builds its model (`model.arch`, e.g.
    model=tiny) was given `model.name_or_path`, that model's own name (EleutherAI/pythia-410m -> pythia-410m):
    the run was tagged 'tiny' whatever it trained."""
    path = model.get("name_or_path")
    if path and model.get("arch"):
        return str(path).rstrip("/").rpartition("/")[2] or str(path)
    return str(model.name)


def default_run_name(tags: dict[str, str]) -> str:
    """`<algo>-<memory>-<mode>` from a run's tags (those present)."""
    return "-".join(tags[k] for k in RUN_NAME_GROUPS if k in tags)

# Tags the sweep callback writes and the report reads.
SWEEP_JOB_TAG = f"{SWEEP_TAG}.job"  # on a child: its job number
SWEEP_OVERRIDES_TAG = f"{SWEEP_TAG}.overrides"  # on a child: its overrides; on the parent: the sweep's
SWEEP_METRIC_TAG = f"{SWEEP_TAG}.metric"  # on the parent: the metric that picks the best child
SWEEP_BEST_RUN_NAME_TAG = f"{SWEEP_TAG}.best_run_name"
SWEEP_OBJECTIVE_TAG = f"{SWEEP_TAG}.objective"  # on the parent: what OBJECTIVE is, in words
RUN_RECORD = "mlflow_run.json"  # in a run's output directory: its MLflow run id, tracking URI and experiment
SWEEP_MOVED_FROM_TAG = f"{SWEEP_TAG}.moved_from"  # on a job's run a later sweep continued: the first parent it was under
SWEEP_CONTINUED_BY_TAG = f"{SWEEP_TAG}.continued_by"  # on a parent: the later sweep its jobs' runs moved to
ERROR_TAG = "rlhflab.error"  # on a FAILED run: what ended it, in one line (`<type>: <message>`)
STOP_TAG = "rlhflab.stopped"  # on a KILLED run: what stopped it (`stopped by SIGPIPE (its output pipe was closed)`)
# On a run and a sweep's parent: the process that runs it (process_identity), so that a later run or sweep can tell
# one left RUNNING by a process that is gone (SIGKILL, the OOM killer: no exit hook ran) from one still running.
PROCESS_TAG = "rlhflab.process"
MAX_TAG = 5000  # MLflow caps tag values (8000 chars); error messages are kept below it
OBJECTIVE = "sweep/objective"  # on each job's run, with a KL budget (kl_budget): the value its sweeper was told

# Overrides that change where things are logged or shown, not what is trained: left out of run names.
NOT_IN_NAMES = ("logger.", "hydra.", "trainer.enable_progress_bar", "cache_dir", "output.", "checkpoint.", "resume")
GROUP_NAMES = ("task", "model", "algo", "reward", "memory", "mode", "off_policy", "generator", "trainer", "experiment", "debug")
MAX_RUN_NAME = 250


HYDRA_ESCAPE = re.compile(r"\\(.)")  # Hydra's sweepers escape : , = ( ) [ ] { } and spaces in a job's values


def clipped(text: str, limit: int) -> str:
    """`text` cut to `limit` characters at a space, with '...' where it was cut (not mid-value: 'fn=reward.py:'),
    unless that leaves less than half of it: one long value named a run 'rloo ...'."""
    if len(text) <= limit:
        return text
    head = text[: limit - 4]
    at_space = head.rpartition(" ")[0]
    return (at_space if len(at_space) >= limit // 2 else head) + " ..."


def short_override(override: str, keys: int = 1, among: str | None = None) -> str:
    """A setting by its last key (`keys` last parts of it) and a path by its last part (the whole path is a param):
    `algo.kl_coef=0.1` -> `kl_coef=0.1`, `model.sft_path=/runs/a/ckpt` -> `sft_path=ckpt` (a saved
    policy with its run's directory: `/runs/a/policy` -> `a/policy`; sweep values apart: `/x/a/ckpt,/y/a/ckpt` ->
    `x/a/ckpt,y/a/ckpt`; a sweep job's own value as apart from the sweep's values `among`), a long decimal to 3
    significant digits, `rl.lr=0.0006380556092044456` -> `lr=0.000638` (run names, sweep names, plot labels)."""
    key, _, value = override.partition("=")
    values = _values(value)
    apart = set(values) | set(_values(among) if among else ())
    parts = 1
    while len({_short_value(v, parts) for v in apart}) < len(apart) and parts < 8:
        parts += 1  # /runs/a/policy,/runs/b/policy: a/policy,b/policy (both were named policy)
    return f"{'.'.join(key.split('.')[-keys:])}={','.join(_short_value(v, parts) for v in values)}"


def _values(value: str) -> list[str]:
    """A sweep's list, each value on its own (a,b: the path shortened across the comma lost one value and the list),
    not range(1,3) / interval(0,1); a sweep job's escaped comma (a\\,b) is one value, and so is a list ([a,b],[c]:
    two values)."""
    return [HYDRA_ESCAPE.sub(r"\1", v) for v in _top_level(value)] if "(" not in value else [value]


def _top_level(value: str) -> list[str]:
    """`value` split at its commas outside brackets and not escaped."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(value):
        depth += (c in "[{") - (c in "]}")
        if c == "," and depth == 0 and (i == 0 or value[i - 1] != "\\"):
            parts.append(value[start:i])
            start = i + 1
    return [*parts, value[start:]]


# What rlhflab names every run's saved model (`<run dir>/policy`): named by it alone, every sft_path was `policy`
SAVED_NAMES = ("policy", "merged")  # (merged: policy/merged, a LoRA policy merged into its base)


def _short_value(value: str, parts: int = 1) -> str:
    if value.startswith("[") and value.endswith("]"):  # a list's items each (reward.fns=[/x/a.py:f,/x/b.py:g])
        return f"[{','.join(_short_value(v.strip(), parts) for v in _top_level(value[1:-1]))}]"
    if value.startswith(("/", "./", "../", "~")):
        path = value.rstrip("/").split("/")
        keep = max(parts, 2 if path[-1] in SAVED_NAMES else 1)
        return "/".join(p for p in path[-keep:] if p) or value
    if len(value) > 8 and re.fullmatch(r"-?\d*\.\d+(e-?\d+)?", value):  # an Optuna trial's 0.08025955666793813
        return f"{float(value):.3g}"
    return value


def run_name(algo: str, overrides: list[str], swept: dict[str, str] | None = None) -> str:
    """A run name that carries what this run changed: the algorithm, then each command-line override,
    a group choice by its option (`mode=async` -> async; an option named `default` by its group: `debug=default`
    -> debug) and a value by its last key (`rl.lr=3e-4` -> lr=3e-4), or its last two where two keys end alike
    (`stages.sft.epochs=2 stages.rm.epochs=4` -> sft.epochs=2 rm.epochs=4), a path by its last part
    (`model.sft_path=/runs/a/policy` -> sft_path=a/policy). A key given twice is named once, with the value Hydra
    keeps (the last). In a sweep, a path is named as apart from the other values of its key there (`swept`).

    >>> run_name("online_dpo", ["algo=online_dpo", "mode=async", "staleness=2", "rl.lr=3e-4", "logger.run_name=x"])
    'online_dpo async staleness=2 lr=3e-4'
    >>> run_name("rloo", ["debug=default", "memory=lora"])
    'rloo debug lora'
    """
    chosen: dict[str, str] = {}  # key -> value, in the order keys first appear
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        value = HYDRA_ESCAPE.sub(r"\1", value)  # a sweep job's reward.py\:score, as Hydra's sweeper writes it
        if not key.startswith(NOT_IN_NAMES) and key != "algo":
            chosen[key] = value
    ends = Counter(key.rpartition(".")[2] for key in chosen if key not in GROUP_NAMES)
    parts = [algo]
    for key, value in chosen.items():
        if key in GROUP_NAMES:
            parts.append(key if value == "default" else value)
        else:
            parts.append(short_override(f"{key}={value}", keys=1 if ends[key.rpartition('.')[2]] == 1 else 2,
                                        among=(swept or {}).get(key)))
    return clipped(" ".join(parts), MAX_RUN_NAME)


def named_run(given: str | None, algo: str, overrides: list[str], swept: dict[str, str] | None = None) -> str:
    """A run's name: logger.run_name where given, else run_name(...). In a sweep (`swept`) a given name is followed
    by what this job sweeps: -m algo=rloo,grpo logger.run_name=ablation named every child 'ablation'.

    >>> named_run("ablation", "grpo", ["algo=grpo", "seed=1", "logger.run_name=ablation"], {"algo": "rloo,grpo"})
    'ablation grpo'
    """
    if not given or not swept:
        return given or run_name(algo, overrides, swept)
    mine = [o for o in overrides if o.lstrip("+~").partition("=")[0] in swept and not o.startswith("algo=")]
    what = run_name(algo if "algo" in swept else "", mine, swept).strip()
    return clipped(f"{given} {what}", MAX_RUN_NAME) if what else given


def home_expanded(value: str) -> str:
    """A path setting with its leading `~` (or a sqlite URI's `sqlite:///~`) made the home directory: Hydra and
    the shell leave a quoted one as it is, and a directory named `~` would be made in the working directory."""
    import os

    if value.startswith("sqlite:///~"):
        return "sqlite:///" + os.path.expanduser(value.removeprefix("sqlite:///"))
    return os.path.expanduser(value) if value.startswith("~") else value


def sqlite_path(tracking_uri: str):
    """The database file of a `sqlite:///` tracking URI (a Path), or None for any other store."""
    from pathlib import Path

    uri = home_expanded(tracking_uri)
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def absolute_uri(tracking_uri: str) -> str:
    """`tracking_uri` with a relative sqlite path made absolute (sqlite:///mlflow.db is relative to the working
    directory): what a later run started from elsewhere needs to find the store."""
    db = sqlite_path(tracking_uri)
    return f"sqlite:///{db.absolute()}" if db is not None and not db.is_absolute() else tracking_uri


CREDENTIAL = re.compile(r"(\b[a-zA-Z][\w+.-]*://[^:/@\s]*:)[^@\s/]+@")


def redact(text: str) -> str:
    """Text with the password of every URI in it replaced by *** (user:password@host -> user:***@host),
    so a credential never reaches a log line, a param, a tag or an artifact."""
    return CREDENTIAL.sub(r"\1***@", text)


def behind_server(artifact_location: str, tracking_uri: str) -> bool:
    """Files an MLflow server keeps (mlflow-artifacts:/..., an experiment made through `mlflow server`), which a
    store URI other than that server's http(s):// one (its sqlite:/// database opened directly) cannot reach."""
    return str(artifact_location).startswith("mlflow-artifacts:") and not tracking_uri.startswith(("http://", "https://"))


def check_server(tracking_uri: str, timeout_s: float = 10.0) -> None:
    """An http(s) tracking URI with no server behind it: MLflow's client retries every request with a growing
    backoff, so a run sat for minutes printing 'Retrying (Retry(total=...' lines before it failed (and a timeout's
    SIGTERM then said its MLflow run was KILLED, which never existed). One request to the server's /health, no
    retries: a refused or unanswered connection is one line. Any HTTP answer (a proxy's 404 too) is left to MLflow."""
    import urllib.error
    import urllib.parse
    import urllib.request

    from rlhflab.errors import ConfigError

    if not tracking_uri.startswith(("http://", "https://")):
        return
    parts = urllib.parse.urlsplit(tracking_uri)
    bare = parts._replace(netloc=parts.netloc.rpartition("@")[2])  # no user:password@ (urllib resolves it as a host)
    try:
        urllib.request.urlopen(bare.geturl().rstrip("/") + "/health", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError) as err:
        why = getattr(err, "reason", err)
        raise ConfigError(f"logger.tracking_uri: no MLflow server answers at {redact(tracking_uri)} ({why}); start it "
                          "(mlflow server --backend-store-uri sqlite:///mlflow.db --host HOST --port PORT), or log to "
                          "a file: logger.tracking_uri=sqlite:///mlflow.db") from None


# What `import mlflow` loads and no rlhflab run uses: MLflow registers a pandas dataset type and an HDFS artifact store
# when pandas and pyarrow import, and skips both where they do not (mlflow-skinny, which has neither). Together they
# were 62-70 MB of every run's peak RSS and ~0.4 s of its start (README, "Against TRL"; benchmarks/import_rss.py).
MLFLOW_UNUSED = ("pandas", "pyarrow")
HDFS_SCHEMES = ("hdfs", "viewfs")  # MLflow's HDFS artifact store, the one user of pyarrow at a run's use


def import_mlflow():
    """`import mlflow` as a run needs it: without pandas and pyarrow where nothing imported them yet. They are hidden
    from MLflow's first import only, so a reward function, the report or HF datasets import them as usual after it.
    Call before the process's first mlflow import; later calls do nothing. -> the mlflow module."""
    import sys

    if "mlflow" not in sys.modules:
        hidden = [name for name in MLFLOW_UNUSED if name not in sys.modules]
        for name in hidden:
            sys.modules[name] = None  # its import raises ImportError, which MLflow's optional imports catch
        try:
            import mlflow  # noqa: F401
        finally:
            for name in hidden:
                if sys.modules.get(name, 0) is None:
                    del sys.modules[name]
    return sys.modules["mlflow"]


def ready_artifact_store(artifact_uri: str) -> None:
    """Where a run's artifacts go to HDFS, the HDFS store MLflow skipped without pyarrow (import_mlflow) is loaded
    again, now with it: reloading runs the module anew in its own namespace, so the class MLflow registered finds
    pyarrow's names there."""
    import sys
    from urllib.parse import urlparse

    module = sys.modules.get("mlflow.store.artifact.hdfs_artifact_repo")
    if urlparse(str(artifact_uri)).scheme in HDFS_SCHEMES and module is not None and not hasattr(module, "HadoopFileSystem"):
        import importlib

        importlib.reload(module)


def _started(pid: int | str) -> str | None:
    """When process `pid` started, in clock ticks after boot (/proc/PID/stat field 22); None without it."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[19]  # after the command name, which may hold spaces
    except (OSError, IndexError):
        return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def process_identity() -> str:
    """This process, for PROCESS_TAG (JSON): its host (for people), the kernel's boot id, its pid namespace, pid and
    start time. A pid alone names another process once it is reused; the start time tells them apart."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = None
    ident = {"host": socket.gethostname(), "boot": _read("/proc/sys/kernel/random/boot_id"), "pid_ns": namespace,
             "pid": os.getpid(), "start": _started("self")}
    return json.dumps({k: v for k, v in ident.items() if v is not None}, separators=(",", ":"))


def process_gone(tag: str | None) -> bool:
    """Whether the process a PROCESS_TAG names is certainly gone: it ran in this boot of this kernel (the boot id is
    random at each boot, so no other machine has it) and pid namespace, and no process of its pid has its start time
    now. Anything else (another machine, or this one before a restart, since a host name can be shared; another pid
    namespace; a tag without these, from a run made before the tag or on a platform without /proc): False, as
    nothing here can tell."""
    try:
        ident = json.loads(tag) if tag else {}
        pid, start, boot, namespace = int(ident.get("pid")), ident.get("start"), ident.get("boot"), ident.get("pid_ns")
    except (ValueError, TypeError, AttributeError):
        return False
    try:
        here = os.readlink("/proc/self/ns/pid")
    except OSError:
        return False
    if None in (start, boot) or boot != _read("/proc/sys/kernel/random/boot_id") or namespace != here:
        return False
    return _started(pid) != start
