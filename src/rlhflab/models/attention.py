"""Attention for the forwards that train, on the CPU under bf16/fp16: float32 sdpa over short keys.

Every model rlhflab loads with transformers' default attention (`sdpa`) is switched to `sdpa_trains_f32`
(`use_for_training`), an entry in transformers' AttentionInterface that is sdpa itself everywhere but in one case: a
forward with grad on, on the CPU, in half precision (bf16/fp16 autocast, `trainer.precision=bf16-mixed`, or half
weights), over keys at most SHORT_KEYS long. There it rounds query, key and value to the half dtype as autocast
would, runs PyTorch's CPU flash attention on them in float32, and rounds the product to the half dtype as autocast's
sdpa returns it (`f32_between`): the same roundings, float32 arithmetic between them in place of the same kernel in
bf16, whose backward is slow at short lengths. The backward keeps the same half tensors half sdpa keeps. Measured on
this repo's machine (torch 2.13, Intel Xeon with AMX, one thread, `benchmarks/attention_train.py`), forward and
backward of 12 heads of 64 over ~1,400 tokens: 1.88x bf16 sdpa's speed at 44 keys (40.9 against 76.8 ms), 1.26x at
128, 1.34x at 160, 0.87x at 192 and 0.72x at 512, hence the bound; the product no farther from float64's than bf16
sdpa's. Through the 113M model's forward and backward under bf16 autocast (32 x 44 tokens): 1.21x (2.64 against 3.20
s), with the same memory held for the backward (`benchmarks/attention_train.md`).

Forwards without grad (generation, the reference's and the old log-probs' forwards) run sdpa unchanged, so their
numbers are as before bit for bit, and so is every float32 run. The choice is per call and per thread (grad mode and
autocast are thread-local), so a reference forward in a thread beside the learner's keeps sdpa.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

NAME = "sdpa_trains_f32"
SHORT_KEYS = 160  # the longest key length attended in float32 (see the module docstring)
HALF = (torch.bfloat16, torch.float16)
_said: list = []  # the one-time log line, once said in this process


def trains_in_f32(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether this attention call runs in float32: grad on, CPU, half precision, keys at most SHORT_KEYS."""
    if not torch.is_grad_enabled() or query.device.type != "cpu" or key.shape[-2] > SHORT_KEYS:
        return False
    return query.dtype in HALF or (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") in HALF)


def sdpa_trains_f32(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not trains_in_f32(query, key) or kwargs.get("dropout", 0.0) or set(kwargs) & ODD_KWARGS:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    half = query.dtype if query.dtype in HALF else torch.get_autocast_dtype("cpu")
    if not _said:
        _said.append(True)
        log.info("attention: forwards that train in %s on the CPU attend in float32 over keys of up to %d tokens "
                 "(sdpa's bf16 backward is ~3x slower there; transformers' sdpa everywhere else)",
                 str(half).removeprefix("torch."), SHORT_KEYS)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:  # as transformers' sdpa with a mask: the key/value heads repeated
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    is_causal = kwargs.get("is_causal")
    is_causal = query.shape[2] > 1 and attention_mask is None and (
        is_causal if is_causal is not None else getattr(module, "is_causal", True))
    out = f32_between(query, key, value, attention_mask, is_causal, kwargs.get("scaling"), half)
    return out.transpose(1, 2).contiguous(), None


# What sdpa_trains_f32 leaves to transformers' sdpa: a paged cache, T5's position bias, a soft cap, attention weights.
ODD_KWARGS = {"cache", "position_bias", "softcap", "output_attentions"}


class _F32Between(torch.autograd.Function):
    """The CPU flash kernel (the one sdpa picks on the CPU) on float32 copies of half inputs; its product and what
    the backward keeps in the half dtype, as half sdpa keeps them."""

    @staticmethod
    def forward(ctx, query, key, value, mask, is_causal, scale, half):
        q, k, v = query.to(half), key.to(half), value.to(half)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.float(), k.float(), v.float(), 0.0, is_causal, attn_mask=mask, scale=scale)
        out = out.to(half)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.is_causal, ctx.scale, ctx.dtypes = is_causal, scale, (query.dtype, key.dtype, value.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, mask = ctx.saved_tensors
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.float(), q.float(), k.float(), v.float(), out.float(), lse, 0.0, ctx.is_causal, attn_mask=mask,
            scale=ctx.scale)
        return *(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)), None, None, None, None


def f32_between(query, key, value, mask, is_causal: bool, scale, half) -> torch.Tensor:
    """Attention over query, key and value (rows, heads, length, dim; as many key/value heads as query heads) rounded
    to `half`, in float32, its product rounded to `half`: autocast's roundings of sdpa's inputs and output, float32
    arithmetic between them. The backward keeps the half inputs and product (float32 copies cost +125 MB at 113M, 32
    x 44 tokens, and put the async side's peak RSS above TRL's) and reads them back as float32. A boolean mask
    (True: attend) becomes sdpa's own additive one."""
    if mask is not None and mask.dtype == torch.bool:  # as sdpa converts it, at each layer
        mask = torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))
    elif mask is not None:
        mask = mask.float()
    with torch.autocast("cpu", enabled=False):
        return _F32Between.apply(query, key, value, mask, is_causal, scale, half)


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
