"""Text -> padded tensors, built once per dataset (per-example Python in the loop is 20x slower)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset


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


def prompt_loader(query: torch.Tensor, batch_size: int, seed: int) -> DataLoader:
    """Batches of (query (b, P), index (b,)); the index finds the prompt text."""
    dataset = TensorDataset(query, torch.arange(len(query)))
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(seed))


def tensor_loader(*tensors: torch.Tensor, batch_size: int, seed: int, shuffle: bool = True) -> DataLoader:
    return DataLoader(
        TensorDataset(*tensors), batch_size=batch_size, shuffle=shuffle, generator=torch.Generator().manual_seed(seed)
    )
