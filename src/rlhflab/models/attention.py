"""Attention for the forwards that train, on the CPU under bf16/fp16: eager attention over short keys.

Every model rlhflab loads with transformers' default attention (`sdpa`) is switched to `sdpa_trains_eager`
(`use_for_training`), an entry in transformers' AttentionInterface that is sdpa itself everywhere but in one case: a
forward with grad on, on the CPU, in half precision (bf16/fp16 autocast, `trainer.precision=bf16-mixed`, or half
weights), over keys at most SHORT_KEYS long. There it attends as transformers' `eager` attention does under autocast
(`eager_half`): the scores q k^T as a half matmul, softmax in float32, its weights rounded to half and multiplied by
v, each product in the half dtype; autograd's backward of those matmuls. PyTorch's CPU flash kernel, which sdpa runs
there, has a backward ~11x its forward at short lengths (56.9 against 4.9 ms a layer in a 113M step). Measured on this
repo's machine (torch 2.13, Intel Xeon with AMX, one thread, `benchmarks/attention_train.py`), forward and backward
of 12 heads of 64 over ~1,400 tokens: 3.10x bf16 sdpa's speed at 44 keys (24.2 against 74.8 ms), 1.27x at 96, 1.01x
at 128, 0.50x at 192, hence the bound. The product is farther from float64's than bf16 sdpa's (relative 2.5e-3
against 1.6e-3 at 44 keys: the scores rounded to bf16, as transformers' eager attention rounds them), the query's
gradient about as far (3.7e-3 against 3.2e-3). Through the 113M model's forward and backward under bf16 autocast (32
x 44 tokens): 1.24x (2.36 against 2.92 s), its gradient as far from float32's as sdpa's (1.46e-2 both;
`benchmarks/attention_train.md`). On an AMD EPYC without AMX (AVX-512's bf16 dot products) the same: 3.55x at 44 keys,
1.27x at 96, 1.32x at 128, 0.79x at 192, and 1.10x the 113M SFT policy's forward and backward (5.44 against 5.97 s;
`benchmarks/attention_train_epyc.md`). What it keeps for the backward beyond sdpa: the softmax's weights in float32 and
bf16, 6 bytes a score (4.5 MB a layer there).

Forwards without grad (generation, the reference's and the old log-probs' forwards) run sdpa unchanged, so their
numbers are as before bit for bit, and so is every float32 run. `train_attention=sdpa` (the root config) runs sdpa in
every forward. The choice is per call and per thread (grad mode and
autocast are thread-local), so a reference forward in a thread beside the learner's keeps sdpa.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

NAME = "sdpa_trains_eager"
SHORT_KEYS = 96  # the longest key length attended eagerly (see the module docstring)
HALF = (torch.bfloat16, torch.float16)
_said: list = []  # the one-time log line, once said in this process
_mode = ["eager"]  # the run's `train_attention` (configure): "sdpa" turns the eager path off


def configure(mode: str) -> None:
    """The run's `train_attention`: "eager" (the default) or "sdpa" (transformers' sdpa in every forward)."""
    _mode[0] = mode


def trains_eager(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether this attention call runs eagerly: `train_attention=eager`, grad on, CPU, half precision, keys at most
    SHORT_KEYS."""
    if _mode[0] != "eager" or not torch.is_grad_enabled() or query.device.type != "cpu" or key.shape[-2] > SHORT_KEYS:
        return False
    return query.dtype in HALF or (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") in HALF)


def sdpa_trains_eager(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if not trains_eager(query, key) or kwargs.get("dropout", 0.0) or set(kwargs) & ODD_KWARGS:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    half = query.dtype if query.dtype in HALF else torch.get_autocast_dtype("cpu")
    if not _said:
        _said.append(True)
        log.info("attention: forwards that train in %s on the CPU attend eagerly over keys of up to %d tokens "
                 "(sdpa's backward is ~3x slower there; transformers' sdpa everywhere else)",
                 str(half).removeprefix("torch."), SHORT_KEYS)
    groups = getattr(module, "num_key_value_groups", 1)  # transformers' own repeat, as its sdpa and eager do
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    is_causal = kwargs.get("is_causal")
    is_causal = query.shape[2] > 1 and attention_mask is None and (
        is_causal if is_causal is not None else getattr(module, "is_causal", True))
    out = eager_half(query, key, value, attention_mask, is_causal, kwargs.get("scaling"), half)
    return out.transpose(1, 2).contiguous(), None


# What sdpa_trains_eager leaves to transformers' sdpa: a paged cache, T5's position bias, a soft cap, attention weights.
ODD_KWARGS = {"cache", "position_bias", "softcap", "output_attentions"}


def eager_half(query, key, value, mask, is_causal: bool, scale, half) -> torch.Tensor:
    """Attention over query, key and value (rows, heads, length, dim; as many key/value heads as query heads) rounded
    to `half`, as transformers' eager attention computes it under autocast: the scores q k^T * scale a half product,
    softmax in float32, its weights rounded to half, times v in half. `mask`: sdpa's (True: attend) or an additive
    one; `is_causal` without one. A row with every key masked (a padded position) gets zero weights, not NaN, which
    the backward would spread."""
    q, k, v = query.to(half), key.to(half), value.to(half)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    with torch.autocast("cpu", enabled=False):
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if is_causal:
            length, keys = q.shape[-2], k.shape[-2]
            mask = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril(keys - length)
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        elif mask is not None:
            scores = scores + mask.to(half)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).nan_to_num(0.0).to(half)
        return torch.matmul(weights, v)


def register() -> None:
    """Make NAME known to transformers in this process (a spawned generator unpickles a model that names it)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, sdpa_trains_eager)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks sdpa gets, as sdpa is what runs


def use_for_training(model):
    """Switch a model on transformers' default `sdpa` to `sdpa_trains_eager` (other choices are left as they are)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) == "sdpa":
        register()
        model.set_attn_implementation(NAME)
    return model


def is_sdpa(config) -> bool:
    """Whether a model's attention is sdpa in every forward without grad: `sdpa` or `sdpa_trains_eager`."""
    return getattr(config, "_attn_implementation", None) in ("sdpa", NAME)
