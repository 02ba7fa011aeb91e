"""Validate a composed config and instantiate its cheap parts, before any model loads.

Every failure is a ConfigError whose message is one line: the key, what is
wrong, and how to fix it.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass

import torch

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from rlhflab.algos.registry import Algorithm
from rlhflab.contracts import Generator, MemoryStrategy, Reward, RolloutSource, Task
from rlhflab.errors import ConfigError
from rlhflab.lit.reference import WORKERS
from rlhflab.models.build import check_reward_chat_template
from rlhflab.models.checks import check_language_model, check_reward_head
from rlhflab.naming import model_tag
from rlhflab.rollout.sources import HALF_KERNELS, cpu_has_half_kernels
from rlhflab.schema import check, check_generator_device, cuda_index, ranks
from rlhflab.tracking import MlflowTracker

log = logging.getLogger(__name__)

REQUIRED_GROUPS = ("task", "model", "algo", "reward", "memory", "mode", "off_policy", "generator", "trainer", "logger")


@dataclass
class Plan:
    """The instantiated, model-free parts of an experiment."""

    task: Task
    algo: Algorithm
    reward: Reward
    generator: Generator
    source: RolloutSource
    memory: MemoryStrategy
    tracker: MlflowTracker
    tags: dict[str, str]
    fitted: tuple | None = None  # (tokenizer, task counts) when train() read a given tokenizer before the run
    data: dict | None = None  # the task's data_keys, which checkpoints keep
    code: dict | None = None  # callables.source_keys of its reward and gold functions, which checkpoints keep


def _instantiate(group: str, node: DictConfig, **kwargs):
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise ConfigError(f"{group}: {str(cause or err).splitlines()[0]}") from None


def resolve_reference(cfg: DictConfig, source, algo, memory, reward) -> None:
    """mode.reference=auto, and whether `thread` can run.

    mode=async: `auto` is the generator when it is forked (it shares the reference model), else the learner; the
    learner too where its reference costs no forward: memory=hydra scoring with its reward head, whose trunk
    output the reference reads.
    mode=sync: `thread` runs the reference's forward in a second thread beside the update's
    policy forward, `process` in a forked process (its own GIL: faster where the model is small enough for
    Python dispatch to set the pace); `fastest` times both over the first steps and keeps the faster (which one
    is follows the host; the thread unless the process is over 5% faster, as it holds more memory). Each needs a
    reference model of its own, one pass over the batch in one mini-batch, one CPU process and a core its torch
    threads leave free. `auto` picks `fastest` when all hold, else `learner`."""
    if source.name != "sync":
        free_in_learner = getattr(memory, "reference_shares_scoring_forward", False) and reward.needs_reward_model
        if source.reference == "auto":
            source.reference = "generator" if source.start_method == "fork" and not free_in_learner else "learner"
        return
    cores = len(os.sched_getaffinity(0))
    threads = cfg.torch_threads or torch.get_num_threads()
    free = cores - threads
    why_not = (
        f"memory={memory.name} computes the reference with the policy's own modules (its adapter off)" if memory.name != "full"
        else f"{algo.name} updates a value model in the same step" if algo.needs_values
        else "it needs one pass over each batch in one mini-batch (algo.epochs=1, algo.num_minibatches=1)"
        if algo.updates_per_batch != 1
        else "it runs beside the update in one CPU process (trainer=cpu)" if cfg.trainer.accelerator != "cpu" or ranks(cfg.trainer) > 1
        else (f"torch_threads={'null' if cfg.torch_threads is None else cfg.torch_threads}"  # null: torch's own count
              f"{f' ({threads} threads)' if cfg.torch_threads is None else ''} leaves no core of {cores} free for it"
              + (f" (torch_threads={cores - 1} would)" if cores > 1 else "")) if free < 1
        else None
    )
    if source.reference in WORKERS and why_not:  # each of the workers that run it beside the update
        raise ConfigError(f"mode.reference={source.reference}: {why_not}; use mode.reference=learner (or auto)")
    if source.reference == "auto":
        source.reference = "learner" if why_not else "fastest"


def check_trainer(cfg: DictConfig) -> None:
    """Lightning's Trainer takes trainer.* as given: build one (no process starts, nothing trains) so that what it
    refuses (trainer.strategy=deepspeed without DeepSpeed, an accelerator this machine lacks) is one line before the
    MLflow run, not Hydra's 'Error executing job ... MisconfigurationException' at stage sft. And trainer.num_nodes > 1
    with nothing that started this process as one of the nodes waited for the others forever."""
    import logging

    from lightning.fabric.plugins.environments import LightningEnvironment

    quiet = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # 'GPU available: ...', said again at stage sft
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            trainer = instantiate(cfg.trainer, logger=False, callbacks=[])
    except Exception as err:
        cause = err.__cause__ if isinstance(err, InstantiationException) and err.__cause__ else err
        raise ConfigError(f"trainer: Lightning's Trainer refuses it: {' '.join(str(cause).split())}") from None
    finally:
        quiet.setLevel(level)
    asked = str(cfg.trainer.precision)
    asked = "32-true" if asked == "32" else asked  # the one legacy spelling the schema takes
    if trainer.precision != asked:  # Lightning's substitute (fp16 AMP on CPU: bf16-mixed), which the run's params would hide
        why = next((m.group(1) for w in said if (m := re.search(r" but (.+?)\. Using", str(w.message)))), "")
        raise ConfigError(f"trainer.precision={asked}: Lightning would run {trainer.precision} instead{f' ({why})' if why else ''}; "
                          f"set trainer.precision={trainer.precision}" + (", or run on a GPU (trainer=gpu)" if "CPU" in why else ""))
    nodes = int(cfg.trainer.num_nodes)
    manual = {"NODE_RANK", "MASTER_ADDR"} <= set(os.environ)  # Lightning's launch by hand: the same command on each node
    if nodes > 1 and type(getattr(trainer.strategy, "cluster_environment", None)) is LightningEnvironment and not manual:
        raise ConfigError(f"trainer.num_nodes={nodes}: nothing started this process as one of {nodes} nodes, so it would "
                          "wait for the others forever; run under SLURM (hydra/launcher=slurm, or srun), torchrun "
                          f"--nnodes={nodes}, or the same command on each node with NODE_RANK, MASTER_ADDR and MASTER_PORT set")


def check_devices(cfg: DictConfig) -> None:
    """The GPUs the config asks for are here: else Lightning or the generator process fails after the stages ran
    (Lightning's 'No supported gpu backend found!' in a Hydra traceback; the generator 'died without a traceback').
    Apart from validate(), which also judges GPU configs on a machine without one (the tests do)."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    trainer = cfg.trainer
    accelerator = str(trainer.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda") and not visible:
        raise ConfigError(f"trainer.accelerator={accelerator}: no CUDA GPU is visible here (torch.cuda.is_available() is False); "
                          "use trainer=cpu (or trainer=ddp / fsdp, which run CPU processes here), or run on a GPU machine")
    devices = trainer.get("devices")
    if visible and accelerator in ("gpu", "cuda", "auto") and isinstance(devices, int) and devices > visible:
        raise ConfigError(f"trainer.devices={devices}: only {visible} CUDA GPU(s) visible here; "
                          f"set trainer.devices={visible} or fewer, make more visible (CUDA_VISIBLE_DEVICES), "
                          "or trainer.accelerator=cpu for CPU processes")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not visible and isinstance(devices, int) and devices > cores and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        # an 8-GPU preset (experiment=rloo_pythia6.9b_tldr: accelerator auto) started 8 CPU processes here, silently
        log.warning("trainer.devices=%d: no CUDA GPU is visible, so %d CPU processes share %d core(s) (each rank runs "
                    "at a fraction of one); set trainer.devices=%d or fewer here", devices, devices, cores, cores)
    check_async_threads(cfg, visible, cores)
    check_cpu_half(cfg, visible)
    device = cfg.mode.get("device")
    index = cuda_index(device)  # its format was checked with the schema
    if index is not None and index >= visible:
        raise ConfigError(f"mode.device={device}: {'no CUDA GPU is' if not visible else f'only {visible} CUDA GPU(s) are'} "
                          "visible here; give a visible cuda:N, or mode.device=null to generate on the CPU")
    if visible:  # trainer.accelerator=auto trains on these GPUs
        check_generator_device(cfg, gpus=("gpu", "cuda", "auto"))
    strategy = trainer.get("strategy")
    if not visible and isinstance(strategy, DictConfig) and strategy.get("process_group_backend") == "nccl":
        raise ConfigError("trainer.strategy.process_group_backend=nccl: NCCL needs GPUs, and no CUDA GPU is visible here; "
                          "use gloo (or null to choose by device)")


def check_async_threads(cfg: DictConfig, visible: int, cores: int) -> None:
    """mode=async runs the generator's torch threads beside the learner's on the CPU: more than the cores ran slower
    (2+2 on 2 cores: 10x), which only the run's speed showed. Warned, as the CPU ranks beyond the cores are."""
    mode = cfg.mode
    if "generator_threads" not in mode or mode.get("device") or int(os.environ.get("LOCAL_RANK", 0)) != 0:
        return
    on_cpu = not visible and str(cfg.trainer.get("accelerator", "auto")) in ("cpu", "auto")
    learners = ranks(cfg.trainer) if on_cpu else 0  # each CPU rank its learner and its generator
    threads = (int(mode.generator_threads) + int(mode.learner_threads if on_cpu else 0)) * max(learners, 1)
    if threads > cores:
        log.warning("mode.generator_threads=%d%s: %d torch threads%s on %d core(s), which slows both sides (2+2 on 2 "
                    "cores ran 10x slower); %s", mode.generator_threads,
                    f" + mode.learner_threads={mode.learner_threads}" if on_cpu else "", threads,
                    f" ({learners} ranks, each with its generator)" if learners > 1 else "", cores,
                    f"give fewer ranks (trainer.devices) or threads" if learners > 1 else f"keep their sum at most {cores}")


def check_cpu_half(cfg: DictConfig, visible: int) -> None:
    """bfloat16 or float16 on a CPU without oneDNN's kernels for it runs far slower than float32, which only the run's
    speed showed: on an AVX2-only AMD EPYC, one thread, a 113M Llama's forward and backward over 8 x 44 tokens under
    bf16 autocast took 114.7 against float32's 4.8 s (24x), 8 rows' sampling of 8 tokens 3.9 against 1.5 s; a 768 x
    3072 linear over 1,408 rows forward and backward 5.8x, its forward on bf16 weights 7.5x and on float16 weights
    6.2x. Warned with the setting that asks for it, as the threads beyond the cores are; not refused: the numbers are
    right, and half weights halve a preset's memory."""
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        return
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if not (accelerator == "cpu" or (not visible and accelerator == "auto")):
        return
    precision, weights = str(cfg.trainer.get("precision")), cfg.model.get("dtype")
    asked = []  # (setting, its float32 setting, the dtype it computes in)
    if precision.startswith("bf16"):  # (16-mixed on the CPU check_trainer refuses; the schema has no 16-true)
        asked.append((f"trainer.precision={precision}", "trainer.precision=32-true", "bfloat16"))
    if weights in ("bfloat16", "float16"):
        asked.append((f"model.dtype={weights}", "model.dtype=float32", weights))
    slow = [a for a in asked if not cpu_has_half_kernels(getattr(torch, a[2]))]
    if slow:
        dtypes = sorted({a[2] for a in slow})
        log.warning("%s: this CPU has no %s kernels (oneDNN's need %s; torch reports %s), so it runs far slower than "
                    "float32 here (a 113M Llama's forward and backward 24x in bf16 on an AVX2 CPU); %s is faster",
                    " and ".join(a[0] for a in slow), " or ".join(dtypes), ", and ".join(HALF_KERNELS[d] for d in dtypes),
                    torch.backends.cpu.get_cpu_capability(), " and ".join(a[1] for a in slow))


def check_half_precision(cfg: DictConfig, memory: str, needs_reward_model: bool) -> None:
    """model.dtype=float16 trains whole weights in float16, where AdamW's first step turns them to NaN: its eps
    (1e-8) is 0 in float16 (stage sft stopped at 'sft/loss is nan at step 1; ... Lower stages.sft.lr', which would
    not help). LoRA adapters train in float32 on a float16 base (peft casts them), so lora with every stage given
    is left alone."""
    if cfg.model.get("dtype") != "float16":
        return
    from rlhflab.models.heads import has_reward_head

    sft_path = cfg.model.get("sft_path")
    if memory == "full":
        trains = "memory=full"
    elif memory == "hydra" and needs_reward_model:  # its one stage, from model.sft_path too, unless that has the head
        trains = None if sft_path and has_reward_head(sft_path) else "stage hydra_sft"
    else:
        trains = ("stage sft" if not sft_path else
                  "stage rm" if needs_reward_model and not cfg.model.get("reward_model_path") else None)
    if trains:
        raise ConfigError(f"model.dtype=float16: {trains} would train whole weights in float16, which AdamW's first step "
                          "turns to NaN (its eps, 1e-8, is 0 in float16); use model.dtype=bfloat16, or float32 with "
                          "trainer.precision=16-mixed on a GPU")


def check_prompt_count(cfg: DictConfig, task) -> None:
    if 0 < task.num_train_prompts < cfg.rl.prompts_per_step:  # 0: a hub dataset not read yet
        raise ConfigError(
            f"rl.prompts_per_step={cfg.rl.prompts_per_step}: larger than the task's {task.num_train_prompts} training prompts; "
            + ("lower it or raise task.num_train_prompts" if "num_train_prompts" in cfg.task
               else f"lower it or add prompts to {cfg.task.get('path')}")
        )


def check_task_data(cfg: DictConfig, task, reward) -> None:
    """The checks that read the task's rows, which validate() makes (in its order) of data read at construction
    (local files), and train() again once it has read the rest (a hub dataset), still before any model loads or
    MLflow run exists."""
    check_prompt_count(cfg, task)
    if reward.needs_reward_model:
        check_reward_chat_template(cfg.model, task)  # conversations: known once the rows are read
    if hasattr(reward, "check_columns"):
        reward.check_columns(task)  # reward functions take the columns of the files read


def validate(cfg: DictConfig) -> Plan:
    """Every check that needs no model: the schema's (types, ranges, undeclared keys), then the
    ones that need the plug-ins themselves (the task's data, the algorithm's needs, ...)."""
    for group in REQUIRED_GROUPS:
        if group not in cfg or cfg[group] is None:
            raise ConfigError(f"{group}: missing; add '{group}=<option>' (options are the files in conf/{group}/)")
    check(cfg)
    task = _instantiate("task", cfg.task)
    algo = _instantiate("algo", cfg.algo)
    reward = _instantiate("reward", cfg.reward)
    generator = _instantiate("generator", cfg.generator)
    correction = _instantiate("off_policy", cfg.off_policy)
    source = _instantiate("mode", cfg.mode, generator=generator, correction=correction)
    memory = _instantiate("memory", cfg.memory)
    tracker = _instantiate("logger", cfg.logger)

    check_prompt_count(cfg, task)
    if hasattr(reward, "check_columns"):
        reward.check_columns(task)
    if getattr(reward, "needs_gold", False) and not task.has_gold:
        raise ConfigError(f"reward=rule: task {task.name} has no gold rule to score with (task.gold_fn: null); "
                          "set task.gold_fn=<file.py>:<function>, or use reward=function or reward=model")
    if correction.weights_samples and not algo.uses_importance_ratio:
        raise ConfigError(
            f"off_policy={correction.name}: {algo.name}'s loss has no importance ratio to weight; "
            "use off_policy=behaviour or off_policy=recompute"
        )
    if cfg.model.get("tokenizer") and not (cfg.model.get("name_or_path") or cfg.model.get("sft_path")):
        # ensure_base_model builds the model for the task's own tokenizer: another one's ids are rows it does not
        # have, or other words (read as [UNK] only after the run had been made)
        raise ConfigError(f"model.tokenizer={cfg.model.tokenizer}: a model built from model.arch has the task's own "
                          "tokenizer; set model.tokenizer=null, or give model.name_or_path (or model.sft_path) it belongs to")
    if task.demonstrations() is None and not cfg.model.get("sft_path"):
        raise ConfigError(f"model.sft_path: null, but task {task.name} has no demonstrations to train SFT on; give a ready SFT "
                          "policy" + (" or task.demonstrations_path=<file>" if "demonstrations_path" in cfg.task else ""))
    if (reward.needs_reward_model and task.preference_pairs() is None and not cfg.model.get("reward_model_path")
            and memory.name != "hydra"):  # memory=hydra takes no reward model: its own check says what it lacks
        raise ConfigError(
            f"model.reward_model_path: null, but task {task.name} has no preference pairs to train one; "
            "give a ready reward model" + (", or task.preferences_path=<file>" if "preferences_path" in cfg.task else "")
            + ", or use reward=function (or reward=rule with task.gold_fn)"
        )
    memory.check(cfg.model, task, reward.needs_reward_model)
    if reward.needs_reward_model:  # after memory.check: memory=hydra refuses a reward model before its template counts
        check_reward_head("model.reward_model_path", cfg.model.get("reward_model_path"))
        check_reward_chat_template(cfg.model, task)
    check_reward_head("task.gold_model_path", cfg.task.get("gold_model_path"))
    for key in ("sft_path", "name_or_path"):
        check_language_model(f"model.{key}", cfg.model.get(key))
    check_half_precision(cfg, memory.name, reward.needs_reward_model)
    resolve_reference(cfg, source, algo, memory, reward)
    generator.check_model(cfg.model)
    if not cfg.model.get("name_or_path") and not cfg.model.get("arch"):
        raise ConfigError("model.name_or_path: null and no model.arch to build from; give a from_pretrained name/path")

    tags = {
        "algo": algo.name,
        "mode": source.name,
        "off_policy": correction.name,
        "staleness": str(cfg.staleness),
        "memory": memory.name,
        "model": model_tag(cfg.model),
        "reward": type(reward).__name__.removesuffix("Reward").lower(),
        "task": task.name,
    }
    return Plan(task, algo, reward, generator, source, memory, tracker, tags)
