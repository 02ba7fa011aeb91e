"""`task=prompts`: your own prompts, demonstrations and preference pairs, from files or the hub.

Every table is read with `datasets`: a local JSON Lines, JSON, CSV or Parquet file, a
directory written by `save_to_disk`, or a hub dataset name with its split. Prompts are text, or a list of
`{"role", "content"}` messages (conversational, as in TRL), rendered with the tokenizer's
chat template. A prompt longer than `max_prompt_tokens` is dropped or truncated (its
start cut, `overlong`), and the counts are logged. The rows' other columns reach the
reward functions as keyword arguments, and `gold_fn` (same signature) judges held-out
completions for `eval/gold_reward`.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import torch

from rlhflab.callables import call_reward, check_signature, load_callable
from rlhflab.errors import ConfigError, no_such_file
from rlhflab.models.build import leading_bos, prompt_ids
from rlhflab.models.checks import DATA_BUILDERS, is_hub_dataset

log = logging.getLogger(__name__)

SPECIALS = {"pad": "[PAD]", "eos": "[EOS]", "bos": "[BOS]", "unk": "[UNK]"}


def saved_to_disk(path: Path) -> bool:
    """A directory written by Dataset.save_to_disk or DatasetDict.save_to_disk."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def is_local(path: str) -> bool:
    """A table read from this machine (a file by its suffix, a folder), not the hub; also a file of another suffix,
    which load_table refuses (as a hub name, it cost datasets' retries)."""
    return not is_hub_dataset(path)


def load_table(path: str, split: str, key: str):
    """A `datasets.Dataset` from a local file (by its suffix), a directory written by `save_to_disk` (a Dataset, or
    a DatasetDict's `split`), or a hub dataset name; one-line errors naming `key`. A CSV's columns are text as
    written: a CSV holds no types, and datasets' guesses made the completion '384' a number (the tokenizer's
    traceback) and an `answer` of '007' the number 7, which a reward function compared with text silently."""
    import datasets

    datasets.disable_progress_bars()
    # Not even its errors: the one line below says what failed (its JSON reader logged it first, as a second line).
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    local = Path(path).expanduser()
    if not local.exists() and not is_hub_dataset(path):  # x.tsv, x.JSONL: looked up on the hub, 'not in the cache'
        raise ConfigError(f"{key}: {no_such_file(path)}; give a .jsonl, .json, .csv or .parquet file, or a hub dataset name")
    try:
        if local.suffix in DATA_BUILDERS and not local.is_dir():
            if not local.is_file():
                raise ConfigError(f"{key}: {no_such_file(path)}; give a .jsonl, .json, .csv or .parquet file, or a hub dataset name")
            table = read_files([local], key)
        elif saved_to_disk(local):
            # Dataset.save_to_disk / DatasetDict.save_to_disk: load_dataset refuses it ('Please use load_from_disk')
            table = datasets.load_from_disk(str(local))
            if isinstance(table, datasets.DatasetDict):
                if split not in table:
                    how = {"task.path": "task.split=", "task.eval_path": "task.eval_split="}.get(key)
                    raise ConfigError(f"{key}: '{path}' (saved with save_to_disk) has no split '{split}'; its splits are "
                                      f"{', '.join(table)}: " + (f"choose one with {how}" if how else
                                                                 f"give {key} the directory of the split to use"))
                table = table[split]
        elif local.is_file():
            raise ConfigError(f"{key}: '{path}' is not a file rlhflab reads (by its suffix{', ' + repr(local.suffix) if local.suffix else ''}); "
                              "give a .jsonl, .json, .csv or .parquet file")
        elif local.is_dir():
            files = folder_files(local, path, split, key)
            table = read_files(files, key)
            names = [str(f.relative_to(local.resolve())) for f in files]
            log.info("%s: read %d rows of split '%s' from %d file%s in '%s': %s", key, len(table), split, len(files),
                     "s" * (len(files) > 1), path, ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else ""))
        else:
            table = datasets.load_dataset(path, split=split)
    except ConfigError:
        raise
    except Exception as err:
        if type(err).__name__ == "DatasetGenerationError" and err.__cause__ is not None:
            err = err.__cause__  # the parser's own words (JSON parse error ... in row 1), not 'An error occurred'
        if "corresponds to no data" in str(err) or "BatchSize must be greater than 0" in str(err):
            # datasets' 'Instruction "train" corresponds to no data!' (a JSON Lines file of blank lines); an empty
            # Parquet file's ArrowInvalid
            raise ConfigError(f"{key}: '{path}' has no rows") from None
        reason = (str(err).splitlines() or [""])[0][:160]
        raise ConfigError(f"{key}: cannot read '{path}' ({type(err).__name__}{': ' + reason if reason else ''}); "
                          "check the file (or the hub name and split)") from None
    if len(table) == 0:
        raise ConfigError(f"{key}: '{path}' has no rows")
    return table


def read_files(files: list[Path], key: str):
    """One table from data files of one suffix, as datasets' builder for it reads them (CSV columns as text)."""
    import datasets

    for f in files:
        if f.stat().st_size == 0:  # datasets' StopIteration
            raise ConfigError(f"{key}: '{f}' has no rows")
    suffix = files[0].suffix
    json_files = suffix in (".jsonl", ".json")

    def refuse_clash(columns: list[str] | None = None) -> None:
        # Values of one column in several types: datasets reads the column as JSON values ('019' became 19), casts
        # one file's to another's (a folder: '011' became 11), or fails in pandas' words ('Expected object or value').
        clash = type_clash(files, columns) if json_files else None
        if clash:
            raise ConfigError(f"{key}: {clash}; give every row's value the same type (text in quotes for text)") from None

    if len(files) > 1:  # a folder: datasets casts one file's column to another's without a word
        refuse_clash()
    csv = {"converters": {c: str for f in files for c in csv_header(f)}} if suffix == ".csv" else {}
    try:
        table = datasets.load_dataset(DATA_BUILDERS[suffix], data_files=[str(f) for f in files], split="train", **csv)
    except Exception:
        refuse_clash()
        raise
    json_columns = [c for c, feature in table.features.items() if isinstance(feature, datasets.Json)]
    if json_columns:  # (a column of dicts whose keys differ is Json too, and fine)
        refuse_clash(json_columns)
    return table


def table_key(table) -> str:
    """A short hash of a datasets table's rows as read (all of its file, whatever select() kept of it)."""
    import hashlib

    import pyarrow as pa

    data = getattr(table.data, "table", table.data)
    # keys in another order within a row are the same data (the columns, and datasets' features in the schema)
    data = data.select(sorted(data.column_names)).replace_schema_metadata(None)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, data.schema) as writer:
        writer.write_table(data)
    return hashlib.sha256(sink.getvalue()).hexdigest()[:12]


def type_clash(files: list[Path], columns: list[str] | None = None) -> str | None:
    """Where a column of these JSON files first changes type ("the column 'answer' of 'x.jsonl' is str in row 0
    (line 1) and list in row 2 (line 3)"), or None. Whole numbers and decimals are one type (numbers); a dict is a
    dict whatever its keys."""
    import json

    first: dict[str, tuple] = {}
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        try:
            rows = json.loads(text) if f.suffix == ".json" else [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError:
            return None  # the parser's own error says what is wrong with the file
        for i, row in enumerate(rows if isinstance(rows, list) else []):
            for column in (columns or (row if isinstance(row, dict) else ())):
                value = row.get(column) if isinstance(row, dict) else None
                if value is None:
                    continue
                kind = "number" if type(value) in (int, float) else type(value).__name__
                seen = first.setdefault(column, (f, i, kind))
                if kind == seen[2]:
                    continue
                at = lambda g, j: f"row {j}{_line(str(g), j)}" + ("" if g == f == seen[0] else f" of '{g}'")  # noqa: E731
                where = f" of '{f}'" if f == seen[0] else ""
                return f"the column '{column}'{where} is {seen[2]} in {at(seen[0], seen[1])} and {kind} in {at(f, i)}"
    return None


def folder_files(local: Path, path: str, split: str, key: str) -> list[Path]:
    """The files of `split` in a plain folder, found by datasets' own file naming (train.jsonl, data/test-0.csv, ...;
    every file is `train` where no name says a split). They must all be of one suffix rlhflab reads: datasets reads a
    folder as the kind most of its files are and leaves the others out without a word (a save_to_disk subfolder's
    state.json it read as prompts)."""
    from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns

    empty = ConfigError(f"{key}: the folder '{path}' holds no data files; give a .jsonl, .json, .csv or .parquet file, "
                        "or a folder of them")
    try:
        found = DataFilesDict.from_patterns(get_data_patterns(str(local)), base_path=str(local))
    except (EmptyDatasetError, FileNotFoundError):
        raise empty from None
    splits = {str(name): files for name, files in found.items()}
    if split not in splits:
        how = {"task.path": "task.split=", "task.eval_path": "task.eval_split="}.get(key, f"{key}=<a file>")
        raise ConfigError(f"{key}: the folder '{path}' has no split '{split}' (datasets names a split by its files' names, "
                          f"e.g. {split}.jsonl); its splits are {', '.join(splits)}: choose one with {how}")
    files = sorted(Path(f).resolve() for f in splits[split])
    if not files:
        raise empty
    kinds = sorted({f.suffix or f.name for f in files})
    if len(kinds) > 1 or files[0].suffix not in DATA_BUILDERS:
        shown = ", ".join(str(f.relative_to(local.resolve())) for f in files[:6]) + (", ..." if len(files) > 6 else "")
        raise ConfigError(f"{key}: the folder '{path}' (split '{split}') holds files of {len(kinds)} kind{'s' * (len(kinds) > 1)} "
                          f"({', '.join(kinds)}: {shown}); give one file, or a folder of .jsonl, .json, .csv or .parquet "
                          "files of one kind")
    return files


def csv_header(path: Path) -> list[str]:
    import csv

    with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:  # a BOM is not in the name
        return next(csv.reader(f), [])


def warn_missing_values(table, prompt_field: str, key: str, path: str) -> None:
    """The columns beside the prompt reach reward functions as keywords; a row without a value there (a JSON Lines
    row without the key, a JSON null, an empty CSV cell) gave them None without a word, and an exact-match reward
    scored such rows 0. Said once per column; not refused (a column may be optional)."""
    for name in table.column_names:
        if name == prompt_field:
            continue
        missing = [i for i, v in enumerate(table[name]) if v is None]
        if missing:
            log.warning("%s: the column '%s' of '%s' has no value in %d of %d rows (the first: row %d%s); reward "
                        "functions get None there", key, name, path, len(missing), len(table), missing[0],
                        _line(path, missing[0]))


def _column(table, field: str, key: str, path: str, setting: str = "task.prompt_field") -> list:
    """The column `field` of `table` (read from `key`'s `path`), which `setting` names."""
    if field not in table.column_names:  # the line named the columns, not the setting that picks one
        fix = f"name the one to read with {setting}=<column>"
        if setting == "task.prompt_field" and key != "task.path":  # that setting would then miss task.path's column
            fix = (f"every file's prompts are its column {setting}='{field}', task.path's too: rename that file's "
                   f"prompt column to '{field}'")
        raise ConfigError(f"{key}: no column '{field}' in '{path}'; its columns are {', '.join(table.column_names)}: {fix}")
    values = list(table[field])
    for i, v in enumerate(values):
        if v is None or (isinstance(v, str) and not v.strip()) or (isinstance(v, list) and not v):
            what = f"no '{field}'" if v is None else f"an empty '{field}'"
            raise ConfigError(f"{key}: row {i}{_line(path, i)} of '{path}' has {what}; fill it or remove the row")
        if not (isinstance(v, str) or is_conversation(v)):  # a JSON number: the tokenizer's traceback, after the run began
            raise ConfigError(f"{key}: row {i}{_line(path, i)} of '{path}' has {field} {v!r} ({type(v).__name__}), not text "
                              "or a list of {role, content} messages; write it as a string")
    return values


def _line(path: str, row: int) -> str:
    """' (line N)': where data row `row` (from 0, blank lines skipped) is in a JSON Lines file, for an editor."""
    local = Path(path).expanduser()
    if local.suffix != ".jsonl" or not local.is_file():
        return ""
    with open(local, encoding="utf-8", errors="replace") as f:
        seen = -1
        for number, text in enumerate(f, start=1):
            seen += bool(text.strip())
            if seen == row:
                return f" (line {number})"
    return ""


def is_conversation(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def _text(value) -> str:
    """A completion as text: itself, or the content of a conversation's last (assistant) message."""
    return value[-1]["content"] if is_conversation(value) else value


class PromptsTask:
    """Prompts (and optionally demonstrations and preference pairs) from your files.

    path / split / prompt_field: the prompts; eval_path / eval_split: held-out prompts, else
    eval_fraction of path is held out; num_eval_prompts: at most this many held out.
    chat_template: apply the tokenizer's chat template to text prompts (conversations always are).
    max_prompt_tokens / overlong: the prompt budget, and drop or truncate past it.
    demonstrations_path (+ completion_field): prompt/completion pairs for stage sft.
    preferences_path (+ chosen_field, rejected_field): pairs for stage rm (and hydra_sft).
    max_new_tokens: the response budget. gold_fn: judges held-out completions (eval/gold_reward).
    tokenizer: for a model built from config (model.name_or_path null): word or char level over the data.
    """

    name = "prompts"

    def __init__(self, path: str, split: str = "train", prompt_field: str = "prompt", eval_path: str | None = None,
                 eval_split: str | None = None, eval_fraction: float = 0.1, num_eval_prompts: int = 64,
                 chat_template: bool = False, max_prompt_tokens: int = 256, overlong: str = "drop",
                 demonstrations_path: str | None = None, completion_field: str = "completion",
                 preferences_path: str | None = None, chosen_field: str = "chosen", rejected_field: str = "rejected",
                 max_new_tokens: int = 64, gold_fn: str | None = None, tokenizer: str = "word", seed: int = 0) -> None:
        self.prompt_field = prompt_field
        self.chat_template = chat_template
        self.max_prompt_tokens = max_prompt_tokens
        self.overlong = overlong
        self.max_new_tokens = max_new_tokens
        self.tokenizer_level = tokenizer
        self.gold_fn = load_callable(gold_fn, "task.gold_fn") if gold_fn else None
        self.gold_subject = f"gold function {str(gold_fn).rpartition(':')[2]} (task.gold_fn={gold_fn})"  # its errors' words
        self.has_gold = self.gold_fn is not None
        self.source = dict(path=path, split=split, eval_path=eval_path, eval_split=eval_split, eval_fraction=eval_fraction,
                           num_eval_prompts=num_eval_prompts, demonstrations_path=demonstrations_path,
                           completion_field=completion_field, preferences_path=preferences_path, chosen_field=chosen_field,
                           rejected_field=rejected_field, seed=seed)
        self.tables = None
        self._tokenizer = None  # build_tokenizer's, built once (train()'s checks and the base model both ask for it)
        self.num_train_prompts = 0  # known once loaded
        self.rendered: dict[str, list[str]] = {}
        # Local files are read now (a missing field fails before anything loads); hub datasets when the run
        # starts (train() calls load() after check_hub_dataset, before the MLflow run), so that a preset
        # validates without downloading.
        if all(is_local(p) for p in (path, eval_path, demonstrations_path, preferences_path) if p):
            self.load()

    def load(self) -> bool:
        """Read the tables (once): local files at construction, hub datasets when train() calls it. True when
        this call read them."""
        if self.tables is not None:
            return False
        src = self.source
        path, prompt_field = src["path"], self.prompt_field
        train = load_table(path, src["split"], "task.path")
        _column(train, prompt_field, "task.prompt_field", path)
        warn_missing_values(train, prompt_field, "task.path", path)
        self.sources = {"train": f"the training prompts of '{path}' (task.path)"}
        if src["eval_path"]:
            held = load_table(src["eval_path"], src["eval_split"] or src["split"], "task.eval_path")
            _column(held, prompt_field, "task.prompt_field", src["eval_path"])
            warn_missing_values(held, prompt_field, "task.eval_path", src["eval_path"])
            self.sources["eval"] = f"the held-out prompts of '{src['eval_path']}' (task.eval_path)"
            lacking = [c for c in train.column_names if c not in held.column_names]
            if lacking:  # the reward functions take each split's own columns: they would fail at the first evaluation
                log.warning("task.eval_path: '%s' lacks the column%s %s that task.path has; reward functions get the "
                            "columns of the held-out prompts from it", src["eval_path"], "s" * (len(lacking) > 1),
                            ", ".join(lacking))
            self.file_rows = {"train": list(range(len(train))), "eval": list(range(len(held)))}
        else:
            order = list(range(len(train)))
            random.Random(src["seed"]).shuffle(order)
            n = min(src["num_eval_prompts"], max(1, int(len(train) * src["eval_fraction"])))
            if len(train) - n < 1:
                raise ConfigError(f"task.eval_fraction: holding out {n} of {len(train)} prompts leaves none to train on; "
                                  "give task.eval_path or more prompts")
            self.file_rows = {"train": sorted(order[n:]), "eval": sorted(order[:n])}  # rows of the file, from 0
            self.sources["eval"] = f"the held-out prompts of '{path}' (task.path, task.eval_fraction)"
            held, train = train.select(self.file_rows["eval"]), train.select(self.file_rows["train"])
        self.tables = {"train": train, "eval": held.select(range(min(len(held), src["num_eval_prompts"])))}
        self.num_train_prompts = len(train)
        self.rows = {s: list(range(len(t))) for s, t in self.tables.items()}  # kept rows (setup may drop some)
        self.raw_demos = self._pairs(src["demonstrations_path"], ["prompt_field", "completion_field"], "task.demonstrations_path")
        self.raw_prefs = self._pairs(src["preferences_path"], ["prompt_field", "chosen_field", "rejected_field"],
                                     "task.preferences_path")
        self.demos, self.prefs = self.raw_demos, self.raw_prefs  # rendered by setup()
        self.conversational = is_conversation(train[0][prompt_field])
        if self.gold_fn is not None:
            for split, columns in self.columns().items():
                check_signature(self.gold_fn, "task.gold_fn", columns, self.sources[split])
        return True

    def _pairs(self, path: str | None, settings: list[str], key: str) -> list[tuple] | None:
        """The rows of `path` as tuples of the columns the task's `settings` (prompt_field, ...) name."""
        if not path:
            return None
        table = load_table(path, "train", key)
        fields = {s: self.prompt_field if s == "prompt_field" else self.source[s] for s in settings}
        columns = [_column(table, field, key, path, f"task.{s}") for s, field in fields.items()]
        return list(zip(*columns))

    # ---- rendering, against the policy's tokenizer -------------------------------------------

    def setup(self, tokenizer) -> dict[str, int]:
        """Render prompts (chat template), enforce max_prompt_tokens; returns the counts it logged."""
        self.load()
        counts, bos = {}, leading_bos(tokenizer)
        for split, table in self.tables.items():
            kept, texts, dropped, truncated = [], [], 0, 0
            rendered = [self._render(prompt, tokenizer) for prompt in table[self.prompt_field]]
            for row, (text, ids) in enumerate(zip(rendered, prompt_ids(tokenizer, rendered))):
                if len(ids) > self.max_prompt_tokens:
                    if self.overlong == "drop":
                        dropped += 1
                        continue
                    # keep the end; the budget counts the BOS that encoding puts first
                    body = ids[1:] if bos is not None else ids
                    keep = self.max_prompt_tokens - (bos is not None)
                    text, truncated = tokenizer.decode(body[len(body) - keep :]), truncated + 1
                kept.append(row)
                texts.append(text)
            if not texts:
                raise ConfigError(f"task.max_prompt_tokens: every {split} prompt is longer than {self.max_prompt_tokens} tokens; "
                                  "raise it or set task.overlong=truncate")
            self.rows[split], self.rendered[split] = kept, texts
            counts |= {f"task/{split}_prompts": len(texts), f"task/{split}_prompts_dropped": dropped,
                       f"task/{split}_prompts_truncated": truncated}
            if dropped or truncated:
                log.warning("task: %d %s prompts longer than task.max_prompt_tokens=%d %s", dropped or truncated, split,
                            self.max_prompt_tokens, "dropped" if dropped else "truncated (their start cut)")
        self.num_train_prompts = len(self.rendered["train"])
        # Demonstrations and preference pairs start from the same rendering as RL prompts.
        render = lambda pairs: pairs and [(self._render(p, tokenizer), *map(_text, rest)) for p, *rest in pairs]  # noqa: E731
        self.demos, self.prefs = render(self.raw_demos), render(self.raw_prefs)
        return counts

    def _render(self, prompt, tokenizer) -> str:
        if is_conversation(prompt) or self.chat_template:
            if not getattr(tokenizer, "chat_template", None):
                raise ConfigError("task.chat_template: the tokenizer has no chat template"
                                  + (" and the prompts are conversations" if is_conversation(prompt) else "")
                                  + "; use a model whose tokenizer has one, or plain-text prompts with task.chat_template=false")
            messages = prompt if is_conversation(prompt) else [{"role": "user", "content": prompt}]
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return prompt

    # ---- what the pipeline reads --------------------------------------------------------------

    def prompts(self, split: str) -> list[str]:
        if split not in self.rendered:
            raise RuntimeError("PromptsTask.setup(tokenizer) must run before prompts()")
        return self.rendered[split]

    def demonstrations(self) -> list[tuple[str, str]] | None:
        """Pairs for stage sft; before a hub dataset is loaded, [] if one is configured (validation's question)."""
        if self.tables is None:
            return [] if self.source["demonstrations_path"] else None
        return self.demos

    def preference_pairs(self) -> list[tuple[str, str, str]] | None:
        if self.tables is None:
            return [] if self.source["preferences_path"] else None
        return self.prefs

    def columns(self) -> dict[str, list[str]]:
        """{split: the columns beside the prompt that reward functions get} of the files read ({} before)."""
        if self.tables is None:
            return {}
        return {split: [c for c in t.column_names if c != self.prompt_field] for split, t in self.tables.items()}

    def reward_inputs(self, split: str, rows, prompts: list[str], completions: list[str]):
        """The dataset's own prompts (text or messages) and other columns for `rows`, TRL's way."""
        if rows is None:
            return prompts, completions, {}
        table = self.tables[split]
        index = [self.rows[split][r] for r in rows.tolist()]
        picked = table.select(index)
        raw = list(picked[self.prompt_field])
        if self.conversational:
            completions = [[{"role": "assistant", "content": c}] for c in completions]
        extra = {c: list(picked[c]) for c in self.columns()[split]}
        return raw, completions, extra

    def row_source(self, split: str, rows) -> tuple[list[int], str]:
        """For messages: each of `rows` (indices of the split's kept prompts) as its row in the file it came from
        (from 0, as the other messages' rows), and which file and split that is."""
        return [self.file_rows[split][self.rows[split][r]] for r in rows.tolist()], self.sources[split]

    def gold_reward(self, prompts: list[str], responses: list[str], split: str = "eval", rows=None) -> torch.Tensor:
        if self.gold_fn is None:
            raise RuntimeError("task.gold_fn is null: this task has no gold reward")
        raw, completions, kwargs = self.reward_inputs(split, rows, prompts, responses)
        ids, source = self.row_source(split, rows) if rows is not None else (None, None)
        # None, a reward function's 'does not apply', made the gold mean NaN: the run FINISHED with
        # eval/gold_reward=nan, the metric a sweep picks its best job by
        return call_reward(self.gold_fn, self.gold_subject, raw, completions, kwargs, ids, source,
                           no_none="the gold reward judges every completion (eval/gold_reward is their mean): return a "
                                   "number for each")

    def data_keys(self) -> dict[str, str]:
        """A hash of what was read from each data setting (every row and column): a checkpoint keeps them, so that
        a resume on edited files is said rather than mixing two data sets in one run."""
        from rlhflab.models.cache import config_key

        self.load()
        keys = {"task.path": table_key(self.tables["train"])}
        if self.source["eval_path"]:
            keys["task.eval_path"] = table_key(self.tables["eval"])
        for key, pairs in (("task.demonstrations_path", self.raw_demos), ("task.preferences_path", self.raw_prefs)):
            if pairs:
                keys[key] = config_key(pairs)
        return keys

    def build_tokenizer(self):
        """A tokenizer over the data's words (or characters), for a model built from config."""
        if self._tokenizer is None:
            self._tokenizer = self._word_tokenizer()
        return self._tokenizer

    def _word_tokenizer(self):
        self.load()
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        texts = [p if isinstance(p, str) else " ".join(m["content"] for m in p) for t in self.tables.values()
                 for p in list(t[self.prompt_field])]
        for pairs in (self.raw_demos or [], self.raw_prefs or []):
            texts += [_text(x) for pair in pairs for x in pair[1:]]
        units = sorted({u for t in texts for u in (t if self.tokenizer_level == "char" else t.split())})
        vocab = {tok: i for i, tok in enumerate(SPECIALS.values())}
        for unit in units:
            vocab.setdefault(unit, len(vocab))
        backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIALS["unk"]))
        if self.tokenizer_level == "char":
            from tokenizers import Regex, decoders

            backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
            backend.decoder = decoders.Fuse()  # characters back together, not joined by spaces
        else:
            backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=SPECIALS["pad"], eos_token=SPECIALS["eos"],
                                       bos_token=SPECIALS["bos"], unk_token=SPECIALS["unk"], padding_side="left")
