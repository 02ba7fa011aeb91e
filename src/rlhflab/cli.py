"""What `src/train.py` does before Hydra's own main: `--help`, and one-line errors for bad input.

`preflight(argv)` composes the config from the command line exactly as Hydra will,
types and range-checks every value (rlhflab.schema), and on the first problem prints
`error: <key>: <what>; <fix>` and exits with status 2, before torch, transformers or
MLflow are imported and before any MLflow run exists. A sweep (`-m a=1,2 b=x,y`) is
checked job by job (up to MAX_SWEEP_JOBS of them).
"""

from __future__ import annotations

import copy
import itertools
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhflab.errors import ConfigError
from rlhflab.naming import check_server, redact
from rlhflab.schema import SCHEMAS, check, check_own_gpu, check_typed, register, writable_dir

if TYPE_CHECKING:
    from omegaconf import DictConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "conf"
CONFIG_NAME = "train"
MAX_SWEEP_JOBS = 64
# Flags that make Hydra do something other than run the experiment: leave those to Hydra.
HYDRA_FLAGS = ("--cfg", "-c", "--info", "-i", "--hydra-help", "--package", "-p", "--resolve", "--shell-completion", "-sc",
               "--version", "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun")
TYPE_WORDS = {"Integer": "a whole number", "Float": "a number", "Boolean": "true or false", "String": "a string"}


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def preflight(argv: list[str]) -> list[tuple[str, str | None]]:
    """Print help, or check the command line's config; exits on bad input. Returns when all is well, with the
    (logger.tracking_uri, cache_dir) of each job (for store_template.make_aside)."""
    if "--help" in argv or "-h" in argv:
        print(render_help())
        sys.exit(0)
    if any(a.split("=")[0] in HYDRA_FLAGS for a in argv):
        check_shell_completion(argv)
        return []
    overrides = [a for a in argv if not a.startswith("-")]
    register()
    multirun = "-m" in argv or "--multirun" in argv
    try:
        jobs = sweep_jobs(overrides, multirun)
        searches = command_line_searches(overrides) if multirun else {}
    except ConfigError as err:  # a search on the command line that no sweeper can run
        fail(str(err))
    except Exception as err:  # an override Hydra's grammar cannot parse
        fail(composition_error(err, overrides))
    servers: set[str] = set()
    outputs: set[str] = set()  # the fixed output.dir values of the jobs so far
    stores: dict[str, str] = {}  # the MLflow store and experiment of the sweep's first job
    made: dict[tuple[str, str | None], None] = {}  # each job's (store, cache), in order: what preflight returns
    gridded: set[tuple[str, ...]] = set()  # jobs of a preset's grid, whose own grid is this one
    which = {}  # each job's words in a message
    parents: set[tuple[str, ...]] = set()  # jobs that are a preset's grid, not a job of their own
    composed = {}  # each sweep job's config, composed once (check_sweep_jobs composed each job a second time)
    sweeping = multirun
    for job in jobs:
        which[tuple(job)] = f" (sweep job: {' '.join(job)})" if multirun or tuple(job) in gridded else ""
        try:
            cfg = compose(job, hydra=True)
            if tuple(job) not in gridded:
                more = grid_jobs(cfg.hydra, job)
                gridded.update(map(tuple, more))
                jobs.extend(more)
                if more:  # a preset's grid: its jobs run, not this one
                    parents.add(tuple(job))
            sweeping = sweeping or str(cfg.hydra.mode) == "RunMode.MULTIRUN"  # -m, or a preset's hydra.mode
            if sweeping and tuple(job) not in parents:  # for check_sweep_jobs, before sweep_searches takes its hydra node
                composed[tuple(job)] = copy.deepcopy(cfg)
            check_hydra_dirs(cfg.hydra)
            check_optuna(cfg.hydra)
            if searches and optuna_space(cfg.hydra) is None:  # the command line's own words, not a job's
                fail(no_search(searches))
            searched = sweep_searches(cfg)
            check_typed(cfg, searched["choices"])
            check_own_gpu(cfg, searched["choices"])
            check_launcher(searched["choices"])
            check_sweeper(searched["choices"])
            check(cfg)
            searched_keys_exist(cfg, searched)
            if multirun:
                check_one_output_per_job(cfg, searched, outputs)
            if sweeping and tuple(job) not in parents:
                check_one_experiment(cfg, stores)
            if cfg.logger.tracking_uri not in servers:
                servers.add(cfg.logger.tracking_uri)
                check_server(cfg.logger.tracking_uri)
            if tuple(job) not in parents:
                made.setdefault((cfg.logger.tracking_uri, cfg.get("cache_dir")), None)
        except ConfigError as err:
            fail(f"{err}{which[tuple(job)]}")
        except Exception as err:  # Hydra's and OmegaConf's composition errors
            fail(composition_error(err, job) + which[tuple(job)])
    if sweeping:  # a job's own error first: it is the more precise (memory.target_modules=[nope] is wrong in any job)
        check_sweep_jobs({job: words for job, words in which.items() if job not in parents}, composed)
        check_sweep_base(overrides)
    return list(made)


def check_sweep_base(overrides: list[str]) -> None:
    """Hydra composes a sweep's own config before its jobs, from the command line without its sweeps: a swept group
    keeps its default option there. `-m memory=lora,hydra memory.target_modules=[q_proj]` composed in each job,
    passed here, and then stopped in Hydra with 6 lines ending "Key 'target_modules' not in 'FullMemory'", since
    memory=full has no target_modules. One line, with Hydra's own fix: `++key=value` adds the key where it is missing
    (the sweep's own config) and sets it where it is not (each job)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    base = [text for text, one in zip(overrides, parsed) if not one.is_sweep_override()]
    if len(base) == len(overrides):  # no sweep on the command line: the sweep's config is a job's, composed above
        return
    try:
        compose(base)
    except Exception as err:
        found = re.search(r"Could not override '([^']+)'", str(err))
        override = next((o for o in base if found and o.partition("=")[0] == found.group(1)), None)
        if override is None:
            fail(f"{composition_error(err, base)} (in the sweep's own config, which Hydra composes from the command "
                 "line without its sweeps)")
        key = found.group(1)
        group = key.partition(".")[0]
        try:
            choice = compose([o for o in base if o != override], hydra=True).hydra.runtime.choices.get(group)
        except Exception:
            choice = None
        swept = " ".join(t for t, one in zip(overrides, parsed) if one.is_sweep_override() and str(one.get_key_element()) == group)
        default = f"{group}={choice}" if choice else f"the default {group}"
        fail(f"{override}: {default} has no {key}, and Hydra composes the sweep's own config from that default before "
             f"its jobs ({swept or 'the sweeps'} left out); write ++{override}, which adds it there and sets it in "
             "every job")


def check_sweep_jobs(which: dict[tuple[str, ...], str], composed: dict[tuple[str, ...], DictConfig]) -> None:
    """What train(cfg) checks before it loads a model (train.check_job, model.arch on the meta device, the LoRA
    targets of a given model whose config is on this machine: train.check_lora_targets), for each
    job of a sweep before the sweep starts: mode.reference=thread beside memory=lora, model.dtype=float16 with a stage
    to train, reward.weights not one per reward.fn, a model.arch transformers cannot build, or an output.dir holding
    another run's checkpoints or policy passed the schema's check here, and then failed that job at its start as a
    FAILED child run, the sweep going on. Imports torch
    (~3 s, which the sweep's first job pays anyway); ~0.1 s a job (a given model: its modeling code's import once,
    ~20 ms for its skeleton, kept for the jobs that follow). The jobs say their warnings themselves.
    `composed`: each job's config as the preflight composed it (taken, not composed again)."""
    import logging
    import warnings
    from functools import partial

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    from rlhflab.models.build import check_arch, load_tokenizer
    from rlhflab.train import check_job, check_lora_targets, check_new_run_dir, check_sweep_resume_dir

    tokenizers = {}  # the task's own tokenizer, for model.arch's vocabulary: one per task setting
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for number, (job, words) in enumerate(which.items()):
                cfg = composed.pop(job)
                with open_dict(cfg):  # what Hydra's launcher gives a job: ${hydra:job.num} resolves as it will there
                    cfg.hydra.job.num, cfg.hydra.job.id = number, str(number)
                    cfg.hydra.runtime.output_dir = str(Path(cfg.hydra.sweep.dir, str(number)))
                HydraConfig.instance().set_config(cfg)
                sweep_searches(cfg)
                try:
                    plan = check_job(cfg)
                    if cfg.output.dir and not cfg.resume:  # a rerun of `-m ... output.dir=runs/${hydra:job.num}`
                        check_new_run_dir(cfg, Path(cfg.output.dir))
                    elif cfg.resume == "auto":  # the same, to continue it: a job that finished, or one of other settings
                        check_sweep_resume_dir(Path(cfg.output.dir or cfg.hydra.runtime.output_dir), cfg)
                    given = cfg.model.get("sft_path") or cfg.model.get("name_or_path")
                    if given:
                        tokenizer = partial(load_tokenizer, cfg.model.get("tokenizer") or given, given)
                    else:  # one train() builds from model.arch
                        task = OmegaConf.to_yaml(cfg.task)
                        if task not in tokenizers:
                            tokenizers[task] = plan.task.build_tokenizer()
                        check_arch(OmegaConf.to_container(cfg.model.arch, resolve=True), tokenizers[task],
                                   cfg.memory.get("target_modules"))
                        tokenizer = partial(tokenizers.get, task)
                    check_lora_targets(cfg, plan, tokenizer)  # a given model's (or reward model's), on its config
                except ConfigError as err:
                    fail(f"{err}{words or ' (sweep job: ' + ' '.join(job) + ')'}")
    finally:
        logging.disable(logging.NOTSET)
        HydraConfig.instance().cfg = None


def grid_jobs(hydra, job: list[str]) -> list[list[str]]:
    """The jobs of a grid a preset (or hydra.sweeper.params.X=...) gives Hydra's basic sweeper, e.g.
    experiment=sweep_algos, each to be checked as the command line's own are: a typo in one of its values
    ('hydra.sweeper.params.algo="rloo,grop"') failed in Hydra's many lines after the sweep's MLflow parent was made."""
    from hydra.core.override_parser.types import ChoiceSweep
    from omegaconf import OmegaConf

    if str(hydra.mode) != "RunMode.MULTIRUN":
        return []
    given = {o.partition("=")[0].lstrip("+~") for o in job}  # the command line's own values win, as in Hydra
    space = optuna_space(hydra)
    if space is not None:  # Optuna's choice(a,b): each value, as a job would get it (choice(rloo,rlooo) trained a
        # trial, then ended the sweep in Hydra's 'Could not find algo/rlooo'); intervals are checked by check_optuna
        return [[*job, f"{key}={choice}"] for key, parsed in space.items()
                if isinstance(parsed, ChoiceSweep) and key not in given for choice in parsed.list]
    if not str(OmegaConf.select(hydra, "sweeper._target_") or "").endswith("BasicSweeper"):
        return []
    params = OmegaConf.to_container(OmegaConf.select(hydra, "sweeper.params") or OmegaConf.create({}))
    extra = [f"{key}={value}" for key, value in params.items() if key not in given]
    return [j for j in sweep_jobs([*job, *extra], True) if j != job] if extra else []


def sweep_searches(cfg) -> dict:
    """Take Hydra's node off the composed config (the schema's check sees the job's config), keeping what a
    sweep searches: {"params": the sweeper's params of a multirun preset, "choices": the group choices}."""
    from omegaconf import OmegaConf, open_dict

    hydra = cfg.hydra
    multirun = str(hydra.mode) == "RunMode.MULTIRUN"
    searched = {"params": list(OmegaConf.select(hydra, "sweeper.params") or {}) if multirun else [],
                "choices": OmegaConf.to_container(hydra.runtime.choices)}
    with open_dict(cfg):
        del cfg["hydra"]
    return searched


def optuna_space(hydra) -> dict | None:
    """{key: its parsed search (ChoiceSweep, IntervalSweep, ...)} of an Optuna sweeper's params; None for another
    sweeper."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    sweeper = hydra.get("sweeper")
    if sweeper is None or not str(sweeper.get("_target_", "")).endswith("OptunaSweeper"):
        return None
    params = sweeper.get("params")  # null under hydra-optuna-sweeper's own config (hydra/sweeper=optuna)
    params = OmegaConf.to_container(params, resolve=False) if params is not None else {}
    parser = OverridesParser.create()
    return {key: parser.parse_overrides([f"{key}={value}"])[0].value() for key, value in params.items()}


def check_hydra_dirs(hydra) -> None:
    """Hydra makes its run (sweep) directory before rlhflab's code runs, and does not expand '~': quoted past the shell
    and Hydra's grammar ('hydra.run.dir="~/runs/a"') it made a directory named '~' in the working directory, where
    rlhflab's own path settings take '~' for the home directory (schema.check)."""
    from omegaconf import OmegaConf

    dirs = {kind: OmegaConf.to_container(hydra[kind], resolve=False)["dir"] for kind in ("run", "sweep")}
    for kind, value in dirs.items():
        if isinstance(value, str) and value.startswith("~"):
            raise ConfigError(f"hydra.{kind}.dir: '{value}' would be a directory named '~' in the working directory (Hydra "
                              f"does not expand '~'); {home_fix(f'hydra.{kind}.dir', value)}")
        fixed = value.split("${")[0] if isinstance(value, str) else ""  # up to its first interpolation (the time)
        if fixed:  # under a file: Hydra's NotADirectoryError traceback (a sweep's left an empty FAILED parent run)
            writable_dir(f"hydra.{kind}.dir", Path(fixed), make=False)


def check_optuna(hydra) -> None:
    """hydra-optuna-sweeper reads its settings only once the sweep's MLflow parent run is made: n_trials=0, a misspelt
    direction, a log interval from 0 or SQL storage each left an empty FAILED parent and 22-32 lines of traceback."""
    from omegaconf import OmegaConf

    space = optuna_space(hydra)
    if space is None:
        return
    sweeper = hydra.sweeper
    for name in ("n_trials", "n_jobs"):  # n_jobs=0: a ZeroDivisionError
        count = sweeper.get(name)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"hydra.sweeper.{name}={count}: a study needs {'a trial' if name == 'n_trials' else 'a trial per batch'}"
                              " to run; give a whole number, 1 or more")
    rate = sweeper.get("max_failure_rate")
    if not isinstance(rate, (int, float)) or not 0 <= rate <= 1:  # Optuna's bare AssertionError
        raise ConfigError(f"hydra.sweeper.max_failure_rate={rate}: a share of the trials; give a number from 0 to 1")
    direction = OmegaConf.to_container(sweeper, resolve=True).get("direction")
    if isinstance(direction, list) and len(direction) != 1:  # every trial 'Failed experiment', the sweep exit 0
        raise ConfigError(f"hydra.sweeper.direction={direction}: rlhflab's objective is one number (the gold reward, or "
                          "its KL-penalised form); give one direction, maximize")
    for one in direction if isinstance(direction, list) else [direction]:
        name = getattr(one, "name", one)  # the schema's default is hydra-optuna-sweeper's Direction enum
        if name not in ("maximize", "minimize"):
            raise ConfigError(f"hydra.sweeper.direction={name}: not an Optuna direction; give maximize (rlhflab's "
                              "objective, the gold reward, is maximized) or minimize")
    if sweeper.get("storage") is not None:
        raise ConfigError(f"hydra.sweeper.storage={sweeper.storage}: Optuna 2.10's SQL storage fails with SQLAlchemy 2.1 "
                          "(an AssertionError once the sweep starts); leave it null (the study in memory; every trial's "
                          "numbers are in MLflow)")
    for key, parsed in space.items():
        check_search(f"hydra.sweeper.params.{key}", sweeper.params[key], parsed)


def check_search(key: str, value, parsed) -> None:
    """One key's Optuna search (`value` as written, `parsed` as Hydra reads it): a tag Optuna's sweeper knows, an
    interval that is not empty, a log one above 0 (Optuna raised each once the sweep's parent run was made)."""
    from hydra.core.override_parser.types import IntervalSweep

    tags = set(getattr(parsed, "tags", None) or ())
    if "int" in tags and isinstance(parsed, IntervalSweep):  # hydra-optuna-sweeper reads no int tag, and Hydra reads an
        # interval's ends as floats: each trial of a whole-number setting failed on a value such as 1.5488
        raise ConfigError(f"{key}: {value}: Optuna's sweeper searches an interval over real numbers, whatever its "
                          "tag; for whole numbers give range(low, high) (each whole number from low to high-1)")
    unknown = sorted(tags - {"log", "int"})  # hydra-optuna-sweeper's one (int: on a range or choice, it is not read)
    if unknown:  # tag(lg, ...) searched a linear scale without a word
        raise ConfigError(f"{key}: {value} has the tag {', '.join(unknown)}, which Optuna's sweeper "
                          "does not know; give tag(log, ...) for a log scale")
    if isinstance(parsed, IntervalSweep):
        if parsed.start >= parsed.end:
            raise ConfigError(f"{key}: {value} is empty; give interval(low, high) with low below high")
        if "log" in (parsed.tags or set()) and parsed.start <= 0:
            raise ConfigError(f"{key}: {value} searches on a log scale from {parsed.start}; give a low above 0")


def command_line_searches(overrides: list[str]) -> dict[str, str]:
    """{key: its search as written} of the command line's sweeps that are no list of values (interval(...))."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return {str(o.get_key_element()): text.partition("=")[2] for text, o in zip(overrides, parsed)
            if o.is_sweep_override() and not o.is_discrete_sweep()}


def no_search(searches: dict[str, str]) -> str:
    """A search on the command line under a sweeper that runs lists (Hydra's basic one): 'BasicSweeper does not
    support sweep type : INTERVAL_SWEEP' once the sweep's MLflow parent run was made, which it left FAILED and empty."""
    key, value = next(iter(searches.items()))
    return (f"{key}={value}: a search, which Hydra's basic sweeper cannot run (it runs comma lists and range(...)); "
            f"add hydra/sweeper=rlhflab_optuna for an Optuna study of it, or give the values to run, e.g. {key}=a,b,c")


def home_fix(key: str, value: str) -> str:
    """The fix for `key=value` whose value starts with '~': $HOME, which the shell expands in any word."""
    return f"write {key}=$HOME{value[1:]}, which the shell expands, or the full path" if value[1:2] in ("", "/") else "write the full path"


def check_shell_completion(argv: list[str]) -> None:
    """`--shell-completion` (`-sc`) alone was Hydra's ValueError traceback ('Expecting one subcommand'), as was
    -m with --cfg or --info ('Only one of --run, --multirun, --cfg, --info and --shell_completion can be specified')."""
    at = next((i for i, a in enumerate(argv) if a.split("=")[0] in ("--cfg", "-c", "--info", "-i")), None)
    if at is not None and any(a in ("-m", "--multirun") for a in argv):
        shown = argv[at] + (f" {argv[at + 1]}" if at + 1 < len(argv) and not argv[at + 1].startswith("-")
                            and "=" not in argv[at + 1] else "")
        overrides = [a for a in argv if "=" in a and not a.startswith("-")]
        try:  # the sweep's first job, the user's own overrides (the example dropped them all for algo=rloo)
            first = " ".join(sweep_jobs(overrides, True)[0]) if overrides else ""
        except Exception:
            first = ""
        fail(f"{argv[at]}: Hydra shows one job's config, not a sweep's; drop -m and give one value per key, e.g. "
             f"python src/train.py {first + ' ' if first else ''}{shown}")
    if not any(a in ("--shell-completion", "-sc") for a in argv):
        return
    if not any(a.split("=")[0] in ("install", "uninstall", "query") for a in argv):
        fail("--shell-completion: say what to do: install=bash (or zsh, fish), uninstall=bash, or query=bash; "
             "e.g. eval \"$(python src/train.py -sc install=bash)\"")


def check_one_output_per_job(cfg, searched: dict, outputs: set[str]) -> None:
    """A sweep's jobs each need their own output.dir: given one fixed value (`-m seed=0,1 output.dir=runs/a`), the
    second job replaced the first's policy/ and mlflow_run.json without a word (or, once the first had written
    checkpoints, was refused). A value that interpolates (${hydra:job.num}) differs per job; so does a swept one."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(cfg.output, resolve=False).get("dir")
    if raw is None or "${" in str(raw):
        return
    if str(raw) in outputs or searched["params"]:  # two jobs of the grid, or a sweeper's trials
        raise ConfigError(f"output.dir: every job of this sweep would write to {raw}, each replacing the last one's "
                          "policy/; leave output.dir out (each job gets hydra.sweep.dir/<job number>), or make it differ "
                          f"per job: output.dir='{raw}/${{hydra:job.num}}'")
    outputs.add(str(raw))


def check_one_experiment(cfg, stores: dict[str, str]) -> None:
    """A sweep's runs are children of one parent run, made in the first job's experiment and store: a job logged
    to another experiment (-m logger.experiment_name=a,b) was a child the parent's summary and the report did not
    find ('0 jobs'), and one logged to another store was no child at all."""
    for key in ("experiment_name", "tracking_uri"):
        value = redact(str(cfg.logger[key]))
        first = stores.setdefault(key, value)
        if value != first:
            raise ConfigError(f"logger.{key}: a sweep's runs are the children of one parent run, in one experiment of one "
                              f"store, but its jobs log to {first} and {value}; run one sweep for each")


def check_sweeper(choices: dict) -> None:
    """hydra-optuna-sweeper's own config (hydra/sweeper=optuna) minimizes by default: a study of rlhflab's objective
    (the gold reward) searched for the worst runs, and named the worst the best. rlhflab_optuna is that sweeper with
    rlhflab's defaults (maximize; a failed trial recorded, the study going on)."""
    if choices.get("hydra/sweeper") == "optuna":
        raise ConfigError("hydra/sweeper=optuna: hydra-optuna-sweeper's own defaults minimize, and rlhflab's objective (the "
                          "gold reward) is to be maximized; use hydra/sweeper=rlhflab_optuna, the same sweeper with "
                          "rlhflab's defaults (its direction, n_trials and sampler settable as hydra.sweeper.*)")


def check_launcher(choices: dict) -> None:
    """hydra/launcher=slurm submits with sbatch/srun: off a SLURM cluster submitit raised a traceback ('Could not
    detect "srun"') after the sweep's MLflow parent run existed."""
    if choices.get("hydra/launcher") == "slurm" and shutil.which("srun") is None:
        raise ConfigError("hydra/launcher=slurm: this machine has no srun (not a SLURM cluster); run the command on your "
                          "cluster's login node, or leave hydra/launcher out to run the jobs here")


def searched_keys_exist(cfg, searched: dict) -> None:
    """A preset's sweeper searches keys of the config (Optuna's intervals: each trial sets them). One the config
    does not have failed at the first trial, in Hydra's words ('Could not override algo.kl_coef'), e.g.
    experiment=sweep_optuna algo=grpo, whose KL weight is algo.kl_loss_coef."""
    from omegaconf import OmegaConf

    for key in map(str, searched["params"]):
        group, dot, _ = key.partition(".")
        if not dot or key.startswith(("+", "~", "hydra.")) or OmegaConf.select(cfg, key) is not None:
            continue
        chosen, preset = searched["choices"].get(group), searched["choices"].get("experiment")
        raise ConfigError(f"hydra.sweeper.params: {f'experiment={preset}' if preset else 'the sweep'} searches {key}, "
                          f"{_lacking(group, chosen)}; choose another {group}, or copy "
                          f"conf/experiment/{preset or '<preset>'}.yaml to a preset of your own that searches another key")


def _lacking(group: str, option: str) -> str:
    """'which algo=grpo does not have (algo=grpo's settings: ...)': the settings one option of a group has."""
    return f"which {group}={option} does not have ({group}={option}'s settings: {', '.join(_keys(group, [f'{group}={option}']))})"


def _root_defaults() -> dict[str, str]:
    """Each group's default option in conf/train.yaml."""
    import yaml

    root = yaml.safe_load((CONFIG_DIR / f"{CONFIG_NAME}.yaml").read_text())
    return {k: v for d in root["defaults"] if isinstance(d, dict) for k, v in d.items()}


def compose(overrides: list[str], hydra: bool = False):
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config_name=CONFIG_NAME, overrides=overrides, return_hydra_config=hydra)


def what_composes(overrides: list[str]) -> list[str]:
    """The overrides that compose, each bad one left out: what an error message reads its valid keys and
    defaults under. With two bad keys on the line (algo.foo=1 memory.bar=2), composing the others failed on the
    second, and the first's message listed no keys ('see ... --cfg job')."""
    try:
        compose(overrides)
        return list(overrides)
    except Exception:
        kept: list[str] = []
        for override in overrides:
            try:
                compose([*kept, override])
            except Exception:
                continue
            kept.append(override)
        return kept


def sweep_jobs(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The command line's jobs: each combination of a sweep's comma lists and ranges. A continuous search
    (interval(...), for Optuna) is checked (check_search) and gives the jobs of its two ends: it was left out of
    every job, and a typo in its key or a value out of the setting's range passed to fail the sweep once it ran."""
    if not multirun:
        return [overrides]
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import IntervalSweep

    choices = []
    for text, parsed in zip(overrides, OverridesParser.create().parse_overrides(overrides)):
        if not parsed.is_sweep_override():
            choices.append([text])
        elif parsed.is_discrete_sweep():
            choices.append([f"{parsed.get_key_element()}={value}" for value in parsed.sweep_string_iterator()])
        else:
            search = parsed.value()
            check_search(str(parsed.get_key_element()), text.partition("=")[2], search)
            if isinstance(search, IntervalSweep):  # its ends as the sweeper gives values: floats
                choices.append([f"{parsed.get_key_element()}={float(end)!r}" for end in (search.start, search.end)])
    return [list(job) for job in itertools.islice(itertools.product(*choices), MAX_SWEEP_JOBS)]


def composition_error(err: Exception, overrides: list[str]) -> str:
    """One line for what Hydra or OmegaConf raised while composing."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(err, OverrideParseException):
        for override in overrides:  # the one the grammar stops at
            try:
                OverridesParser.create().parse_overrides([override])
            except OverrideParseException as bad:
                key, _, value = override.partition("=")
                if value.startswith("~"):  # the shell expands ~ only after a variable's name (a=~/x), not key.name=~/x
                    return f"{override}: Hydra cannot read a value that starts with '~' (nor would it expand it); {home_fix(key, value)}"
                why = str(bad).strip().splitlines()[0].split(" expecting ")[0]
                return (f"{override}: not an override Hydra can read ({why}); write group=option or key=value "
                        "(key=a,b sweeps with -m), quoting a value that holds spaces, commas or brackets")

    searched = next((o for o in overrides if o.lstrip("+~").startswith("hydra.sweeper.params.")), None)
    if searched and "hydra.sweeper.params" in f"{err} {getattr(err, 'full_key', '')} {err.__cause__}":
        return searched_key_error(searched, [o for o in overrides if o != searched])
    if isinstance(err, MissingConfigException):
        found = re.search(r"Could not find '([^']+)/([^']+)'", str(err))
        if found:
            group, option = found.groups()
            path = f"{group}/{option}"
            for override in overrides:  # a nested option (reward=examples/revers) is the group's, not reward/examples'
                key, _, value = override.partition("=")
                key = key.lstrip("+~")
                if path.startswith(f"{key}/") and path[len(key) + 1:] in value.split(","):
                    group, option = key, path[len(key) + 1:]
                    break
            options = sorted(set(option_files(group)) | registered_options(group))
            return f"{group}={option}: no such option; choose one of {', '.join(options)}"
    if re.search(r"Could not load 'hydra/sweeper/optuna'", str(err)):  # hydra-optuna-sweeper is the dev extra's
        return ("hydra/sweeper=rlhflab_optuna: Optuna's sweeper is not installed (hydra-optuna-sweeper, which "
                "`pip install -e \".[dev]\"` installs); install it, or sweep lists of values with Hydra's basic sweeper")
    unregistered = re.search(r"In '([^']+)': Could not load 'schema/([^'/]+)/([^']+)'", str(err))
    if unregistered:
        option, group, name = unregistered.groups()
        return (f"{option.replace('/', '=', 1)}: its defaults start from /schema/{group}/{name}, which no schema registers; "
                f"add '{name}' to SCHEMAS['{group}'] in src/rlhflab/schema.py, or start from one it has: "
                f"{', '.join(sorted(SCHEMAS.get(group, {})))}")
    cause = err
    while cause.__cause__ is not None or cause.__context__ is not None:  # the innermost error names the key
        if getattr(cause, "full_key", None):
            break
        cause = cause.__cause__ or cause.__context__
    key = getattr(cause, "full_key", None)
    message = str(getattr(cause, "msg", None) or cause).strip().splitlines()[0]
    converted = re.search(r"Value '(.*)' of type '\w+' could not be converted to (\w+)", message)
    others = [o for o in overrides if key is None or o.split("=")[0].lstrip("+~") != key]
    if key:
        others = what_composes(others)
    if key and converted:
        value, kind = converted.groups()
        default = _default(key, others)
        if default == "None":  # 'e.g. checkpoint.every_n_steps=None' suggested what the value was not
            default = EXAMPLES.get(kind, "<value>") + " (or null, its default)"
        return f"{key}: {value!r} is not {TYPE_WORDS.get(kind, kind)}; give {TYPE_WORDS.get(kind, kind)}, e.g. {key}={default}"
    if key and re.search(r"Key '\w+' not in '\w+'", message):
        clash = _preset_clash(key, overrides)
        if clash:
            return clash
        return not_a_setting(key, others)
    if key and re.search(r"Key '\w+' is not in struct", message):  # a free mapping (model.arch): any key may be added
        bad = next((o for o in overrides if o.split("=")[0].lstrip("~") == key), f"{key}=<value>")
        return f"{not_a_setting(key, others)}; to add it, write +{bad}"
    if key and "does not support deletion" in message:  # a schema's setting: '~' would leave it missing
        return f"{key}: a setting of the schema cannot be removed with '~'; give it a value, e.g. {key}={_default(key, others)}"
    if key and re.search(r"is not Optional", message):
        return f"{key}: null is not allowed here; give a value, e.g. {key}={_default(key, others)}"
    if key and re.search(r"is not a ListConfig, list or tuple", message):  # reward.fns=a.py:f (one value, not a list)
        given = next((o.split("=", 1)[1] for o in overrides if o.split("=")[0].lstrip("+~") == key), "<value>")
        return f"{key}: {given!r} is one value, not a list; write {key}=[{given}] (several: {key}=[a,b])"
    if key:
        return f"{key}: {message}; see python src/train.py --help"
    if "Unexpected type for root: NoneType" in message:  # a key set under a node that is null in this config
        null = _under_null(overrides)
        if null:
            return null
    appended = re.search(r"Could not append to config. An item is already at '([^']+)'", message)
    if appended:
        key = appended[1]
        given = next((o.lstrip("+") for o in overrides if o.lstrip("+").startswith(f"{key}=")), f"{key}=<value>")
        return f"+{key}: '{key}' is a setting already; drop the '+' ({given})"
    bad = next((o for o in overrides if o.split("=")[0].lstrip("+~") in str(err)), " ".join(overrides) or "the config")
    if message.startswith("Ambiguous value for argument"):  # Hydra's next lines, the ways out, were cut above
        return (f"{bad}: a comma list is a sweep, which needs -m (python src/train.py -m {bad} ...); "
                "for a list value write key=[a,b], for a string with a comma quote it: key=\"'a,b'\"")
    return f"{bad}: {message}; see python src/train.py --help"


def registered_options(group: str) -> set[str]:
    """The options Hydra and its plugins register for a group (hydra/launcher: basic, submitit_local, ...): the message
    for hydra/launcher=slrm offered only conf/'s slurm. (rlhflab's schema/ entries are bases, not options.)"""
    from hydra.core.config_store import ConfigStore

    try:
        names = ConfigStore.instance().list(group) if group.startswith("hydra/") else []
    except Exception:  # a group nothing registers (ConfigStore: "Path not found")
        return set()
    return {n.removesuffix(".yaml") for n in names if n.endswith(".yaml")}


def _under_null(overrides: list[str]) -> str | None:
    """model=pythia410m_tldr model.arch.hidden_size=64 said 'Unexpected type for root: NoneType': the preset loads a
    pretrained model, and its model.arch is null. The override set under a null node, in words."""
    from omegaconf import OmegaConf

    for override in overrides:
        key = override.partition("=")[0].lstrip("+~")
        others = what_composes([o for o in overrides if o != override])
        try:
            cfg = compose(others)
        except Exception:  # noqa: BLE001 - not this one
            continue
        parts = key.split(".")
        for i in range(1, len(parts)):
            node = ".".join(parts[:i])
            if OmegaConf.select(cfg, node, default="missing") is None:
                chosen = " ".join(o for o in others if "=" in o and "." not in o.partition("=")[0]) or "this config"
                why = (" (the model is loaded pretrained, its architecture the checkpoint's; model.arch is for a preset "
                       "that builds its model, e.g. model=tiny)") if node == "model.arch" else ""
                return f"{key}: {node} is null under {chosen}, so it has no '{parts[i]}' to set; leave {key} out{why}"
    return None


def searched_key_error(override: str, others: list[str]) -> str:
    """hydra.sweeper.params.rl.lr=...: Hydra reads the dots of a searched key as nesting (params.rl.lr, where the
    preset's key is 'rl.lr'), so it cannot be set this way. Unquoted, its value was a sweep that 'requires
    --multirun' (the preset is one already); quoted, 'rl' was not a setting, and '+' then failed on a dict. A dict
    override merges into the search space, and '++' adds a key it lacks: the line writes that, for this key only,
    once the jobs are known to have the key."""
    from omegaconf import OmegaConf

    key, _, value = override.lstrip("+~").partition("=")
    name = key.removeprefix("hydra.sweeper.params.")
    composing = what_composes(others)
    try:
        job = compose(composing)
    except Exception:
        job = None
    if job is not None and OmegaConf.select(job, name, default=_ABSENT) is _ABSENT:
        return f"hydra.sweeper.params.{not_a_setting(name, composing)}"
    return (f"{key}: Hydra reads a searched key's dots as nesting and its unquoted value as a sweep of the command line; "
            f"write '++hydra.sweeper.params={{{name}:\"{value.strip(chr(39) + chr(34))}\"}}' (it merges into the "
            "search space)")


def _preset_clash(key: str, overrides: list[str]) -> str | None:
    """A preset (experiment=X) sets `key` for its own choice of the group, and the command line chose another
    option that has no such setting (e.g. experiment=async_pythia1b_tldr algo=rloo: the preset's algo.beta is
    online DPO's). Hydra merges the preset's values before anything on the command line can remove them."""
    import yaml

    group = key.partition(".")[0]
    chosen = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == group and "=" in o), None)
    preset = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "experiment"), None)
    path = CONFIG_DIR / "experiment" / f"{preset}.yaml"
    if not chosen or not preset or not path.is_file():
        return None
    body = yaml.safe_load(path.read_text()) or {}
    node = body
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if node is None:
        return None
    own = next((list(d.values())[0] for d in body.get("defaults", []) if isinstance(d, dict)
                and list(d)[0] == f"override /{group}"), None) or _root_defaults().get(group, "its default")
    return (f"{key}: experiment={preset} sets it for {group}={own}, {_lacking(group, chosen)}; keep the preset's {group}, "
            f"or copy conf/experiment/{preset}.yaml to a preset of your own with {group}: {chosen}")


EXAMPLES = {"Integer": "10", "Float": "0.1", "Boolean": "true"}  # a value of each kind, where a setting's default is null


def _default(key: str, overrides: list[str]) -> str:
    """The value `key` has without the bad override (what the fix suggests)."""
    from omegaconf import OmegaConf

    try:
        # hydra.*: Hydra's own node, which a job's config lacks ('e.g. hydra.sweeper.n_trials=None')
        return str(OmegaConf.select(compose(overrides, hydra=key.startswith("hydra.")), key, throw_on_missing=False))
    except Exception:
        return "<value>"


def not_a_setting(key: str, others: list[str]) -> str:
    """`key` is not among the settings of the option chosen for its group: the ones it has, and the group's other
    options that have `key` (reward.fn under the default reward=model, which has no settings: 'valid keys: ' and
    nothing after it)."""
    from omegaconf import OmegaConf

    parent = key.rpartition(".")[0]
    keys = _keys(parent, others)
    where = parent or "the config"
    said = f"{key}: not a setting of {where}; valid keys: {', '.join(keys)}" if keys else f"{key}: {where} has no settings"
    group = parent.partition(".")[0]
    if group not in SCHEMAS or not (CONFIG_DIR / group).is_dir():
        return said
    rest = [o for o in others if o.partition("=")[0].lstrip("+~") != group]
    having = []
    for option, path in option_files(group).items():
        if "/" in option:  # the nested are examples (reward=examples/reverse)
            continue
        given = _option_has(path, key.partition(".")[2])  # read from the option's file and schema, not composed
        if given is not None:  # (7 composes made a misspelt algo key ~4 s; model.arch's 9 options ~3 s on a slow host)
            if given:
                having.append(option)
            continue
        try:
            if OmegaConf.select(compose([*rest, f"{group}={option}"]), key, default=_ABSENT) is not _ABSENT:
                having.append(option)
        except Exception:  # an option this command line cannot compose with
            continue
    if not having:
        return said if keys else f"{said}; remove {key}"
    # several: each is named, none picked for the user (memory.r: hydra came first by name, lora is as likely)
    return (f"{said}; {key} is a setting of {' and '.join(f'{group}={o}' for o in having)}: add "
            + " or ".join(f"{group}={o}" for o in having))


_ABSENT = object()


def _option_keys(path: Path) -> tuple[set[str], Any, type | None] | None:
    """The settings an option file gives: its own keys and its schema's fields (`- /schema/<group>/<name>@_here_`
    in its defaults), with the file's node and that schema; None where only composing can tell (another package,
    another option among its defaults)."""
    import dataclasses

    from omegaconf import OmegaConf

    if "@package" in path.read_text():
        return None
    node = OmegaConf.load(path)
    keys = {str(k) for k in node.keys() if k != "defaults"}
    schema_cls = None
    for entry in node.get("defaults") or []:
        schema = re.fullmatch(r"/schema/(\w+)/(\w+)@_here_", str(entry))
        if schema and schema[2] in SCHEMAS.get(schema[1], {}):
            schema_cls = SCHEMAS[schema[1]][schema[2]]
            keys |= {field.name for field in dataclasses.fields(schema_cls)}
        elif str(entry) != "_self_" and not (OmegaConf.is_dict(entry) and all(str(k).startswith("override ") for k in entry)):
            return None
    return {k for k in keys if not k.startswith("_")}, node, schema_cls


def _option_has(path: Path, name: str) -> bool | None:
    """Whether the option file at `path` gives the setting `name` (`r`, or `arch.rope_theta` under a free mapping
    such as model.arch), read from the file and its schema; None where only composing can tell (a schema's typed
    value or default under the setting's first key, an interpolation on the way)."""
    import dataclasses
    import typing

    from omegaconf import OmegaConf

    read = _option_keys(path)
    if read is None:
        return None
    keys, node, schema_cls = read
    head, _, rest = name.partition(".")
    if not rest:
        return head in keys
    if head not in keys:
        return False
    field = next((f for f in dataclasses.fields(schema_cls) if f.name == head), None) if schema_cls else None
    if field is not None:  # only a free mapping with nothing of its own (model.arch: Optional[Dict], MISSING)
        kind = typing.get_type_hints(schema_cls)[head]
        kinds = typing.get_args(kind) if typing.get_origin(kind) is typing.Union else (kind,)  # Optional[Dict]: Dict
        if not any(typing.get_origin(t) is dict for t in kinds) \
                or field.default_factory is not dataclasses.MISSING or field.default not in (dataclasses.MISSING, None, "???"):
            return None  # a schema's typed value, or a default of its own, under `head`
    if head not in node:  # the schema's MISSING or null: nothing under it
        return False
    value = OmegaConf.to_container(node, resolve=False)[head]
    for part in rest.split("."):
        if isinstance(value, str) and "${" in value:
            return None
        if not isinstance(value, dict):
            return False
        if part not in value:
            return False
        value = value[part]
    return True


def _keys(parent: str, overrides: list[str]) -> list[str]:
    from omegaconf import OmegaConf

    try:
        node = OmegaConf.select(compose(overrides), parent) if parent else compose(overrides)
        return [k for k in node.keys() if not str(k).startswith("_")]
    except Exception:
        return ["(see python src/train.py --cfg job)"]


# ---- --help -----------------------------------------------------------------------------------

def _summary(path: Path) -> str:
    """The first sentence of an option file's leading comment (after `# @package`), however many lines it spans."""
    words: list[str] = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if "@package" not in line:
            words.append(line.lstrip("# ").strip())
    text = " ".join(words)
    for match in re.finditer(r"[A-Za-z0-9)\]`']\.(\s|$)", text):
        if not re.search(r"\b(Dr|vs|al|e\.g|i\.e|cf)$", text[:match.start() + 1]):  # an abbreviation goes on
            return text[:match.start() + 2]
    return text


def render_help() -> str:
    """The groups, their options (default first) and each option's one-line comment."""
    defaults = _root_defaults()
    lines = [
        "rlhflab: declarative RLHF experiments (Hydra composes, Lightning trains, MLflow records).",
        "",
        "usage: python src/train.py [group=option ...] [key=value ...]     one experiment",
        "       python src/train.py -m group=a,b key=1,2 ...               a sweep: one MLflow parent run, a child per job",
        "",
        "groups and options (* = default):",
    ]
    groups = {g: _options(g, defaults[g]) for g in sorted(defaults, key=list(defaults).index) if g != "experiment"}
    width = max(len(name) for options in groups.values() for name, _ in options) + 1  # a name never runs into its text
    for group, options in groups.items():
        for i, (name, path) in enumerate(options):
            mark = "*" if name == defaults[group] else " "
            lines += _wrapped(f"  {group if i == 0 else '':<12}{mark}{name:<{width}}", _summary(path))
    lines += ["", "presets (experiment=NAME, debug=NAME):"]
    presets = [(f"{group}={name}", path) for group in ("experiment", "debug") for name, path in _options(group, None)]
    width = max(len(preset) for preset, _ in presets) + 1
    for preset, path in presets:
        lines += _wrapped(f"  {preset:<{width}}", _summary(path))
    lines += ["", "where the jobs of -m run, and how they are chosen (Hydra's groups):"]
    basic = {"launcher": "One job after another, in this process.", "sweeper": "Every combination of the comma lists (a grid)."}
    hydra = [(group, "*basic", basic[group]) for group in basic]
    hydra += [(group, " " + name, _summary(path)) for group in basic for name, path in _options(f"hydra/{group}", None)]
    hydra.sort(key=lambda row: list(basic).index(row[0]))  # stable: basic first in each group
    width = max(len(option) for _, option, _ in hydra) + 1
    for i, (group, option, text) in enumerate(hydra):
        lines += _wrapped(f"  {'hydra/' + group if i == 0 or hydra[i - 1][0] != group else '':<16}{option:<{width}}", text)
    lines += [
        "",
        "every value: python src/train.py --cfg job    (each field's one-line comment is in its file under conf/)",
        "e.g.         python src/train.py algo=online_dpo mode=async staleness=2 rl.lr=3e-4 trainer.max_steps=100",
        "runs:        mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1",
        "durable:     output.dir=<dir> (policy/, checkpoints/), checkpoint.every_n_steps=N; after a Ctrl-C or a kill",
        "             the same command with resume=auto continues; docs/DURABLE.md",
        "ranks:       trainer=ddp or trainer=fsdp, trainer.devices=N (CPU processes or GPUs); docs/DISTRIBUTED.md",
        "own data:    task=prompts task.path=<file> reward=function reward.fn=<file.py>:<function>; docs/OWN_DATA.md",
        "Hydra's own flags: python src/train.py --hydra-help",
    ]
    return "\n".join(lines)


def _wrapped(name: str, text: str) -> list[str]:
    """`name` then `text`, wrapped to the terminal (at least 100 columns), continuation lines under the text."""
    import textwrap

    columns = max(shutil.get_terminal_size((120, 24)).columns, 100)
    return textwrap.wrap(text, columns - 1, initial_indent=name, subsequent_indent=" " * len(name)) or [name]


def option_files(group: str) -> dict[str, Path]:
    """{option: its file} of a config group, by name; a nested one by its path in the group (reward=examples/reverse),
    after the others."""
    root = CONFIG_DIR / group
    named = {path.relative_to(root).with_suffix("").as_posix(): path for path in root.rglob("*.yaml")}
    return {name: named[name] for name in sorted(named, key=lambda name: (name.count("/"), name))}


def _options(group: str, default: str | None) -> list[tuple[str, Path]]:
    """(option, its file) of a group, the default first."""
    return sorted(option_files(group).items(), key=lambda option: option[0] != default)
