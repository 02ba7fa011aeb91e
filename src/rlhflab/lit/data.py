"""Text -> padded tensors, built once per dataset (per-example Python in the loop is 20x slower)."""

from __future__ import annotations

from itertools import count

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from rlhflab.models.build import prompt_ids
from rlhflab.rollout.batch import trim_left


def _ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _pad(rows: list[list[int]], pad: int, left: bool) -> torch.Tensor:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            if left:
                out[i, width - len(r) :] = torch.tensor(r)
            else:
                out[i, : len(r)] = torch.tensor(r)
    return out


def encode_prompts(tokenizer, prompts: list[str]) -> torch.Tensor:
    """(n, P) prompt ids, left-padded so every completion starts in the same column."""
    return _pad(prompt_ids(tokenizer, prompts), tokenizer.pad_token_id, left=True)


def encode_completions(tokenizer, prompts: list[str], responses: list[str]):
    """prompt + response + EOS, right-padded: (input_ids, attention_mask, labels) each (n, T).

    labels are -100 on the prompt and the padding, so SFT learns the response and EOS only.
    """
    rows, labels = [], []
    for p, r in zip(prompt_ids(tokenizer, prompts), _ids(tokenizer, responses)):
        rows.append(p + r + [tokenizer.eos_token_id])
        labels.append([-100] * len(p) + r + [tokenizer.eos_token_id])
    input_ids = _pad(rows, tokenizer.pad_token_id, left=False)
    attention_mask = (input_ids != tokenizer.pad_token_id).long()
    label_ids = _pad(labels, -100, left=False)
    return input_ids, attention_mask, label_ids


class PromptBatches(IterableDataset):
    """The RL stage's prompt batches: batch j (j = start, start+1, ...) is a pure function of (seed, j).

    Epoch e = j // per_epoch shuffles every prompt with its own seed (seed, e), and
    batch j takes the (j % per_epoch)-th run of `prompts_per_step` prompts of that
    order; an epoch's incomplete tail is dropped. So a run resumed at batch j, and the
    async generator iterating its own copy, see exactly the prompts an uninterrupted
    learner would. Under data parallelism rank r of w takes the r-th of w equal
    contiguous slices of each batch (whole prompts: their k samples stay together).

    Yields (query (b, P), prompt index (b,), batch index j (0-d)); with `pad_token_id`, P is the batch's
    longest prompt, not the dataset's (`query` is padded to the dataset's longest).
    """

    def __init__(self, query: torch.Tensor, prompts_per_step: int, seed: int, start: int = 0, rank: int = 0,
                 world_size: int = 1, pad_token_id: int | None = None) -> None:
        self.query = query
        self.pad_token_id = pad_token_id
        self.size = prompts_per_step
        self.per_epoch = len(query) // prompts_per_step
        if self.per_epoch < 1:
            raise ValueError(f"{len(query)} prompts cannot fill one batch of {prompts_per_step}")
        self.seed, self.start = seed, start
        self.rank, self.world_size = rank, world_size
        self.local = prompts_per_step // world_size
        self._order: tuple[int, torch.Tensor] | None = None

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._order = (epoch, torch.randperm(len(self.query), generator=g))
        return self._order[1]

    def indices(self, j: int) -> torch.Tensor:
        """Global prompt indices (prompts_per_step,) of batch j."""
        epoch, pos = divmod(j, self.per_epoch)
        return self._epoch_order(epoch)[pos * self.size : (pos + 1) * self.size]

    def __iter__(self):
        for j in count(self.start):
            index = self.indices(j)[self.rank * self.local : (self.rank + 1) * self.local]
            query = self.query[index]
            yield query if self.pad_token_id is None else trim_left(query, self.pad_token_id), index, torch.tensor(j)


def prompt_loader(batches: PromptBatches) -> DataLoader:
    """The stream as a DataLoader (batches are made by the stream itself). Its own generator: creating
    an iterator draws a base seed, which from the global generator would shift every later draw of a
    resumed run (it creates one more iterator than an uninterrupted run) by one."""
    return DataLoader(batches, batch_size=None, generator=torch.Generator().manual_seed(0))


def tensor_loader(*tensors: torch.Tensor, batch_size: int, seed: int, shuffle: bool = True) -> DataLoader:
    return DataLoader(
        TensorDataset(*tensors), batch_size=batch_size, shuffle=shuffle, generator=torch.Generator().manual_seed(seed)
    )
