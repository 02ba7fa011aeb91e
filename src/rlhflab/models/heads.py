"""Scalar heads on a causal LM's trunk (Hydra-RLHF's reward and value heads) and the trunk itself.

The heads read the final hidden states of the decoder, the same tensor the LM
head reads, so one trunk forward can serve several roles. A reward head is saved
next to the causal LM whose trunk it reads (`HEAD_FILE`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from rlhflab.models.build import DTYPES
from rlhflab.rollout.lean import last_token_index, lean_hidden, lean_unsupported

HEAD_FILE = "rlhflab_reward_head.safetensors"


class ScalarHead(nn.Linear):
    """(..., H) hidden states -> (..., 1) scores; saved next to the causal LM whose trunk it reads."""

    def __init__(self, hidden_size: int, dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size, 1, bias=False, dtype=dtype)
        nn.init.zeros_(self.weight)  # every sequence starts at score 0; training sets the scale

    def save_pretrained(self, path, state_dict: dict | None = None) -> None:
        from safetensors.torch import save_file

        weight = (state_dict or {"weight": self.weight})["weight"]
        Path(path).mkdir(parents=True, exist_ok=True)
        save_file({"weight": weight.detach().contiguous()}, str(Path(path) / HEAD_FILE))

    @classmethod
    def from_pretrained(cls, path, dtype: str = "float32") -> "ScalarHead":
        from safetensors.torch import load_file

        weight = load_file(str(Path(path) / HEAD_FILE))["weight"]
        head = cls(weight.shape[1], dtype=DTYPES[dtype])
        with torch.no_grad():
            head.weight.copy_(weight)
        return head


def has_reward_head(path) -> bool:
    return (Path(path) / HEAD_FILE).is_file()


def trunk(causal_lm, input_ids, attention_mask, position_ids=None) -> torch.Tensor:
    """(n, T) -> (n, T, H) final hidden states: what the LM head, reward head and value head all read (through the
    lean forward's trunk where it reproduces them: rollout/lean.py)."""
    if lean_unsupported(causal_lm) is None:
        return lean_hidden(causal_lm.model, input_ids, attention_mask, position_ids)
    out = causal_lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state


def sequence_scores(head: nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """(n, T, H) hidden, (n, T) ids -> (n,) raw scores read at each sequence's last token."""
    last = last_token_index(input_ids, pad_token_id)
    return head(hidden[torch.arange(len(hidden), device=hidden.device), last]).squeeze(-1)
