"""`reward=function`: your own Python functions, with TRL's signature, as the reward.

    def score(prompts: list, completions: list, **kwargs) -> list[float]

`prompts` are the dataset's prompts of the batch (text, or a list of messages for a
conversational dataset), `completions` the sampled texts (for a conversational dataset,
`[{"role": "assistant", "content": text}]` each), and `kwargs` the dataset's other
columns for the same rows (e.g. a reference `answer`). As TRL does, a function that names them
or takes **kwargs is also given `completion_ids` (each completion's token ids, up to and
including its EOS) and `trainer_state` (transformers' TrainerState: `global_step`, the number
of RL updates whose weights sampled the batch, and `max_steps`). Several functions are summed
with `reward.weights`, and each one's mean is logged as `train/reward/<name>`. As in
TRL, a function returns None for a completion it does not apply to (a math checker on
a coding prompt): the sum leaves it out, its mean is over the rest, and a completion
that no function scores gets 0 (a warning says so once). A function that raises,
returns the wrong number of values, or a NaN stops the run in one line naming the
function and the row.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from rlhflab.callables import GIVEN, call_reward, check_signature, load_callable, takes
from rlhflab.contracts import MemoryStrategy, Task
from rlhflab.errors import ConfigError
from rlhflab.rollout.batch import Rollout, response_mask_from_eos

log = logging.getLogger(__name__)


def _name(spec: str) -> str:
    return str(spec).rpartition(":")[2]


class FunctionReward:
    """Your functions as the reward. fn: one `module:function` or `path/to/file.py:function`;
    fns: several of them; weights: one per function (default 1 each)."""

    needs_reward_model = False

    def __init__(self, fn: str | None = None, fns: Sequence[str] = (), weights: Sequence[float] | None = None) -> None:
        specs = ([fn] if fn else []) + list(fns or [])
        if not specs:
            raise ConfigError("reward.fn: no reward function; set reward.fn=module:function or reward.fns=[a:f,b:g]")
        # the setting that chose each function (reward.fns[1], not reward.fns, when there are several): what its errors name
        settings = ["reward.fn"] * bool(fn) + [f"reward.fns[{i}]" if len(fns) > 1 else "reward.fns" for i in range(len(fns or []))]
        self.settings = settings
        self.functions = [(_name(spec), load_callable(spec, setting)) for spec, setting in zip(specs, settings)]
        names = [n for n, _ in self.functions]
        if len(set(names)) != len(names):  # two files' `score`: tell them apart by position
            self.functions = [(f"{n}{i}", f) for i, (n, f) in enumerate(self.functions)]
        # what its errors name: the function (as its train/reward/<name> metric does), the setting and spec that chose it
        self.subjects = [f"reward function {name} ({setting}={spec})" for (name, _), setting, spec in zip(self.functions, settings, specs)]
        self.weights = [1.0] * len(specs) if weights is None else [float(w) for w in weights]
        if len(self.weights) != len(specs):
            raise ConfigError(f"reward.weights: {len(self.weights)} weights for {len(specs)} functions; give one per function")
        bad = next((w for w in self.weights if not math.isfinite(w)), None)
        if bad is not None:  # every reward then NaN: a failed step 1 after the model loaded (skip_batch: minutes, FINISHED)
            raise ConfigError(f"reward.weights: {bad} is not a finite number; give each function a finite weight")
        self.components: dict[str, float] = {}
        self.warned = False
        # which of TRL's completion_ids and trainer_state each function takes (by name, or in **kwargs): decided once
        self.wants = [{g for g in GIVEN if takes(fn, g)} for _, fn in self.functions]
        self.eos_token_id: int | None = None  # setup: where each completion's ids (completion_ids) end
        self.max_steps = 0  # setup: the RL stage's budget, trainer_state.max_steps

    def setup(self, tokenizer, max_steps: int) -> None:
        """What the functions' completion_ids and trainer_state need, once the RL stage's tokenizer is read."""
        self.eos_token_id, self.max_steps = tokenizer.eos_token_id, int(max_steps)

    def check_columns(self, task: Task) -> None:
        """Each function takes the columns of each split's file (task=prompts, once its files are read)."""
        for split, columns in getattr(task, "columns", dict)().items():
            clash = [c for c in columns if c in GIVEN]
            if clash:  # what the functions are given would replace the column's values without a word
                raise ConfigError(f"{task.sources[split]} has a column {clash[0]!r}, the name of what reward functions "
                                  f"are given beside the columns ({', '.join(GIVEN)}, as in TRL); rename the column")
            for (_, fn), setting in zip(self.functions, self.settings):
                check_signature(fn, setting, columns, task.sources[split], GIVEN)

    def _given(self, response: torch.Tensor | None, version: int) -> dict:
        """completion_ids and trainer_state, once per batch, where a function takes them (TRL gives every function both)."""
        wanted = set().union(*self.wants)
        given = {}
        if response is not None and "completion_ids" in wanted:
            mask = (response_mask_from_eos(response, self.eos_token_id) if self.eos_token_id is not None
                    else torch.ones_like(response)).bool()
            given["completion_ids"] = [ids[keep].tolist() for ids, keep in zip(response.cpu(), mask.cpu())]
        if "trainer_state" in wanted:
            from transformers import TrainerState

            given["trainer_state"] = TrainerState(global_step=int(version), max_steps=self.max_steps)
        return given

    def _score(self, task: Task, split: str, prompts: list[str], texts: list[str], rows: torch.Tensor | None,
               response: torch.Tensor | None = None, version: int = 0) -> torch.Tensor:
        prompts, completions, kwargs = task.reward_inputs(split, rows, prompts, texts)
        total = torch.zeros(len(texts))
        scored = torch.zeros(len(texts), dtype=torch.bool)
        self.components = {}
        row_ids, source = rows.tolist() if rows is not None else None, None
        if rows is not None and hasattr(task, "row_source"):  # task=prompts: the file's rows, and which file
            row_ids, source = task.row_source(split, rows)
        given = self._given(response, version)
        for (name, fn), weight, subject, wants in zip(self.functions, self.weights, self.subjects, self.wants):
            values = call_reward(fn, subject, prompts, completions, {**kwargs, **{g: given[g] for g in wants if g in given}},
                                 row_ids, source)
            applies = ~values.isnan()  # None: it does not apply there
            if applies.any():
                self.components[f"train/reward/{name}"] = float(values[applies].mean())
            total += weight * values.nan_to_num(0.0)
            scored |= applies
        if not scored.all() and not self.warned:
            i = int((~scored).nonzero()[0])
            log.warning("reward: no function scored %d of %d completions (first: prompt %r, completion %r): their reward "
                        "is 0, as in TRL (said once)", int((~scored).sum()), len(texts), str(prompts[i])[:60], str(completions[i])[:60])
            self.warned = True
        return total

    def score(self, memory: MemoryStrategy, task: Task, rollout: Rollout) -> torch.Tensor:
        return self._score(task, rollout.split, rollout.prompts, rollout.texts, rollout.rows, rollout.response, rollout.version)

    def score_baseline(self, memory: MemoryStrategy, task: Task, rollout: Rollout) -> torch.Tensor:
        k = rollout.num_samples // rollout.baseline_response.shape[0]
        rows = rollout.rows[::k] if rollout.rows is not None else None
        return self._score(task, rollout.split, rollout.prompts[::k], rollout.baseline_texts, rows, rollout.baseline_response,
                           rollout.version)
