"""Validate a composed config and instantiate its cheap parts, before any model loads.

Every failure is a ConfigError whose message is one line: the key, what is
wrong, and how to fix it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig

from rlhflab.algos import functional as F
from rlhflab.algos.registry import Algorithm
from rlhflab.contracts import Generator, MemoryStrategy, Reward, RolloutSource, Task
from rlhflab.errors import ConfigError
from rlhflab.models.build import check_pretrained
from rlhflab.tracking import MlflowTracker

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


def check_keys(group: str, node: DictConfig) -> None:
    """Every key of a `_target_` node must be a parameter of the target (no silently ignored typo)."""
    target = node.get("_target_")
    if target is None:
        raise ConfigError(f"{group}: no _target_; pick one of the options in conf/{group}/")
    try:
        obj = get_class(target) if "." in target else None
    except Exception:
        obj = None
    if obj is None:
        raise ConfigError(f"{group}._target_={target!r}: cannot be imported; check the spelling in conf/{group}/")
    params = inspect.signature(obj).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        params = {**params, **{n: None for c in obj.__mro__ for n in inspect.signature(c.__init__).parameters if c is not object}}
    for key in node:
        if not str(key).startswith("_") and key not in params:
            valid = ", ".join(n for n in params if n not in ("self", "kw", "kwargs"))
            raise ConfigError(f"{group}.{key}: not a setting of {target}; valid keys: {valid}")


def _instantiate(group: str, node: DictConfig, **kwargs):
    check_keys(group, node)
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise ConfigError(f"{group}: {str(cause or err).splitlines()[0]}") from None


def validate(cfg: DictConfig) -> Plan:
    for group in REQUIRED_GROUPS:
        if group not in cfg or cfg[group] is None:
            raise ConfigError(f"{group}: missing; add '{group}=<option>' (options are the files in conf/{group}/)")
    task = _instantiate("task", cfg.task)
    algo = _instantiate("algo", cfg.algo)
    reward = _instantiate("reward", cfg.reward)
    generator = _instantiate("generator", cfg.generator)
    correction = _instantiate("off_policy", cfg.off_policy)
    source = _instantiate("mode", cfg.mode, generator=generator, correction=correction)
    memory = _instantiate("memory", cfg.memory)
    tracker = _instantiate("logger", cfg.logger)
    check_keys("trainer", cfg.trainer)

    if cfg.staleness != source.staleness:  # sync pins 0; async reads the top-level key
        raise ConfigError(
            f"staleness={cfg.staleness}: mode={source.name} runs with staleness {source.staleness}; "
            f"use mode=async for staleness > 0 (or staleness={source.staleness})"
        )
    if not cfg.trainer.get("max_steps") or cfg.trainer.max_steps < 1:
        raise ConfigError(f"trainer.max_steps={cfg.trainer.get('max_steps')}: the RL stage needs a positive step budget")
    rl = cfg.rl
    if rl.prompts_per_step < 1:
        raise ConfigError(f"rl.prompts_per_step={rl.prompts_per_step}: must be at least 1")
    try:
        F.divide_exact(rl.prompts_per_step, algo.num_minibatches, "rl.prompts_per_step / algo.num_minibatches")
    except ValueError as err:
        raise ConfigError(f"{err}; make rl.prompts_per_step a multiple of algo.num_minibatches") from None
    if task.num_train_prompts < rl.prompts_per_step:
        raise ConfigError(
            f"rl.prompts_per_step={rl.prompts_per_step}: larger than the task's {task.num_train_prompts} training prompts; "
            f"lower it or raise task.num_train_prompts"
        )
    for key in ("name_or_path", "sft_path", "reward_model_path", "tokenizer"):
        check_pretrained(f"model.{key}", cfg.model.get(key))
    if correction.weights_samples and not algo.uses_importance_ratio:
        raise ConfigError(
            f"off_policy={correction.name}: {algo.name}'s loss has no importance ratio to weight; "
            "use off_policy=behaviour or off_policy=recompute"
        )
    if task.demonstrations() is None and not cfg.model.get("sft_path"):
        raise ConfigError(f"model.sft_path: null, but task {task.name} has no demonstrations to train SFT on; give a ready SFT policy")
    if reward.needs_reward_model and task.preference_pairs() is None and not cfg.model.get("reward_model_path"):
        raise ConfigError(
            f"model.reward_model_path: null, but task {task.name} has no preference pairs to train one; "
            "give a ready reward model or use reward=rule"
        )
    memory.check(cfg.model, task, reward.needs_reward_model)
    generator.check_model(cfg.model)
    if not cfg.model.get("name_or_path") and not cfg.model.get("arch"):
        raise ConfigError("model.name_or_path: null and no model.arch to build from; give a from_pretrained name/path")

    tags = {
        "algo": algo.name,
        "mode": source.name,
        "off_policy": correction.name,
        "staleness": str(cfg.staleness),
        "memory": memory.name,
        "model": str(cfg.model.name),
        "reward": type(reward).__name__.removesuffix("Reward").lower(),
        "task": task.name,
    }
    return Plan(task, algo, reward, generator, source, memory, tracker, tags)
