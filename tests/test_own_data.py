"""Your own data and reward (issue 13): prompt files, reward functions, a reward model with its own tokenizer."""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from conftest import ROOT, compose_cfg, tokenizer_without_pad
from rlhflab.callables import call_reward
from rlhflab.errors import ConfigError, RewardError
from rlhflab.rewards.functions import FunctionReward
from rlhflab.rollout.batch import Rollout
from rlhflab.models.checks import is_hub_dataset
from rlhflab.tasks.files import PromptsTask
from rlhflab.train import train

EXAMPLE = ROOT / "examples" / "reverse"
REWARD = f"{EXAMPLE}/reward.py"
# The embedded SHRINK, less the sentiment task's own keys.
SMALL = ["stages.sft.epochs=1", "stages.rm.epochs=2", "rl.prompts_per_step=16", "rl.eval_every=0", "rl.log_generations=4",
         "trainer.enable_progress_bar=false"]


def rows(n: int = 40) -> list[dict]:
    # `level` is a number in JSON Lines and Parquet, and text in a CSV (its columns are text as written).
    return [{"prompt": f"{i:03d}=", "answer": "r" + f"{i:03d}"[::-1], "level": i % 3} for i in range(n)]


def write(path: Path, data: list[dict]) -> Path:
    import pandas as pd

    frame = pd.DataFrame(data)
    {".jsonl": lambda: frame.to_json(path, orient="records", lines=True), ".csv": lambda: frame.to_csv(path, index=False),
     ".parquet": lambda: frame.to_parquet(path)}[path.suffix]()
    return path


def own_task(tmp_path: Path, *extra: str, reward: tuple[str, ...] = ("reward=function", f"reward.fn={REWARD}:correct_digits")) -> list[str]:
    """Overrides for task=prompts on the example's files (demonstrations included) and, by default, reward=function."""
    return ["task=prompts", f"task.path={EXAMPLE}/train.jsonl", f"task.eval_path={EXAMPLE}/eval.jsonl",
            f"task.demonstrations_path={EXAMPLE}/demos.jsonl", "task.max_new_tokens=4", "task.tokenizer=char",
            *reward, *SMALL, *extra]


# ---- files -----------------------------------------------------------------------------------

def saved(path: Path, data: list[dict], split: str | None = None) -> Path:
    """A `datasets.Dataset` (or, with `split`, a DatasetDict holding it as that split) written by save_to_disk."""
    import datasets

    table = datasets.Dataset.from_list(data)
    (datasets.DatasetDict({split: table}) if split else table).save_to_disk(str(path))
    return path


def cached_hub_dataset(monkeypatch, cache: Path, name: str, source: Path) -> None:
    """`name` ('org/Name') in datasets' cache at `cache`, as a load where the hub was reachable leaves it (one
    `default` config, split `train` from the JSON Lines `source`), and this process offline: load_dataset(name)
    reads it from there, as on a machine without the hub."""
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.json.json import Json

    org, last = name.split("/")
    snake = camelcase_to_snakecase(last)
    Json(data_files={"train": str(source)}, cache_dir=str(cache / "build"), dataset_name=snake).download_and_prepare()
    home = cache / f"{org}___{snake}" / "default" / "0.0.0"  # where load_dataset(name) looks offline
    home.mkdir(parents=True)
    next((cache / "build").glob("*/*/0.0.0")).rename(home / ("0" * 16))  # built in <snake>/default-<config hash>/0.0.0
    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", cache)  # read at import: the attributes
    monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("extra, error", [("task.split=nope", r"task.path: cannot read 'nobody/MyPrompts' \(ValueError: Unknown split"),
                                          ("task.prompt_field=question", r"task.prompt_field: no column 'question'"),
                                          ("rl.prompts_per_step=1024", r"rl.prompts_per_step=1024: larger than the task's 836 ")])
def test_data_read_at_run_start_fails_before_the_mlflow_run(make_cfg, tmp_path, monkeypatch, extra, error):
    """What construction leaves unread (a hub dataset, here one in datasets' cache, offline) is read by train()
    before the MLflow run: before, its bad split or column came after the run was made, which then ended FAILED.
    The checks validation makes of local rows run then too (prompts_per_step against the rows; a reward model's
    chat template for conversations, check_task_data)."""
    cached_hub_dataset(monkeypatch, tmp_path / "datasets", "nobody/MyPrompts", EXAMPLE / "train.jsonl")
    cfg = make_cfg(*own_task(tmp_path), "task.path=nobody/MyPrompts", "task.eval_path=null", extra, shrink=False)
    with pytest.raises(ConfigError, match="^" + error):
        train(cfg)
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet", "Dataset.save_to_disk", "DatasetDict.save_to_disk"])
def test_prompt_files_of_each_format_give_the_same_task(tmp_path, suffix):
    """save_to_disk directories were refused in datasets' words ('Please use `load_from_disk` instead')."""
    path = (saved(tmp_path / "train", rows(), "train" if suffix.startswith("DatasetDict") else None)
            if suffix.endswith("save_to_disk") else write(tmp_path / f"train{suffix}", rows()))
    task = PromptsTask(path=str(path), eval_fraction=0.25, tokenizer="char", seed=0)
    tokenizer = task.build_tokenizer()
    counts = task.setup(tokenizer)
    assert counts["task/train_prompts"] + counts["task/eval_prompts"] == 40 and counts["task/eval_prompts"] == 10
    assert set(task.prompts("train")) | set(task.prompts("eval")) == {r["prompt"] for r in rows()}
    # the other columns reach a reward function for the same rows
    prompts, completions, kwargs = task.reward_inputs("train", torch.tensor([0, 1]), task.prompts("train")[:2], ["x", "y"])
    assert ["r" + p[:3][::-1] for p in prompts] == kwargs["answer"] and set(kwargs) == {"answer", "level"}


def test_a_saved_datasetdict_without_the_split_is_one_line_naming_its_splits(tmp_path):
    path = saved(tmp_path / "dd", rows(), "validation")
    with pytest.raises(ConfigError, match=rf"^task.path: '{path}' \(saved with save_to_disk\) has no split 'train'; its "
                                          r"splits are validation: choose one with task.split=$"):
        PromptsTask(path=str(path))
    task = PromptsTask(path=str(path), split="validation", eval_fraction=0.25, tokenizer="char")
    assert task.setup(task.build_tokenizer())["task/train_prompts"] == 30


def test_a_folder_is_read_by_its_files_names_and_says_which_it_read(tmp_path, caplog):
    """A plain folder went to load_dataset: it read the folder as the kind most of its files were, left the others
    out without a word, and tried a save_to_disk subfolder's state.json as prompts; nothing said which files it read.
    Now its split's files (by datasets' naming) must be of one kind, are read as that kind's file is (CSV columns as
    text), and the log names them."""
    folder = tmp_path / "data"
    folder.mkdir()
    for i in range(3):
        write(folder / f"train-{i}.csv", rows(40)[i * 10:(i + 1) * 10])
    write(folder / "test.csv", rows(40)[30:])
    with caplog.at_level(logging.INFO, logger="rlhflab.tasks.files"):
        task = PromptsTask(path=str(folder), eval_path=str(folder), eval_split="test", tokenizer="char")
    counts = task.setup(task.build_tokenizer())
    assert (counts["task/train_prompts"], counts["task/eval_prompts"]) == (30, 10)
    assert f"task.path: read 30 rows of split 'train' from 3 files in '{folder}': train-0.csv, train-1.csv, train-2.csv" \
        in caplog.messages
    assert f"task.eval_path: read 10 rows of split 'test' from 1 file in '{folder}': test.csv" in caplog.messages
    prompts, _, kwargs = task.reward_inputs("train", torch.tensor([0]), task.prompts("train")[:1], ["x"])
    assert kwargs["level"] == ["0"]  # as in a CSV file: text as written
    with pytest.raises(ConfigError, match=rf"^task.path: the folder '{folder}' has no split 'validation' \(datasets names a "
                                          r"split by its files' names, e.g. validation.jsonl\); its splits are train, test: "
                                          r"choose one with task.split=$"):
        PromptsTask(path=str(folder), split="validation")

    write(folder / "train-3.jsonl", rows(2))  # of another kind: datasets read the three CSVs and dropped it
    with pytest.raises(ConfigError, match=rf"^task.path: the folder '{folder}' \(split 'train'\) holds files of 2 kinds "
                                          r"\(.csv, .jsonl: train-0.csv, train-1.csv, train-2.csv, train-3.jsonl\); give one "
                                          r"file, or a folder of .jsonl, .json, .csv or .parquet files of one kind$"):
        PromptsTask(path=str(folder))
    (folder / "train-3.jsonl").unlink()
    saved(folder / "train-saved", rows(4))  # a save_to_disk folder inside, whose name says train: datasets took it
    with pytest.raises(ConfigError, match=r"holds files of 2 kinds \(.arrow, .json: train-saved/data-00000-of-00001.arrow, "
                                          r"train-saved/state.json\)"):  # for the train split, and its state.json as prompts
        PromptsTask(path=str(folder))
    with pytest.raises(ConfigError, match=rf"^task.path: the folder '{tmp_path / 'empty'}' holds no data files; "):
        (tmp_path / "empty").mkdir()
        PromptsTask(path=str(tmp_path / "empty"))


def test_overlong_prompts_are_dropped_or_truncated_and_counted(tmp_path):
    data = rows(20) + [{"prompt": "9" * 50 + "=", "answer": "x", "level": 0}]
    path = write(tmp_path / "train.jsonl", data)
    for overlong, kept in (("drop", 20), ("truncate", 21)):
        task = PromptsTask(path=str(path), eval_path=str(path), max_prompt_tokens=10, overlong=overlong, tokenizer="char")
        counts = task.setup(task.build_tokenizer())
        assert counts["task/train_prompts"] == kept
        assert counts[f"task/train_prompts_{'dropped' if overlong == 'drop' else 'truncated'}"] == 1
        if overlong == "truncate":
            assert "9999999999=" not in task.prompts("train") and "999999999=" in task.prompts("train")


def test_conversational_prompts_use_the_chat_template(tmp_path):
    convo = [{"prompt": [{"role": "user", "content": f"reverse {i}"}], "answer": str(i)[::-1]} for i in range(10, 30)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in convo))
    task = PromptsTask(path=str(path), eval_fraction=0.1, tokenizer="word")
    tokenizer = task.build_tokenizer()
    with pytest.raises(ConfigError, match=r"^task.chat_template: the tokenizer has no chat template and the prompts are conversations"):
        task.setup(tokenizer)
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}<assistant>"
    task.setup(tokenizer)
    assert all(p.startswith("<user> reverse ") and p.endswith("<assistant>") for p in task.prompts("train"))
    raw, completions, _ = task.reward_inputs("train", torch.tensor([0]), task.prompts("train")[:1], ["21"])
    assert raw[0][0]["role"] == "user" and completions == [[{"role": "assistant", "content": "21"}]]  # TRL's shapes


def test_mixed_types_are_named_after_a_blank_line_and_across_a_folders_files_and_dicts_pass(tmp_path):
    """After a blank line the clash was pandas' 'Expected object or value'; across a folder's files datasets cast
    one file's '011' to the other's number 11 without a word; a column of dicts whose keys differ was refused."""
    (tmp_path / "blank.jsonl").write_text('{"prompt": "1=", "answer": "019"}\n\n{"prompt": "2=", "answer": 19}\n')
    with pytest.raises(ConfigError, match=r"^task.path: the column 'answer' of '.*blank.jsonl' is str in row 0 \(line 1\) "
                                          r"and number in row 1 \(line 3\); give every row's value the same type"):
        PromptsTask(path=str(tmp_path / "blank.jsonl"))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"prompt": "1=", "answer": 22}\n')
    (folder / "b.jsonl").write_text('{"prompt": "2=", "answer": "011"}\n')
    with pytest.raises(ConfigError, match=rf"^task.path: the column 'answer' is number in row 0 \(line 1\) of '{folder}/a.jsonl' "
                                          rf"and str in row 0 \(line 1\) of '{folder}/b.jsonl'; give every row's value"):
        PromptsTask(path=str(folder), eval_fraction=0.5)
    (tmp_path / "meta.jsonl").write_text("".join(json.dumps({"prompt": f"{i}=", "meta": {"id": i} if i % 2 else {"src": "a"}}) + "\n"
                                                 for i in range(20)))
    assert PromptsTask(path=str(tmp_path / "meta.jsonl")).num_train_prompts == 18  # read, not refused (2 held out)


@pytest.mark.parametrize("setting, data, message", [
    ("task.path", None, r"^task.path: no such file"),
    ("task.prompt_field", [{"question": "1=", "answer": "1"}], r"^task.prompt_field: no column 'prompt' in .*its columns are question, answer"),
    ("task.path", [], r"^task.path: '.*' has no rows"),
    ("task.path", "\n\n  \n", r"^task.path: '.*' has no rows$"),  # blank lines: 'Instruction "train" corresponds to no data!'
    ("task.prompt_field", [{"prompt": "1="}, {"prompt": ""}], r"^task.prompt_field: row 1 \(line 2\) of .* has an empty 'prompt'"),
    # blank lines are not rows: 'row 2' was line 5 of the file, and an empty prompt was 'has no'
    ("task.prompt_field", '{"prompt": "1="}\n\n{"prompt": "2="}\n\n{"x": 1}\n', r"^task.prompt_field: row 2 \(line 5\) of .* has no 'prompt'"),
    # a JSON number: the tokenizer's traceback ('int' object is not iterable) once the MLflow run was made
    ("task.prompt_field", [{"prompt": "1="}, {"prompt": 7}], r"^task.path: the column 'prompt' of '.*' is str in row 0 \(line 1\) "
                                                             r"and number in row 1 \(line 2\); give every row's value the same type"),
    # one list among text answers: datasets read the column as JSON values, so the answer '019' reached the reward
    # function as the number 19, without a word
    ("task.path", [{"prompt": "1=", "answer": "019"}, {"prompt": "2=", "answer": "020"}, {"prompt": "3=", "answer": ["814", "x"]}],
     r"^task.path: the column 'answer' of '.*train.jsonl' is str in row 0 \(line 1\) and list in row 2 \(line 3\); give every row's value the same type"),
])
def test_bad_data_is_one_line_naming_the_key(tmp_path, setting, data, message):
    path = tmp_path / "train.jsonl"
    if data is not None:
        path.write_text(data if isinstance(data, str) else "".join(json.dumps(r) + "\n" for r in data))
    with pytest.raises(ConfigError, match=message) as err:
        PromptsTask(path=str(path))
    assert "\n" not in str(err.value)


def test_a_csvs_columns_are_text_as_written(tmp_path):
    """The example's files as CSV: datasets read the completion '384' as the number 384, and the prompts of
    digits.csv as numbers too (007 as 7); the run failed in the tokenizer with a traceback. Its `answer` column
    reached the reward functions as numbers: `exact` compared text with 384, 0 every time, without a word."""
    prompts = write(tmp_path / "train.csv", [{"prompt": f"{i:03d}", "answer": f"{i:03d}"[::-1]} for i in range(20)])
    demos = write(tmp_path / "demos.csv", [{"prompt": f"{i:03d}", "completion": f"{i:03d}"[::-1]} for i in range(20)])
    task = PromptsTask(path=str(prompts), demonstrations_path=str(demos), eval_fraction=0.25, tokenizer="char")
    task.setup(task.build_tokenizer())
    assert set(task.prompts("train")) | set(task.prompts("eval")) == {f"{i:03d}" for i in range(20)}
    assert ("007", "700") in task.raw_demos
    prompts, completions, kwargs = task.reward_inputs("train", torch.tensor([0, 1]), task.prompts("train")[:2], ["x", "y"])
    assert kwargs["answer"] == [p[::-1] for p in prompts]  # '070' for '070', not 70


@pytest.mark.parametrize("name, text, reason", [
    ("bad.jsonl", '{"prompt": "a"}\n{"prompt": "b"\n', r"ArrowInvalid: JSON parse error: .* in row 1"),
    ("bad.csv", 'prompt,answer\n"a,1\nb,2\n', r"ParserError: Error tokenizing data. C error: EOF inside string starting at row 1"),
])
def test_a_malformed_file_says_what_its_parser_found_in_one_line(tmp_path, capfd, name, text, reason):
    """It said '(DatasetGenerationError: An error occurred while generating the dataset)', and for JSON Lines
    datasets' logger printed the parser's words first, as another line."""
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=rf"^task.path: cannot read '.*{name}' \({reason}\); check the file"):
        PromptsTask(path=str(tmp_path / name))
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("name", ["train.txt", "train.JSONL", "train.jsonl.gz", "train"])
def test_a_file_of_another_suffix_is_one_line_not_a_hub_name(tmp_path, name):
    """It went to datasets as a hub name: ~25 s of 'Retrying in 8s' warnings, then 'Couldn't reach ... on the Hub'."""
    path = tmp_path / name
    path.write_text((EXAMPLE / "train.jsonl").read_text())
    with pytest.raises(ConfigError, match=rf"^task.path: '{path}' is not a file rlhflab reads .*give a .jsonl, .json, .csv or .parquet file$"):
        PromptsTask(path=str(path))


@pytest.mark.parametrize("name", ["x.tsv", "x.JSONL", "x.txt"])
def test_a_missing_file_of_another_suffix_is_no_such_file(tmp_path, monkeypatch, name):
    """A relative x.tsv or x.JSONL that is not there was looked up as a hub dataset: "'x.tsv' is not in the local
    Hugging Face datasets cache and the hub cannot be reached"."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=rf"^task.path: no such file '{name}' \(relative to {tmp_path}\); give a .jsonl"):
        PromptsTask(path=name)
    assert not is_hub_dataset(name) and is_hub_dataset("org/data")


# ---- reward functions --------------------------------------------------------------------------

def test_reward_functions_get_the_rows_columns_and_are_combined_with_weights(tmp_path):
    path = write(tmp_path / "train.csv", rows())
    task = PromptsTask(path=str(path), eval_path=str(path), tokenizer="char")
    task.setup(task.build_tokenizer())
    reward = FunctionReward(fns=[f"{REWARD}:correct_digits", f"{REWARD}:exact"], weights=[1.0, 0.5])
    index = torch.tensor([3, 4])
    answers = [rows()[3]["answer"], rows()[4]["answer"]]  # e.g. "r300"
    rollout = Rollout(query=torch.zeros(2, 1, dtype=torch.long), response=torch.zeros(2, 4, dtype=torch.long),
                      response_mask=torch.ones(2, 4), logprobs=torch.zeros(2, 4), version=0,
                      prompts=[task.prompts("train")[i] for i in index], texts=[answers[0], answers[1][:2] + "x"],
                      rows=index, split="train")
    scores = reward.score(None, task, rollout)
    assert scores.tolist() == pytest.approx([1.0 + 0.5 * 1.0, 2 / 4 + 0.5 * 0.0])  # "r4" + "x" of "r400": 2 of 4 right
    assert reward.components == pytest.approx({"train/reward/correct_digits": (1 + 2 / 4) / 2, "train/reward/exact": 0.5})


def test_a_function_returns_none_where_it_does_not_apply_as_in_trl(tmp_path, caplog):
    """TRL's reward functions return None for a completion they do not apply to (a math checker on a coding
    prompt); such a function was refused in one line ('returned list, not a list of numbers'). Now the sum leaves
    it out, each function's logged mean is over the completions it scored, and a completion no function scores
    gets 0 with a warning, as TRL does."""
    import sys
    import types

    module = types.ModuleType("none_rewards")
    module.evens = lambda prompts, completions, **kw: [1.0 if i % 2 == 0 else None for i in range(len(completions))]
    module.firsts = lambda prompts, completions, **kw: [3.0 if i == 1 else None for i in range(len(completions))]
    sys.modules["none_rewards"] = module
    try:
        path = write(tmp_path / "train.csv", rows())
        task = PromptsTask(path=str(path), eval_path=str(path), tokenizer="char")
        task.setup(task.build_tokenizer())
        reward = FunctionReward(fns=["none_rewards:evens", "none_rewards:firsts"], weights=[1.0, 2.0])
        texts = ["a", "b", "c", "d"]
        rollout = Rollout(query=torch.zeros(4, 1, dtype=torch.long), response=torch.zeros(4, 4, dtype=torch.long),
                          response_mask=torch.ones(4, 4), logprobs=torch.zeros(4, 4), version=0,
                          prompts=task.prompts("train")[:4], texts=texts, rows=torch.arange(4), split="train")
        assert reward.score(None, task, rollout).tolist() == [1.0, 6.0, 1.0, 0.0]
        assert reward.components == {"train/reward/evens": 1.0, "train/reward/firsts": 3.0}
        assert "no function scored 1 of 4 completions (first: prompt" in caplog.text and "completion 'd'" in caplog.text
    finally:
        del sys.modules["none_rewards"]


def test_an_async_reward_function_is_awaited_as_trl_does():
    """`async def score(...)` returned a coroutine: 'returned coroutine, not a list of numbers', then Python's
    'coroutine ... was never awaited' warning after the error line."""
    async def score(prompts, completions, **kw):
        return [float(len(c)) for c in completions]

    assert call_reward(score, "score", ["1=", "2="], ["x", "yy"], {}, None).tolist() == [1.0, 2.0]


@pytest.mark.parametrize("returned, message", [
    (lambda prompts, completions, **kw: [1.0], r"^reward function bad returned 1 values for 2 completions"),
    (lambda prompts, completions, **kw: [1.0, float("nan")], r"^reward function bad returned nan for row 8 \(prompt '8=', completion 'y'\)"),
    (lambda prompts, completions, **kw: 1 / 0, r"^reward function bad raised ZeroDivisionError: division by zero"),
    (lambda prompts, completions, **kw: [1.0, "high"], r"^reward function bad returned str 'high' for row 8 "
                                                       r"\(prompt '8=', completion 'y'\); return a finite number, or None"),
    (lambda prompts, completions, **kw: 2.0, r"^reward function bad returned float, not a list of numbers"),
    # a float32 tensor's inf, blamed on the learning rate at the first update
    (lambda prompts, completions, **kw: [1.0, 1e39], r"^reward function bad returned 1e\+39, past float32's 3.4e\+38, for row 8 .*"
                                                        r"; return a finite number float32 holds, or None"),
    # read as one reward per character ('11' for two completions: 1.0 and 1.0), by its keys, or as a number from text
    (lambda prompts, completions, **kw: "11", r"^reward function bad returned str, not a list of numbers"),
    (lambda prompts, completions, **kw: {"a": 1, "b": 2}, r"^reward function bad returned dict, not a list of numbers"),
    (lambda prompts, completions, **kw: [1.0, "0.5"], r"^reward function bad returned str '0.5' for row 8 "),
])
def test_a_misbehaving_reward_function_is_one_line_naming_it_and_the_row(returned, message):
    with pytest.raises(RewardError, match=message) as err:
        call_reward(returned, "reward function bad", ["7=", "8="], ["x", "y"], {}, [7, 8])
    assert "\n" not in str(err.value)


def test_a_reward_functions_error_names_the_file_and_its_row_there(tmp_path, caplog):
    """An eval_path without the train file's `answer` column failed at the first evaluation in a line that named
    neither the held-out prompts nor their file, and 'dataset row N' was an index into the split after the hold-out,
    not a row of the file."""
    from rlhflab.rewards.functions import FunctionReward

    train, held = write(tmp_path / "train.jsonl", rows(20)), write(tmp_path / "eval.jsonl", [{"prompt": "1="}, {"prompt": "2="}])
    task = PromptsTask(path=str(train), eval_path=str(held), tokenizer="char")
    assert f"task.eval_path: '{held}' lacks the columns answer, level that task.path has" in caplog.text
    task.setup(task.build_tokenizer())
    with pytest.raises(RewardError, match=rf"^reward function exact \(reward.fn={REWARD}:exact\) raised TypeError: .*'answer' \(on 2 completions of the "
                                          rf"held-out prompts of '{held}' \(task.eval_path\); first prompt '1='\)$"):
        FunctionReward(fn=f"{REWARD}:exact")._score(task, "eval", task.prompts("eval"), ["x", "y"], torch.tensor([0, 1]))
    # held out of the same file: the row is the file's (the prompt of row i is f"{i:03d}=")
    task = PromptsTask(path=str(train), eval_fraction=0.25, tokenizer="char")
    task.setup(task.build_tokenizer())
    nan_second = f"{tmp_path}/nan.py"
    Path(nan_second).write_text("def score(prompts, completions, **kw):\n    return [1.0, float('nan')]\n")
    with pytest.raises(RewardError) as err:
        FunctionReward(fn=f"{nan_second}:score")._score(task, "train", task.prompts("train")[4:6], ["x", "y"], torch.tensor([4, 5]))
    row, prompt = re.search(r"returned nan for row (\d+) of the training prompts of '.*train.jsonl' \(task.path\) \(prompt "
                            r"'(\d+)=", str(err.value)).groups()
    assert int(row) == int(prompt) and int(row) != 5, str(err.value)


def test_a_missing_column_names_the_setting_that_picks_it_and_an_empty_parquet_has_no_rows(tmp_path):
    """'task.demonstrations_path: no column 'completion' ...; its columns are prompt, response' named the columns,
    not task.completion_field, which picks one. An empty Parquet file was 'cannot read (ArrowInvalid: BatchSize must
    be greater than 0, got 0)' where every other empty file 'has no rows'."""
    train = write(tmp_path / "train.jsonl", rows(20))
    demos = write(tmp_path / "demos.jsonl", [{"prompt": "1=", "response": "1"}])
    with pytest.raises(ConfigError, match=r"^task.demonstrations_path: no column 'completion' in '.*demos.jsonl'; its columns "
                                          r"are prompt, response: name the one to read with task.completion_field=<column>$"):
        PromptsTask(path=str(train), demonstrations_path=str(demos))
    assert PromptsTask(path=str(train), demonstrations_path=str(demos), completion_field="response").demonstrations()
    # the prompt column of demonstrations: task.prompt_field, which would then miss task.path's (its fix said to set it)
    other = write(tmp_path / "other.jsonl", [{"q": "1=", "completion": "1"}])
    with pytest.raises(ConfigError, match=r"^task.demonstrations_path: no column 'prompt' in '.*other.jsonl'; its columns "
                                          r"are q, completion: every file's prompts are its column task.prompt_field="
                                          r"'prompt', task.path's too: rename that file's prompt column to 'prompt'$"):
        PromptsTask(path=str(train), demonstrations_path=str(other))
    empty = write(tmp_path / "empty.parquet", [])
    with pytest.raises(ConfigError, match=rf"^task.path: '{empty}' has no rows$"):
        PromptsTask(path=str(empty))


def test_rows_without_a_value_in_a_column_reward_functions_read_are_warned(tmp_path, caplog):
    """A JSON Lines row without `answer`, a JSON null or an empty CSV cell reached the reward functions as None
    without a word (the example's exact-match reward scored those rows 0)."""
    data = rows(20)
    for i in (3, 7):
        del data[i]["answer"]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in data))
    PromptsTask(path=str(path))
    assert (f"task.path: the column 'answer' of '{path}' has no value in 2 of 20 rows (the first: row 3 (line 4)); reward "
            "functions get None there") in caplog.text
    assert "'level'" not in caplog.text and "'prompt'" not in caplog.text


@pytest.mark.parametrize("code, said", [
    ("def f(prompts, completions):\n    return [0.0] * len(completions)\n", "got an unexpected keyword argument 'answer'"),
    ("def f(completions):\n    return [0.0] * len(completions)\n", "got an unexpected keyword argument 'prompts'"),
    ("def f(prompts, completions, solution, **kw):\n    return [0.0] * len(completions)\n", "missing a required argument: 'solution'"),
])
@pytest.mark.parametrize("key", ["reward.fn", "task.gold_fn"])
def test_a_function_that_cannot_take_the_datas_columns_is_one_line_before_anything_loads(tmp_path, code, said, key):
    """Called as f(prompts=..., completions=..., **columns): a function without **kwargs beside a column, or with a
    parameter no column fills, raised its TypeError once the MLflow run was made, the model loaded and SFT trained."""
    (tmp_path / "fns.py").write_text(code)
    train = write(tmp_path / "train.jsonl", [{"prompt": f"{i}=", "answer": str(i)} for i in range(60)])
    overrides = ["task=prompts", f"task.path={train}", "task.tokenizer=char", "reward=function",
                 f"reward.fn={tmp_path}/fns.py:f" if key == "reward.fn" else f"reward.fn={EXAMPLE}/reward.py:exact",
                 *([f"task.gold_fn={tmp_path}/fns.py:f"] if key == "task.gold_fn" else [])]
    from rlhflab.config import validate

    with pytest.raises(ConfigError, match=rf"^{key}: f\(.*\) cannot be called as f\(prompts=\.\.\., completions=\.\.\., "
                                          rf"\*\*columns\) with the columns of the training prompts of '{train}' \(task.path\) "
                                          rf"\(answer\): {said}; take prompts and completions by name"):
        validate(compose_cfg(overrides, shrink=False))


def test_which_of_several_reward_fns_cannot_take_the_columns_or_be_loaded_is_named_by_its_index(tmp_path):
    """Before the run, a signature error (or a missing file) in the second of reward.fns was keyed `reward.fns`, which
    did not say which one; errors during RL said reward.fns[1]."""
    (tmp_path / "fns.py").write_text("def f(prompts, completions):\n    return [0.0] * len(completions)\n")
    train = write(tmp_path / "train.jsonl", [{"prompt": f"{i}=", "answer": str(i)} for i in range(60)])
    overrides = ["task=prompts", f"task.path={train}", "task.tokenizer=char", "reward=function"]
    from rlhflab.config import validate

    with pytest.raises(ConfigError, match=r"^reward.fns\[1\]: f\(prompts, completions\) cannot be called as "):
        validate(compose_cfg([*overrides, f"reward.fns=[{EXAMPLE}/reward.py:exact,{tmp_path}/fns.py:f]"], shrink=False))
    with pytest.raises(ConfigError, match=r"^reward.fns\[0\]: no such file"):
        validate(compose_cfg([*overrides, f"reward.fns=[{tmp_path}/nope.py:f,{EXAMPLE}/reward.py:exact]"], shrink=False))


def test_missing_preference_pairs_name_the_file_and_fixes_that_fit_the_memory_strategy():
    """memory=hydra reward=model without preference pairs said 'give a ready reward model or use reward=rule', and a
    reward model was then refused under memory=hydra; its own line said 'demonstrations or preference pairs', not
    which."""
    from rlhflab.config import validate

    demos_only = ["task=prompts", f"task.path={EXAMPLE}/train.jsonl", f"task.demonstrations_path={EXAMPLE}/demos.jsonl",
                  "task.tokenizer=char", "reward=model"]
    with pytest.raises(ConfigError, match=r"^memory=hydra: stage hydra_sft trains the policy and its reward head together, "
                                          r"and task prompts has no preference pairs \(task.preferences_path\); give it, "
                                          r"or use memory=lora \(with model.reward_model_path="):
        validate(compose_cfg([*demos_only, "memory=hydra"], shrink=False))
    with pytest.raises(ConfigError, match=r"^model.reward_model_path: null, but task prompts has no preference pairs to train "
                                          r"one; give a ready reward model, or task.preferences_path=<file>, or use "
                                          r"reward=function"):
        validate(compose_cfg(demos_only, shrink=False))


def test_a_failing_function_of_several_names_its_place_in_reward_fns(tmp_path):
    """'reward function score raised ...' named neither the setting nor which of reward.fns (two files' `score`)."""
    from rlhflab.rewards.functions import FunctionReward

    train = write(tmp_path / "train.jsonl", rows(20))
    task = PromptsTask(path=str(train), eval_fraction=0.25, tokenizer="char")
    task.setup(task.build_tokenizer())
    boom = tmp_path / "boom.py"
    boom.write_text("def exact(prompts, completions, **kw):\n    raise ValueError('boom')\n")
    with pytest.raises(RewardError, match=rf"^reward function exact1 \(reward.fns\[1\]={boom}:exact\) raised ValueError: boom "
                                          rf"at {boom}:2 \(on 2 completions"):
        FunctionReward(fns=[f"{REWARD}:exact", f"{boom}:exact"])._score(task, "eval", task.prompts("eval")[:2], ["x", "y"],
                                                                          torch.tensor([0, 1]))


def test_trls_reward_functions_get_completion_ids_and_trainer_state(tmp_path):
    """TRL gives a reward function completion_ids and trainer_state beside the columns; a function that named them was
    refused before anything loaded ('missing a required argument: completion_ids; take prompts and completions by
    name ...', a fix that does not fix it), and one that read them from **kwargs raised KeyError in RL's first step."""
    from transformers import TrainerState

    path = write(tmp_path / "train.csv", rows())
    task = PromptsTask(path=str(path), eval_path=str(path), tokenizer="char")
    tokenizer = task.build_tokenizer()
    task.setup(tokenizer)
    fns = tmp_path / "trl_style.py"
    fns.write_text("seen = {}\n"
                   "def named(prompts, completions, completion_ids, trainer_state, **kwargs):\n"
                   "    seen['named'] = (completion_ids, trainer_state, sorted(kwargs))\n"
                   "    return [float(len(ids)) for ids in completion_ids]\n"
                   "def from_kwargs(prompts, completions, **kwargs):\n"
                   "    seen['kwargs'] = (kwargs['completion_ids'], kwargs['trainer_state'].global_step)\n"
                   "    return [0.0] * len(completions)\n"
                   "def columns_only(prompts, completions, answer, level):\n"  # no **kwargs: given only what it names
                   "    return [0.0] * len(completions)\n")
    reward = FunctionReward(fns=[f"{fns}:named", f"{fns}:from_kwargs", f"{fns}:columns_only"])
    reward.check_columns(task)
    reward.setup(tokenizer, 40)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    a, b = tokenizer("r3", add_special_tokens=False).input_ids, tokenizer("r40", add_special_tokens=False).input_ids
    response = torch.tensor([a + [eos] + [pad] * 2, b + [eos, pad]])
    rollout = Rollout(query=torch.zeros(2, 1, dtype=torch.long), response=response, response_mask=torch.ones(2, 5),
                      logprobs=torch.zeros(2, 5), version=7, prompts=task.prompts("train")[3:5], texts=["r3", "r40"],
                      rows=torch.tensor([3, 4]), split="train")
    assert reward.score(None, task, rollout).tolist() == [len(a) + 1.0, len(b) + 1.0]  # up to and including EOS
    seen = sys.modules[next(n for n in sys.modules if n.startswith("rlhflab_user_trl_style"))].seen
    ids, state, columns = seen["named"]
    assert ids == [a + [eos], b + [eos]] and columns == ["answer", "level"]
    assert isinstance(state, TrainerState) and (state.global_step, state.max_steps) == (7, 40)
    assert seen["kwargs"] == ([a + [eos], b + [eos]], 7)
    # (check_columns above: validate's check before anything loads.) task.gold_fn judges held-out text: it is not given
    # them, and says so (not 'take prompts and completions by name')
    from rlhflab.config import validate

    gold = tmp_path / "gold.py"
    gold.write_text("def gold(prompts, completions, completion_ids, **kwargs):\n    return [1.0] * len(completions)\n")
    overrides = ["task=prompts", f"task.path={path}", "task.tokenizer=char", "reward=function", f"reward.fn={fns}:named"]
    with pytest.raises(ConfigError, match=r"^task.gold_fn: gold\(prompts, completions, completion_ids, \*\*kwargs\) needs "
                                          r"completion_ids, which reward functions are given \(reward.fn, reward.fns, as in "
                                          r"TRL\) but task.gold_fn is not: .*; give completion_ids a default \(e.g. None\)$"):
        validate(compose_cfg([*overrides, f"task.gold_fn={gold}:gold"], shrink=False))
    # a column of that name would be replaced without a word
    clash = write(tmp_path / "clash.csv", [{**r, "trainer_state": 1} for r in rows()])
    task = PromptsTask(path=str(clash), eval_path=str(clash), tokenizer="char")
    task.setup(task.build_tokenizer())
    with pytest.raises(ConfigError, match=rf"^the training prompts of '{clash}' \(task.path\) has a column 'trainer_state', the name of what reward "
                                          r"functions are given beside the columns \(completion_ids, trainer_state, as in TRL\); "
                                          r"rename the column$"):
        FunctionReward(fn=f"{fns}:columns_only").check_columns(task)


def test_a_gold_fn_that_returns_none_is_one_line_naming_the_row(tmp_path):
    """None is a reward function's 'does not apply'; from task.gold_fn the eval's mean was NaN, and the run FINISHED
    with eval/gold_reward=nan (a sweep picks its best job by it)."""
    train = write(tmp_path / "train.jsonl", rows(20))
    half = tmp_path / "half.py"
    half.write_text("def gold(prompts, completions, **kw):\n    return [1.0 if i % 2 else None for i in range(len(completions))]\n")
    task = PromptsTask(path=str(train), eval_fraction=0.25, tokenizer="char", gold_fn=f"{half}:gold")
    task.setup(task.build_tokenizer())
    prompts = task.prompts("eval")[:2]
    with pytest.raises(RewardError, match=rf"^gold function gold \(task.gold_fn={half}:gold\) returned None for row \d+ of the held-out prompts "
                                          r"of '.*train.jsonl' \(task.path, task.eval_fraction\) \(prompt '\d+='\); the gold reward judges "
                                          r"every completion \(eval/gold_reward is their mean\): return a number for each$"):
        task.gold_reward(prompts, ["x", "y"], "eval", rows=torch.tensor([0, 1]))


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_xyz:score", r"^reward.fn: cannot import 'no_such_module_xyz'"),
    (f"{EXAMPLE}/reward.py:nope", r"^reward.fn: .* has no function 'nope'; its functions are correct_digits, exact$"),
    ("examples/nowhere.py:score", r"^reward.fn: no such file"),
    ("just_a_name", r"^reward.fn: 'just_a_name' is not 'module:function'"),
])
def test_a_reward_function_that_cannot_be_had_is_one_line(spec, message):
    with pytest.raises(ConfigError, match=message):
        FunctionReward(fn=spec)


@pytest.mark.parametrize("source, message", [
    ("import no_such_package_xyz\n", r"importing it failed at .*deps.py:1 \(ModuleNotFoundError: No module named "
                                      r"'no_such_package_xyz'\); install that package$"),
    ("def score(:\n", r"importing it failed at .*deps.py:1 \(SyntaxError: .*\); fix that code$"),
])
def test_a_reward_file_whose_own_import_fails_says_so_not_check_the_name(tmp_path, source, message):
    """It said '...; check the name, or give path/to/file.py:function' of a name that was right."""
    (tmp_path / "deps.py").write_text(source)
    with pytest.raises(ConfigError, match=rf"^reward.fn: '{tmp_path}/deps.py' was found, but " + message):
        FunctionReward(fn=f"{tmp_path}/deps.py:score")


def test_a_reward_file_imports_the_files_beside_it_as_a_script_does(tmp_path, monkeypatch):
    """`reward.fn=myr/r.py:score` whose r.py does `from helpers import bonus` (myr/helpers.py) said 'No module
    named helpers ...; install that package'; `python myr/r.py` finds it, beside the file."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    folder = tmp_path / "myr"
    folder.mkdir()
    (folder / "helpers_beside_r.py").write_text("def bonus(c):\n    return 0.5 if c.endswith('1') else 0.0\n")
    (folder / "r.py").write_text("from helpers_beside_r import bonus\n\n"
                                 "def score(prompts, completions, **kw):\n    return [bonus(c) for c in completions]\n")
    reward = FunctionReward(fn=f"{folder}/r.py:score")
    assert call_reward(reward.functions[0][1], "score", ["1=", "2="], ["21", "12"], {}, None).tolist() == [0.5, 0.0]


def test_two_reward_files_importing_helpers_of_one_name_is_one_line(tmp_path, monkeypatch):
    """a/r.py and b/r2.py each import their own helpers_same.py: the second silently got the first's (a module
    name is imported once per process), and scored with the wrong function."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    for folder, value in (("a", 0.0), ("b", 100.0)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "helpers_same.py").write_text(f"def bonus(c):\n    return {value}\n")
        (tmp_path / folder / f"r{folder}.py").write_text("from helpers_same import bonus\n\n"
                                                          "def score(prompts, completions, **kw):\n    return [bonus(c) for c in completions]\n")
    FunctionReward(fn=f"{tmp_path}/a/ra.py:score")
    with pytest.raises(ConfigError, match=rf"^reward.fn: '{tmp_path}/b/rb.py' imports 'helpers_same', which is beside it, but "
                                          rf"this process already has a 'helpers_same' from {tmp_path}/a/helpers_same.py .*; "
                                          "rename one of them$"):
        FunctionReward(fn=f"{tmp_path}/b/rb.py:score")


def test_a_reward_package_in_the_working_directory_imports_as_with_python_m(tmp_path, monkeypatch):
    """`reward.fn=my_pkg.rewards:score` with my_pkg beside you: `python src/train.py` puts src/ first on sys.path,
    not the working directory, so the documented module form failed unless the package was installed."""
    package = tmp_path / "my_rewards_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "rewards.py").write_text("def score(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    reward = FunctionReward(fn="my_rewards_pkg.rewards:score")
    assert [fn(["1="], ["abc"]) for _, fn in reward.functions] == [[3.0]]
    assert sys.path[-1] == str(tmp_path)  # appended: an installed package of the same name still wins


# ---- end to end ------------------------------------------------------------------------------------

def test_the_example_learns_and_logs_each_function(make_cfg):
    """The README's example (experiment=reverse), shortened: the dense reward rises, each function is a metric."""
    cfg = make_cfg("experiment=reverse", "trainer.max_steps=160", "rl.eval_every=0", "trainer.enable_progress_bar=false",
                   shrink=False)
    result = train(cfg)
    client = MlflowClient(cfg.logger.tracking_uri)
    digits = [m.value for m in sorted(client.get_metric_history(result.run_id, "train/reward/correct_digits"), key=lambda m: m.step)]
    assert len(digits) == 160 and "train/reward/exact" in client.get_run(result.run_id).data.metrics
    early, late = sum(digits[:20]) / 20, sum(digits[-20:]) / 20
    assert late > early + 0.15, (early, late)
    assert "eval/gold_reward" in result.metrics  # the example's gold_fn (exact) judges held-out answers


@pytest.mark.parametrize("extra", [["mode=async"], ["memory=lora"], ["memory=hydra"], ["mode=async", "memory=hydra"]])
def test_own_data_and_reward_run_in_every_mode_and_memory(make_cfg, tmp_path, extra, caplog):
    with caplog.at_level(logging.INFO, logger="rlhflab"):
        cfg = make_cfg(*own_task(tmp_path, *extra), "trainer.max_steps=3", shrink=False)
        result = train(cfg)
    assert result.module.updates == 3
    rows = json.loads((Path(cfg.output.dir) / "generations.json").read_text())  # its 'gold_reward' was the reward again
    assert rows and all(set(r) == {"rl_step", "prompt", "response", "reward"} for r in rows)
    assert "eval/reward" in result.metrics and "eval/gold_reward" not in result.metrics  # no gold_fn: the reward, said so
    # in the same words on the eval lines and the closing line (which said 'reward (no task.gold_fn)')
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("eval after", "done: "))]
    assert len(said) >= 2 and all("reward (the task has no gold_fn) " in line for line in said), said


def test_a_built_model_reads_and_sets_up_the_prompts_once(make_cfg, tmp_path, monkeypatch):
    """For a model built from model.arch, train()'s check before the run set the task's prompts up with its own
    tokenizer, and then _run set them up again with the saved copy and built that tokenizer again: 200,000 prompts
    took 5.5 s more. Once each; the counts still reach the run."""
    from rlhflab.tasks.files import PromptsTask

    calls = {"setup": 0, "tokenizer": 0}

    def counted(name, method):
        def call(self, *args):
            calls[name] += 1
            return method(self, *args)
        return call

    monkeypatch.setattr(PromptsTask, "setup", counted("setup", PromptsTask.setup))
    monkeypatch.setattr(PromptsTask, "_word_tokenizer", counted("tokenizer", PromptsTask._word_tokenizer))
    cfg = make_cfg(*own_task(tmp_path), "trainer.max_steps=1", "rl.eval_every=0", "trainer.enable_progress_bar=false",
                   shrink=False)
    result = train(cfg)
    assert calls == {"setup": 1, "tokenizer": 1}
    assert MlflowClient(cfg.logger.tracking_uri).get_run(result.run_id).data.metrics["task/train_prompts"] == 900


def test_a_reward_model_with_its_own_tokenizer_reads_the_text(make_cfg, tmp_path, monkeypatch):
    """reward=model with a sequence classifier whose tokenizer is not the policy's: completions are
    decoded and re-tokenised its way, and the scores are its scores of that text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<unk>", "</s>", *sorted("0123456789=")[::-1]])}  # another order

    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    backend.decoder = decoders.Fuse()
    rm_tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="</s>")
    rm_tok.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"  # its own markup: '=' after each turn
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                    num_attention_heads=2, num_labels=1, pad_token_id=0))
    rm.save_pretrained(tmp_path / "rm")
    rm_tok.save_pretrained(tmp_path / "rm")
    cfg = make_cfg(*own_task(tmp_path, reward=("reward=model", f"model.reward_model_path={tmp_path}/rm")), "trainer.max_steps=2",
                   shrink=False)
    result = train(cfg)
    memory = result.module.memory
    assert memory.reward_tokenizer is not None
    prompts, completions = ["125=", "275="], ["521", "9"]
    batch = rm_tok([p + c for p, c in zip(prompts, completions)], return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = rm.eval()(**batch).logits.squeeze(-1)
    got = memory.scores(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long), prompts, completions)
    torch.testing.assert_close(got, expected)  # no reward-stage statistics: scores are raw

    # Conversational prompts: the reward model reads the conversation in its own chat template, not the policy's
    # rendering of it (here '<user> 125 <assistant>'), as TRL does. Before, ModelReward passed that rendering on.
    from rlhflab.rewards.builtin import ModelReward

    convo = [{"prompt": [{"role": "user", "content": f"{i}"}]} for i in (125, 275, 300, 401)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in convo))
    task = PromptsTask(path=str(tmp_path / "chat.jsonl"), eval_fraction=0.25, tokenizer="word")
    policy_tok = task.build_tokenizer()
    policy_tok.chat_template = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}<assistant>"
    task.setup(policy_tok)
    rows = torch.tensor([0, 1])
    raw, _, _ = task.reward_inputs("train", rows, [], [])
    zeros = torch.zeros(2, 1, dtype=torch.long)
    rollout = Rollout(query=zeros, response=zeros, response_mask=torch.ones(2, 1), logprobs=torch.zeros(2, 1), version=0,
                      prompts=task.prompts("train")[:2], texts=["521", "9"], rows=rows, split="train")
    assert rollout.prompts[0].startswith("<user> ")  # the policy's rendering
    batch = rm_tok([f"{m[0]['content']}={c}=" for m, c in zip(raw, rollout.texts)], return_tensors="pt", padding=True,
                   add_special_tokens=False)
    with torch.no_grad():
        expected = rm(**batch).logits.squeeze(-1)
    torch.testing.assert_close(ModelReward().score(memory, task, rollout), expected)
    from rlhflab.models.build import scored_texts

    rm_tok.chat_template = None
    with pytest.raises(ConfigError, match=r"^model.reward_model_path: the prompts are conversations, and the reward model's"):
        scored_texts(rm_tok, raw, [[{"role": "assistant", "content": "9"}]] * 2)
    # and before anything trains, where both tokenizers are local (the config's validation calls this)
    from rlhflab.models.build import check_reward_chat_template

    policy_tok.save_pretrained(tmp_path / "policy")
    rm_tok.save_pretrained(tmp_path / "rm_plain")
    check_reward_chat_template({"name_or_path": str(tmp_path / "policy"), "reward_model_path": str(tmp_path / "rm")}, task)
    with pytest.raises(ConfigError, match=r"^model.reward_model_path: the prompts are conversations"):
        check_reward_chat_template({"name_or_path": str(tmp_path / "policy"), "reward_model_path": str(tmp_path / "rm_plain")}, task)
    # and where they are hub names (here from a hub cache, offline): before, a hub reward model's missing template
    # stopped the run at its first scoring, after stage sft
    for name in ("policy", "rm", "rm_plain"):
        to_hub_cache(tmp_path / "hub", f"org/{name}", tmp_path / name, config=tmp_path / "rm" / "config.json")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    check_reward_chat_template({"name_or_path": "org/policy", "reward_model_path": "org/rm"}, task)
    with pytest.raises(ConfigError, match=r"^model.reward_model_path: the prompts are conversations"):
        check_reward_chat_template({"name_or_path": "org/policy", "reward_model_path": "org/rm_plain"}, task)
    # one not cached, with no hub: check_hub's line at once (without it, from_pretrained's retries took 46 s here)
    with pytest.raises(ConfigError, match=r"^model.reward_model_path: 'org/not_cached' is not in the local Hugging Face cache"):
        check_reward_chat_template({"name_or_path": "org/policy", "reward_model_path": "org/not_cached"}, task)


def to_hub_cache(cache: Path, repo_id: str, files: Path, config: Path) -> None:
    """A directory's files as the hub cache holds a download of repo_id (`from_pretrained(repo_id)` finds them
    offline), with a model's config.json as every hub repo has (AutoTokenizer reads it first from the hub)."""
    import shutil

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(files, repo / "snapshots" / ("0" * 40))
    shutil.copy(config, repo / "snapshots" / ("0" * 40) / "config.json")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)


@pytest.mark.parametrize("memory", ["full", "hydra"])
def test_stages_train_on_your_demonstrations_and_preferences(make_cfg, tmp_path, memory, caplog):
    """reward=model with task.preferences_path: stage rm (or hydra_sft) learns the user's pairs."""
    import logging

    cfg = make_cfg(*own_task(tmp_path, reward=("reward=model", f"task.preferences_path={EXAMPLE}/prefs.jsonl")),
                   f"memory={memory}", "trainer.max_steps=2", "stages.rm.epochs=16", shrink=False)
    with caplog.at_level(logging.INFO):
        result = train(cfg)
    stage = "hydra_sft" if memory == "hydra" else "rm"
    assert f"stage {stage}: training on" in caplog.text and "900 preference pairs" not in caplog.text  # 90 held out
    accuracy = float(caplog.text.split("held-out pair accuracy ")[1].split(",")[0])
    # The right reversal over a one-digit edit of it; chance 0.5. With 16 epochs: rm 0.867, hydra 0.678 (90 pairs).
    # Hydra's joint LM + reward training learns them slowest: after 6 epochs it gave 0.73 on one CPU, 0.567 on another.
    assert accuracy > 0.6, accuracy
    assert result.module.updates == 2
    # no gold function here: no correlation with it, said so, and no NaN metric (before: 'correlation with gold nan')
    assert f"held-out pair accuracy {caplog.text.split('held-out pair accuracy ')[1][:5]}, no correlation with gold" in caplog.text
    assert "rm/gold_correlation" not in MlflowClient(cfg.logger.tracking_uri).get_run(result.run_id).data.metrics


# ---- a from_pretrained model whose tokenizer has no pad token -----------------------------------------------


def pretrained_without_pad(path: Path, unk: bool = False, specials: tuple[str, ...] = (), spare_rows: int = 0,
                           bos: bool = False) -> Path:
    """A saved Llama and its character tokenizer with no pad token (conftest.tokenizer_without_pad), with one
    embedding row per token as Llama 2's and GPT-2's, or `spare_rows` more as Pythia's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tokenizer_without_pad(unk, specials, bos)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer) + spare_rows, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, bos_token_id=0, eos_token_id=1))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("kind, pad", [
    (dict(unk=True), "<unk>"),
    (dict(specials=("<|start_header_id|>", "<|reserved_special_token_0|>", "<|finetune_right_pad_id|>")), "<|finetune_right_pad_id|>"),
    (dict(specials=("<|start_header_id|>", "<|reserved_special_token_0|>")), "<|reserved_special_token_0|>"),
    (dict(spare_rows=3), "[PAD]"),
    (dict(specials=("<|start_header_id|>",)), None),  # a chat template's token is never the pad
])
def test_a_tokenizer_without_pad_pads_with_a_token_its_model_has_a_row_for(tmp_path, kind, pad):
    from rlhflab.models.build import load_tokenizer

    path = pretrained_without_pad(tmp_path / "model", **kind)
    if pad is None:
        with pytest.raises(ConfigError, match=r"^model\.tokenizer: .* has no pad token, .*\(14 rows for 14 tokens\)"):
            load_tokenizer(path)
        return
    tokenizer = load_tokenizer(path)
    rows = 13 + len(kind.get("specials", ())) + kind.get("unk", 0) + kind.get("spare_rows", 0)
    assert tokenizer.pad_token == pad and tokenizer.pad_token_id < rows
    assert tokenizer.pad_token_id not in (tokenizer.eos_token_id, tokenizer.bos_token_id)


def test_a_llama2_like_model_without_pad_token_trains(make_cfg, tmp_path):
    """model.name_or_path of a model whose tokenizer has no pad token and whose embedding has one row per token
    (Llama 2, the ReMax and Hydra-RLHF presets' model): an added [PAD] got id = vocab size, and stage sft ended in
    'IndexError: index out of range in self' at its first forward."""
    path = pretrained_without_pad(tmp_path / "llama2_like", unk=True)
    result = train(make_cfg("model.name_or_path=" + str(path), "model.arch=null", *own_task(tmp_path), "trainer.max_steps=2",
                            shrink=False))
    assert result.module.updates == 2
    assert result.module.tokenizer.pad_token == "<unk>"


def first_tokens(query: torch.Tensor, pad: int) -> list[list[int]]:
    """Each left-padded row's first two tokens."""
    return [row[row != pad][:2].tolist() for row in query]


def test_plain_text_prompts_start_with_the_bos_their_tokenizer_adds(make_cfg, tmp_path):
    """A Llama's or Gemma's tokenizer puts BOS first (`tokenizer(text)`), and the model was trained so. Prompts are
    tokenized without special tokens (a chat template writes its own BOS), so plain-text prompts reached the policy,
    the reward model and stage sft without it (TRL's GRPO has the same defect: trl#3520, garbage from Gemma)."""
    path = pretrained_without_pad(tmp_path / "llama_bos", unk=True, bos=True)
    result = train(make_cfg("model.name_or_path=" + str(path), "model.arch=null", *own_task(tmp_path), "trainer.max_steps=1",
                            shrink=False))
    tokenizer = result.module.tokenizer
    for query in (result.module.train_query, result.module.eval_query):
        starts = first_tokens(query, tokenizer.pad_token_id)
        assert all(s[0] == tokenizer.bos_token_id and s[1] != tokenizer.bos_token_id for s in starts), starts[:3]


def test_bos_is_added_once_and_only_where_the_tokenizer_adds_it(tmp_path):
    from rlhflab.lit.data import encode_completions, encode_prompts

    with_bos, without = tokenizer_without_pad(unk=True, bos=True), tokenizer_without_pad(unk=True)
    for tok in (with_bos, without):
        tok.pad_token = "<unk>"
    # plain text gets BOS; text that starts with it (a chat template's rendering) keeps its one
    assert first_tokens(encode_prompts(with_bos, ["12=", "<s>34="]), with_bos.pad_token_id) == [[0, 4], [0, 6]]
    assert first_tokens(encode_prompts(without, ["12="]), without.pad_token_id) == [[4, 5]]
    ids, _, labels = encode_completions(with_bos, ["12="], ["21"])
    assert ids[0].tolist() == [0, 4, 5, 13, 5, 4, 1]  # BOS, prompt, response, EOS: no BOS before the response
    assert labels[0].tolist() == [-100] * 4 + [5, 4, 1]
    # the prompt budget counts the BOS: a truncated prompt keeps its end and fits with it
    prompts = write(tmp_path / "p.jsonl", [{"prompt": "123456="}, {"prompt": "1="}])
    task = PromptsTask(path=str(prompts), eval_path=str(prompts), max_prompt_tokens=4, overlong="truncate")
    task.setup(with_bos)
    assert [encode_prompts(with_bos, [p])[0].tolist() for p in task.prompts("train")] == [[0, 8, 9, 13], [0, 4, 13]]  # "56=", "1="

def test_a_gold_reward_model_without_pad_token_scores_a_batch(tmp_path):
    """task=tldr's gold judge (a Pythia reward model) may have no pad token: a batch of texts raised 'Asking to pad
    but the tokenizer does not have a padding token'. Each score is the one the text gets alone, unpadded."""
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    from rlhflab.tasks.hub import HubPromptTask

    path = pretrained_without_pad(tmp_path / "gold")
    classifier = LlamaForSequenceClassification.from_pretrained(path, num_labels=1).eval()
    classifier.save_pretrained(path)
    assert classifier.config.pad_token_id is None
    prompts, responses = ["125=", "7="], ["521", "7777"]
    got = HubPromptTask("unused", gold_model_path=str(path)).gold_reward(prompts, responses)
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        alone = [classifier(**tok(p + r, return_tensors="pt")).logits.item() for p, r in zip(prompts, responses)]
    torch.testing.assert_close(got, torch.tensor(alone))


@pytest.mark.parametrize("unk, pad", [(True, "<unk>"), (False, "</s>")])
def test_a_pad_token_that_is_eos_is_replaced_where_another_fits(tmp_path, caplog, unk, pad):
    """A tokenizer saved with pad_token = eos_token (Qwen2.5's base ones; many SFT recipes') hid the EOS from every
    mask: the reward model scored a completion that ended like one cut at the budget. Another pad where one fits
    (here the unknown token); where none does, EOS stays, and the log says what that costs."""
    import logging

    from transformers import AutoTokenizer

    from rlhflab.models.build import load_tokenizer

    path = pretrained_without_pad(tmp_path / "model", unk=unk)
    saved = AutoTokenizer.from_pretrained(path)
    saved.pad_token = saved.eos_token
    saved.save_pretrained(path)
    with caplog.at_level(logging.INFO, logger="rlhflab.models.build"):
        tokenizer = load_tokenizer(path)
    assert tokenizer.pad_token == pad
    said = " ".join(r.getMessage() for r in caplog.records)
    assert ("padding with <unk>" in said) if unk else ("the reward model cannot tell a completion that ended" in said)


def test_a_language_model_given_as_the_reward_model_is_one_line(make_cfg, tmp_path):
    """A policy saved by a run, given as model.reward_model_path, loaded with a fresh random score head (the
    transformers warning that says so is quieted) and the run trained against it without a word."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from rlhflab.config import validate

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_labels=1, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "lm")
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    with pytest.raises(ConfigError, match=r"^model.reward_model_path: '.*lm' is a language model \(LlamaForCausalLM\) with no "
                                          r"reward head.*; give a reward model"):
        validate(make_cfg(f"model.reward_model_path={tmp_path}/lm"))
    assert validate(make_cfg(f"model.reward_model_path={tmp_path}/rm")).reward.needs_reward_model  # a reward model passes


def test_a_model_whose_tokenizer_cannot_read_the_tasks_prompts_is_one_line(tmp_path):
    """model.sft_path=<the reverse example's policy> (a 15-character vocabulary) under the sentiment task read its
    prompts as [UNK] and trained on them without a word: gold 0.000 -> 0.000. The task's own tokenizer passes."""
    from rlhflab.models.build import check_vocabulary
    from rlhflab.tasks.sentiment import SentimentTask

    digits = PromptsTask(path=f"{EXAMPLE}/train.jsonl", tokenizer="char")
    char_tokenizer = digits.build_tokenizer()
    digits.setup(char_tokenizer)
    words = SentimentTask().prompts("eval")
    with pytest.raises(ConfigError, match=r"^model.sft_path: its tokenizer reads 100% of the task's prompt tokens as its "
                                          r"unknown token '\[UNK\]': it was made for other text; give a model"):
        check_vocabulary(char_tokenizer, words, "model.sft_path")
    check_vocabulary(char_tokenizer, digits.prompts("eval"), "model.sft_path")


def test_a_model_directory_without_a_tokenizer_is_one_line_before_the_run_and_not_a_reward_models_own(make_cfg, tmp_path):
    """transformers makes an empty tokenizer of a config's class for a directory that holds none: a GPT-2 model saved
    without its tokenizer, given as model.sft_path, trained on texts of no ids (stage sft's IndexError, after the run
    was made); given as a reward model it scored empty texts."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlhflab.models.build import foreign_tokenizer
    from rlhflab.train import train

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2)).save_pretrained(tmp_path / "bare")
    cfg = make_cfg(f"model.sft_path={tmp_path}/bare", f"cache_dir={tmp_path}/cache")
    with pytest.raises(ConfigError, match=rf"^model.sft_path: no tokenizer can be read from '{tmp_path}/bare' \(none of "
                                          r"tokenizer.json, tokenizer_config.json, tokenizer.model, ... there\); save one beside"):
        train(cfg)
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "cache").exists()
    policy = PromptsTask(path=f"{EXAMPLE}/train.jsonl", tokenizer="char").build_tokenizer()
    assert foreign_tokenizer(tmp_path / "bare", policy) is None  # it reads the policy's tokens


def test_a_given_tokenizer_of_another_vocabulary_than_the_models_is_warned(tmp_path, caplog):
    """model.tokenizer of another vocabulary that fits within the model's rows was taken without a word: every id
    read as another token than the model learned (only more tokens than rows was refused)."""
    from rlhflab.models.build import load_tokenizer
    from rlhflab.tasks.sentiment import SentimentTask
    from rlhflab.train import warn_other_vocabulary

    PromptsTask(path=f"{EXAMPLE}/train.jsonl", tokenizer="char").build_tokenizer().save_pretrained(tmp_path / "model")
    SentimentTask().build_tokenizer().save_pretrained(tmp_path / "words")
    warn_other_vocabulary(str(tmp_path / "model"), load_tokenizer(tmp_path / "model"), str(tmp_path / "model"))
    assert "model.tokenizer" not in caplog.text  # its own (with the pad token load_tokenizer may add)
    warn_other_vocabulary(str(tmp_path / "words"), load_tokenizer(tmp_path / "words"), str(tmp_path / "model"))
    assert re.search(rf"model.tokenizer={tmp_path}/words: \d+ of the \d+ tokens of the tokenizer saved with {tmp_path}/model "
                     r"have another id \(or none\) in it, so the model reads them as other tokens", caplog.text)


def test_a_given_tokenizer_is_judged_before_the_mlflow_run_is_made(make_cfg, tmp_path):
    """train() read a given policy's tokenizer only after the MLflow run was made, so the one line above came with a
    run ended FAILED in the store. It is now read before: no store, no run, nothing cached."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhflab.train import train

    char_tokenizer = PromptsTask(path=f"{EXAMPLE}/train.jsonl", tokenizer="char").build_tokenizer()
    LlamaForCausalLM(LlamaConfig(vocab_size=len(char_tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, pad_token_id=char_tokenizer.pad_token_id)).save_pretrained(tmp_path / "sft")
    char_tokenizer.save_pretrained(tmp_path / "sft")
    cfg = make_cfg(f"model.sft_path={tmp_path}/sft", f"cache_dir={tmp_path}/cache")
    with pytest.raises(ConfigError, match=r"^model.sft_path: its tokenizer reads 100% of the task's prompt tokens"):
        train(cfg)
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "cache").exists()
    # the prompt budget, judged with the same tokenizer ('125=' is 4 characters)
    cfg = make_cfg("experiment=reverse", f"model.sft_path={tmp_path}/sft", f"cache_dir={tmp_path}/cache",
                   "task.max_prompt_tokens=3", shrink=False)
    with pytest.raises(ConfigError, match=r"^task.max_prompt_tokens: every train prompt is longer than 3 tokens"):
        train(cfg)
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "cache").exists()
    # and for a model still to be built, with the task's own tokenizer (it was judged after the run was made)
    cfg = make_cfg("experiment=reverse", f"cache_dir={tmp_path}/cache", "task.max_prompt_tokens=3", shrink=False)
    with pytest.raises(ConfigError, match=r"^task.max_prompt_tokens: every train prompt is longer than 3 tokens"):
        train(cfg)
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "cache").exists()
    # a model with fewer embedding rows than its tokenizer has tokens: stage rm's IndexError, after the run was made
    LlamaForCausalLM(LlamaConfig(vocab_size=5, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, pad_token_id=0)).save_pretrained(tmp_path / "small")
    char_tokenizer.save_pretrained(tmp_path / "small")
    cfg = make_cfg("experiment=reverse", f"model.sft_path={tmp_path}/small", f"cache_dir={tmp_path}/cache", shrink=False)
    with pytest.raises(ConfigError, match=rf"^model.sft_path: its tokenizer has {len(char_tokenizer)} tokens and the model "
                                          r".* 5 embedding rows"):
        train(cfg)
    # a saved model without its tokenizer: transformers' ValueError traceback
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / "small" / name).unlink(missing_ok=True)
    with pytest.raises(ConfigError, match=r"^model.sft_path: no tokenizer can be read from '.*small' \("):
        train(cfg)
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "cache").exists()
