"""Text -> padded tensors, built once per dataset (per-example Python in the loop is 20x slower)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset


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
    return _pad(_ids(tokenizer, prompts), tokenizer.pad_token_id, left=True)


def encode_completions(tokenizer, prompts: list[str], responses: list[str]):
    """prompt + response + EOS, right-padded: (input_ids, attention_mask, labels) each (n, T).

    labels are -100 on the prompt and the padding, so SFT learns the response and EOS only.
    """
    rows, labels = [], []
    for p, r in zip(_ids(tokenizer, prompts), _ids(tokenizer, responses)):
        rows.append(p + r + [tokenizer.eos_token_id])
        labels.append([-100] * len(p) + r + [tokenizer.eos_token_id])
    input_ids = _pad(rows, tokenizer.pad_token_id, left=False)
    attention_mask = (input_ids != tokenizer.pad_token_id).long()
    label_ids = _pad(labels, -100, left=False)
    return input_ids, attention_mask, label_ids


class EpochShuffle(Sampler):
    """A shuffle that is a pure function of (seed, epoch).

    The async generator iterates its own copy of the learner's loader; a
    sampler that drew from a running generator would drift from the learner's
    whenever either side started one more iterator. Lightning calls set_epoch.
    """

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


def prompt_loader(query: torch.Tensor, batch_size: int, seed: int) -> DataLoader:
    """Batches of (query (b, P), index (b,)); the index finds the prompt text."""
    dataset = TensorDataset(query, torch.arange(len(query)))
    return DataLoader(dataset, batch_size=batch_size, sampler=EpochShuffle(len(query), seed), drop_last=True)


def tensor_loader(*tensors: torch.Tensor, batch_size: int, seed: int, shuffle: bool = True) -> DataLoader:
    return DataLoader(
        TensorDataset(*tensors), batch_size=batch_size, shuffle=shuffle, generator=torch.Generator().manual_seed(seed)
    )
