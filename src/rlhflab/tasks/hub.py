"""Prompts from a Hugging Face dataset (e.g. TL;DR), scored by a gold reward model.

Used with a real model preset whose SFT policy and reward model are ready
(`model.sft_path`, `model.reward_model_path`): the task supplies prompts only.
Nothing is downloaded until the prompts or the gold model are first needed.
"""

from __future__ import annotations

from functools import cached_property

import torch

from rlhflab.errors import ConfigError


class HubPromptTask:
    """dataset: a `datasets.load_dataset` name or local path; prompt_key: its prompt column.

    gold_model_path: the reward model that plays the gold reward in evaluation
    (the async-RLHF paper uses a larger "gold" RM than the training RM).
    """

    name = "hub_prompts"
    has_gold = True  # the gold reward model

    def __init__(self, dataset: str, prompt_key: str = "prompt", train_split: str = "train", eval_split: str = "validation",
                 num_train_prompts: int = 8192, num_eval_prompts: int = 256, max_new_tokens: int = 53,
                 gold_model_path: str | None = None, seed: int = 0) -> None:
        self.dataset = dataset
        # The run's `task` tag and the errors' word for it: the dataset's own name (trl-lib/tldr -> tldr).
        self.name = dataset.rstrip("/").rpartition("/")[2] or self.name
        self.prompt_key = prompt_key
        self.splits = {"train": train_split, "eval": eval_split}
        self.num_train_prompts = num_train_prompts
        self.num_eval_prompts = num_eval_prompts
        self.max_new_tokens = max_new_tokens
        self.gold_model_path = gold_model_path
        self.seed = seed

    def demonstrations(self) -> None:
        """No SFT data: give model.sft_path."""
        return None

    def preference_pairs(self) -> None:
        """No preference data: give model.reward_model_path."""
        return None

    def build_tokenizer(self):
        raise ConfigError("task: a hub dataset brings no tokenizer; set model.name_or_path to a pretrained model")

    def prompts(self, split: str) -> list[str]:
        try:
            import datasets
        except ImportError:
            raise ConfigError(f"task.dataset={self.dataset}: needs the `datasets` package; pip install datasets") from None
        n = {"train": self.num_train_prompts, "eval": self.num_eval_prompts}[split]
        data = datasets.load_dataset(self.dataset, split=self.splits[split]).shuffle(seed=self.seed)
        return list(data.select(range(min(n, len(data))))[self.prompt_key])

    @cached_property
    def _gold(self):
        from rlhflab.models.build import for_text_scores, load_reward_model, saved_tokenizer

        if self.gold_model_path is None:
            raise ConfigError("task.gold_model_path: null; name the reward model that scores evaluation")
        try:
            tok = for_text_scores(saved_tokenizer(self.gold_model_path))  # Pythia's has no pad token
        except OSError as err:
            raise ConfigError(f"task.gold_model_path: no tokenizer can be read from '{self.gold_model_path}' ({err}); "
                              "save the one it was trained with beside it (tokenizer.save_pretrained)") from None
        return tok, load_reward_model(self.gold_model_path, pad_token_id=tok.pad_token_id).eval()

    @torch.no_grad()
    def setup(self, tokenizer) -> dict[str, int]:
        return {}

    def reward_inputs(self, split, rows, prompts, completions):
        return prompts, completions, {}

    def gold_reward(self, prompts: list[str], responses: list[str], split: str = "eval", rows=None) -> torch.Tensor:
        tok, model = self._gold
        batch = tok([p + r for p, r in zip(prompts, responses)], return_tensors="pt", padding=True)
        return model(**batch.to(model.device)).logits.squeeze(-1).float().cpu()
