"""Stages `sft` and `rm`: supervised fine-tuning and a reward model, each cached (rlhflab.models.cache).

An entry's key covers the identity of its input model, the task's data itself, the
stage's settings and seed, and the tokenizer's vocabulary. A stage whose result is
unusable (a non-finite loss, reward-model statistics that are not finite, or a
held-out accuracy at chance) stops the run in one line and is not cached.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch

from rlhflab.errors import RewardError, StageFailed
from rlhflab.lit.data import encode_completions, tensor_loader
from rlhflab.lit.stage_modules import RewardModule, SFTModule
from rlhflab.models.build import REWARD_NORM_FILE, load_causal_lm, load_reward_model
from rlhflab.models.cache import Saved, cached, config_key
from rlhflab.models.sharding import save_whole
from rlhflab.rng import fixed_seed

log = logging.getLogger(__name__)

# Below this many held-out pairs an accuracy near 0.5 may be noise, so only non-finite statistics fail the stage.
MIN_PAIRS_TO_JUDGE = 50
CHANCE = 0.55


def torch_threads_said(batch_threads: int = 1) -> str:
    """'2 torch threads', or '2 batch threads of 1 torch thread': what a stage trains with (stages.torch_threads,
    stages.batch_threads), in its first line."""
    n = torch.get_num_threads()
    said = f"{n} torch thread{'s' if n != 1 else ''}"
    return f"{batch_threads} batch threads of {said}" if batch_threads > 1 else said


def vocab_key(tokenizer) -> str:
    return config_key(tokenizer.get_vocab())


def run_sft(base: Saved, tokenizer, task, stage_cfg: dict, dtype: str, cache_dir: Path, make_trainer) -> Saved:
    """Supervised fine-tuning of the base model on the task's demonstrations."""
    prompts, responses = (list(x) for x in zip(*task.demonstrations()))
    # The data itself is hashed: any task setting that changes it (sizes, word lists, seeds) makes a new entry.
    key = config_key(base.identity, vocab_key(tokenizer), task.name, prompts, responses, stage_cfg, dtype)

    def build(tmp: Path) -> None:
        log.info("stage sft: training on %d demonstrations, %s", len(prompts), torch_threads_said(stage_cfg.get("batch_threads", 1)))
        with fixed_seed(stage_cfg["seed"]):
            model = load_causal_lm(base.path, dtype)
            data = encode_completions(tokenizer, prompts, responses)
            loader = tensor_loader(*data, batch_size=stage_cfg["batch_size"], seed=stage_cfg["seed"])
            make_trainer("sft", max_epochs=stage_cfg["epochs"]).fit(
                SFTModule(model, stage_cfg["lr"], stage_cfg.get("batch_threads", 1)), loader)
        save_whole(model, tmp)
        tokenizer.save_pretrained(tmp)

    return Saved(cached(cache_dir, "stages", "sft", key, "stage sft", build), f"sft-{key}")


@torch.no_grad()
def score_all(module, input_ids: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
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
    corr = math.nan  # without a gold judgement of plain text (e.g. a gold_fn that needs its row's answer)
    if task.has_gold:
        try:
            gold = task.gold_reward(prompts, responses, "train", None)
            corr = float(torch.corrcoef(torch.stack([demo_scores, gold]))[0, 1])
        except (RewardError, TypeError) as err:
            log.info("reward model report: no correlation with gold (%s)", str(err).splitlines()[0])
    return {"mean": float(demo_scores.mean()), "std": float(demo_scores.std()), "held_out_accuracy": accuracy,
            "gold_correlation": corr, "held_out_pairs": len(held_out[0])}


def accept_reward_report(stage: str, norm: dict, trainer, lr_key: str) -> None:
    """Log the report, and refuse (StageFailed, nothing cached) a reward model that is unusable."""
    corr = norm["gold_correlation"]
    measured = math.isfinite(corr)  # not: no gold judgement of plain text (said above); no NaN in the logs for it
    log.info("stage %s: held-out pair accuracy %.3f, %s", stage, norm["held_out_accuracy"],
             f"correlation with gold {corr:.3f}" if measured else "no correlation with gold")
    if trainer.logger is not None:
        trainer.logger.log_metrics({"rm/held_out_accuracy": norm["held_out_accuracy"], **({"rm/gold_correlation": corr} if measured else {})})
    if not all(math.isfinite(norm[k]) for k in ("mean", "std")) or norm["std"] == 0:
        raise StageFailed(f"stage {stage}: its reward model's scores are {'constant' if norm['std'] == 0 else 'not finite'} "
                          f"(mean {norm['mean']}, std {norm['std']}); not cached. Lower {lr_key} and run again")
    if norm["held_out_pairs"] >= MIN_PAIRS_TO_JUDGE and norm["held_out_accuracy"] < CHANCE:
        raise StageFailed(f"stage {stage}: held-out pair accuracy {norm['held_out_accuracy']:.3f} on {norm['held_out_pairs']} pairs "
                          f"is chance level; not cached. Lower {lr_key}, train longer, or give more preference pairs")


def score_statistics_texts(task) -> tuple[list[str], list[str]]:
    """Where a reward model's score mean/std are measured: the demonstrations (responses like the SFT
    policy's), or without them (a ready model.sft_path) every chosen and rejected response of the pairs."""
    demos = task.demonstrations()
    if demos:
        return [p for p, _ in demos], [r for _, r in demos]
    pairs = task.preference_pairs()
    return [p for p, _, _ in pairs] * 2, [c for _, c, _ in pairs] + [r for _, _, r in pairs]


def run_rm(sft: Saved, tokenizer, task, stage_cfg: dict, dtype: str, cache_dir: Path, make_trainer) -> Saved:
    """A reward model (the SFT backbone plus a scalar head) trained on gold-labelled preference pairs.

    Also stores the mean/std of its scores on demonstrations: the RL stage
    standardises scores with them so that a KL coefficient means the same
    thing whatever scale the reward model happened to learn.
    """
    pairs = task.preference_pairs()
    prompts, responses = score_statistics_texts(task)
    key = config_key(sft.identity, vocab_key(tokenizer), task.name, pairs, prompts, responses, stage_cfg, dtype)

    def build(tmp: Path) -> None:
        held_out = max(1, int(len(pairs) * stage_cfg["held_out_fraction"]))
        log.info("stage rm: training on %d preference pairs (%d held out), %s", len(pairs) - held_out, held_out,
                 torch_threads_said(stage_cfg.get("batch_threads", 1)))
        with fixed_seed(stage_cfg["seed"]):  # the fresh score head too: the same model for the same key
            model = load_reward_model(sft.path, dtype, tokenizer.pad_token_id)
            chosen, rejected = pair_tensors(tokenizer, pairs)
            module = RewardModule(model, stage_cfg["lr"], stage_cfg.get("batch_threads", 1))
            loader = tensor_loader(chosen[:-held_out], rejected[:-held_out], batch_size=stage_cfg["batch_size"], seed=stage_cfg["seed"])
            trainer = make_trainer("rm", max_epochs=stage_cfg["epochs"])
            trainer.fit(module, loader)
        demo_ids = encode_completions(tokenizer, prompts, responses)[0]
        norm = reward_report(module, (chosen[-held_out:], rejected[-held_out:]), demo_ids, task, prompts, responses)
        accept_reward_report("rm", norm, trainer, "stages.rm.lr")
        save_whole(model, tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / REWARD_NORM_FILE).write_text(json.dumps(norm, indent=2))

    return Saved(cached(cache_dir, "stages", "rm", key, "stage rm", build), f"rm-{key}")
