"""The command line: bad values fail in one line naming the key, before anything heavy loads; --help."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

TRAIN = str(ROOT / "src" / "train.py")

# (override(s), the key the one-line error must start with)
BAD_VALUES = [
    ("trainer.max_steps=abc", "trainer.max_steps"),
    ("rl.lr=abc", "rl.lr"),
    ("rl.lr=1e-3x", "rl.lr"),
    ("algo.kl_coef=abc", "algo.kl_coef"),
    ("+rl.lrr=1", "rl.lrr"),
    ("rl.lrr=1", "rl.lrr"),
    ("+algo.kl_coeff=0.1", "algo.kl_coeff"),
    ("algo=grpo +algo.kl_coef=0.1", "algo.kl_coef"),
    ("rl.lr=-1", "rl.lr"),
    ("rl.lr=0", "rl.lr"),
    ("algo.kl_coef=-1", "algo.kl_coef"),
    ("rl.eval_every=-5", "rl.eval_every"),
    ("rl.max_grad_norm=-1", "rl.max_grad_norm"),
    # infinite or NaN numbers passed their bounds (inf > 0), then failed only after the models loaded: rl.lr=inf at RL
    # step 2 (diverged weights), rl.eos_penalty=nan at RL step 1 (every EOS-less completion's reward NaN)
    ("rl.lr=inf", "rl.lr: inf is not a finite number"),
    ("rl.eos_penalty=nan", "rl.eos_penalty: nan is not a finite number"),
    ("rl.eos_penalty=-inf", "rl.eos_penalty: -inf is not a finite number"),
    ("algo.kl_coef=inf", "algo.kl_coef: inf is not a finite number"),
    ("generator.temperature=inf", "generator.temperature: inf is not a finite number"),
    ("generator.max_new_tokens=0", "generator.max_new_tokens"),
    ("generator.temperature=0", "generator.temperature"),
    ("generator.temperature=-1", "generator.temperature"),
    ("generator.top_k=5", "generator.top_k"),
    ("task.response_words=0", "task.response_words"),
    ("task.prompt_words=0", "task.prompt_words"),
    ("task.num_eval_prompts=0", "task.num_eval_prompts"),
    ("model.dtype=float8", "model.dtype"),
    ("trainer.max_steps=0", "trainer.max_steps"),
    ("logger.experiment_name=", "logger.experiment_name"),  # an AttributeError traceback from MLflow
    # MLflow's default store took the run, then Lightning's logger met the refused ./mlruns: a 50-line traceback
    ("logger.tracking_uri=", "logger.tracking_uri: empty"),
    # an in-memory store: the run ended FINISHED, linking a database that had gone with the process
    ("logger.tracking_uri=sqlite://", "logger.tracking_uri: sqlite:// is an in-memory database"),
    ("logger.tracking_uri=sqlite:///:memory:", "logger.tracking_uri: sqlite:///:memory: is an in-memory database"),
    ("cache_dir=", "cache_dir: empty"),  # models/ and stages/ were written into the working directory, without a word
    ("trainer.devices=0", "trainer.devices"),  # passed, made an MLflow run, then Lightning's MisconfigurationException
    ("trainer.devices=[0,1]", "trainer.devices"),  # GPU indices on CPU
    ("trainer=gpu trainer.devices=[0,0]", "trainer.devices"),
    ("trainer.devices=-1", "trainer.devices"),  # every GPU: not on CPU
    ('trainer=ddp trainer.devices="3"', "rl.prompts_per_step"),  # a count as a string is 3 ranks, as Lightning reads it
    ("trainer.precision=fp8", "trainer.precision"),
    ("rl.prompts_per_step=0", "rl.prompts_per_step"),
    ("rl.eval_samples_per_prompt=0", "rl.eval_samples_per_prompt"),
    ("stages.sft.batch_size=0", "stages.sft.batch_size"),
    ("stages.rm.held_out_fraction=1.5", "stages.rm.held_out_fraction"),
    ("stages.rm.held_out_fraction=0", "stages.rm.held_out_fraction"),
    ("memory=lora memory.lora_dropout=1.2", "memory.lora_dropout"),
    ("memory=lora memory.r=0", "memory.r"),
    # the fix suggested a typical value, not the bound (it said 'set e.g. algo.gamma=0': no discount at all)
    ("algo=ppo algo.gamma=1.5", "algo.gamma: 1.5 must be >= 0 and <= 1; set e.g. algo.gamma=1.0"),
    ("algo=ppo algo.lam=-0.1", "algo.lam: -0.1 must be >= 0 and <= 1; set e.g. algo.lam=0.95"),
    ("kl_budget=-1", "kl_budget: -1.0 must be >= 0; set e.g. kl_budget=3.0"),
    ("algo.clip_eps=0", "algo.clip_eps"),
    ("algo.epochs=0", "algo.epochs"),
    ("algo.samples_per_prompt=1", "algo.samples_per_prompt"),
    ("algo=online_dpo algo.beta=0", "algo.beta"),
    ("algo=online_dpo algo.ties=drop", "algo.ties"),
    ("algo.kl_estimator=k9", "algo.kl_estimator"),
    # a preset's grid, changed on the command line: a typo failed in Hydra's ~15 lines after the sweep's parent run was made
    ('experiment=sweep_algos hydra.sweeper.params.algo="rloo,grop"', "algo=grop: no such option; choose one of"),
    # Hydra's and its plugins' own options too: it offered only conf/'s slurm
    ("-m hydra/launcher=slrm seed=1,2", "hydra/launcher=slrm: no such option; choose one of basic, slurm, submitit_local, "
                                        "submitit_slurm (sweep job: hydra/launcher=slrm seed=1)"),
    # an evaluation no run logs: the run (every job of a sweep) trained, then failed on the name
    ("optimized_metric=eval/gld", "optimized_metric: eval/gld: no run logs it; give one of eval/gold_reward, "),
    ("-m seed=0,1 optimized_metric=eval/gold", "optimized_metric: eval/gold: no run logs it"),
    # a nested option was not offered (reward=examples/reverse)
    ("reward=examples/revers", "reward=examples/revers: no such option; choose one of examples/reverse, function, model, rule"),
    # a setting of another option of the group: under reward=model (no settings) it said 'valid keys: ' and nothing
    ("reward.fn=my_pkg.rewards:score", "reward.fn: reward has no settings; reward.fn is a setting of reward=function: add reward=function"),
    # several options have it: it said 'add memory=hydra', the first by name
    ("memory.r=8", "memory.r: not a setting of memory; valid keys: gradient_checkpointing; memory.r is a setting of memory=hydra and memory=lora: add memory=hydra or memory=lora"),
    ("algo.beta=0.1", "algo.beta: not a setting of algo; valid keys: samples_per_prompt"),
    # a second bad key on the line: the first's keys were '(see python src/train.py --cfg job)'
    ("algo.beta=0.1 memory.bar=2", "algo.beta: not a setting of algo; valid keys: samples_per_prompt"),
    ("foo.bar=1", "foo: not a setting of the config; valid keys: task, model, algo"),
    # model.arch is a transformers config, open to any key with '+'; it said "Key 'foo' is not in struct"
    ("model.arch.rope_theta=1e4", "model.arch.rope_theta: not a setting of model.arch; valid keys: model_type, hidden_size, "
                                  "intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, "
                                  "max_position_embeddings; to add it, write +model.arch.rope_theta=1e4"),
    ("algo.loss_agg=token-sum", "algo.loss_agg"),
    ("mode=async staleness=-1", "staleness"),
    ("staleness=2", "staleness"),
    ("mode=async mode.staleness=2", "mode.staleness"),
    ("+rl.lr=0.002", "+rl.lr: 'rl.lr' is a setting already; drop the '+' (rl.lr=0.002)"),  # Hydra's 'Could not append'
    ("~rl.lr", "rl.lr: a setting of the schema cannot be removed"),  # '... does not support deletion'
    ("rl.lr=null", "rl.lr: null is not allowed here; give a value, e.g. rl.lr="),  # "field 'rl.lr' is not Optional"
    # OmegaConf's 'Invalid value assigned: str is not a ListConfig, list or tuple.', with no fix
    ("reward=function reward.fns=my_pkg.rewards:score", "reward.fns: 'my_pkg.rewards:score' is one value, not a list; write "
                                                        "reward.fns=[my_pkg.rewards:score] (several: reward.fns=[a,b])"),
    # 'Unexpected type for root: NoneType': the preset loads a pretrained model, its model.arch null
    ("model=pythia410m_tldr model.arch.hidden_size=64", "model.arch.hidden_size: model.arch is null under model=pythia410m_tldr"),
    ("hydra.run.dir=/dev/null/x", "hydra.run.dir"),  # under a file: Hydra's NotADirectoryError traceback
    ("-m seed=0,1 hydra.sweep.dir=/dev/null/x", "hydra.sweep.dir"),  # and an empty FAILED parent run  # it ran at 2; its tag, param and the report said 1
    ("mode=async mode.start_method=thread", "mode.start_method"),
    ("mode=async mode.sync_every=0", "mode.sync_every"),
    ("off_policy=tis off_policy.cap=0.5", "off_policy.cap"),
    ("algo.num_minibatches=3", "rl.prompts_per_step"),
    ("seed=-1", "seed"),
    ("torch_threads=0", "torch_threads"),
    ("task.words_file=/no/such/words.json", "task.words_file"),
    ("model.sft_path=/no/such/model", "model.sft_path"),
    ("algo=nope", "algo=nope"),
    ("-m algo=rloo,grpo algo.kl_coef=0.1", "algo.kl_coef"),
    ("-m seed=0,1 output.dir=runs/a", "output.dir"),  # job 1 replaced job 0's policy/ without a word
    ("-m experiment=sweep_optuna output.dir=runs/a", "output.dir"),  # every trial into one directory
    # Hydra's 'Only one of --run, --multirun, --cfg, --info and --shell_completion can be specified' traceback
    ("-m algo=online_dpo,rloo --cfg job", "--cfg: Hydra shows one job's config, not a sweep's; drop -m and give one value "
                                          "per key, e.g. python src/train.py algo=online_dpo --cfg job"),  # the user's own
    # one key of a search space: 'requires --multirun' (unquoted), then 'not a setting ... write +...' (quoted), then
    # 'Cannot convert dict to string' (with +): Hydra reads the dots of 'rl.lr' as nesting; '++' merges a dict in
    ('experiment=sweep_optuna hydra.sweeper.params.rl.max_grad_norm="interval(0.5,2)"',
     "hydra.sweeper.params.rl.max_grad_norm: Hydra reads a searched key's dots as nesting and its unquoted value as a "
     "sweep of the command line; write '++hydra.sweeper.params={rl.max_grad_norm:\"interval(0.5,2)\"}'"),
    ("experiment=sweep_kl hydra.sweeper.params.algo=rloo,grpo", "hydra.sweeper.params.algo: Hydra reads"),
    # a typo was told to write '+...', which then failed on the same key
    ('experiment=sweep_optuna hydra.sweeper.params.rl.lrr="interval(0.5,2)"',
     "hydra.sweeper.params.rl.lrr: not a setting of rl; valid keys: prompts_per_step, lr"),
    # Optuna's settings, read by it once the sweep's parent run was made: a traceback and an empty FAILED parent
    ("experiment=sweep_optuna hydra.sweeper.n_trials=0", "hydra.sweeper.n_trials=0: a study needs a trial to run"),
    ("experiment=sweep_optuna hydra.sweeper.direction=maximise", "hydra.sweeper.direction=maximise: not an Optuna direction"),
    ("experiment=sweep_optuna hydra.sweeper.storage=sqlite:///optuna.db", "hydra.sweeper.storage=sqlite:///optuna.db: Optuna"),
    ('experiment=sweep_optuna hydra.sweeper.params={algo.kl_coef:"tag(log,interval(0,0.1))"}',
     "hydra.sweeper.params.algo.kl_coef: tag(log,interval(0,0.1)) searches on a log scale from 0.0; give a low above 0"),
    # n_jobs=0: a ZeroDivisionError; max_failure_rate=2: a bare AssertionError; two directions: every trial failed
    ("experiment=sweep_optuna hydra.sweeper.n_jobs=0", "hydra.sweeper.n_jobs=0: a study needs a trial per batch"),
    ("experiment=sweep_optuna hydra.sweeper.max_failure_rate=2", "hydra.sweeper.max_failure_rate=2.0: a share of the trials"),
    ("experiment=sweep_optuna hydra.sweeper.direction=[maximize,minimize]", "hydra.sweeper.direction=['maximize', 'minimize']"),
    # a choice() value no job can have: a trial trained, then Hydra's 'Could not find algo/rlooo' ended the sweep
    ('experiment=sweep_optuna ++hydra.sweeper.params={algo:"choice(rloo,rlooo)"}', "algo=rlooo: no such option"),
    # a tag Optuna does not know: a linear search without a word
    ('experiment=sweep_optuna ++hydra.sweeper.params={rl.lr:"tag(lg,interval(1e-4,1e-3))"}', "hydra.sweeper.params.rl.lr: "
     "tag(lg,interval(1e-4,1e-3)) has the tag lg"),
    # the fix named None: the default was read from a job's config, which has no hydra node
    ("experiment=sweep_optuna hydra.sweeper.n_trials=abc", "hydra.sweeper.n_trials: 'abc' is not a whole number; give a "
                                                           "whole number, e.g. hydra.sweeper.n_trials=8"),
    # a setting whose default is null was told 'e.g. checkpoint.every_n_steps=None'
    ("checkpoint.every_n_steps=abc", "checkpoint.every_n_steps: 'abc' is not a whole number; give a whole number, e.g. "
                                     "checkpoint.every_n_steps=10 (or null, its default)"),
    # distributed (issue 11)
    ("trainer=ddp rl.prompts_per_step=3", "rl.prompts_per_step"),
    # each rank splits its own share into mini-batches: two tracebacks after the stages ran
    ("trainer=ddp algo=ppo rl.prompts_per_step=2", "rl.prompts_per_step: 2 prompts give each of 2 ranks 1, which algo.num_minibatches=2"),
    ("trainer=ddp stages.sft.batch_size=63", "stages.sft.batch_size: 63 does not split evenly over 2 ranks"),
    ("trainer=ddp task.num_eval_prompts=1", "task.num_eval_prompts"),
    ("trainer=fsdp mode=async", "mode=async"),
    ("trainer=fsdp memory=lora output.merge_lora=true", "output.merge_lora"),
    ("trainer=fsdp trainer.strategy.data_parallel_size=1", "trainer.strategy.data_parallel_size"),
    ("trainer=ddp trainer.strategy.process_group_backend=nccl trainer.accelerator=cpu", "trainer.strategy.process_group_backend"),
    ("mode=async trainer=gpu mode.device=cuda:0", "mode.device"),
    ("trainer=ddp trainer.accelerator=gpu mode=async mode.device=cuda:1", "mode.device"),
    # a paper's preset with another option of a group it configures: the preset's setting for its own option
    ("experiment=async_pythia1b_tldr algo=rloo", "algo.beta: experiment=async_pythia1b_tldr sets it for algo=online_dpo, which algo=rloo does not have"),
    ("experiment=lora_ppo_llama7b_tldr memory=full", "memory.r: experiment=lora_ppo_llama7b_tldr sets it for memory=lora"),
    ("experiment=quick task=prompts", "task.num_demonstrations: experiment=quick sets it for task=sentiment"),
    # a sweep preset searching a key the chosen option lacks (failed at Optuna's first trial, in Hydra's words)
    ("experiment=sweep_optuna algo=grpo", "hydra.sweeper.params: experiment=sweep_optuna searches algo.kl_coef, which algo=grpo does not have"),
    # overrides Hydra's grammar cannot read: with -m the sweep's expansion raised a traceback
    ("-m algo=rloo,grpo ...", "...: not an override Hydra can read"),
    ("-m algo=rloo,", "algo=rloo,: not an override Hydra can read"),
    ("rl.lr=[1,2", "rl.lr=[1,2: not an override Hydra can read"),
    # the shell leaves '~' after 'key.name=' as it is, and Hydra's grammar cannot read it
    ("output.dir=~/runs/a", "output.dir=~/runs/a: Hydra cannot read a value that starts with '~'"),
    # quoted past both ('hydra.run.dir="~/runs/a"'): Hydra made a directory named '~' (rlhflab's own paths expand it)
    ('hydra.run.dir="~/runs/a"', "hydra.run.dir: '~/runs/a' would be a directory named '~'"),
    ('-m seed=1,2 hydra.sweep.dir="~/sweeps/a"', "hydra.sweep.dir: '~/sweeps/a' would be a directory named '~'"),
    # a comma list without -m: Hydra's ways out (list, quoted string, --multirun) were cut from its message
    ("algo=rloo,grpo", "algo=rloo,grpo: a comma list is a sweep, which needs -m"),
    # an Optuna search on the command line (docs/SWEEPS.md: "Without a preset, ... give the search on the command
    # line"): it passed the preflight unread, then Optuna's ValueError (29 lines) or Hydra's 'Could not override'
    # ended the sweep and left an empty FAILED parent run; a linear search ran under an unknown tag without a word
    ("-m hydra/sweeper=rlhflab_optuna algo.kl_coef=interval(0.1,0.01)", "algo.kl_coef: interval(0.1,0.01) is empty; give "
     "interval(low, high) with low below high"),
    ("-m hydra/sweeper=rlhflab_optuna algo.kl_coef=tag(log,interval(0,0.1))", "algo.kl_coef: tag(log,interval(0,0.1)) "
     "searches on a log scale from 0.0; give a low above 0"),
    ("-m hydra/sweeper=rlhflab_optuna algo.kl_coef=tag(lg,interval(0.01,0.1))", "algo.kl_coef: tag(lg,interval(0.01,0.1)) "
     "has the tag lg"),
    ("-m hydra/sweeper=rlhflab_optuna algo.kl_cof=interval(0.01,0.1)", "algo.kl_cof: not a setting of algo"),
    ("-m hydra/sweeper=rlhflab_optuna algo.kl_coef=interval(-1,-0.5)", "algo.kl_coef: -1.0 must be >= 0"),
    # an interval over a whole-number setting: each trial failed on e.g. 1.5488 (Optuna's sweeper reads no int tag)
    ("-m hydra/sweeper=rlhflab_optuna stages.sft.epochs=interval(1,4)", "stages.sft.epochs: '1.0' is not a whole number"),
    ("-m hydra/sweeper=rlhflab_optuna stages.sft.epochs=tag(int,interval(1,4))", "stages.sft.epochs: tag(int,interval(1,4)): "
     "Optuna's sweeper searches an interval over real numbers"),
    # without an Optuna sweeper: 'BasicSweeper does not support sweep type : INTERVAL_SWEEP' and an empty FAILED parent
    ("-m algo.kl_coef=interval(0.01,0.1)", "algo.kl_coef=interval(0.01,0.1): a search, which Hydra's basic sweeper "
     "cannot run"),
]

RUNNER = r'''
import contextlib, io, json, sys, time
sys.argv = ["train.py"]
from rlhflab.cli import preflight
rows = []
for args in json.loads(sys.stdin.read()):
    err = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stderr(err):
            preflight(args)
        code = 0
    except SystemExit as exit:
        code = exit.code
    rows.append({"args": args, "code": code, "stderr": err.getvalue(), "s": time.perf_counter() - start})
heavy = sorted(m for m in ("torch", "transformers", "mlflow", "lightning") if m in sys.modules)
print(json.dumps({"rows": rows, "heavy": heavy}))
'''


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """Every row through the CLI's preflight, in one fresh interpreter (no heavy module imported)."""
    cwd = tmp_path_factory.mktemp("cli")
    payload = json.dumps([row.split() for row, _ in BAD_VALUES])
    out = subprocess.run([sys.executable, "-c", RUNNER], input=payload, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), cwd


def test_at_least_thirty_bad_values():
    assert len(BAD_VALUES) >= 30


@pytest.mark.parametrize("i", range(len(BAD_VALUES)), ids=[row for row, _ in BAD_VALUES])
def test_bad_value_is_one_line_naming_the_key(table, i):
    result, cwd = table
    row, key = BAD_VALUES[i], BAD_VALUES[i][1]
    got = result["rows"][i]
    assert got["code"] == 2, (row, got)
    lines = got["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {key}"), lines
    assert "; " in lines[0]  # what is wrong; the fix
    assert "Traceback" not in got["stderr"]
    # (no bound on got["s"]: a timed assertion failed on a loaded machine, 5.1 s against 3; that nothing heavy loads
    # is test_the_checks_import_nothing_heavy_and_create_no_run's)


def test_the_checks_import_nothing_heavy_and_create_no_run(table):
    result, cwd = table
    assert result["heavy"] == []  # neither torch, transformers, mlflow nor lightning
    assert not (Path(cwd) / "mlflow.db").exists() and not (Path(cwd) / "mlruns").exists()


def run_cli(*args: str, cwd: Path):
    return subprocess.run([sys.executable, TRAIN, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, key", [(["trainer.max_steps=abc"], "trainer.max_steps"), (["+rl.lrr=1"], "rl.lrr"),
                                       (["rl.lr=-1"], "rl.lr"), (["algo=nope"], "algo=nope"),
                                       # checks that read the task's files (after the imports, before any model loads)
                                       (["task=prompts", f"task.path={ROOT}/examples/reverse/eval.jsonl", "task.tokenizer=char",
                                         "rl.prompts_per_step=500"], "rl.prompts_per_step"),
                                       (["task=prompts", f"task.path={ROOT}/examples/reverse/train.jsonl", "task.tokenizer=char",
                                         "reward=rule"], "reward=rule")])
def test_the_real_command_line_fails_in_one_line(tmp_path, args, key):
    out = run_cli(*args, f"cache_dir={tmp_path}/cache", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and out.stderr.startswith(f"error: {key}")
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("argv", [["--shell-completion"], ["-sc"]])
def test_shell_completion_without_what_to_do_is_one_line(argv, capsys):
    """Hydra raised its ValueError ('Expecting one subcommand ...') as a traceback."""
    from rlhflab.cli import preflight

    with pytest.raises(SystemExit) as exit:
        preflight(argv)
    assert exit.value.code == 2
    assert capsys.readouterr().err == ("error: --shell-completion: say what to do: install=bash (or zsh, fish), "
                                       "uninstall=bash, or query=bash; e.g. eval \"$(python src/train.py -sc install=bash)\"\n")
    preflight(["-sc", "install=bash"])  # left to Hydra


DIRECTORIES = [("output.dir", "{f}/run", "Not a directory"), ("cache_dir", "{f}", "is a file, not a directory"),
               ("cache_dir", "{f}/cache", "a_file' is a file, so"), ("output.dir", "/proc/rlhflab", "No such file or directory")]


def test_a_directory_that_cannot_be_made_is_one_line_before_the_run(tmp_path, make_cfg):
    """output.dir or cache_dir on a path that cannot hold a directory stopped at a FileNotFoundError or
    NotADirectoryError traceback (after the MLflow run existed, for cache_dir). The command line for one of them;
    train() for each (what the command line prints is its ConfigError)."""
    from rlhflab.errors import ConfigError
    from rlhflab.train import train

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    key, value, says = DIRECTORIES[0]
    out = run_cli(f"{key}={value.format(f=a_file)}", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.startswith(f"error: {key}: ") and says in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "Traceback" not in out.stderr
    assert not (tmp_path / "mlflow.db").exists()  # before any run
    for key, value, says in DIRECTORIES:
        cfg = make_cfg(f"{key}={value.format(f=a_file)}")
        with pytest.raises(ConfigError) as err:
            train(cfg)
        assert str(err.value).startswith(f"{key}: ") and says in str(err.value), (key, value, str(err.value))
        assert not (tmp_path / "mlflow.db").exists()  # make_cfg's database: before any run


UNTYPED = """_target_: rlhflab.algos.registry.RLOO
samples_per_prompt: 4
kl_coef: 0.05
kl_estimator: k1
clip_eps: 0.2
loss_agg: seq-mean-token-sum
epochs: 1
num_minibatches: 1
"""


@pytest.mark.parametrize("schema, key", [(None, "algo=mine: its config has no schema"),
                                         ("/schema/algo/mine", "algo=mine: its defaults start from /schema/algo/mine, which no schema registers")])
def test_an_option_of_ones_own_without_a_schema_fails_in_one_line(tmp_path, schema, key):
    """A new conf/algo/X.yaml (docs/ALGORITHMS.md, Adding an algorithm) without its schema line had none of its values
    checked (algo.kl_coef=abc failed as a tensor TypeError after the stages ran); with a schema nobody registered,
    Hydra's words were "In 'algo/mine': Could not load 'schema/algo/mine'"."""
    (tmp_path / "conf" / "algo").mkdir(parents=True)
    head = f"defaults:\n  - {schema}@_here_\n  - _self_\n" if schema else ""
    (tmp_path / "conf" / "algo" / "mine.yaml").write_text(head + UNTYPED)
    out = run_cli("algo=mine", "algo.kl_coef=abc", f"hydra.searchpath=[file://{tmp_path}/conf]", f"cache_dir={tmp_path}/cache",
                  cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith(f"error: {key}"), out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "SCHEMAS['algo']" in out.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "cache").exists()
    typed = (tmp_path / "conf" / "algo" / "mine.yaml")
    typed.write_text("defaults:\n  - /schema/algo/rloo@_here_\n  - _self_\n" + UNTYPED)
    out = run_cli("algo=mine", "algo.kl_coef=abc", f"hydra.searchpath=[file://{tmp_path}/conf]", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("error: algo.kl_coef: 'abc' is not a number"), out.stderr


@pytest.mark.skipif(shutil.which("srun") is not None, reason="this machine is a SLURM cluster: the launcher can submit")
def test_the_slurm_launcher_off_a_cluster_fails_in_one_line(tmp_path):
    """Off a SLURM cluster, `-m hydra/launcher=slurm` (README, Distributed training) ended in submitit's traceback
    ('Could not detect "srun"'), exit 1, after the sweep's MLflow parent run was made."""
    out = run_cli("-m", "hydra/launcher=slurm", "hydra.launcher.partition=gpu", "algo=rloo,grpo", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("error: hydra/launcher=slurm: this machine has no srun"), out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and not (tmp_path / "mlflow.db").exists()


def test_the_settings_read_from_an_option_file_are_the_ones_it_composes_to():
    """A misspelt key (algo.kl_coeff) is told which options have it: each option of the group was composed (~0.45 s
    each: 4 s for algo's 7, against the README's 'under a second'; a misspelt model.arch key 3 s for model's 9 on the
    AVX2-only EPYC); the settings, and those under a free mapping (model.arch.hidden_size), are now read from the
    option's file and schema, which must give what composing gives, or say it cannot tell."""
    from omegaconf import OmegaConf

    from rlhflab.cli import CONFIG_DIR, _option_has, compose, option_files
    from rlhflab.schema import SCHEMAS, register

    register()
    read = nested = 0
    for group in (g for g in SCHEMAS if (CONFIG_DIR / g).is_dir()):
        for option, path in option_files(group).items():
            composed = OmegaConf.to_container(OmegaConf.select(compose([f"{group}={option}"]), group), resolve=False)
            settings = {k for k in composed if not k.startswith("_")}
            if _option_has(path, "no_such_setting") is None:
                continue
            for name in settings | {"no_such_setting"}:
                assert _option_has(path, name) is (name in settings), (group, option, name)
            read += 1
            for head, value in composed.items():  # under a mapping: each key it holds, and one it does not
                below = list(value) if isinstance(value, dict) else []
                for name in [*below, "no_such_setting"]:
                    given = _option_has(path, f"{head}.{name}")
                    assert given in (None, name in below), (group, option, head, name, given)
                    nested += given is not None
    assert read >= 30  # all but the few that only composing can tell (mode=async's package, a file of defaults)
    assert nested >= 20  # model.arch's keys, and its absence where a preset loads its model (arch: null)


def test_help_lists_groups_options_and_their_comments(tmp_path):
    out = run_cli("--help", cwd=tmp_path)
    assert out.returncode == 0
    assert "powered by Hydra" not in out.stdout
    for text in ("algo", "*rloo", "RLOO (Ahmadian et al., 2024)", "memory", "hydra", "off_policy", "decoupled", "experiment=quick"):
        assert text in out.stdout, text
    words = out.stdout.split()
    for path in (ROOT / "conf").glob("*/*.yaml"):  # every option, its name apart from its text
        shown = f"{path.parent.name}={path.stem}" if path.parent.name in ("experiment", "debug") else path.stem
        assert shown in words or f"*{shown}" in words, shown
    # a nested option (reward=examples/reverse, in conf/reward/examples/) was left out
    assert "examples/reverse" in words and "The reverse example's reward (experiment=reverse): your functions" in " ".join(words)
    # Hydra's launcher and sweeper groups, which the README's table lists, were left out
    for group in ("launcher", "sweeper"):
        assert f"hydra/{group}" in words and "*basic" in words
        for path in (ROOT / "conf" / "hydra" / group).glob("*.yaml"):
            assert path.stem in words, path
    # a comment's first sentence is shown whole, however many lines it spans in the file
    assert "[algo=... memory=... mode=async ...]." in " ".join(words)
    # an abbreviation's period does not end it ("Dr." once cut dr_grpo's to "Dr.")
    assert "Dr. GRPO (Liu et al., 2025): GRPO without std scaling, one token mean over the batch (DAPO's)." in " ".join(words)
    # resume, ranks and one's own data were nowhere in it: each named, with the guide it points to (which exists)
    for key in ("resume=auto", "checkpoint.every_n_steps=N", "trainer=ddp", "trainer.devices=N", "task.path=<file>"):
        assert key in out.stdout, key
    guides = re.findall(r"docs/\w+\.md", out.stdout)
    assert len(guides) == 3 and all((ROOT / g).is_file() for g in guides), guides


def test_help_summary_is_the_first_sentence_past_abbreviations(tmp_path):
    from rlhflab.cli import _summary

    option = tmp_path / "x.yaml"
    option.write_text("# @package _global_\n# Dr. X, i.e. a test vs. e.g. Y (cf. Z et al. 2024). Second\n# sentence.\nkey: 1\n")
    assert _summary(option) == "Dr. X, i.e. a test vs. e.g. Y (cf. Z et al. 2024)."
    option.write_text("# One line without a period\nkey: 1\n")
    assert _summary(option) == "One line without a period"


# Commands the docs show that are not meant to run here: placeholders, a cluster, files of your own, the
# recipe's algorithm before you write it.
NOT_HERE = ("<", "...", "[", "hydra/launcher=slurm", "data/train.jsonl", "algo=reinforce ")


def doc_commands() -> list[tuple[str, list[str]]]:
    """Every `python src/train.py ...` the README, docs/ and conf/'s comments show (continued lines joined), as
    (file, argv)."""
    import re
    import shlex

    found = {}
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "conf").rglob("*.yaml"))]:
        text = re.sub(r"\\\n\s*", " ", md.read_text())
        for match in re.finditer(r"python src/train\.py([^`\n]*)", text):
            args, quote = "", None
            for char in match.group(1):  # up to a comment, a "(note)", a pipe, each outside quotes
                if quote is None and char in "|#;&(":
                    break
                quote = (None if char == quote else quote) if quote else (char if char in "'\"" else None)
                args += char
            args = args.strip()
            if not any(marker in args + " " for marker in NOT_HERE):
                found.setdefault(args, md.name)
    return [(name, shlex.split(args)) for args, name in found.items()]


@pytest.mark.slow
def test_every_command_in_the_docs_passes_the_preflight(tmp_path):
    """A doc command that composes to an error is a user's first error (docs/SWEEPS.md's first sweep swept
    algo.kl_coef over grpo, whose KL weight is algo.kl_loss_coef). They run where the repository's files are, but not
    what runs wrote: once a user ran SWEEPS.md's `-m seed=0,1,2 'output.dir=runs/seeds/${hydra:job.num}'`, its
    runs/seeds/0 failed the same command here (a rerun into a saved policy)."""
    commands = doc_commands()
    assert len(commands) >= 30
    for path in ROOT.iterdir():  # the sources, docs and examples; no runs/, multirun/, outputs/ or mlflow.db
        if path.name in ("conf", "docs", "examples", "plugins", "src", "pyproject.toml", "README.md"):
            (tmp_path / path.name).symlink_to(path)
    out = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps([argv for _, argv in commands]), cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    failed = [f"{name}: python src/train.py {' '.join(argv)}: {row['stderr'].strip()}"
              for (name, argv), row in zip(commands, json.loads(out.stdout.splitlines()[-1])["rows"]) if row["code"] not in (0, None)]
    assert not failed, "\n".join(failed)


def test_a_tracking_server_that_is_not_there_is_one_line(tmp_path):
    """MLflow's client retried an unanswered http tracking URI for minutes ('Retrying (Retry(total=...') before it
    failed; a timeout's SIGTERM then reported a KILLED MLflow run that never existed. One line, for a run and for
    every job of a sweep, before anything loads; any HTTP answer at /health (a proxy's 404 too) is MLflow's."""
    import http.server
    import socket
    import threading

    from rlhflab.naming import check_server

    with socket.socket() as probe:  # a port nothing listens on: bound, not listening, so no other test takes it
        probe.bind(("127.0.0.1", 0))  # (closed before, it went to test_failures' server on the other xdist worker)
        port = probe.getsockname()[1]
        for args in (["trainer.max_steps=5"], ["-m", "seed=0,1"]):
            out = run_cli(f"logger.tracking_uri=http://127.0.0.1:{port}", *args, cwd=tmp_path)
            assert out.returncode == 2 and out.stderr.startswith(
                f"error: logger.tracking_uri: no MLflow server answers at http://127.0.0.1:{port} ([Errno 111] "
                "Connection refused)"), out.stderr
            assert out.stderr.strip().splitlines() == [out.stderr.strip()] and not (tmp_path / "mlflow.db").exists()
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501 to a GET
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        check_server(f"http://127.0.0.1:{server.server_port}")  # an answer, whatever it says: MLflow's to judge
        check_server(f"http://alice:s3cr3t@127.0.0.1:{server.server_port}/")  # credentials are not a host to resolve
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    check_server("sqlite:///mlflow.db")  # not a server


@pytest.mark.parametrize("args, line", [
    (["experiment=reverse"], "error: task.path: no such file 'examples/reverse/train.jsonl' (relative to {cwd}); give a"),
    (["task=prompts", "task.path=data/x.jsonl"], "error: task.path: no such file 'data/x.jsonl' (relative to {cwd}); give a"),
    (["task.words_file=w.json"], "error: task.words_file: no such file 'w.json' (relative to {cwd}); point it at"),
    (["task=prompts", f"task.path={ROOT}/examples/reverse/train.jsonl", "reward=function", "reward.fn=r.py:score"],
     "error: reward.fn: no such file 'r.py' (relative to {cwd}) (from 'r.py:score'); give an existing .py file"),
])
def test_a_relative_path_that_is_not_there_says_where_it_was_looked_for(tmp_path, args, line):
    """`python src/train.py experiment=reverse` outside the repository root said only "no such file
    'examples/reverse/train.jsonl'", which exists, in the repository: relative paths are read from the working
    directory, which the line now names (the first three in the preflight, reward.fn in the run's validation)."""
    out = subprocess.run([sys.executable, str(ROOT / "src" / "train.py"), *args], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    said = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert len(said) == 1 and said[0].startswith(line.format(cwd=tmp_path)), said


def test_the_optuna_sweeper_not_installed_is_one_line_naming_the_extra(tmp_path):
    """hydra-optuna-sweeper is the dev extra's. Without it, hydra/sweeper=rlhflab_optuna was Hydra's "In
    'hydra/sweeper/rlhflab_optuna': Could not load 'hydra/sweeper/optuna'", after five lines of Hydra's warning that
    rlhflab's plugin was 'incompatible with this Hydra version or buggy'. Hidden here as an absent package is."""
    code = ("import sys\n"
            "sys.modules['hydra_plugins.hydra_optuna_sweeper'] = None\n"
            "sys.argv = ['train.py']\n"
            "from rlhflab.cli import preflight\n"
            "preflight(['-m', 'hydra/sweeper=rlhflab_optuna', 'algo.kl_coef=interval(0.01,0.1)'])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr == (
        "error: hydra/sweeper=rlhflab_optuna: Optuna's sweeper is not installed (hydra-optuna-sweeper, which `pip install "
        "-e \".[dev]\"` installs); install it, or sweep lists of values with Hydra's basic sweeper (sweep job: "
        "hydra/sweeper=rlhflab_optuna algo.kl_coef=0.01)\n"), out.stderr


def test_an_infinite_limit_that_only_switches_it_off_passes(monkeypatch, tmp_path):
    """inf where it means no limit (no gradient clipping, no ratio clipping, no KL budget, no cap) is still allowed."""
    from rlhflab.cli import preflight

    monkeypatch.chdir(tmp_path)
    preflight(["rl.max_grad_norm=inf", "algo.clip_eps=inf", "kl_budget=inf", "off_policy=tis", "off_policy.cap=inf"])
