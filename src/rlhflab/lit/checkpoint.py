"""Checkpoints of the RL stage: everything needed to continue exactly where a run stopped.

`<output.dir>/checkpoints/step-00000100/` holds
  trainable.safetensors  the trainable tensors (the whole policy, or only adapters and heads)
  optimizer.pt           the optimizer's state
  state.pt               counters, every RNG state, the evaluation history, the async generator's
                         pending rollouts and their versions, the MLflow run id
  config.yaml            the resolved config, so a resume can refuse a different one
  rlhflab_manifest.json  sizes and hashes: a damaged checkpoint is reported, not loaded
Weights are safetensors; the rest is read with torch.load(weights_only=True). A checkpoint is
written to a temporary directory and renamed, and only the newest `checkpoint.keep` stay.
"""

from __future__ import annotations

import logging
import signal
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from rlhflab import distributed
from rlhflab.errors import ConfigError, RunInterrupted, TrackingLost, writing
from rlhflab.interrupts import STOP
from rlhflab.models.cache import damage, write_manifest
from rlhflab.naming import RUN_RECORD, redact
from rlhflab.tracking import flatten

log = logging.getLogger(__name__)

WEIGHTS, OPTIMIZER, STATE, CONFIG = "trainable.safetensors", "optimizer.pt", "state.pt", "config.yaml"
# What may differ between a checkpoint's config and the resuming run's.
MAY_DIFFER = ("trainer.max_steps", "trainer.enable_progress_bar", "trainer.log_every_n_steps", "logger.", "checkpoint.",
              "resume", "output.", "cache_dir")


@dataclass
class Checkpoint:
    path: Path
    tensors: dict[str, torch.Tensor]
    optimizer: dict
    state: dict
    config: str
    forked: bool = False  # resumed outside the line it was written in: a new MLflow run (see find)
    why: str | None = None  # why it is forked, for the line that says where the run goes on from

    @property
    def updates(self) -> int:
        return self.state["updates"]


def directory(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def write(root: Path, updates: int, tensors: dict, optimizer: dict, state: dict, config_yaml: str, keep: int) -> Path:
    """Write one checkpoint atomically and drop all but the newest `keep`. A full disk (or another storage
    error) is WriteFailed, one line; the older checkpoints stay, and nothing of this one."""
    from safetensors.torch import save_file

    final = root / f"step-{updates:08d}"
    with writing("checkpoint", final):
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".step-", dir=root))
        try:
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / WEIGHTS))
            for name, obj in ((OPTIMIZER, optimizer), (STATE, state)):
                with open(tmp / name, "wb") as f:  # a file object: torch.save's error then chains the OSError
                    torch.save(obj, f)
            (tmp / CONFIG).write_text(config_yaml)
            write_manifest(tmp)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def newest(root: Path, before: int | None = None) -> Path | None:
    """The newest whole checkpoint under `root` (a damaged one is named and passed over), of a step below
    `before` where given."""
    for path in sorted(root.glob("step-*"), reverse=True):
        if before is not None and int(path.name.removeprefix("step-")) >= before:
            continue
        problem = damage(path)
        if problem is None:
            return path
        log.warning("checkpoint %s is damaged (%s); trying an older one", path, problem)
    return None


def read(path: Path) -> Checkpoint:
    from safetensors.torch import load_file

    problem = damage(path)
    if problem:
        raise ConfigError(f"resume: '{path}' is not a whole checkpoint ({problem}); give another, or resume=auto for the newest whole one")
    return Checkpoint(path, load_file(str(path / WEIGHTS)), torch.load(path / OPTIMIZER, weights_only=True),
                      torch.load(path / STATE, weights_only=True), (path / CONFIG).read_text())


def differences(saved_yaml: str, cfg: DictConfig) -> list[str]:
    """`key: old -> new` for every setting that differs and may not (see MAY_DIFFER)."""
    old = flatten(OmegaConf.to_container(OmegaConf.create(saved_yaml), resolve=True))
    new = flatten(OmegaConf.to_container(cfg, resolve=True))
    absent = "(not set)"  # a key one side lacks (a null is the string 'null' here)
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k, absent) != new.get(k, absent) and not k.startswith(MAY_DIFFER))
    return [f"{k}: {old.get(k, absent)} -> {new.get(k, absent)}" for k in keys]


def group_choices() -> dict[str, str] | None:
    """The config groups' options this run was composed with (algo: rloo, debug: default), where Hydra composed it."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return {group: None if option is None else str(option) for group, option in HydraConfig.get().runtime.choices.items()
            if not group.startswith("hydra/")}


def group_changes(old: dict | None, new: dict | None, changed: list[str]) -> list[str]:
    """`changed` led by the group options that differ (`algo: rloo -> grpo`, `debug: default -> (none)`), without the
    keys of a changed group's own package (algo.*): the group is what the user changed. A checkpoint or a run without
    the choices (written before they were kept, or a train(cfg) call) keeps the keys alone."""
    if not changed or old is None or new is None:
        return changed
    groups = sorted(g for g in old.keys() | new.keys() if old.get(g) != new.get(g))
    said = {g for g in groups if "/" not in g}  # (a nested group's keys are under its parent's package)
    return ([f"{g}: {old.get(g) or '(none)'} -> {new.get(g) or '(none)'}" for g in groups]
            + [c for c in changed if c.partition(":")[0].partition(".")[0] not in said])


def changes(saved_yaml: str, saved_choices: dict | None, cfg: DictConfig) -> list[str]:
    """What a checkpoint (its config.yaml, its state's group choices) was made with that `cfg` changes and may not,
    led by the groups changed: what find refuses a resume, and a sweep's preflight each job it would refuse."""
    return group_changes(saved_choices, group_choices(), differences(saved_yaml, cfg))


def find(resume: str | None, output_dir: Path, cfg: DictConfig, key: str = "output.dir") -> Checkpoint | None:
    """The checkpoint `resume` names (auto: the newest in output_dir), checked against the config. A new line
    of training (a new run, or a branch) is refused an output directory that holds another line's checkpoints:
    `checkpoint.keep` deleted its own as older than those, and resume=auto would then continue the other line.
    `key`: the setting that chose output_dir, for the message."""
    if resume and resume != "auto":  # what it names, first: 'resume=latest' in a directory with checkpoints was
        given_path(resume)             # refused as a new run that would mix with them
    held = sorted(directory(output_dir).glob("step-*"))
    if held and resume != "auto" and (not resume or Path(resume).expanduser().resolve().parent != directory(output_dir).resolve()):
        span = held[0].name + (f" .. {held[-1].name}" if len(held) > 1 else "")
        raise ConfigError(f"{key}: {output_dir} already holds another run's checkpoints ({span}); continue that run with "
                          f"resume=auto, or give this run another {key} (or remove {directory(output_dir)})")
    if not resume:
        return None
    if resume == "auto":
        path = newest(directory(output_dir))
        if path is None and held:  # a new run's checkpoints would fall below theirs (checkpoint.keep)
            raise ConfigError(f"resume=auto: every checkpoint in {directory(output_dir)} is damaged (named above); "
                              f"remove them to start a new run there, or give another {key}")
        if path is None:  # (announce says so, once the other checks of a new run passed)
            return None
    else:
        path = given_path(resume)
        latest = newest(path.parent) or path
        if path.resolve().parent == directory(output_dir).resolve() and latest.resolve() != path.resolve():
            # its checkpoints would fall among the newer ones of the line it leaves
            raise ConfigError(f"resume: {path} is older than {latest.name} beside it; start from it in another {key} "
                              f"(resume={path} {key}=<new dir>), or continue from the newest with resume=auto")
    checkpoint = read(path)
    changed = changes(checkpoint.config, checkpoint.state.get("choices"), cfg)
    if changed:
        raise ConfigError(f"resume: {path} was made with other settings ({'; '.join(changed)}); run with the same settings "
                          "(only trainer.max_steps, checkpoint.*, output.*, cache_dir and logging keys may change) or start a new run in another "
                          f"{key}")
    # The run goes on in its MLflow run only where it is the same line of training: the newest whole checkpoint of
    # this output directory (a kill and resume=auto; the steps the killed run logged after it repeat bit for bit
    # and are not logged twice). From another directory's checkpoint the steps after it are new, and logging them
    # into the old run would drop them beside the ones it holds.
    why = None
    if resume != "auto" and path.resolve().parent != directory(output_dir).resolve():
        why = f"it is not in this run's directory {output_dir}"
    checkpoint.forked, checkpoint.why = why is not None, why
    return checkpoint


def announce(checkpoint: Checkpoint | None, given: str | None = None, output_dir: Path | None = None) -> None:
    """Where the run goes on from, once every check of it passed (it was said just before a refusal)."""
    if checkpoint is None:
        if given == "auto":
            log.info("resume=auto: no checkpoint in %s; starting a new run", directory(output_dir))
        return
    if checkpoint.forked:
        log.info("resume: starting from %s (RL step %d) in a new MLflow run, tagged rlhflab.resumed_from_run=%s: %s",
                 checkpoint.path, checkpoint.updates, checkpoint.state.get("run_id"), checkpoint.why)
    else:
        log.info("resume: continuing from %s (RL step %d)", checkpoint.path, checkpoint.updates)


def given_path(resume: str) -> Path:
    """The checkpoint directory `resume` names, or a one-line ConfigError saying what it names instead."""
    path = Path(resume).expanduser()
    if not path.is_dir():
        raise ConfigError(f"resume: no checkpoint directory '{resume}'; give a checkpoints/step-* directory, or resume=auto")
    if directory(path).is_dir():  # a run's output directory: 'not a whole checkpoint (no manifest ...)' said nothing of it
        inside = newest(directory(path))
        raise ConfigError(f"resume: '{resume}' is a run's output directory, not a checkpoint; continue that run with "
                          f"resume=auto output.dir={resume}" + (f", or start from its newest checkpoint with resume={inside}"
                                                                 " output.dir=<new dir>" if inside else ""))
    if (path / "policy").is_dir() or (path / RUN_RECORD).is_file():  # a finished run's, without checkpoints
        raise ConfigError(f"resume: '{resume}' is a run's output directory with no checkpoints, so there is nothing to "
                          f"resume; start from its trained policy as a new run with model.sft_path={path / 'policy'} (its "
                          "policy/merged for adapters saved with output.merge_lora=true)")
    if path.name == directory(path).name and any(path.glob("step-*")):  # its checkpoints/ folder
        inside = newest(path)
        raise ConfigError(f"resume: '{resume}' is a folder of checkpoints; name one of its step-* directories"
                          + (f" (the newest whole one: resume={inside})" if inside else "")
                          + f", or continue its run with resume=auto output.dir={path.parent}")
    return path


def check_same_data(checkpoint: Checkpoint | None, data: dict[str, str]) -> None:
    """A run continued on data files edited since its checkpoint is refused (its held-out set redrawn, its SFT
    reference retrained, in the same MLflow run); a branch into another directory is warned."""
    saved = checkpoint.state.get("data") if checkpoint is not None else None
    if saved is None:  # a checkpoint written before the data was kept
        return
    changed = sorted(k for k in saved.keys() | data.keys() if saved.get(k) != data.get(k))
    if not changed:
        return
    what = ", ".join(changed)
    if checkpoint.forked:
        log.warning("resume: the data of %s differs from what %s was trained on; the new run goes on with today's", what, checkpoint.path)
        return
    raise ConfigError(f"resume: the data read from {what} differs from what {checkpoint.path} was trained on (the files "
                      "were edited); restore them to go on, or start from it on the new data in another directory: "
                      f"resume={checkpoint.path} output.dir=<new dir>")


def check_same_code(checkpoint: Checkpoint | None, code: dict[str, str]) -> list[str]:
    """A reward or gold function edited since the checkpoint is said, not refused: fixing the function that failed
    a run and continuing it with resume=auto is what that failure's line says to do. -> what was edited."""
    saved = checkpoint.state.get("code") if checkpoint is not None else None
    if saved is None:  # a checkpoint written before the functions' files were kept
        return []
    edited = sorted(k for k in saved.keys() & code.keys() if saved[k] != code[k])
    for what in edited:
        log.warning("resume: %s was edited since %s was written; RL steps after %d use the edited function, those "
                    "before it the old one%s", what, checkpoint.path, checkpoint.updates,
                    "" if checkpoint.forked else " (the steps after it that the run logged are logged again: MLflow "
                    "keeps both values of each)")
    return edited


class SignalsOurs(L.Callback):
    """Every fit handles SIGINT and SIGTERM with rlhflab's handler. Lightning installs its own SIGTERM handler
    after on_fit_start and before on_train_start; under several ranks it broadcasts from inside the handler,
    which meets a rank in the middle of another collective (the backward's all-reduce), and both ranks hang.
    Ours only sets a flag, which the ranks agree on at the next step boundary (STOP.agreed)."""

    def on_train_start(self, trainer, module) -> None:
        STOP.take_back()


class Checkpointer(L.Callback):
    """Writes a checkpoint every `every_n_steps` optimizer updates (at the next batch boundary the
    rollout source can resume from exactly) and when a stop was asked for, then honours the stop."""

    def __init__(self, root: Path, every_n_steps: int | None, keep: int, config_yaml: str, data: dict | None = None,
                 code: dict | None = None) -> None:
        self.root = root
        self.data = data or {}  # the task's data_keys: what the run read from its data files
        self.code = code or {}  # callables.source_keys: the files of its reward and gold functions
        self.choices = group_choices()  # which option of each group: a resume that changes one names it
        self.every = every_n_steps
        self.keep = keep
        self.config_yaml = config_yaml
        self.last: Path | None = None  # rank 0's newest written checkpoint
        self.saved_at: int | None = None  # the step of the newest checkpoint, on every rank
        self.next_at: int | None = None

    def on_train_start(self, trainer, module) -> None:
        if self.every:
            self.next_at = (module.updates // self.every + 1) * self.every

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        due = self.next_at is not None and module.updates >= self.next_at
        tracker = getattr(module.logger, "tracker", None)  # rank 0's; the others have no run
        # one decision for every rank, whichever got the signal (a store that stopped answering: at a checkpointable step)
        stop, lost = STOP.agreed(bool(tracker and tracker.lost))
        ready = module.can_checkpoint()
        lost = lost and ready
        if stop and not ready:  # stopping here lost every step since the last checkpoint (mode.sync_every=4: up to 3)
            if not STOP.finishing:
                STOP.finishing = True
                log.warning("%s: RL step %d is not one a resume can start from (%s); training on to the next that is, "
                            "to stop there with a checkpoint (send it again to stop at once, without one)",
                            signal.Signals(stop).name, module.updates, module.why_no_checkpoint())
            return
        if (due or stop or lost) and ready:
            self.save(module)
            if due:
                self.next_at = (module.updates // self.every + 1) * self.every
        if stop:
            raise RunInterrupted(stop)
        if lost:
            distributed.claim_end("run")
            if not (tracker and tracker.lost):
                raise TrackingLost("mlflow: the tracking store stopped answering (rank 0 says why)", checkpointed=True)
            raise TrackingLost(f"mlflow: {redact(tracker.tracking_uri)} stopped answering ({tracker.lost}); the run "
                               f"stopped at RL step {module.updates} with a checkpoint that keeps the "
                               f"{len(tracker.pending)} metric values it could not write", checkpointed=True)

    def save(self, module) -> Path | None:
        """Every rank gives its state (collective); rank 0 writes the checkpoint, after the metrics of every step
        it holds (a resumed run re-runs only the steps after it, so buffered metrics up to here must be kept)."""
        tensors, optimizer, state = module.checkpoint_state()
        state = {**state, "data": self.data, "code": self.code, "choices": self.choices}
        self.saved_at = module.updates
        if distributed.is_main():
            if hasattr(module.logger, "flush"):  # rlhflab's RunLogger: metrics up to this step, written now
                module.logger.flush()
                # what the store did not take (it stopped answering) goes with the checkpoint; a resume writes it:
                # its metrics, and the tags set since (a resume's rlhflab.edited_at_step, said once and not again)
                tracker = module.logger.tracker
                state = {**state, "unwritten_metrics": tracker.unwritten(), "unwritten_tags": dict(tracker.pending_tags)}
            self.last = write(self.root, module.updates, tensors, optimizer, state, self.config_yaml, self.keep)
            log.info("checkpoint: %s", self.last)
        return self.last
