"""Stage `hydra_sft` (Hydra-RLHF's Hydra-SFT): one backbone learns demonstrations (LM head) and
preferences (reward head) together.

It replaces stages sft and rm under memory=hydra. Each optimizer step takes
one batch of demonstrations (next-token cross-entropy) and one batch of
preference pairs (Bradley-Terry loss on the reward head), both through the
same trunk. The output is cached like the other stages: a causal-LM
`save_pretrained` directory named by a hash of everything that determines it,
with the reward head and its score normalisation saved next to the weights.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from lightning.pytorch.utilities import CombinedLoader

from rlhflab.lit.data import encode_completions, tensor_loader
from rlhflab.lit.stage_modules import HydraSFTModule
from rlhflab.models.build import REWARD_NORM_FILE, config_key, load_causal_lm, save_atomically
from rlhflab.models.heads import ScalarHead
from rlhflab.stages.supervised import log_reward_report, pair_tensors, reward_report

log = logging.getLogger(__name__)


def _stage_data(tokenizer, prompts, responses, pairs, stages: dict):
    """-> (loader of {"sft": demonstration batch, "rm": pair batch}, held-out (chosen, rejected), demonstration ids)."""
    sft, rm = stages["sft"], stages["rm"]
    demos = encode_completions(tokenizer, prompts, responses)
    held_out = max(1, int(len(pairs) * rm["held_out_fraction"]))
    chosen, rejected = pair_tensors(tokenizer, pairs)
    loaders = {
        "sft": tensor_loader(*demos, batch_size=sft["batch_size"], seed=sft["seed"]),
        "rm": tensor_loader(chosen[:-held_out], rejected[:-held_out], batch_size=rm["batch_size"], seed=rm["seed"]),
    }
    # An epoch runs through the longer of the two; the shorter one cycles.
    return CombinedLoader(loaders, mode="max_size_cycle"), (chosen[-held_out:], rejected[-held_out:]), demos[0]


def run_hydra_sft(start_path, tokenizer, task, stages: dict, dtype: str, cache_dir: Path, make_trainer) -> Path:
    """Train (or load from the cache) the two-headed model; returns its save_pretrained directory.

    Epochs: the larger of stages.sft.epochs and stages.rm.epochs; learning
    rates: stages.sft.lr for the backbone and LM head, stages.rm.lr for the
    reward head; batch sizes and seeds from each stage's settings;
    stages.hydra_sft.reward_loss_weight weighs the preference loss against the LM loss.
    """
    reward_loss_weight = stages["hydra_sft"]["reward_loss_weight"]
    prompts, responses = (list(x) for x in zip(*task.demonstrations()))
    pairs = task.preference_pairs()
    # The data itself is hashed: any task setting that changes it (sizes, word lists) makes a new entry.
    key = config_key(str(start_path), task.name, stages["sft"], stages["rm"], reward_loss_weight, prompts, responses, pairs)
    out = Path(cache_dir) / "stages" / f"hydra_sft-{key}"
    if (out / "config.json").is_file():
        log.info("stage hydra_sft: cached, loading %s", out)
        return out
    loader, held_out, demo_ids = _stage_data(tokenizer, prompts, responses, pairs, stages)
    log.info("stage hydra_sft: training on %d demonstrations and %d preference pairs (%d held out) -> %s",
             len(prompts), len(pairs) - len(held_out[0]), len(held_out[0]), out)
    causal_lm = load_causal_lm(start_path, dtype)
    head = ScalarHead(causal_lm.config.hidden_size, dtype=causal_lm.dtype)
    module = HydraSFTModule(causal_lm, head, tokenizer.pad_token_id, stages["sft"]["lr"], stages["rm"]["lr"], reward_loss_weight)
    trainer = make_trainer(max_epochs=max(stages["sft"]["epochs"], stages["rm"]["epochs"]))
    trainer.fit(module, loader)

    norm = reward_report(module, held_out, demo_ids, task, prompts, responses)
    log_reward_report("hydra_sft", norm, trainer)
    save_atomically(out, causal_lm, tokenizer, head, files={REWARD_NORM_FILE: json.dumps(norm, indent=2)})
    return out
