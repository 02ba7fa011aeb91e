"""The embedded synthetic task: "continue these words, positively".

A prompt is `prompt_words` random words; a response is up to `response_words`
words then EOS. The gold reward is (#positive - #negative) / response_words:
a fixed denominator, so stopping early never pays. Demonstrations are random
continuations (an SFT policy scores about 0); preference pairs are labelled by
the gold rule and cover the whole reward range, so a reward model learns it.
Everything is generated from a seed, as Python lists, in well under a second.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhflab.errors import ConfigError, no_such_file

log = logging.getLogger(__name__)

EMBEDDED_WORDS = Path(__file__).parent / "data" / "sentiment_words.json"
MAX_WORDS = 5000  # beyond this the embedded model sizes and data counts are unlikely to learn the task
SPECIALS = {"pad": "[PAD]", "eos": "[EOS]", "bos": "[BOS]", "unk": "[UNK]"}


@dataclass(frozen=True)
class WordLists:
    positive: tuple[str, ...]
    negative: tuple[str, ...]
    neutral: tuple[str, ...]

    @property
    def all(self) -> tuple[str, ...]:
        return self.positive + self.negative + self.neutral


def load_words(words_file: str | None) -> WordLists:
    """Read the word lists; every problem is one line naming `task.words_file`."""
    path = Path(words_file) if words_file else EMBEDDED_WORDS
    fix = "point it at a JSON file with 'positive', 'negative', 'neutral' word lists, or set task.words_file=null"
    if not path.is_file():
        raise ConfigError(f"task.words_file: {no_such_file(path)}; {fix}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"task.words_file: '{path}' is not UTF-8 text (byte {err.start}); save it as UTF-8, or {fix}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"task.words_file: '{path}' is not valid JSON ({err.msg}, line {err.lineno}); {fix}") from None
    lists = {}
    for key in ("positive", "negative", "neutral"):
        words = data.get(key) if isinstance(data, dict) else None
        if not isinstance(words, list) or not words or not all(isinstance(w, str) and w.strip() == w and w for w in words):
            raise ConfigError(f"task.words_file: '{path}' needs a non-empty list of single words under '{key}'; {fix}")
        lists[key] = tuple(words)
    every = lists["positive"] + lists["negative"] + lists["neutral"]
    if len(set(every)) != len(every):
        raise ConfigError(f"task.words_file: '{path}' lists a word twice; {fix}")
    special = sorted(set(every) & set(SPECIALS.values()))
    if special:
        raise ConfigError(f"task.words_file: '{path}' lists {', '.join(special)}, which the tokenizer reserves; remove them")
    if len(every) > MAX_WORDS:
        log.warning("task.words_file: %d words make a vocabulary the tiny model and %s may not learn; "
                    "the reward stage stops if its model stays at chance", len(every), "the default data sizes")
    return WordLists(**lists)


_MADE: dict[tuple, tuple] = {}  # SentimentTask's demonstrations and preference pairs by their settings


def _once(key: tuple, make) -> list:
    """make()'s rows, made once per process for the same settings (a sweep's preflight asks for every job's: ~0.5 s of
    pairs and ~30 ms of demonstrations each); a copy, so that a caller's edit does not reach them."""
    if key not in _MADE:
        if len(_MADE) >= 16:  # a sweep over the task's settings: the oldest go
            del _MADE[next(iter(_MADE))]
        _MADE[key] = tuple(make())
    return list(_MADE[key])


class SentimentTask:
    """Prompts, demonstrations, preference pairs and the gold reward of the embedded task."""

    name = "sentiment"
    has_gold = True

    def __init__(
        self,
        words_file: str | None = None,
        prompt_words: int = 6,
        response_words: int = 8,
        num_train_prompts: int = 4096,
        num_eval_prompts: int = 64,
        num_demonstrations: int = 2048,
        num_preference_pairs: int = 2048,
        seed: int = 0,
    ) -> None:
        self.words = load_words(words_file)
        self.prompt_words = prompt_words
        self.response_words = response_words
        self.num_train_prompts = num_train_prompts
        self.num_eval_prompts = num_eval_prompts
        self.num_demonstrations = num_demonstrations
        self.num_preference_pairs = num_preference_pairs
        self.seed = seed
        self._positive = frozenset(self.words.positive)
        self._negative = frozenset(self.words.negative)

    # Generation budget: every word is one token, plus one for EOS.
    @property
    def max_new_tokens(self) -> int:
        return self.response_words + 1

    def build_tokenizer(self):
        """A word-level tokenizer over the task's words (pad differs from EOS)."""
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {tok: i for i, tok in enumerate(SPECIALS.values())}
        for word in self.words.all:
            vocab[word] = len(vocab)
        backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIALS["unk"]))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        # padding_side must be given to the constructor: setting it later is not saved.
        return PreTrainedTokenizerFast(
            tokenizer_object=backend,
            pad_token=SPECIALS["pad"],
            eos_token=SPECIALS["eos"],
            bos_token=SPECIALS["bos"],
            unk_token=SPECIALS["unk"],
            padding_side="left",
        )

    def _rng(self, split: str) -> random.Random:
        return random.Random(f"{self.seed}-{split}")

    def _prompt(self, rng: random.Random) -> str:
        return " ".join(rng.choice(self.words.all) for _ in range(self.prompt_words))

    def prompts(self, split: str) -> list[str]:
        """`split` is 'train' or 'eval'; the two never share a generator seed."""
        n = {"train": self.num_train_prompts, "eval": self.num_eval_prompts}[split]
        rng = self._rng(split)
        return [self._prompt(rng) for _ in range(n)]

    def _settings(self) -> tuple:
        return (self.words.positive, self.words.negative, self.words.neutral, self.prompt_words, self.response_words,
                self.seed)

    def demonstrations(self) -> list[tuple[str, str]]:
        """(prompt, response) pairs of random continuations of 3/4 to full length (made once per process, `_once`)."""
        def make():
            rng = self._rng("sft")
            shortest = max(1, (3 * self.response_words) // 4)
            for _ in range(self.num_demonstrations):
                n = rng.randint(shortest, self.response_words)
                yield self._prompt(rng), " ".join(rng.choice(self.words.all) for _ in range(n))

        return _once(("demonstrations", *self._settings(), self.num_demonstrations), make)

    def _biased_response(self, rng: random.Random) -> str:
        # A per-response "mood" spreads pairs over the whole reward range: a
        # reward model trained only on random text never sees very positive text.
        mood = rng.uniform(-1.0, 1.0)
        words = []
        for _ in range(self.response_words):
            u = rng.random()
            if u < max(mood, 0.0):
                words.append(rng.choice(self.words.positive))
            elif u < max(mood, 0.0) + max(-mood, 0.0):
                words.append(rng.choice(self.words.negative))
            else:
                words.append(rng.choice(self.words.all))
        return " ".join(words)

    def preference_pairs(self) -> list[tuple[str, str, str]]:
        """(prompt, chosen, rejected), labelled by the gold reward; ties are skipped (made once per process, `_once`)."""
        def make():
            rng = self._rng("rm")
            out = []
            while len(out) < self.num_preference_pairs:
                prompt, a, b = self._prompt(rng), self._biased_response(rng), self._biased_response(rng)
                ra, rb = self.gold_reward([prompt, prompt], [a, b]).tolist()
                if ra != rb:
                    out.append((prompt, a, b) if ra > rb else (prompt, b, a))
            return out

        return _once(("pairs", *self._settings(), self.num_preference_pairs), make)

    def setup(self, tokenizer) -> dict[str, int]:
        """Its prompts are words of its own tokenizer: nothing to adapt."""
        return {}

    def reward_inputs(self, split, rows, prompts, completions):
        return prompts, completions, {}

    def gold_reward(self, prompts: list[str], responses: list[str], split: str = "eval", rows=None) -> torch.Tensor:
        """(#positive - #negative) / response_words for each response text: (n,).

        Only the first `response_words` words count, so running past the budget never pays.
        """
        del prompts  # the rule ignores the prompt
        scores = []
        for text in responses:
            words = text.split()[: self.response_words]
            pos = sum(w in self._positive for w in words)
            neg = sum(w in self._negative for w in words)
            scores.append((pos - neg) / self.response_words)
        return torch.tensor(scores, dtype=torch.float32)
