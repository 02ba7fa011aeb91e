"""`train(cfg)`: validate, run the stages that are missing, then RL; save the policy; all tracked in MLflow.

A run writes into its output directory (`output.dir`, by default Hydra's run directory):
`policy/` (the trained policy, loadable with from_pretrained), `checkpoints/` (to resume
with `resume=auto`) and `mlflow_run.json` (which MLflow run it is). It ends FINISHED,
FAILED or KILLED in MLflow and with exit code 0, 1 (2 for bad input) or 128 + the signal.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shlex
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from rlhflab import distributed, startup
from rlhflab.callables import source_keys
from rlhflab.config import Plan, check_devices, check_task_data, check_trainer, validate
from rlhflab.errors import (ONE_LINE, ConfigError, NonFiniteError, RankLost, RewardError, RunInterrupted, TrackingLost,
                            WriteFailed, writing)
from rlhflab.interrupts import STOP, as_interrupt
from rlhflab.lit import checkpoint as ckpt
from rlhflab.lit.progress import StageProgressBar
from rlhflab.lit.reference import WORKERS
from rlhflab.lit.rl_module import RLHFModule, trainer_autocast
from rlhflab.models import attention
from rlhflab.models.build import check_arch, check_vocabulary, ensure_base_model, load_tokenizer
from rlhflab.models.checks import check_hub, check_hub_dataset
from rlhflab.naming import ERROR_TAG, MAX_TAG, RUN_RECORD, STOP_TAG, absolute_uri, redact
from rlhflab.quiet import quiet_libraries
from rlhflab.rng import fixed_seed
from rlhflab.schema import ranks, trainer_devices, writable_dir
from rlhflab.stages.pipeline import run_stages
from rlhflab.tracking import UNWRITTEN, MlflowTracker

log = logging.getLogger("rlhflab")
LOCK_FILE = ".rlhflab.lock"  # in the output directory: which process runs there


@dataclass
class Result:
    metrics: dict[str, float]
    module: RLHFModule | None  # for callers (tests) that inspect the trained models; None where nothing was trained
    run_id: str
    output_dir: Path


def hydra_overrides() -> list[str]:
    """The command line's overrides when Hydra runs us (none for a train(cfg) call)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def output_dir(cfg: DictConfig) -> Path:
    """output.dir, else Hydra's run directory, else a new outputs/<date>/<time> (a train(cfg) call)."""
    from hydra.core.hydra_config import HydraConfig

    if cfg.output.dir:
        path = Path(cfg.output.dir)
    elif HydraConfig.initialized():
        path = Path(HydraConfig.get().runtime.output_dir)
    else:
        now = datetime.now()
        path = Path("outputs") / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S-%f")
    return writable_dir("output.dir", path).resolve()


@contextmanager
def output_lock(out: Path, key: str):
    """One run at a time in an output directory, held by rank 0 for the run: a second run there (the same
    output.dir or hydra.run.dir twice by mistake) overwrote the first's policy/, checkpoints and
    mlflow_run.json while both trained. It is now one line before any model loads."""
    if not distributed.is_main():  # the other ranks of this run
        yield
        return
    handle = open(out / LOCK_FILE, "a+")
    try:
        try:
            # A POSIX record lock: a forked child (the async generator) does not inherit it, so a learner that was
            # SIGKILLed frees the directory at once, whatever its generator is still doing.
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):
            handle.seek(0)
            holder = handle.read().strip() or "?"
            raise ConfigError(f"{key}: {out} is in use by another run (pid {holder}); give this run another {key}, "
                              "or wait for that one to end") from None
        except OSError:  # a filesystem without locks: run unguarded, as before
            pass
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        yield
    finally:
        handle.close()  # and with it the lock


def relaunch_as_one_job(cfg: DictConfig, out: Path) -> None:
    """Lightning starts the other ranks by running this process's command line again. In a sweep job
    that line is the whole sweep (-m a=1,2 ...): make it this job's overrides, in this job's directory."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    distributed_trainer = trainer_devices(cfg.trainer) not in (1, "auto") or cfg.trainer.num_nodes > 1
    if not (distributed_trainer and HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN):
        return
    hydra_cfg = HydraConfig.get()
    sys.argv = [sys.argv[0], *hydra_cfg.overrides.task, f"output.dir={out}"]
    OmegaConf.set_readonly(hydra_cfg, False)
    hydra_cfg.run.dir = str(out)  # Lightning passes it on as hydra.run.dir


def _make_trainer(cfg: DictConfig, logger, stage: str, callbacks=(), **overrides):
    bar = [StageProgressBar(stage)] if cfg.trainer.enable_progress_bar else []
    return instantiate(cfg.trainer, logger=logger, callbacks=[*bar, ckpt.SignalsOurs(), *callbacks], **overrides)


def check_job(cfg: DictConfig) -> Plan:
    """The checks that read no model, no hub and no MLflow store: validate's (every check that needs no model), the
    GPUs it asks for are here, Lightning takes the trainer's settings. train() makes them first; the command line's
    preflight makes them for each job of a sweep, before the sweep starts (cli.check_sweep_jobs)."""
    plan = validate(cfg)
    check_devices(cfg)
    check_trainer(cfg)
    return plan


def train(cfg: DictConfig) -> Result:
    """Run one experiment end to end. Raises ConfigError (one line) before loading any model."""
    plan = check_job(cfg)
    for key in ("name_or_path", "sft_path", "reward_model_path", "tokenizer"):
        check_hub(f"model.{key}", cfg.model.get(key))  # hub ids: cached, or the hub answers (before any run exists)
    check_hub("task.gold_model_path", cfg.task.get("gold_model_path"))
    for key in ("path", "eval_path", "demonstrations_path", "preferences_path", "dataset"):
        check_hub_dataset(f"task.{key}", cfg.task.get(key))
    if hasattr(plan.task, "load") and plan.task.load():  # hub data read now: its missing split or column, too,
        check_task_data(cfg, plan.task, plan.reward)  # and what validate could not check yet
    quiet_libraries()
    plan.fitted = fit_tokenizer(cfg, plan.task)
    check_lora_targets(cfg, plan, lambda: plan.fitted[0] or plan.task.build_tokenizer())
    warn_unused_arch(cfg.model, hydra_overrides())
    if cfg.torch_threads:
        torch.set_num_threads(int(cfg.torch_threads))
    attention.configure(cfg.train_attention)  # before any model loads: the stages' forwards too
    torch.manual_seed(cfg.seed)
    if not distributed.is_main():  # one rank speaks: rank 0
        for name in ("", "rlhflab", "lightning", "lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).setLevel(logging.WARNING)
    out = output_dir(cfg)
    writable_dir("cache_dir", Path(cfg.cache_dir), make=False)  # made by the first entry it caches
    key = "output.dir" if cfg.output.dir else "hydra.run.dir"  # what chose `out`, for the messages about it
    # One run at a time in a directory; what follows may read its checkpoints.
    with output_lock(out, key):
        return _train_job(cfg, plan, out, key)


def _train_job(cfg: DictConfig, plan: Plan, out: Path, key: str) -> Result:
    """train(cfg) from the checkpoint it resumes on: the MLflow run, the stages and RL, its end."""
    if cfg.resume == "auto" and (out / UNWRITTEN).is_file():  # it trained to the end: nothing to train or load
        return end_unwritten_run(cfg, plan.tracker, out)
    if not cfg.resume:  # a finished run's directory: its policy first (its checkpoints' line would offer resume=auto)
        check_saved_policy(None, None, out, key)
    resume = ckpt.find(cfg.resume, out, cfg, key)
    if cfg.resume:  # resume=auto with no checkpoint left, or a branch from another directory: a new line too
        check_saved_policy(cfg.resume, resume, out, key)
    check_budget_reaches(cfg, plan, resume, out, key)
    plan.data = plan.task.data_keys() if hasattr(plan.task, "data_keys") else {}
    ckpt.check_same_data(resume, plan.data)
    plan.code = code_keys(plan)
    edited = ckpt.check_same_code(resume, plan.code)
    ckpt.announce(resume, cfg.resume, out)
    tracker = plan.tracker
    relaunch_as_one_job(cfg, out)
    with distributed.one_job(on_lost=tracker.finish, how_to_continue=lambda: how_to_continue(cfg, out, run_made=True)), STOP.installed():
        status = "FAILED"
        try:  # from the run's start: a signal that lands while it logs its params still ends it KILLED
            if distributed.is_main():  # the other ranks log nothing to MLflow (their tracker has no run)
                tags, continued = plan.tags, None
                if resume and resume.forked:
                    tags = {**tags, "rlhflab.resumed_from_run": str(resume.state.get("run_id")),
                            "rlhflab.resumed_from": str(resume.path.resolve())}
                elif resume:
                    continued = resume.state["run_id"]
                    missing = tracker.cannot_continue(continued, out)
                    if missing:  # MLflow's 'Run with id=... not found' traceback, after the checkpoint was read
                        raise ConfigError(f"resume: {resume.path} continues a run, but {missing}; point logger.tracking_uri "
                                          "(or MLFLOW_TRACKING_URI) at the store that holds it, or continue as a new MLflow "
                                          f"run in another directory: resume={resume.path} output.dir=<another dir>")
                run_id = tracker.start(cfg, tags, hydra_overrides(), out, continued)
                if not continued:  # a run this directory's last process left RUNNING, dead before any checkpoint
                    tracker.end_left_running(out)
                tracker.end_runs_gone()  # and any other its experiment holds whose process is gone (SIGKILL)
                if continued and edited:  # the steps after the checkpoint are retrained on other rewards
                    tracker.log_again_after(resume.updates)
                    tracker.set_tag("rlhflab.edited_at_step", f"{resume.updates}: {', '.join(edited)}"[:MAX_TAG])
                if continued:  # what the stopped run could not write (its store stopped answering), first
                    tracker.replay(resume.state.get("unwritten_metrics", []), resume.state.get("unwritten_tags", {}))
                (out / RUN_RECORD).write_text(json.dumps({"run_id": run_id, "tracking_uri": redact(absolute_uri(tracker.tracking_uri)),
                                                                 "experiment": tracker.experiment_name}, indent=1))
            result = _run(cfg, plan, tracker, out, resume)
            status = "FINISHED"
        except BaseException as err:
            interrupted = as_interrupt(err)
            if interrupted is None:
                said = distributed.as_rank_error(err)  # which rank says it; a lost rank in one line
                # as a sweep's failed child has it: a single run showed FAILED in the UI and not why
                tracker.set_tag(ERROR_TAG, f"{type(said).__name__}: {said}"[:MAX_TAG])
                if said is err:
                    raise
                raise said from None
            distributed.claim_end("run")
            tracker.set_tag(STOP_TAG, str(interrupted))  # which signal; a closed output pipe says so
            status = "KILLED"
            raise interrupted from None
        finally:
            with STOP.ending_run():  # a signal here waits: stopped in the middle, the MLflow run stayed RUNNING
                STOP.run_made = bool(tracker.run_id)  # set from its start on: a stop while it logged its params made one too
                plan.source.close()
                tracker.finish(status)
            STOP.ended = status if tracker.run_id and tracker.lost is None else None
            STOP.lost = f"{redact(tracker.tracking_uri)} stopped answering ({tracker.lost})" if tracker.lost else None
            if STOP.signum is not None and status == "FAILED":  # the run ended as it was to, and then the stop (a
                raise RunInterrupted(STOP.signum) from sys.exc_info()[1]  # sweep stops too); main names its error
    if tracker.lost:  # trained to the end, but the store stopped answering: what it did not take goes to a file
        kept = out / UNWRITTEN
        kept.write_text(json.dumps(tracker.ended_unwritten()))
        raise TrackingLost(f"mlflow: {redact(tracker.tracking_uri)} stopped answering ({tracker.lost}); the run trained to "
                           f"the end (policy: {out / 'policy'}), but its MLflow run {tracker.run_id} is not ended and "
                           f"{len(tracker.pending)} metric values are in {kept} instead", checkpointed=False)
    if STOP.signum is not None:  # a signal after RL's last step boundary (its final eval, or as the run ended), which
        raise RunInterrupted(STOP.signum)  # it trained to the end through: a sweep stops here too
    return result


def end_unwritten_run(cfg: DictConfig, tracker: MlflowTracker, out: Path) -> Result:
    """resume=auto in the directory of a run that trained to the end while its store stopped answering (TrackingLost:
    the policy saved, the metrics the store did not take in UNWRITTEN, the MLflow run left RUNNING with no way to
    end it): once the store answers, those metrics are written, every step once, the policy and generations.json
    it could not copy are logged, and the run ended FINISHED. Nothing is loaded or trained."""
    kept = out / UNWRITTEN
    try:
        run_id = json.loads((out / RUN_RECORD).read_text())["run_id"]
        ended = json.loads(kept.read_text())
        rows, tags = list(ended["metrics"]), dict(ended["tags"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"resume=auto: {kept} or {out / RUN_RECORD} cannot be read ({err}), so the metrics its run could "
                          f"not write cannot be written now; remove {kept} to leave them") from None
    missing = tracker.cannot_continue(run_id, out)
    if missing:
        raise ConfigError(f"resume=auto: {kept} holds metrics of a run that trained to the end, but {missing}; point "
                          "logger.tracking_uri (or MLFLOW_TRACKING_URI) at the store that holds it")
    tracker.when_lost = f"they stay in {kept}"
    written = tracker.write_unwritten(run_id, rows, tags)
    if not tracker.lost:
        held = {a.path for a in tracker.client.list_artifacts(run_id)}
        generations = out / "generations.json"
        if "generations.json" not in held and generations.is_file():
            tracker.log_generations(json.loads(generations.read_text()))
        if cfg.output.log_policy and "policy" not in held and (out / "policy").is_dir():
            tracker.log_artifacts(out / "policy", "policy")
        tracker.finish("FINISHED")
    if tracker.lost:
        raise TrackingLost(f"mlflow: {redact(tracker.tracking_uri)} still does not answer ({tracker.lost}); the "
                           f"{len(rows)} metric values stay in {kept} and the MLflow run {run_id} is not ended",
                           checkpointed=False)
    kept.unlink()
    log.info("mlflow: wrote the %d metric values %s kept and ended run %s FINISHED; it had trained to the end "
             "(policy: %s). %s", written, kept.name, run_id, out / "policy", browse_hint(tracker))
    return Result(metrics=tracker.client.get_run(run_id).data.metrics, module=None, run_id=run_id, output_dir=out)


def fit_tokenizer(cfg: DictConfig, task, base_path: str | None = None) -> tuple | None:
    """(the policy's tokenizer, the counts task.setup logs): the task's prompts rendered against it (chat template,
    prompt budgets), its vocabulary checked on them, and enough prompts left for a step. Where the model is given
    (model.sft_path or model.name_or_path), train() reads its tokenizer (or model.tokenizer) before the MLflow run is
    made: a tokenizer made for other text, or prompts past the budget, were one line after a run had been made and
    ended FAILED. A model built from model.arch has the task's own tokenizer: train() sets the prompts up with it
    (tokenizer None), and _run reads its saved copy once the model is built (`base_path`), without setting them up
    again (200,000 prompts: 4.4 s)."""
    from transformers import AutoConfig

    model = cfg.model
    source = model.get("sft_path") or model.get("name_or_path") or base_path
    if not source:  # a base model _run will build: the task's own tokenizer judges the prompts now; _run reads its copy
        own = task.build_tokenizer()
        check_arch(OmegaConf.to_container(model.arch, resolve=True), own, cfg.memory.get("target_modules"))
        return None, fit_prompts(cfg, task, own)
    key = next((f"model.{k}" for k in ("tokenizer", "sft_path", "name_or_path") if model.get(k)), None)
    path = model.get("tokenizer") or source
    try:
        tokenizer = load_tokenizer(path, source)
    except ConfigError:
        raise
    except (OSError, ValueError) as err:  # transformers' 'Couldn't instantiate the backend tokenizer' traceback
        if key is None:
            raise
        raise ConfigError(f"{key}: no tokenizer can be read from '{path}' ({str(err).strip().splitlines()[0]}); save one "
                          "beside the model (tokenizer.save_pretrained), or give model.tokenizer=<its tokenizer>") from None
    try:
        rows = AutoConfig.from_pretrained(source).get_text_config().vocab_size
    except (OSError, ValueError):
        rows = None
    if key and rows and len(tokenizer) > rows:  # stage rm's IndexError ('index out of range in self'), after the run
        raise ConfigError(f"{key}: its tokenizer has {len(tokenizer)} tokens and the model ({source}) {rows} embedding "
                          "rows; give the tokenizer the model was trained with")
    if model.get("tokenizer"):
        warn_other_vocabulary(model.tokenizer, tokenizer, source)
    return tokenizer, fit_prompts(cfg, task, tokenizer)


def check_lora_targets(cfg: DictConfig, plan: Plan, policy_tokenizer) -> None:
    """memory.target_modules against the given models the memory strategy adapts, before the run (check_arch judges
    a model built from model.arch): the policy, model.sft_path or else model.name_or_path (of whose architecture
    stage sft's and hydra_sft's policies are), and memory=lora's critic where it is the backbone of a given
    model.reward_model_path (LoraMemory.build). `policy_tokenizer()`: the policy's tokenizer, read only for that
    critic's. A given model whose config cannot be read without a download is left to adapt, once it loads."""
    from rlhflab.memory.lora import LoraMemory, critic_of, critic_on_reward_model
    from rlhflab.models.build import check_given_targets

    targets = cfg.memory.get("target_modules")
    if targets is None or isinstance(targets, str):  # memory=full (no adapter); all-linear or a regex: peft's
        return
    check_given_targets(cfg.model.get("sft_path") or cfg.model.get("name_or_path"), targets)
    reward = cfg.model.get("reward_model_path")
    if not (reward and isinstance(plan.memory, LoraMemory) and plan.reward.needs_reward_model and plan.algo.needs_values):
        return
    try:
        tokenizer = policy_tokenizer()
    except Exception:  # a tokenizer that cannot be read: train() says so itself
        return
    if critic_on_reward_model(True, reward, tokenizer):
        from transformers import AutoModelForTokenClassification

        check_given_targets(reward, targets, AutoModelForTokenClassification, critic_of(reward), keep=targets)


def warn_unused_arch(model: DictConfig, overrides: list[str]) -> None:
    """model.arch.* given on the command line beside a model that is given was dropped without a word."""
    given = next((k for k in ("name_or_path", "sft_path") if model.get(k)), None)
    arch = [o.lstrip("+~").partition("=")[0] for o in overrides if o.lstrip("+~").startswith("model.arch.")]
    if given and arch:
        log.warning("%s: not used; model.%s=%s is the model (its own config.json), and model.arch builds one only where "
                    "neither model.name_or_path nor model.sft_path is given", ", ".join(arch), given, model[given])


def warn_other_vocabulary(given: str, tokenizer, source: str) -> None:
    """model.tokenizer of another vocabulary than the one saved with the model, within its rows: each id read as
    another token than the model learned, without a word (only more tokens than rows was refused)."""
    from rlhflab.models.build import saved_tokenizer

    try:
        own = saved_tokenizer(source)
    except (OSError, ValueError):  # none saved with the model: nothing to compare with
        return
    ours, theirs = tokenizer.get_vocab(), own.get_vocab()  # ours may add a pad token (load_tokenizer): not counted
    moved = sum(ours.get(token) != i for token, i in theirs.items())
    if moved:
        log.warning("model.tokenizer=%s: %d of the %d tokens of the tokenizer saved with %s have another id (or none) in "
                    "it, so the model reads them as other tokens; give the tokenizer it was trained with (or null for "
                    "its own)", given, moved, len(theirs), source)


def fit_prompts(cfg: DictConfig, task, tokenizer) -> dict:
    """task.setup(tokenizer) and the checks of what it kept; the counts it logs."""
    model = cfg.model
    counts = task.setup(tokenizer)  # chat templates and prompt budgets need the tokenizer
    check_vocabulary(tokenizer, task.prompts("eval"),
                     next((f"model.{k}" for k in ("tokenizer", "sft_path") if model.get(k)), "model.name_or_path"))
    if task.num_train_prompts < cfg.rl.prompts_per_step:
        raise ConfigError(f"rl.prompts_per_step={cfg.rl.prompts_per_step}: only {task.num_train_prompts} training prompts "
                          "remain; lower it, or keep more prompts (task.max_prompt_tokens, task.overlong=truncate)")
    return counts


def step_budget(cfg: DictConfig, plan: Plan) -> int:
    """trainer.max_steps in whole rollout batches of algo.epochs x algo.num_minibatches updates (Lightning stops
    only between them)."""
    per_batch = plan.algo.updates_per_batch
    return -(-cfg.trainer.max_steps // per_batch) * per_batch


def code_keys(plan: Plan) -> dict[str, str]:
    """callables.source_keys of the reward functions and task.gold_fn the run calls (a checkpoint keeps them)."""
    functions = [(getattr(plan.reward, "key", "reward.fn"), fn) for _, fn in getattr(plan.reward, "functions", [])]
    if getattr(plan.task, "gold_fn", None):
        functions.append(("task.gold_fn", plan.task.gold_fn))
    return source_keys(functions)


def saved_words(policy: Path) -> str:
    """', RL step N of MLflow run X' for the policy a run saved there (POLICY_STEP_FILE), or '' where it says nothing."""
    saved = saved_record(policy)
    return f", RL step {saved['rl_step']} of MLflow run {saved['run_id']}" if saved and saved["run_id"] else ""


def check_saved_policy(given: str | None, resume: ckpt.Checkpoint | None, out: Path, key: str) -> None:
    """A new line of training (a new run, resume=auto where no checkpoint is left, a branch from another directory's
    checkpoint) is refused a directory that holds the policy a run saved: it would replace it without a word."""
    policy = out / "policy"
    if (resume is not None and not resume.forked) or not policy.is_dir():
        return  # a run going on replaces its own policy (check_budget_reaches says where it would go back)
    what = f"{out} holds the policy a run saved ({policy}{saved_words(policy)})"
    if given == "auto" and resume is None:
        what = f"resume=auto: {ckpt.directory(out)} holds no checkpoint to continue, and {what}"
    else:
        what = f"{key}: {what}"
    whole = policy / "merged" if (policy / "merged").is_dir() else policy  # an adapter (memory=lora, hydra) is no sft_path
    on = (f"to train on from that policy: model.sft_path={whole} {key}=<new dir>" if (whole / "config.json").is_file()
          else "an adapter: to train on from it, save it merged with output.merge_lora=true")
    held = ckpt.directory(out) if any(ckpt.directory(out).glob("step-*")) else None
    raise ConfigError(f"{what}, which this run would replace; give this run another {key} ({on}), or remove {policy}"
                      + (f" and {held} to replace them" if held else " to replace it"))


def check_new_run_dir(cfg: DictConfig, out: Path) -> None:
    """What _train_job refuses a new run's output directory (another run's checkpoints or saved policy), for a sweep's
    jobs before the sweep starts."""
    check_saved_policy(None, None, out, "output.dir")
    ckpt.find(None, out, cfg)


def check_sweep_resume_dir(out: Path, cfg: DictConfig | None = None) -> None:
    """A sweep job's output directory under resume=auto (cli.check_sweep_jobs, before the sweep starts): where a run
    saved its policy and kept no checkpoint (it finished), check_saved_policy refused that job at its start, a FAILED
    child of the new parent, whose line said to retrain it in another directory. Where its newest checkpoint was made
    with other settings than the job's `cfg` (the sweep continued with another grid, or its values in another order:
    job N continues job N's directory), ckpt.find refused each such job at its start, after the parent run was made."""
    newest = ckpt.newest(ckpt.directory(out))
    if newest is not None and cfg is not None:
        job = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])  # what a job's train(cfg) is given
        choices = torch.load(newest / ckpt.STATE, weights_only=True).get("choices")  # not its weights: they are not compared
        changed = ckpt.changes((newest / ckpt.CONFIG).read_text(), choices, job)
        if changed:
            raise ConfigError(f"resume=auto: {newest} was made with other settings ({'; '.join(changed)}), so this sweep "
                              "would refuse that job; continue a sweep with the values it was made with, in the same "
                              "order (job N continues the directory of job N), and sweep new values without resume=auto "
                              "in new directories")
    policy = out / "policy"
    if not policy.is_dir() or any(ckpt.directory(out).glob("step-*")) or (out / UNWRITTEN).is_file():
        return  # (a run whose store stopped answering at its end: the job ends its MLflow run, end_unwritten_run)
    raise ConfigError(f"resume=auto: {out} holds the policy a run saved ({policy}{saved_words(policy)}) and no checkpoint "
                      "to continue, so this sweep would refuse that job; sweep only the values that have not run "
                      "(without resume=auto, in new directories), and continue a stopped job alone with the command its "
                      "line gave (<its overrides> hydra.mode=RUN resume=auto output.dir=<its directory>)")


def check_budget_reaches(cfg: DictConfig, plan: Plan, resume: ckpt.Checkpoint | None, out: Path, key: str = "output.dir") -> None:
    """A checkpoint past the step budget cannot go back to it. Its policy (of its step) replaced the one in the
    output directory, which a finished run had trained further, and the run's curves went on past it."""
    if resume is not None and resume.updates > step_budget(cfg, plan):
        # an older checkpoint beside it is refused in this directory (its line went on past it): another one
        older = ckpt.newest(resume.path.parent, before=step_budget(cfg, plan) + 1)
        raise ConfigError(f"trainer.max_steps={cfg.trainer.max_steps}: {resume.path} is at RL step {resume.updates}, "
                          f"past it, and training cannot go back; its policy would replace {out / 'policy'}. Set "
                          f"trainer.max_steps={resume.updates} or more, or start "
                          + (f"from {older.name} in another directory: resume={older} {key}=<new dir>" if older else
                             f"anew in another {key} (no checkpoint of step {step_budget(cfg, plan)} or before is left)"))
    # The run it continues may have trained past its newest checkpoint (one written by a stop, none at the end)
    trained = saved_step(out / "policy", resume.state.get("run_id")) if resume is not None and not resume.forked else None
    if trained is not None and trained > step_budget(cfg, plan):
        raise ConfigError(f"trainer.max_steps={cfg.trainer.max_steps}: the run in {out} went on to RL step {trained} after "
                          f"{resume.path.name}, and its policy ({out / 'policy'}) would be replaced by one of step "
                          f"{step_budget(cfg, plan)}. Set trainer.max_steps={trained} or more, or start from "
                          f"{resume.path.name} in another directory: resume={resume.path} output.dir=<new dir>")


def in_sft_and_rm(stages: dict, **settings) -> dict:
    """`stages` with `settings` added to stages sft's and rm's own (so to their cache keys); with none, `stages`
    itself: the keys are as before."""
    if not settings:
        return stages
    return {**stages, **{name: {**stages[name], **settings} for name in ("sft", "rm")}}


def per_rank_stages(stages: dict, world: int) -> dict:
    """stages.sft/rm.batch_size is per optimizer step, as rl.prompts_per_step is: each of `world` ranks loads its
    share (validation made it divide). The ranks go into the stage caches' keys (stages.<stage>.ranks): the data
    order differs with them, and a DDP run's SFT policy was cached under a single process's key (with the global
    batch twice the size, the default run then reached a gold reward of 0.650, not 0.818)."""
    if world == 1:
        return stages  # the keys of single-process runs are unchanged
    return {**stages, **{name: {**stages[name], "batch_size": stages[name]["batch_size"] // world, "ranks": world}
                         for name in ("sft", "rm")}}


# Trainer settings that do not change what a stage learns (the ranks are stages.<stage>.ranks; the device is left
# out: accelerator=auto and cpu train the same model here)
NOT_IN_STAGE_KEYS = ("_target_", "accelerator", "devices", "num_nodes", "strategy", "max_steps", "log_every_n_steps",
                     "enable_checkpointing", "enable_model_summary", "enable_progress_bar", "num_sanity_val_steps")


def one_cpu_process(trainer: DictConfig) -> bool:
    """The trainer trains in this one process on the CPU (trainer.accelerator cpu, or auto without a GPU)."""
    cpu = str(trainer.accelerator) == "cpu" or (str(trainer.accelerator) == "auto" and not torch.cuda.is_available())
    return cpu and ranks(trainer) == 1


def batch_threads(cfg: DictConfig) -> int:
    """stages.batch_threads where it applies: one process training on the CPU (under DDP/FSDP the ranks share the
    batch; on a GPU its kernels do; 16-mixed's gradient scaler scales the returned loss alone), else 1."""
    trainer = cfg.trainer
    if not one_cpu_process(trainer) or str(trainer.precision) in ("16-mixed", "16"):
        return 1
    return int(cfg.stages.batch_threads)


def with_batch_threads(stages: dict, threads: int) -> dict:
    """Stages sft and rm with their batch threads in their settings, so in their cache keys and hydra_sft's, which
    reads them there (the shares' sum rounds as one forward does not); with 1, the keys are as before."""
    return in_sft_and_rm(stages, **({"batch_threads": threads} if threads > 1 else {}))


@contextmanager
def stage_threads(threads: int | None, local_ranks: int, batch: int = 1):
    """torch's thread count through the stages (stages.torch_threads), torch_threads's again after them.

    None: OMP_NUM_THREADS where it is set (a count per process: Lightning sets it for the ranks it starts), else every
    core this process may use, shared among the ranks on this machine as Lightning shares them, and among the
    `batch` threads (stages.batch_threads) that each train on a share of a batch. On 2 cores the default stages
    took 0.80x the time with 2 intra-op threads as with 1 on 2026-11-29's host, and ~1.1x on 2026-12-01's; as two
    batch threads of 1 intra-op thread, 0.67x that of 2 intra-op threads (docs/MEASUREMENTS.md). RL's small steps
    keep torch_threads."""
    given = int(os.environ.get("OMP_NUM_THREADS") or 0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or given or max(1, len(os.sched_getaffinity(0)) // max(local_ranks, 1) // batch))
    try:
        yield
    finally:
        torch.set_num_threads(before)


# A second intra-op thread pays in the RL stage from about here: sync PPO on the 113M preset ran 1.49x faster with
# torch_threads=null (2 threads) than with 1 (docs/MEASUREMENTS.md, 2026-12-03); the tiny model's (87k parameters)
# RL is as fast on 1. Between the two it was not measured: the threshold is a guess.
THREADS_PAY_FROM = 50_000_000  # policy parameters


def idle_cores_hint(cfg: DictConfig, source, policy: torch.nn.Module, cores: int) -> str | None:
    """One line for an RL stage on one CPU process whose torch_threads leave cores idle (no reference thread or
    process uses them) on a policy large enough for intra-op threads to pay; None where nothing is idle."""
    threads = cfg.torch_threads
    if (source.name != "sync" or getattr(source, "reference", None) in WORKERS
            or not one_cpu_process(cfg.trainer) or threads is None or int(threads) >= cores):
        return None
    policy_params = sum(p.numel() for p in policy.parameters())
    if policy_params < THREADS_PAY_FROM:
        return None
    return (f"torch_threads={threads}: RL runs on {threads} of this machine's {cores} cores; on a policy of "
            f"{policy_params / 1e6:.0f}M parameters torch_threads=null (every core) is likely faster (1.5x for the "
            "113M preset's PPO: README, Memory strategies)")


def with_trainer_settings(stages: dict, trainer: dict, train_attention: str = "eager") -> dict:
    """The trainer settings that change what stages sft and rm learn (trainer.precision other than 32-true; a
    `+trainer.accumulate_grad_batches`) in their settings, so in their cache keys: a bf16-mixed run's SFT and reward
    models were read by a later 32-true run as its own. Under such a precision `train_attention` too (it changes
    only a half-precision forward's attention: models.attention). Where there are none, the keys are as before."""
    math = {k: v for k, v in trainer.items() if k not in NOT_IN_STAGE_KEYS and not (k == "precision" and str(v) in ("32-true", "32"))}
    if "precision" in math:
        math["train_attention"] = train_attention
    return in_sft_and_rm(stages, **({"trainer": math} if math else {}))


def _run(cfg: DictConfig, plan: Plan, tracker: MlflowTracker, out: Path, resume: ckpt.Checkpoint | None) -> Result:
    started = time.perf_counter()
    cache_dir = Path(cfg.cache_dir)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    shares = batch_threads(cfg)
    stages = with_batch_threads(per_rank_stages(with_trainer_settings(
        OmegaConf.to_container(cfg.stages, resolve=True), OmegaConf.to_container(cfg.trainer, resolve=True),
        cfg.train_attention), ranks(cfg.trainer)), shares)
    logger = tracker.lightning_logger()
    tracker.window_steps = cfg.trainer.log_every_n_steps  # the RL stage's step metrics (stages sft and rm: Lightning's)
    task = plan.task

    # Stage 0: the base model (built from config for the tiny preset, cached).
    base = ensure_base_model(model_cfg, task, cache_dir)  # (None under a model.sft_path: no stage starts from it)
    tokenizer, counts = plan.fitted or fit_tokenizer(cfg, task, base and base.path)  # read before the run where the model is given
    if tokenizer is None:  # the task's own, which set the prompts up before the run: the copy saved with the model
        tokenizer = load_tokenizer(base.path)
    startup.resume()  # imported and built what lives to the run's end: the collector walks what training makes
    if counts:
        tracker.log_metrics(counts, step=0)
    # The stages the memory strategy needs (sft and rm, or hydra_sft), each skipped when given or cached.
    needed = plan.memory.stages(plan.reward.needs_reward_model)

    def stage_trainer(stage: str, **overrides):
        return _make_trainer(cfg, logger, stage, max_steps=-1, **overrides)

    with stage_threads(cfg.stages.torch_threads, ranks(cfg.trainer) // cfg.trainer.num_nodes, shares):
        policy, reward_model = run_stages(needed, model_cfg, base, tokenizer, task, stages, cache_dir, stage_trainer)
    tracker.log_params({"rlhflab.base_model": base and base.path, "rlhflab.policy_start": policy.path,
                        "rlhflab.reward_model": reward_model.path if reward_model else None})
    t_stages = time.perf_counter() - started

    # Stage rl.
    done = resume.updates if resume else 0
    # A rollout batch makes algo.epochs x algo.num_minibatches updates and is not cut short: the budget is whole
    # batches (Lightning stops only between them), said here rather than found as '12/10' on the bar.
    per_batch, budget = plan.algo.updates_per_batch, step_budget(cfg, plan)
    rounded = (f"; trainer.max_steps={cfg.trainer.max_steps} rounded up to whole rollout batches of {per_batch} updates"
               if budget != cfg.trainer.max_steps else "")
    log.info("stage rl: %s, %s memory, %s mode, %d steps%s%s", plan.algo.name, plan.memory.name, plan.source.name,
             budget, f" (from step {done})" if done else "", rounded)
    with fixed_seed(cfg.seed):  # fresh heads (a value head) depend on the seed alone
        memory = plan.memory.build(policy.path, reward_model and reward_model.path, plan.algo.needs_values, tokenizer,
                                   model_cfg["dtype"])
    plan.generator.setup(tokenizer, task.max_new_tokens)
    if hasattr(plan.reward, "setup"):  # reward=function: its functions' completion_ids and trainer_state
        plan.reward.setup(tokenizer, budget)
    train_prompts, eval_prompts = task.prompts("train"), task.prompts("eval")
    module = RLHFModule(memory, plan.algo, plan.reward, plan.source, task, tokenizer, train_prompts, eval_prompts, cfg.rl,
                        cfg.seed, resume)
    module.run_id = tracker.run_id
    hint = idle_cores_hint(cfg, plan.source, memory.generation_model, len(os.sched_getaffinity(0)))
    if hint:
        log.info(hint)
    module.clock = (started, started + t_stages)
    saver = ckpt.Checkpointer(ckpt.directory(out), cfg.checkpoint.every_n_steps, cfg.checkpoint.keep,
                              OmegaConf.to_yaml(cfg, resolve=True), plan.data, plan.code)
    remaining = budget - done
    if remaining > 0:
        trainer = _make_trainer(cfg, logger, "rl", callbacks=[saver], max_steps=remaining)
        module.fit_called = None if distributed.initialized() else time.perf_counter()  # this fit may start the ranks
        with STOP.at_step_boundaries():
            try:
                trainer.fit(module)
            except NonFiniteError as err:
                bad = err.weights_step  # the weights of this step gave the value: not a good checkpoint
                last = saver.last if bad is None and saver.last else ckpt.newest(ckpt.directory(out), before=bad)
                every = cfg.checkpoint.every_n_steps
                why_none = (f" (checkpoint.every_n_steps={every}: the first was due at step {every})" if every
                            else " (set checkpoint.every_n_steps)")
                if bad is None:
                    kept = f"the last good checkpoint is {last}" if last else "no checkpoint exists" + why_none
                elif last:
                    kept = f"step {bad}'s weights may be the cause; the newest checkpoint before them is {last}"
                else:
                    kept = (f"step {bad}'s weights may be the cause; no checkpoint before them"
                            + ("" if ckpt.newest(ckpt.directory(out)) else why_none))
                raise NonFiniteError(f"{err}; {kept}", bad, err.shared) from None
            except BaseException as err:
                # A stop that arrived between steps (Lightning's own SIGTERM check, or while waiting for the
                # generator) still leaves a checkpoint of the last whole step.
                # Every rank decides alike (saving is collective): only rank 0 holds the written path.
                if as_interrupt(err) and saver.saved_at != module.updates and module.updates > done and module.can_checkpoint():
                    saver.save(module)
                raise
    else:
        log.info("resume: the checkpoint is at step %d, the budget %d: nothing left to train", done, budget)
        tracker.rl_ended()  # (after a fit, the module's on_train_end says it)
        module.restore(resume, training=False)
        if module.eval_history[-1][0] != module.policy_version:  # killed after its last checkpoint, before the final eval
            # under the autocast a fit's evaluations run in (trainer.precision=bf16-mixed), with no fit to give it
            module.run_autocast = trainer_autocast(_make_trainer(cfg, logger, "rl"))
            logger.log_metrics(module.evaluate(), step=module.updates)
    # a resumed run's: its processes' up to the checkpoint, and this one's
    t_rl, before = module.elapsed()["rl_s"], module.elapsed_before["rl_s"]

    policy_dir = save_policy(module, tokenizer, out / "policy", cfg, tracker)
    first, (_, after, final_kl) = module.eval_history[0][1], module.eval_history[-1]
    judged = "eval/gold_reward" if task.has_gold else "eval/reward"
    metrics = {
        f"{judged}_before": first,
        judged: after,
        "eval/kl": final_kl,
        **(module.timing_summary() if module.step_times else {}),
        "perf/stages_s": t_stages + module.launch_s,  # the ranks' start-up, wherever it happened
        "perf/rl_s": t_rl,
        "perf/total_s": module.elapsed()["total_s"],
        **({"perf/launch_s": module.launch_s} if module.launch_s else {}),  # ranks started by the RL stage's fit
    }
    summaries = {k: v for k, v in metrics.items() if k not in (judged, "eval/kl")}  # those have curves
    # single values: step 0, so no chart draws them as the end of a curve; again: a finished run trained further holds
    # them (one with nothing left to train keeps its own: this process trained nothing)
    tracker.log_metrics(summaries, step=0, again=remaining > 0)
    if distributed.is_main() and module.generation_rows:  # beside the policy too: read without MLflow, kept if it is lost
        with writing("generations.json", out / "generations.json"):
            (out / "generations.json").write_text(json.dumps(module.generation_rows, indent=1))
    tracker.log_generations(module.generation_rows)
    tracker.set_tag("perf/mem_method", getattr(module, "mem_method", ""))
    judge = "gold reward" if task.has_gold else "reward (the task has no gold_fn)"  # as the eval lines say
    log.info("done: %s %.3f -> %.3f after %d RL steps (stages %.0f s, RL %.0f s%s)", judge, first, after, module.updates,
             t_stages, t_rl, f", {before:.0f} s of it before the resume" if resume else "")
    log.info("policy: %s (AutoModelForCausalLM.from_pretrained loads it)", policy_dir)
    log.info("mlflow: %s", browse_hint(tracker))
    return Result(metrics, module, tracker.run_id, out)


def save_policy(module: RLHFModule, tokenizer, path: Path, cfg: DictConfig, tracker: MlflowTracker) -> Path:
    """The trained policy (with LoRA: the adapter, and a merged copy if output.merge_lora), its tokenizer and the RL
    step it was trained to (POLICY_STEP_FILE); rank 0 writes (a sharded policy is gathered first, by every rank)."""
    state = None
    if module.sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(module.memory.generation_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not distributed.is_main():
        return path
    shutil.rmtree(path, ignore_errors=True)  # a resumed run (or a rerun in the same directory) replaces it
    with writing("policy", path):
        try:
            module.memory.save_policy(path, cfg.output.merge_lora, state)
            tokenizer.save_pretrained(path)
            if (path / "merged").is_dir():
                tokenizer.save_pretrained(path / "merged")
            elif cfg.output.merge_lora:  # it was ignored without a word (a sweep over memory may set it for all jobs)
                log.warning("output.merge_lora: memory=full saves the whole policy, so there is no adapter to merge and "
                            "no policy/merged; policy/ is the model")
            record = json.dumps({"rl_step": module.updates, "run_id": module.run_id}) + "\n"
            for saved in (path, path / "merged"):  # the merged copy too: it is the one copied away and trained on
                if saved.is_dir():
                    (saved / POLICY_STEP_FILE).write_text(record)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)  # half a policy loads as garbage or not at all
            raise
    if cfg.output.log_policy:
        tracker.log_artifacts(path, "policy")
    return path


POLICY_STEP_FILE = "rlhflab.json"  # beside the saved policy: the RL step it was trained to


def saved_record(policy: Path) -> dict | None:
    """{'rl_step': int, 'run_id': ...} that POLICY_STEP_FILE beside the saved policy holds, or None (none, or unreadable)."""
    try:
        saved = json.loads((policy / POLICY_STEP_FILE).read_text())
        return {"rl_step": int(saved["rl_step"]), "run_id": saved.get("run_id")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def saved_step(policy: Path, run_id: str | None) -> int | None:
    """The RL step of the policy saved in `policy` by the MLflow run `run_id` (None where none was, or another run
    left it: an earlier run in the same directory, which a new run there replaces)."""
    saved = saved_record(policy)
    return saved["rl_step"] if saved and saved["run_id"] == run_id else None


def browse_hint(tracker: MlflowTracker) -> str:
    uri = redact(tracker.tracking_uri)
    ui = "" if uri.startswith("http") else f"mlflow ui --backend-store-uri {uri} --host 127.0.0.1, then "
    return f"run {tracker.run_id}: {ui}{tracker.url()} (all runs by gold reward: {tracker.url(table=True)})"


def main(cfg: DictConfig) -> float | None:
    """What `src/train.py` runs: one-line errors and exit codes, the swept metric for sweepers."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    sweeping = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    STOP.run_made = False  # this job's run is not made yet (a sweep's jobs share the process)
    try:
        # rlhflab's handlers until this job exits: train() puts back the ones it found, and a repeat of the
        # signal while the stop unwinds (Ctrl-C twice, each rank of a DDP run) is the same stop, not a
        # KeyboardInterrupt traceback.
        with STOP.installed():
            result = train(cfg)
    except RunInterrupted as err:
        out = cfg.output.dir or (HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None)
        if STOP.ended == "FINISHED":  # the signal came as it ended: nothing to continue
            how = (", and the sweep stops here" if sweeping else "") + f": it had trained to the end (policy: {out}/policy)"
        else:
            how = how_to_continue(cfg, out, STOP.run_made)
        # A stop while the run was being set up (an unanswered tracking server, a slow hub) has no run to mark.
        what = f"; the MLflow run is {STOP.ended or 'KILLED'}" if STOP.run_made else " before its MLflow run was made"
        if STOP.run_made and STOP.lost:  # it could not be ended: a resume continues it (its checkpoint keeps the metrics)
            what = f"; the MLflow run is left RUNNING, as {STOP.lost}"
        if STOP.ended == "FAILED" and err.__cause__ is not None:  # the signal came as the failed run ended
            what += f" ({type(err.__cause__).__name__}: {err.__cause__})"
        if distributed.is_main():  # every rank stops alike; one says so
            print(f"stopped: {err}{what}{how}", file=sys.stderr)
        sys.exit(err.exit_code)  # a sweep stops too
    except ONE_LINE as err:
        if sweeping:
            raise  # a sweep records the failed job and goes on
        if not getattr(err, "quiet", False):  # another rank says it (distributed.as_rank_error)
            rank = getattr(err, "rank", None)
            line = f"error: {rank + ': ' if rank else ''}{err}{resume_hint(err, cfg)}"
            print(line, file=sys.stderr)
            # train.log had no word of it; a reward function's traceback goes there too (the line names its innermost frame)
            detail = getattr(err, "detail", None)
            log.error("%s", line + (f"\n{detail}" if detail else ""), extra={"console": False})
        sys.exit(2 if isinstance(err, ConfigError) else 1)
    try:
        return objective(result.metrics, cfg)
    except ConfigError as err:  # a name no run logs: a sweep's every trial failed without a word
        if sweeping:
            raise  # the job's error: the sweep lists it, and its sweeper is told the trial failed
        log.warning("%s", err)
        return None


def how_to_continue(cfg: DictConfig, out, run_made: bool) -> str:
    """The end of a stopped run's line: how to continue it (resume=auto, a sweep's job alone), or that there is
    nothing to resume. Said by main, and by rank 0's watch where the other ranks were stopped by a signal."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    # none in a stage or RL's first step: resume=auto would start a new run, and the KILLED one stay empty
    resumable = bool(run_made and out and ckpt.newest(ckpt.directory(Path(out))) is not None)
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:  # the same -m command would send
        # every job to this job's directory; hydra.mode=RUN: a sweep preset (experiment=sweep_*) sets MULTIRUN itself
        # (the sweep's own output.dir or resume, e.g. 'output.dir=runs/$\{hydra\:job.num\}' as Hydra keeps it: given again)
        own = [o for o in HydraConfig.get().overrides.task if o.partition("=")[0].lstrip("+~") not in ("output.dir", "resume")]
        if resumable:
            job = shlex.join(["python", "src/train.py", *own, "hydra.mode=RUN", "resume=auto", f"output.dir={out}"])
            return f", and the sweep stops here. Continue this job alone: {job}"
        job = shlex.join(["python", "src/train.py", *own, "hydra.mode=RUN", f"output.dir={out}"])
        why = "this job stopped before its first checkpoint, so there" if run_made else "there"
        return f", and the sweep stops here; {why} is nothing to resume. Run it alone: {job}"
    if run_made and not resumable:
        return (": it stopped before its first checkpoint, so there is nothing to resume; the same command starts a "
                "new run (the stages that finished are cached)")
    if run_made:
        return f". Continue with the same command and resume=auto output.dir={out}"
    return ": there is nothing to resume; run the command again"


def resume_hint(err: Exception, cfg: DictConfig) -> str:
    """For a failure outside the run's own numbers (a reward function or server, a lost rank, a full disk) after a checkpoint:
    how to continue from it once the cause is fixed. A non-finite value names its checkpoint itself."""
    from hydra.core.hydra_config import HydraConfig

    out = cfg.output.dir or (HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else None)
    if isinstance(err, TrackingLost) and not err.checkpointed:  # it trained to the end: only its MLflow run to end
        return f"; once it answers, the same command with resume=auto output.dir={out} writes them and ends the run FINISHED"
    if not isinstance(err, (RewardError, RankLost, TrackingLost, WriteFailed)) or not STOP.run_made:
        return ""
    last = out and ckpt.newest(ckpt.directory(Path(out)))
    if not last and isinstance(err, (RewardError, WriteFailed)):  # the line said nothing of what to do (a policy not
        # written at the end: that its weights are gone, and the whole run is to do again)
        every = cfg.checkpoint.every_n_steps
        return ("; no checkpoint was written before it" + (f" (checkpoint.every_n_steps={every})" if every else
                                                          " (set checkpoint.every_n_steps to keep some)")
                + ", so once fixed the same command starts anew (the stages that finished are cached)")
    if not last:
        return ""
    return f"; its newest checkpoint is {last}: once fixed, the same command with resume=auto output.dir={out} continues from it"


def objective(metrics: dict[str, float], cfg: DictConfig) -> float | None:
    """What a sweeper optimises: `optimized_metric`, less `kl_penalty` per nat of final eval/kl
    above `kl_budget` when a budget is set (Optuna has no constraints, so the budget is a penalty)."""
    name = cfg.get("optimized_metric") or "eval/gold_reward"
    if name not in metrics and not (name == "eval/gold_reward" and "eval/reward" in metrics):  # (no gold_fn: eval/reward)
        raise ConfigError(f"optimized_metric={name}: the run logs no such value at its end; give one of "
                          f"{', '.join(sorted(metrics))}")
    value = metrics.get(name, metrics.get("eval/reward"))
    budget = cfg.get("kl_budget")
    if value is None or budget is None:
        return value
    return value - cfg.get("kl_penalty", 1.0) * max(0.0, metrics["eval/kl"] - budget)


if __name__ == "__main__":  # python -m rlhflab.train did nothing and exited 0: the command line is Hydra's, in src/train.py
    print("error: rlhflab.train is the library src/train.py runs; run python src/train.py [group=option ...] [key=value ...] "
          "(--help for the groups)", file=sys.stderr)
    sys.exit(2)
