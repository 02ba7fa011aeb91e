"""Attention for the forwards that train, on the CPU under bf16/fp16: float32 sdpa over short sequences.

Every model rlhflab loads or builds with transformers' default attention (`sdpa`) is switched to `sdpa_trains_f32`
(`use_for_training`), an entry in transformers' AttentionInterface that is sdpa itself everywhere but in one case: a
forward with grad on, on the CPU, in half precision (bf16/fp16 autocast, `trainer.precision=bf16-mixed`, or half
weights), over keys at most SHORT_KEYS long. There it runs sdpa on float32 query, key and value with autocast off,
and returns the product in the query's dtype. Two reasons, both measured on this repo's machine (torch 2.13, one
thread, `benchmarks/attention_train.py`):
- PyTorch's CPU flash attention backward in bf16 is slow at short lengths: 32 rows of 44 tokens, 12 heads of 64,
  forward and backward took 77 ms in bf16 against 25 ms in float32; at 256 tokens they are level, and from 384 on
  bf16 is faster, hence the bound. Through the 113M model's forward and backward under bf16 autocast (32 x 44
  tokens): 2.55 against 3.2 s on one thread.
- float32 attention is the more exact: its result is within 1e-6 of float64's, bf16's within 2e-2.
Forwards without grad (generation, the reference's and the old log-probs' forwards) run sdpa unchanged, so their
numbers are as before bit for bit, and so is every float32 run. The choice is per call and per thread (grad mode and
autocast are thread-local), so a reference forward in a thread beside the learner's keeps sdpa.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

NAME = "sdpa_trains_f32"
SHORT_KEYS = 256  # the longest key length attended in float32 (see the module docstring)
HALF = (torch.bfloat16, torch.float16)
_said: list = []  # the one-time log line, once said in this process


def trains_in_f32(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether this attention call runs in float32: grad on, CPU, half precision, keys at most SHORT_KEYS."""
    if not torch.is_grad_enabled() or query.device.type != "cpu" or key.shape[-2] > SHORT_KEYS:
        return False
    return query.dtype in HALF or (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") in HALF)


def sdpa_trains_f32(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not trains_in_f32(query, key):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if not _said:
        _said.append(True)
        log.info("attention: forwards that train in %s on the CPU attend in float32 over keys of up to %d tokens "
                 "(sdpa's bf16 backward is ~3x slower there; transformers' sdpa everywhere else)",
                 str(query.dtype if query.dtype in HALF else torch.get_autocast_dtype("cpu")).removeprefix("torch."),
                 SHORT_KEYS)
    with torch.autocast("cpu", enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                              **kwargs)
    return out.to(query.dtype), weights


def register() -> None:
    """Make NAME known to transformers in this process (a spawned generator unpickles a model that names it)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, sdpa_trains_f32)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks sdpa gets, as sdpa is what runs


def use_for_training(model):
    """Switch a model on transformers' default `sdpa` to `sdpa_trains_f32` (other choices are left as they are)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) == "sdpa":
        register()
        model.set_attn_implementation(NAME)
    return model


def is_sdpa(config) -> bool:
    """Whether a model's attention is sdpa in every forward without grad: `sdpa` or `sdpa_trains_f32`."""
    return getattr(config, "_attn_implementation", None) in ("sdpa", NAME)
