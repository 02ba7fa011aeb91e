"""The embedded task: its gold rule, its data, its tokenizer and its one-line errors."""

import json

import pytest
import torch

from rlhflab.errors import ConfigError
from rlhflab.tasks.sentiment import SentimentTask


def test_gold_reward_counts_positive_minus_negative_over_fixed_length():
    task = SentimentTask(response_words=8)
    # 3 positive (good, great, joy), 1 negative (sad): (3 - 1) / 8 = 0.25; a short answer does not pay more.
    r = task.gold_reward(["p", "p", "p"], ["good great the sad joy", "good", ""])
    torch.testing.assert_close(r, torch.tensor([0.25, 0.125, 0.0]))


def test_gold_reward_ignores_words_past_the_budget():
    task = SentimentTask(response_words=2)
    assert task.gold_reward(["p"], ["good good good good"]).item() == 1.0


def test_preference_pairs_and_demonstrations_made_once_are_the_settings_own_and_a_callers_edit_does_not_reach_them():
    """They are kept per process by the task's settings (a sweep's preflight made ~0.5 s of pairs for every job)."""
    from rlhflab.tasks import sentiment

    sentiment._MADE.clear()
    for rows, size in (("preference_pairs", "num_preference_pairs"), ("demonstrations", "num_demonstrations")):
        first = getattr(SentimentTask(**{size: 50}), rows)()
        first.pop()
        again = getattr(SentimentTask(**{size: 50}), rows)()
        assert len(again) == 50 and again[:49] == first
        assert getattr(SentimentTask(**{size: 50}, seed=1), rows)() != again  # another seed, other rows
        assert getattr(SentimentTask(**{size: 50}, response_words=4), rows)() != again
        assert getattr(SentimentTask(**{size: 40}), rows)() == again[:40] != again  # fewer: the same stream, cut
    assert len(sentiment._MADE) == 8


def test_preference_pairs_are_labelled_by_gold_and_cover_high_rewards():
    task = SentimentTask(num_preference_pairs=200)
    pairs = task.preference_pairs()
    assert len(pairs) == 200
    prompts, chosen, rejected = zip(*pairs)
    gc, gr = task.gold_reward(list(prompts), list(chosen)), task.gold_reward(list(prompts), list(rejected))
    assert bool((gc > gr).all())
    assert gc.max() >= 0.75  # the reward model must see very positive text


def test_splits_are_deterministic_and_disjoint_streams():
    a, b = SentimentTask(num_train_prompts=50), SentimentTask(num_train_prompts=50)
    assert a.prompts("train") == b.prompts("train")
    assert a.prompts("train")[:20] != a.prompts("eval")[:20]


def test_tokenizer_round_trips_through_save_and_from_pretrained(tmp_path):
    from transformers import AutoTokenizer

    tok = SentimentTask().build_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.padding_side == "left"
    assert loaded.pad_token_id != loaded.eos_token_id
    ids = loaded("good cat sad", add_special_tokens=False)["input_ids"]
    assert len(ids) == 3 and loaded.decode(ids) == "good cat sad"


def test_missing_words_file_is_one_line_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^task\.words_file: no such file") as err:
        SentimentTask(words_file=str(tmp_path / "nope.json"))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "content, expected",
    [("{not json", "not valid JSON"), (json.dumps({"positive": ["a"], "negative": []}), "non-empty list"),
     (json.dumps({"positive": ["a"], "negative": ["a"], "neutral": ["b"]}), "twice")],
)
def test_malformed_words_file_is_one_line_naming_the_key(tmp_path, content, expected):
    path = tmp_path / "words.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=r"^task\.words_file: ") as err:
        SentimentTask(words_file=str(path))
    assert expected in str(err.value) and "\n" not in str(err.value)
