"""The stage pipeline: `sft`, `rm` and `hydra_sft`, each cached by what determines it.

The memory strategy declares which stages it needs (`memory.stages(need_reward)`);
`run_stages` runs them in order, skipping any whose output the config already
gives (`model.sft_path`, `model.reward_model_path`) or the cache holds.
"""

from __future__ import annotations

import logging
from pathlib import Path

from rlhflab.models.cache import Saved
from rlhflab.models.heads import has_reward_head
from rlhflab.stages.hydra_sft import run_hydra_sft
from rlhflab.stages.supervised import run_rm, run_sft

log = logging.getLogger(__name__)


def given(path: str | None) -> Saved | None:
    """A model the config names (model.sft_path, model.reward_model_path): its name is its identity."""
    return Saved(path, f"given:{path}") if path else None


def run_stages(names: tuple[str, ...], model_cfg: dict, base: Saved, tokenizer, task, stages_cfg: dict, cache_dir: Path,
               make_trainer) -> tuple[Saved, Saved | None]:
    """-> (policy, reward model or None) for `memory.build`."""
    dtype = model_cfg["dtype"]
    sft = given(model_cfg.get("sft_path"))
    if "hydra_sft" in names:
        if sft and has_reward_head(sft.path):
            log.info("stage hydra_sft: skipped, model.sft_path=%s already carries a reward head", sft)
            return sft, sft
        trunk = run_hydra_sft(sft or base, tokenizer, task, stages_cfg, dtype, cache_dir, make_trainer)
        return trunk, trunk
    if sft:
        log.info("stage sft: skipped, using model.sft_path=%s", sft)
    else:
        sft = run_sft(base, tokenizer, task, stages_cfg["sft"], dtype, cache_dir, make_trainer)
    if "rm" not in names:
        log.info("stage rm: skipped, the reward needs no reward model")
        return sft, None
    if model_cfg.get("reward_model_path"):
        log.info("stage rm: skipped, using model.reward_model_path=%s", model_cfg["reward_model_path"])
        return sft, given(model_cfg["reward_model_path"])
    return sft, run_rm(sft, tokenizer, task, stages_cfg["rm"], dtype, cache_dir, make_trainer)
