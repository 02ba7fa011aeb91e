"""Shared fixtures: compose the real config, shrink it, point caches and MLflow at tmp dirs."""

from __future__ import annotations

import json
import os

from rlhflab import startup

if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker, which imports every test module as it collects: see
    startup.pause()  # pytest_collection_finish (the controller collects nothing, and -n 0 is left as it is)

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see docs/ENV.md
if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist's workers export COLUMNS=80 and LINES=24. The runs these tests start are piped, as a cluster
    # job's, whose environment sets neither (an 80-column RL progress bar wraps into padded lines).
    for _var in ("COLUMNS", "LINES"):
        os.environ.pop(_var, None)

import signal
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

from rlhflab.schema import register

register()  # the group schemas, as src/train.py registers them


def pytest_collection_finish(session) -> None:
    """A worker imported torch, Lightning, transformers and MLflow as it collected: as src/train.py's run, with the
    collector paused, then those objects frozen (rlhflab/startup.py), so each full collection while the tests run
    walks what they make."""
    startup.resume()

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")

# Small enough for seconds per stage, large enough that RL still visibly learns.
SHRINK = [
    "task.num_train_prompts=512",
    "task.num_eval_prompts=32",
    "task.num_demonstrations=512",
    "task.num_preference_pairs=1024",
    "stages.sft.epochs=2",
    "stages.rm.epochs=4",
    # the stages' batches and rates these tests were written against (the defaults' before 128 at 2e-3): 16 SFT and
    # 60 RM steps on the data above, where 128 would halve them
    "stages.sft.batch_size=64",
    "stages.sft.lr=1e-3",
    "stages.rm.batch_size=64",
    "stages.rm.lr=1e-3",
    # one torch thread a stage, as every test ran them before stages.torch_threads (null: all cores), so that the two
    # xdist workers' stages do not run 2 + 2 threads on 2 cores
    "stages.torch_threads=1",
    "stages.batch_threads=1",  # one forward a batch, as before stages.batch_threads (tests/test_stage_threads.py: 2)
    "rl.prompts_per_step=16",
    "rl.eval_every=0",
    "rl.log_generations=4",
    "trainer.enable_progress_bar=false",
]


def compose_cfg(overrides: list[str] = (), shrink: bool = True) -> DictConfig:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="train", overrides=(SHRINK if shrink else []) + list(overrides))


def tokenizer_without_pad(unk: bool = False, specials: tuple[str, ...] = (), bos: bool = False):
    """A character tokenizer for the reverse example's text (digits and '=') with BOS and EOS and no pad token, as
    many hub tokenizers: with `unk` an unknown token as Llama 1/2's, with reserved `specials` as Llama 3's, else
    none (GPT-2's and Pythia's unknown token is their EOS). With `bos`, `tokenizer(text)` starts with BOS, as
    Llama's and Gemma's do (GPT-2's, Pythia's and Qwen's do not)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<s>", "</s>", *(["<unk>"] * unk), *specials, *sorted("0123456789=")])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>" if unk else "</s>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    backend.decoder = decoders.Fuse()
    if bos:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>" if unk else None, additional_special_tokens=list(specials))
    assert tokenizer.pad_token is None
    return tokenizer


def save_tiny_neox(path: Path, reward: bool = False, tokenizer=None) -> Path:
    """A GPT-NeoX model (Pythia's architecture) of one layer with the sentiment task's tokenizer (or `tokenizer`),
    saved as from_pretrained reads it: a causal LM, or with `reward` a sequence classifier of one output."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

    from rlhflab.tasks.sentiment import SentimentTask

    words = tokenizer or SentimentTask().build_tokenizer()
    config = GPTNeoXConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, pad_token_id=words.pad_token_id, num_labels=1)
    (GPTNeoXForSequenceClassification if reward else GPTNeoXForCausalLM)(config).save_pretrained(path)
    words.save_pretrained(path)
    return path


# its decoder layers' linear modules, as memory.target_modules names them
NEOX_LINEAR = "dense, dense_4h_to_h, dense_h_to_4h, query_key_value"


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of a run's metric, by step."""
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def run_id_of(out: Path) -> str:
    """The MLflow run of the run whose output directory is `out`."""
    return json.loads((out / "mlflow_run.json").read_text())["run_id"]


def tensors(path: Path) -> dict:
    """Every tensor of the safetensors files in `path`, by name."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.fixture(scope="session")
def stage_cache(tmp_path_factory) -> Path:
    """One cache for the whole session: the tiny model, SFT and RM are trained once. Under pytest-xdist its
    workers share it (the cache's lock makes the second to need an entry wait for the first to write it)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "rlhflab-cache"  # this session's, beside each worker's
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("rlhflab-cache")


@pytest.fixture(scope="session", autouse=True)
def mlflow_migrated_once(tmp_path_factory, stage_cache):
    """MLflow gives a new SQLite store its schema by running its ~50 migrations (alembic): 2-4 s per store on this
    machine, and most tests make one (their own tmp_path/mlflow.db). rlhflab's runs with the session's stage cache
    (in the test process, and the CLI's subprocesses) copy the cache's empty store instead (store_template.seed_store);
    it is made here once, by MLflow's migrations, as a run makes it. A store a test opens with MLflow itself (a
    client of its own) gets the same copy when MLflow would migrate it (sqlite3's backup API); MLflow then goes
    on as usual (its schema check, its default experiment). A test marked `mlflow_migrations` gets MLflow's own
    creation (what it does, e.g. on a full disk, is what it tests)."""
    import mlflow.store.db.utils as db_utils
    import sqlalchemy

    from rlhflab.store_template import copy_database, store_template
    from rlhflab.tracking import ensure_experiment

    template = store_template(stage_cache)
    migrate = db_utils._initialize_tables
    if not template.exists():  # the first worker to get here (a second makes its own, kept whole or not at all)
        with warnings.catch_warnings():  # SQLAlchemy's deprecations inside MLflow's migration scripts
            warnings.simplefilter("ignore")
            ensure_experiment(f"sqlite:///{tmp_path_factory.mktemp('first-store')}/mlflow.db", "rlhflab", stage_cache)

    def initialize_tables(engine) -> None:
        if engine.dialect.name != "sqlite" or sqlalchemy.inspect(engine).get_table_names():
            return migrate(engine)  # another database, or a partial store: MLflow's own way
        copy_database(template, Path(engine.url.database))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(db_utils, "_initialize_tables", initialize_tables)
        yield migrate


@pytest.fixture(autouse=True)
def _mlflow_migrations(request, mlflow_migrated_once, monkeypatch):
    """A test marked `mlflow_migrations` gets MLflow's own creation of a new store, not the migrated copy."""
    if request.node.get_closest_marker("mlflow_migrations"):
        import mlflow.store.db.utils as db_utils

        monkeypatch.setattr(db_utils, "_initialize_tables", mlflow_migrated_once)


def counting_migrations(monkeypatch) -> list[str]:
    """The databases MLflow gives its tables by running its migrations in this process (a new store it makes itself)."""
    import mlflow.store.db.utils as db_utils

    migrate, made = db_utils._initialize_tables, []
    monkeypatch.setattr(db_utils, "_initialize_tables", lambda engine: (made.append(engine.url.database), migrate(engine))[1])
    return made


@pytest.fixture
def make_cfg(stage_cache, tmp_path):
    """Compose + shrink + isolate (own MLflow db per test, shared stage cache). Each config made gets its own
    output.dir, as Hydra gives each run its own directory (a new run is refused one that holds another run's policy):
    the first tmp_path/run, the next run-2, run-3, ...; one that resumes (resume=...) goes on in tmp_path/run."""
    made = []

    def make(*overrides: str, shrink: bool = True) -> DictConfig:
        cfg = compose_cfg([f"cache_dir={stage_cache}", *overrides], shrink=shrink)
        with open_dict(cfg):
            cfg.logger.tracking_uri = f"sqlite:///{tmp_path}/mlflow.db"
            if cfg.output.dir is None:
                made.append(cfg)
                cfg.output.dir = str(tmp_path / ("run" if cfg.resume or len(made) == 1 else f"run-{len(made)}"))
        return cfg

    return make


TRAIN = str(ROOT / "src" / "train.py")


def _terminal_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # in the child, before exec: Python installs its handler over it


@contextmanager
def cli_run(args: list[str], cwd: Path, env: dict | None = None, stderr=subprocess.STDOUT):
    """`python src/train.py ARGS` in its own process group, its stdout a pipe (with its stderr: 2>&1, or `stderr`);
    the group is always killed on exit, so no learner or generator outlives the test, whatever it asserted. It starts
    with SIGINT as a terminal's foreground command has it: a suite started in the background (`cmd &` in a script, a
    CI runner) passes SIG_IGN down, and Python then raises no KeyboardInterrupt before rlhflab's own handler is installed."""
    proc = subprocess.Popen([sys.executable, TRAIN, *args], cwd=cwd, env=os.environ | (env or {}), stdout=subprocess.PIPE,
                            stderr=stderr, text=True, start_new_session=True, preexec_fn=_terminal_signals)
    try:
        yield proc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        if proc.stdout:
            proc.stdout.close()


def wait_for(predicate, timeout: float, what: str, proc=None, poll: float = 0.2):
    """Poll `predicate` until it is true (an event), failing after `timeout` or when `proc` ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before {what}:\n{proc.stdout.read()[-4000:]}")
        time.sleep(poll)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


def on_two_gloo_ranks(fn, store: Path, *args) -> list:
    """fn(rank, *args) in each of two forked processes that form one gloo group (through the file `store`): their
    return values, by rank (lists and numbers: a tensor would be shared by file descriptor and die with its process).
    A rank's exception fails the test at once with its repr, not after a timeout; the processes always end."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(fn, rank, str(store), args, results)) for rank in (0, 1)]
    try:
        for p in procs:
            p.start()
        got = sorted((results.get(timeout=120) for _ in procs), key=lambda g: g[0])
    finally:
        for p in procs:
            p.kill()
            p.join()
    failed = [error for _, _, error in got if error]
    assert not failed, failed
    return [value for _, value, _ in got]


def _gloo_rank(fn, rank: int, store: str, args: tuple, results) -> None:
    import torch

    try:
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        results.put((rank, fn(rank, *args), None))
    except BaseException as err:
        results.put((rank, None, repr(err)))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)
