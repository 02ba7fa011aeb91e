"""Stages `sft` and `rm`: supervised fine-tuning and a reward model, each cached.

Each stage's output is a `save_pretrained` directory under
`<cache_dir>/stages/`, named by a hash of everything that determines it, so a
second run with the same settings loads it instead of training again.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from rlhflab.lit.data import encode_completions, tensor_loader
from rlhflab.lit.stage_modules import RewardModule, SFTModule
from rlhflab.models.build import REWARD_NORM_FILE, config_key, load_causal_lm, load_reward_model, save_atomically

log = logging.getLogger(__name__)


def _cached(kind: str, cache_dir: Path, *identity) -> tuple[Path, bool]:
    path = cache_dir / "stages" / f"{kind}-{config_key(*identity)}"
    return path, (path / "config.json").is_file()


def run_sft(base_path, tokenizer, task, stage_cfg: dict, dtype: str, cache_dir: Path, make_trainer) -> Path:
    """Supervised fine-tuning of the base model on the task's demonstrations."""
    prompts, responses = (list(x) for x in zip(*task.demonstrations()))
    # The data itself is hashed: any task setting that changes it (sizes, word lists) makes a new entry.
    out, done = _cached("sft", cache_dir, str(base_path), task.name, prompts, responses, stage_cfg)
    if done:
        log.info("stage sft: cached, loading %s", out)
        return out
    log.info("stage sft: training on %d demonstrations -> %s", len(prompts), out)
    model = load_causal_lm(base_path, dtype)
    data = encode_completions(tokenizer, prompts, responses)
    loader = tensor_loader(*data, batch_size=stage_cfg["batch_size"], seed=stage_cfg["seed"])
    make_trainer(max_epochs=stage_cfg["epochs"]).fit(SFTModule(model, stage_cfg["lr"]), loader)
    save_atomically(out, model, tokenizer)
    return out


@torch.no_grad()
def score_all(module: RewardModule, input_ids: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    module.eval()
    return torch.cat([module.score(input_ids[i : i + batch_size]) for i in range(0, len(input_ids), batch_size)])


def pair_tensors(tokenizer, pairs):
    prompts, chosen, rejected = (list(x) for x in zip(*pairs))
    c = encode_completions(tokenizer, prompts, chosen)[0]
    r = encode_completions(tokenizer, prompts, rejected)[0]
    width = max(c.shape[1], r.shape[1])
    pad = tokenizer.pad_token_id
    c = torch.nn.functional.pad(c, (0, width - c.shape[1]), value=pad)
    r = torch.nn.functional.pad(r, (0, width - r.shape[1]), value=pad)
    return c, r


def reward_report(module, held_out, demo_ids, task, prompts, responses) -> dict:
    """Held-out pair accuracy, correlation with gold, and the mean/std RL standardises scores with.

    module: anything with `score(input_ids) -> (n,)`; held_out: (chosen ids, rejected ids).
    """
    accuracy = float((score_all(module, held_out[0]) > score_all(module, held_out[1])).float().mean())
    demo_scores = score_all(module, demo_ids)
    gold = task.gold_reward(prompts, responses)
    corr = float(torch.corrcoef(torch.stack([demo_scores, gold]))[0, 1])
    return {"mean": float(demo_scores.mean()), "std": float(demo_scores.std()), "held_out_accuracy": accuracy, "gold_correlation": corr}


def log_reward_report(stage: str, norm: dict, trainer) -> None:
    log.info("stage %s: held-out pair accuracy %.3f, correlation with gold %.3f", stage, norm["held_out_accuracy"], norm["gold_correlation"])
    if trainer.logger is not None:
        trainer.logger.log_metrics({"rm/held_out_accuracy": norm["held_out_accuracy"], "rm/gold_correlation": norm["gold_correlation"]})


def run_rm(sft_path, tokenizer, task, stage_cfg: dict, dtype: str, cache_dir: Path, make_trainer) -> Path:
    """A reward model (the SFT backbone plus a scalar head) trained on gold-labelled preference pairs.

    Also stores the mean/std of its scores on demonstrations: the RL stage
    standardises scores with them so that a KL coefficient means the same
    thing whatever scale the reward model happened to learn.
    """
    pairs = task.preference_pairs()
    prompts, responses = (list(x) for x in zip(*task.demonstrations()))  # where score statistics are measured
    out, done = _cached("rm", cache_dir, str(sft_path), task.name, pairs, prompts, responses, stage_cfg)
    if done:
        log.info("stage rm: cached, loading %s", out)
        return out
    held_out = max(1, int(len(pairs) * stage_cfg["held_out_fraction"]))
    log.info("stage rm: training on %d preference pairs (%d held out) -> %s", len(pairs) - held_out, held_out, out)
    model = load_reward_model(sft_path, dtype, tokenizer.pad_token_id)
    chosen, rejected = pair_tensors(tokenizer, pairs)
    module = RewardModule(model, stage_cfg["lr"])
    loader = tensor_loader(chosen[:-held_out], rejected[:-held_out], batch_size=stage_cfg["batch_size"], seed=stage_cfg["seed"])
    trainer = make_trainer(max_epochs=stage_cfg["epochs"])
    trainer.fit(module, loader)

    demo_ids = encode_completions(tokenizer, prompts, responses)[0]
    norm = reward_report(module, (chosen[-held_out:], rejected[-held_out:]), demo_ids, task, prompts, responses)
    log_reward_report("rm", norm, trainer)
    save_atomically(out, model, tokenizer, files={REWARD_NORM_FILE: json.dumps(norm, indent=2)})
    return out
