"""`train(cfg)`: validate, then run the stages that are missing, then RL; all tracked in MLflow."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from rlhflab.config import Plan, validate
from rlhflab.errors import ConfigError
from rlhflab.lit.rl_module import RLHFModule
from rlhflab.models.build import ensure_base_model, load_tokenizer
from rlhflab.quiet import quiet_libraries
from rlhflab.stages.pipeline import run_stages

log = logging.getLogger("rlhflab")


@dataclass
class Result:
    metrics: dict[str, float]
    module: RLHFModule  # for callers (tests) that inspect the trained models
    run_id: str


def _make_trainer(cfg: DictConfig, logger, **overrides):
    def make(**stage_overrides):
        return instantiate(cfg.trainer, logger=logger, **(overrides | stage_overrides))

    return make


def train(cfg: DictConfig) -> Result:
    """Run one experiment end to end. Raises ConfigError (one line) before loading any model."""
    plan: Plan = validate(cfg)  # every check that needs no model
    quiet_libraries()
    if cfg.torch_threads:
        torch.set_num_threads(int(cfg.torch_threads))
    torch.manual_seed(cfg.seed)
    tracker = plan.tracker
    tracker.start(cfg, plan.tags)
    status = "FAILED"
    try:
        result = _run(cfg, plan, tracker)
        status = "FINISHED"
        return result
    finally:
        tracker.finish(status)


def _run(cfg: DictConfig, plan: Plan, tracker) -> Result:
    started = time.perf_counter()
    cache_dir = Path(cfg.cache_dir)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    stages = OmegaConf.to_container(cfg.stages, resolve=True)
    logger = tracker.lightning_logger()
    make_stage_trainer = _make_trainer(cfg, logger, max_steps=-1)
    task = plan.task

    # Stage 0: the base model (built from config for the tiny preset, cached).
    base = ensure_base_model(model_cfg, task, cache_dir)
    tokenizer = load_tokenizer(model_cfg.get("tokenizer") or model_cfg.get("sft_path") or base)
    # The stages the memory strategy needs (sft and rm, or hydra_sft), each skipped when given or cached.
    needed = plan.memory.stages(plan.reward.needs_reward_model)
    sft_path, reward_path = run_stages(needed, model_cfg, base, tokenizer, task, stages, cache_dir, make_stage_trainer)
    t_stages = time.perf_counter() - started

    # Stage rl.
    log.info("stage rl: %s, %s memory, %s mode, %d steps", plan.algo.name, plan.memory.name, plan.source.name, cfg.trainer.max_steps)
    memory = plan.memory.build(sft_path, reward_path, plan.algo.needs_values, tokenizer.pad_token_id, model_cfg["dtype"])
    plan.generator.setup(tokenizer, task.max_new_tokens)
    train_prompts, eval_prompts = task.prompts("train"), task.prompts("eval")
    module = RLHFModule(memory, plan.algo, plan.reward, plan.source, task, tokenizer, train_prompts, eval_prompts, cfg.rl, cfg.seed)
    trainer = _make_trainer(cfg, logger)()
    try:
        trainer.fit(module)
    finally:
        plan.source.close()
    t_rl = time.perf_counter() - started - t_stages

    before, (_, after, final_kl) = module.eval_history[0][1], module.eval_history[-1]
    metrics = {
        "eval/gold_reward_before": before,
        "eval/gold_reward": after,
        "eval/kl": final_kl,
        **module.timing_summary(),
        "perf/stages_s": t_stages,
        "perf/rl_s": t_rl,
        "perf/total_s": time.perf_counter() - started,
    }
    already_logged = ("eval/gold_reward", "eval/kl")  # by the module's last evaluation
    tracker.log_metrics({k: v for k, v in metrics.items() if k not in already_logged}, step=module.updates)
    tracker.log_generations(module.generation_rows)
    tracker.set_tag("perf/mem_method", module.mem_method)
    log.info(
        "done: gold reward %.3f -> %.3f after %d RL steps; stages %.0fs, RL %.0fs; MLflow run %s",
        before, after, module.policy_version, t_stages, t_rl, tracker.run_id,
    )
    return Result(metrics, module, tracker.run_id)


def main(cfg: DictConfig) -> float | None:
    """What `src/train.py` runs: one-line errors for bad input, the swept metric for sweepers."""
    try:
        result = train(cfg)
    except ConfigError as err:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # a sweep records the failed job and goes on
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    return objective(result.metrics, cfg)


def objective(metrics: dict[str, float], cfg: DictConfig) -> float | None:
    """What a sweeper optimises: `optimized_metric`, less `kl_penalty` per nat of final eval/kl
    above `kl_budget` when a budget is set (Optuna has no constraints, so the budget is a penalty)."""
    value = metrics.get(cfg.get("optimized_metric") or "eval/gold_reward")
    budget = cfg.get("kl_budget")
    if value is None or budget is None:
        return value
    return value - cfg.get("kl_penalty", 1.0) * max(0.0, metrics["eval/kl"] - budget)
