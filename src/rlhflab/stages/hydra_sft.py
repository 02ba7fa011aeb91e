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
from rlhflab.models.build import REWARD_NORM_FILE, load_causal_lm
from rlhflab.models.cache import Saved, cached, config_key
from rlhflab.models.heads import ScalarHead
from rlhflab.models.sharding import save_whole
from rlhflab.rng import fixed_seed
from rlhflab.stages.supervised import accept_reward_report, pair_tensors, reward_report, torch_threads_said, vocab_key

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


def run_hydra_sft(start: Saved, tokenizer, task, stages: dict, dtype: str, cache_dir: Path, make_trainer) -> Saved:
    """Train (or load from the cache) the two-headed model; returns its save_pretrained directory.

    Epochs: the larger of stages.sft.epochs and stages.rm.epochs; learning
    rates: stages.sft.lr for the backbone and LM head, stages.rm.lr for the
    reward head; batch sizes and seeds from each stage's settings;
    stages.hydra_sft.reward_loss_weight weighs the preference loss against the LM loss.
    """
    reward_loss_weight = stages["hydra_sft"]["reward_loss_weight"]
    prompts, responses = (list(x) for x in zip(*task.demonstrations()))
    pairs = task.preference_pairs()
    # The data itself is hashed: any task setting that changes it (sizes, word lists, seeds) makes a new entry.
    key = config_key(start.identity, vocab_key(tokenizer), task.name, stages["sft"], stages["rm"], reward_loss_weight,
                     prompts, responses, pairs, dtype)

    threads = stages["sft"].get("batch_threads", 1)  # stages.batch_threads where it applies (train.batch_threads)

    def build(tmp: Path) -> None:
        loader, held_out, demo_ids = _stage_data(tokenizer, prompts, responses, pairs, stages)
        log.info("stage hydra_sft: training on %d demonstrations and %d preference pairs (%d held out), %s",
                 len(prompts), len(pairs) - len(held_out[0]), len(held_out[0]), torch_threads_said(threads))
        with fixed_seed(stages["sft"]["seed"]):
            causal_lm = load_causal_lm(start.path, dtype)
            head = ScalarHead(causal_lm.config.hidden_size, dtype=causal_lm.dtype)
            module = HydraSFTModule(causal_lm, head, tokenizer.pad_token_id, stages["sft"]["lr"], stages["rm"]["lr"], reward_loss_weight,
                                    threads)
            trainer = make_trainer("hydra_sft", max_epochs=max(stages["sft"]["epochs"], stages["rm"]["epochs"]))
            trainer.fit(module, loader)
        norm = reward_report(module, held_out, demo_ids, task, prompts, responses)
        accept_reward_report("hydra_sft", norm, trainer, "stages.rm.lr")
        save_whole(causal_lm, tmp)
        save_whole(head, tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / REWARD_NORM_FILE).write_text(json.dumps(norm, indent=2))

    return Saved(cached(cache_dir, "stages", "hydra_sft", key, "stage hydra_sft", build), f"hydra_sft-{key}")
