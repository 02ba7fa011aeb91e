"""Lean loops for plain Llama models on the CPU: `generate()`'s tokens and the HF forward's numbers, sooner.

On a small model every op's dispatch, not its arithmetic, sets the time, and Hugging Face adds work of its own per
call: the model's forward builds a causal mask, computes the rotary angles, wraps its outputs and goes through
several decorators; `generate()` also grows a `DynamicCache` by concatenation at every token and runs its logits
processors and stopping criteria. The two functions here run the same modules' weights through the same ops in the
same order (transformers' RMSNorm, SiLU and embedding modules' ops inline, without a module call each; rotate_half
as one roll against a sin with its first half negated), so they compute the same floats:
- `lean_generate` samples (`generator.decode=auto`): a key/value cache allocated once per call, the rotary angles of
  every position computed once, each token drawn from the same probabilities as `torch.multinomial` draws it
  (`_draw`: its algorithm without its per-token checks, 0.98x the loop's time), so from the same torch seed it
  returns generate()'s tokens and the log-probs `BehaviourLogprobs` records. `lean_generate_split` shares the rows
  with the reference's forked process (mode.split_generation), the same tokens and log-probs. On vs_trl's tiny
  policy, 64 rows x 9 tokens took 10.4 against 15.7 ms, 128 rows 16.6 against 21.3 ms (benchmarks/generation.md).
  A prompt's k samples share one prefill forward (`_prefill`): 0.90x / 0.80x the loop's time at k = 2 / 4 on that
  policy, 0.87x for 32 rows x 32 tokens of the 113M model (k = 4), the same tokens and log-probs.
- `lean_forward` is the learner's forward over prompt + response (`MemoryStrategy._forward`: the policy's, with
  grad, and the reference's): HF's logits and gradients bit for bit, without ~0.8 ms of overhead a call on the tiny
  policy, which in sync mode also holds the GIL the reference's thread needs. A Llama sequence classifier (a reward
  model: its score at each row's last real token) and token classifier (a value model) go the same way, as do the
  stages' forwards (`forward_logits`, `lm_loss_of`, `models.heads.trunk`).
- `prompt_once_logits` is its log-prob forward with each distinct prompt's positions run once for its k samples
  (rl.prompt_once, the default): fewer products, not HF's floats bit for bit (within 2e-6 in float32), and under
  autocast too.
tests/test_lean_decode.py checks both against Hugging Face.

They run only what they reproduce (`lean_unsupported` says why not): a `LlamaForCausalLM` (or, for `lean_forward`, a
`LlamaForSequenceClassification` or `LlamaForTokenClassification`) whose projections are plain `nn.Linear` (no LoRA or
quantised layers) and whose modules carry no hooks (FSDP, accelerate), with sdpa attention, no attention dropout in
training, no activation checkpointing and a rotary embedding whose angles do not depend on the sequence length, on
the CPU and outside autocast. Anything else goes through Hugging Face.
"""

from __future__ import annotations

import time
import weakref
from functools import cache

import torch
import torch.nn.functional as F

from rlhflab.models.attention import is_sdpa

# Rotary types whose inverse frequencies are fixed when the model is built (transformers' "dynamic" and
# "longrope" rescale them with the sequence length at each forward).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")

_VERDICT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (its modules' ids, reason or None)


def _structure_unsupported(model) -> str | None:
    from transformers.models.llama import modeling_llama as llama

    if type(model) not in (llama.LlamaForCausalLM, llama.LlamaForSequenceClassification, llama.LlamaForTokenClassification):
        return f"the model is a {type(model).__name__}, not a plain LlamaForCausalLM (or Llama sequence or token classifier)"
    if not is_sdpa(model.config):
        return f"attn_implementation={model.config._attn_implementation!r} (the lean loops reproduce sdpa's)"
    rope = model.model.rotary_emb.rope_type
    if rope not in STATIC_ROPE:
        return f"rope_type={rope!r} rescales its angles with the sequence length"
    linears = [_head(model)]
    for layer in model.model.layers:
        if type(layer) is not llama.LlamaDecoderLayer or type(layer.self_attn) is not llama.LlamaAttention \
                or type(layer.mlp) is not llama.LlamaMLP:
            return f"layer {type(layer).__name__} is not transformers' own Llama layer"
        attn, mlp = layer.self_attn, layer.mlp
        linears += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    odd = next((m for m in linears if type(m) is not torch.nn.Linear), None)
    if odd is not None:
        return f"a projection is a {type(odd).__name__} (LoRA or quantised), not a plain nn.Linear"
    if type(model.model.embed_tokens) is not torch.nn.Embedding:
        return f"the embedding is a {type(model.model.embed_tokens).__name__}"
    return None


def _kind(model) -> str:
    """Which of the heads `_structure_unsupported` admits reads the final hidden states: "causal" (an LM head),
    "token" (a token classifier's score at every position, after its dropout module) or "sequence" (a sequence
    classifier's score, read at each row's rightmost real token)."""
    if hasattr(model, "lm_head"):
        return "causal"
    return "token" if hasattr(model, "dropout") else "sequence"


def _head(model) -> torch.nn.Module:
    return model.lm_head if _kind(model) == "causal" else model.score


def last_token_index(input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """(n, T) -> (n,) position of the rightmost non-pad token (HF sequence classifiers score the same one)."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    return (positions * (input_ids != pad_token_id)).argmax(-1)


def _submodules(model) -> list:
    """`model.modules()`'s modules, each once, without the names it builds (17 of lean_unsupported's 37 us a call on
    the tiny policy, which each log-prob forward and sampling call runs)."""
    found, seen = [model], {id(model)}
    for module in found:  # grows as it is read: each module's children after it
        for child in module._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                found.append(child)
    return found


def lean_unsupported(model, autocast_ok: bool = False, sampling: bool = False) -> str | None:
    """Why the lean loops cannot reproduce Hugging Face on this model now (None when they can). The model's
    structure is judged once (again if its modules change, e.g. wrapped by LoRA); the device, autocast,
    checkpointing, dropout and hooks at each call. autocast_ok: a forward that runs under autocast too
    (`prompt_once_logits`: its ops are those transformers runs, each cast as autocast casts it). sampling: the decode
    loop, which samples as generate() does in eval mode, whatever the model's mode (no attention dropout)."""
    modules = _submodules(model)
    ids = tuple(map(id, modules))
    known = _VERDICT.get(model)
    if known is None or known[0] != ids:
        known = (ids, _structure_unsupported(model))
        _VERDICT[model] = known
    if known[1] is not None:
        return known[1]
    device = model.model.embed_tokens.weight.device
    if device.type != "cpu":
        return f"the model is on {device} (the lean loops are measured and tested on the CPU only)"
    if torch.is_autocast_enabled("cpu") and not autocast_ok:
        return "autocast is on (measured through HF only; its generate() casts each weight once per call there)"
    if any(getattr(layer, "gradient_checkpointing", False) for layer in model.model.layers):
        return "activation checkpointing is on (HF's decoder layers apply it)"
    if not sampling and any(layer.self_attn.training and layer.self_attn.attention_dropout for layer in model.model.layers):
        return "attention dropout is on (HF's attention applies it in training)"
    for m in modules:
        if m._forward_hooks or m._forward_pre_hooks:
            return f"a {type(m).__name__} has forward hooks (FSDP, accelerate or another wrapper)"
        if type(m) in _WEIGHTS_READ and not _own_forward(m):
            return f"a {type(m).__name__}'s forward was replaced on the instance (the lean loops read its weights)"
    return None


# The modules whose weights the loops read without calling the module (F.linear, F.embedding): one whose forward
# was replaced (a kernel hub's kernelize()) goes through Hugging Face; a norm or activation so replaced is called.
_WEIGHTS_READ = (torch.nn.Linear, torch.nn.Embedding)


def _angles(rotary, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' LlamaRotaryEmbedding.forward for (rows, length) positions -> cos and a signed sin, each
    (rows, 1, length, head): sin with its first half negated, so that `_rope` reads rotate_half(x) * sin as
    x.roll(half) * signed sin (-a * b and a * -b are the same float), one op for rotate_half's four."""
    freqs = positions[..., None].float() * rotary.inv_freq.float()
    angles = torch.cat((freqs, freqs), dim=-1)
    sin = (angles.sin() * rotary.attention_scaling).to(dtype)
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return (angles.cos() * rotary.attention_scaling).to(dtype)[:, None], signed[:, None]


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' x * cos + rotate_half(x) * sin: rotate_half(x) = cat(-x2, x1), and x.roll(half) = cat(x2, x1)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


@cache
def _inlined() -> tuple[type, tuple[type, ...]]:
    """(transformers' LlamaRMSNorm, the SiLU module types whose forward is F.silu): modules run inline."""
    from transformers import activations
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm, tuple(t for t in (torch.nn.SiLU, getattr(activations, "SiLUActivation", None)) if t is not None)


def _own_forward(module) -> bool:
    """The module runs its class's forward (no forward set on the instance, e.g. by a kernel hub's kernelize())."""
    return "forward" not in module.__dict__


def _norm(norm, x: torch.Tensor) -> torch.Tensor:
    """norm(x): LlamaRMSNorm.forward's ops inline (a module call costs as much as one of its small ops on the
    tiny policy); any other norm through its module. In float32 without grad (sampling, the reference's forward),
    torch's own `rms_norm`, one op in C++ for the four: the same floats as those ops, bit for bit, gradients too,
    at every width and CPU capability tried (AVX-512, AVX2, none; widths 16-4096; one and two threads), 11.4
    against 15.8 us for the decode loop's 64 rows of width 64 (30.1 against 36.9 for 768 rows). With grad its
    backward is slower (forward and backward 273 against 224 us for 768 rows), and half precision differs (its
    cast of the normed states before the weight's product is not transformers'): both go through the ops."""
    if type(norm) is not _inlined()[0] or not _own_forward(norm):
        return norm(x)
    if x.dtype is torch.float32 and norm.weight.dtype is torch.float32 and not (
            torch.is_grad_enabled() and (x.requires_grad or norm.weight.requires_grad)):
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(dtype)


def _act(act, x: torch.Tensor) -> torch.Tensor:
    """The MLP's activation: F.silu inline for transformers' SiLU modules, any other through its module."""
    return F.silu(x) if type(act) in _inlined()[1] and _own_forward(act) else act(x)


def _embed(embedding: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """nn.Embedding.forward's call inline (lean_unsupported made sure it is a plain nn.Embedding with its own forward)."""
    e = embedding
    return F.embedding(ids, e.weight, e.padding_idx, e.max_norm, e.norm_type, e.scale_grad_by_freq, e.sparse)


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x.view(*x.shape[:2], -1, head_dim).transpose(1, 2)


def _attention(attn, h, cos, sin, mask, cache, start: int) -> torch.Tensor:
    """LlamaAttention.forward with sdpa, as transformers runs it (its own function, as there: q, k and v are freed
    before the MLP runs)."""
    rows, length = h.shape[:2]
    q = _heads(F.linear(h, attn.q_proj.weight, attn.q_proj.bias), attn.head_dim)
    k = _heads(F.linear(h, attn.k_proj.weight, attn.k_proj.bias), attn.head_dim)
    v = _heads(F.linear(h, attn.v_proj.weight, attn.v_proj.bias), attn.head_dim)
    q = _rope(q, cos, sin)
    k = _rope(k, cos, sin)
    if cache is not None:
        end = start + length
        cache[0][:, :, start:end] = k
        cache[1][:, :, start:end] = v
        k, v = cache[0][:, :, :end], cache[1][:, :, :end]
    groups = q.shape[1] // k.shape[1]
    gqa = {}
    if groups > 1:  # as transformers' sdpa_attention_forward: sdpa's own GQA without a mask, else repeated heads
        if mask is None or length == 1:
            gqa = {"enable_gqa": True}
        else:
            k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and length > 1,
                                       scale=attn.scaling, **gqa)
    return F.linear(o.transpose(1, 2).reshape(rows, length, -1), attn.o_proj.weight, attn.o_proj.bias)


def _mlp(mlp, h: torch.Tensor) -> torch.Tensor:
    gate = F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)
    up = F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
    return F.linear(_act(mlp.act_fn, gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)


def _layer(layer, x, cos, sin, mask, cache=None, start: int = 0) -> torch.Tensor:
    """One LlamaDecoderLayer.forward with sdpa attention. `mask`: a boolean (rows, 1, L, S) mask, or None for plain
    causal attention; `cache`: (keys, values) buffers whose slots start.. take this call's."""
    x = x + _attention(layer.self_attn, _norm(layer.input_layernorm, x), cos, sin, mask, cache, start)
    return x + _mlp(layer.mlp, _norm(layer.post_attention_layernorm, x))


def lean_hidden(core, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """A LlamaModel's `last_hidden_state` (`core(input_ids, attention_mask, position_ids, use_cache=False)`), the same
    floats and gradients: a causal mask with the padding's columns masked, or none (plain causal attention) when
    nothing is padded, as transformers decides; position_ids None: 0.. on every row, as there."""
    length = input_ids.shape[1]
    x = _embed(core.embed_tokens, input_ids)
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device)[None]
    cos, sin = _angles(core.rotary_emb, position_ids, x.dtype)
    mask = None
    if not bool(attention_mask.all()):
        causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
        mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
    for layer in core.layers:
        x = _layer(layer, x, cos, sin, mask)
    return _norm(core.norm, x)


def lean_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None,
                 logits_to_keep: int = 0) -> torch.Tensor:
    """`model(input_ids, attention_mask, position_ids, use_cache=False, logits_to_keep=...).logits`, the same floats
    and gradients (`lean_hidden`, then the head as transformers applies it): a causal LM's LM head over the last
    logits_to_keep positions (0: all); a sequence classifier's score at each row's rightmost token that is not
    padding (every position's, then that one read, as there); a token classifier's score at every position after its
    dropout module."""
    x = lean_hidden(model.model, input_ids, attention_mask, position_ids)
    kind, head = _kind(model), _head(model)
    if kind == "causal":
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return F.linear(x, head.weight, head.bias)
    if kind == "token":
        return F.linear(model.dropout(x), head.weight, head.bias)
    logits = F.linear(x, head.weight, head.bias)
    pad = model.config.get_text_config().pad_token_id
    if pad is None:
        if len(input_ids) != 1:
            raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")  # HF's own refusal
        return logits[:, -1]
    return logits[torch.arange(len(input_ids), device=input_ids.device), last_token_index(input_ids, pad)]


def forward_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, **kwargs) -> torch.Tensor:
    """`model(input_ids=..., attention_mask=..., **kwargs).logits`: through `lean_forward` where it reproduces them."""
    if set(kwargs) <= {"position_ids", "logits_to_keep"} and lean_unsupported(model) is None:
        return lean_forward(model, input_ids, attention_mask, **kwargs)
    return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs).logits


def lm_loss_of(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
    """`model(input_ids=..., attention_mask=..., labels=..., **kwargs).loss` of a causal LM: `lean_forward`'s logits
    and the model's own loss function where the lean forward reproduces them (stage sft's forward)."""
    if lean_unsupported(model) is None:
        logits = lean_forward(model, input_ids, attention_mask)
        return model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size, **kwargs)
    return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs).loss


# prompt_once_logits without grad: at least this many multiply-adds saved (prompt positions not run x the layers'
# weights), or one forward over every row. Its extra ops (two attentions a layer, the prompts' keys gathered to each
# row) cost ~0.3 ms; since its keys are padded to whole vector blocks (`padded_keys`) the forward over every row (whose
# 14 keys are not) costs more too. On vs_trl's tiny policy (2 layers of width 64, 6-token prompts, 9 tokens, the AMD
# EPYC host, medians of 400 interleaved pairs without grad): 32 prompts at k = 4 (47M multiply-adds saved) 0.77x the
# time, at k = 2 (16M) 0.96x, 16 prompts at k = 2 (8M) 1.065x; on the 113M preset (~5G saved at k = 2) 0.93x in bf16.
# Whether a forward takes it depends on its rows, and its rows' floats on the rows packed beside them: so
# mode.reference=balance, which splits a batch's reference rows where timings say, runs every row's own forward
# instead (`MemoryStrategy.split_reference`; at 10^7 before that its splits moved log-probs by ~2.4e-7, and this
# threshold was 10^9 from e646367 to 6d4102d).
NO_GRAD_MIN_WORK = 10**7


@cache
def kv_block() -> int:
    """The keys CPU sdpa runs at vector speed come in multiples of this (float32 lanes of ATen's vector ISA: 16 with
    AVX-512, 8 with AVX2; 1, no padding, elsewhere): its flash-attention kernel runs the other keys of a row one by
    one. On the AMD EPYC host (AVX-512), 64 rows x 4 heads of width 16, 10 queries, float32: 14 keys 929 us, 15 keys
    1,001, 16 keys 341, 17 keys 446; with ATEN_CPU_CAPABILITY=avx2 the steps came at 8, 16, 24 keys."""
    return {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability(), 1)


def padded_keys(keys: int) -> int:
    """Masked key columns to add to `keys` for CPU sdpa (`kv_block`): those up to the next multiple of the block,
    where the keys past the last one are at least a quarter of it (a tail of 1-3 keys of 16 cost less than the
    whole block: 64 x 4 x 16, 17 keys 446 against 32 keys 458 us; 16 x 12 x 64, 33 keys 1,713 against 48 keys 1,995,
    37 keys 2,211)."""
    block = kv_block()
    tail = keys % block
    return block - tail if tail and (keys < block or tail >= block // 4) else 0


def _layer_weights(config) -> int:
    """The decoder layers' linear weights (a Llama's projections and MLP), from its config."""
    hidden = config.hidden_size
    head = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    attention = 2 * hidden * head * (config.num_attention_heads + config.num_key_value_heads)  # q, o; k, v
    return config.num_hidden_layers * (attention + 3 * hidden * config.intermediate_size)


def prompt_once_logits(model, query: torch.Tensor, response: torch.Tensor, pad: int) -> torch.Tensor | None:
    """`prompt_once_hidden` through the LM head: the logits at the prompt's last position and at each of `response`'s
    (n, R + 1, V; `_forward(..., logits_to_keep=R + 1)`'s), or None where it gives none."""
    hidden = prompt_once_hidden(model, query, response, pad)
    return None if hidden is None else F.linear(hidden, model.lm_head.weight, model.lm_head.bias)


def prompt_once_scores(model, query: torch.Tensor, response: torch.Tensor, pad: int) -> torch.Tensor | None:
    """A reward model's (a Llama sequence classifier's) scores of prompt + response (n, 1; `_forward`'s) from
    `prompt_once_hidden`: its score head at each row's rightmost token that is not padding, as Hugging Face reads it
    (the prompt's last position where the response is all padding). None where it gives none."""
    if _kind(model) != "sequence":
        return None
    hidden = prompt_once_hidden(model, query, response, pad)
    if hidden is None:
        return None
    last = last_token_index(torch.cat([query[:, -1:], response], 1), pad)  # the hidden states' positions
    return F.linear(hidden[torch.arange(len(hidden), device=hidden.device), last], model.score.weight, model.score.bias)


def prompt_once_values(model, query: torch.Tensor, response: torch.Tensor, pad: int) -> torch.Tensor | None:
    """A value model's (a Llama token classifier's) outputs at the prompt's last position and at each of `response`'s
    (n, R + 1, 1: `_forward`'s from position P - 1 on, which `MemoryStrategy._values` reads) from `prompt_once_hidden`,
    through its dropout module and score head as `lean_forward` runs them. None where it gives none."""
    if _kind(model) != "token":
        return None
    hidden = prompt_once_hidden(model, query, response, pad)
    return None if hidden is None else F.linear(model.dropout(hidden), model.score.weight, model.score.bias)


def prompt_once_hidden(model, query: torch.Tensor, response: torch.Tensor, pad: int) -> torch.Tensor | None:
    """The final hidden states at the prompt's last position and at each of `response`'s (n, R + 1, H: what the head
    of `_forward(..., logits_to_keep=R + 1)` reads), with each distinct prompt's positions run once for all of its rows
    (`rl.prompt_once`): a prompt's k samples share its keys and values, as `_prefill` shares them in sampling, and
    the gradients of its k samples meet there. None when no two rows share a prompt, or `response` is empty (a
    one-token completion: `MemoryStrategy._logprobs` passes every response token but the last, `read_before`).

    The same positions, masks, rotary angles and ops as `lean_forward` over `join`'s rows, attention as the model's
    own (`sdpa_trains_eager`: eager in half precision with grad, sdpa elsewhere), so the same function; not its
    floats bit for bit, for the products run over other shapes (within ~2e-6 of them in float32:
    tests/test_lean_decode.py). Fewer FLOPs where the prompt is a real share of a row: at k = 4, P prompt
    positions of n rows become P of n / 4."""
    from rlhflab.models.attention import HALF, NAME, eager_half, trains_eager

    if response.shape[1] == 0:
        return None
    per_row = query.shape[1] * _layer_weights(model.config)  # multiply-adds of one row's prompt positions
    if not torch.is_grad_enabled() and (len(query) - 1) * per_row < NO_GRAD_MIN_WORK:
        return None  # under the threshold even if every row shared one prompt: no need to find the prompts
    # one sample per prompt (PPO's default) repeats none: a key per row says so first (equal rows give equal keys,
    # int64's wrap-around included), ~40 us where finding the prompts below took ~250 for 32 rows of 6 tokens
    keys = (query * torch.full(query.shape[1:], 1_000_003, device=query.device).cumprod(0)).sum(1)
    if len(keys.unique()) == len(query):
        return None
    # a prompt's k samples are neighbours (repeat_prompts) unless rl.length_buckets put them apart: sorting finds
    # them then (torch.unique; unique_consecutive's ~200 us a call is more than comparing neighbours on a small policy)
    starts = torch.ones(len(query), dtype=torch.bool, device=query.device)
    starts[1:] = (query[1:] != query[:-1]).any(1)
    inverse = starts.cumsum(0) - 1
    prompts = query[starts]
    if len(prompts) == len(query):
        prompts, inverse = torch.unique(query, dim=0, return_inverse=True)
        if len(prompts) == len(query):
            return None
    core = model.model
    if not torch.is_grad_enabled() and (len(query) - len(prompts)) * per_row < NO_GRAD_MIN_WORK:
        return None  # a small policy's forward without grad: its extra ops cost more than the products they save
    (u, width), (n, length) = prompts.shape, response.shape
    head_dim = core.layers[0].self_attn.head_dim
    keep = prompts != pad
    # join()'s positions: counted from a row's first real token, its left padding at 0
    positions = (keep.long().cumsum(1) - 1).clamp(min=0)
    after = keep.sum(1, keepdim=True)[inverse] + torch.arange(length, device=query.device)
    x = _embed(core.embed_tokens, torch.cat([prompts.reshape(-1), response.reshape(-1)]))
    # every packed row's angles (rows, 1, head): the rotary embedding applied before the rows split into heads
    cos, sin = (t.squeeze(1).reshape(-1, 1, head_dim) for t in _angles(
        core.rotary_emb, torch.cat([positions.reshape(1, -1), after.reshape(1, -1)], 1), x.dtype))
    causal = torch.ones(width, width, dtype=torch.bool, device=query.device).tril()
    mask_p = None if bool(keep.all()) else causal[None, None] & keep[:, None, None, :]
    # a response position attends to its prompt's real tokens and to the response up to itself
    mask_r = torch.cat([keep[inverse][:, None, None, :].expand(n, 1, length, width),
                        torch.ones(length, length, dtype=torch.bool, device=query.device).tril().expand(n, 1, -1, -1)], -1)
    eager = model.config._attn_implementation == NAME
    split = u * width
    # sdpa's keys padded with masked-out zero columns to whole vector blocks (`padded_keys`): the same attention,
    # in float32 within ~6e-7 of the unpadded call's (another code path in the kernel), ~2.4x faster for the
    # response rows' 14 keys of the tiny policy. Zeros: a masked key's weight is exactly 0, and 0 x 0 is no NaN.
    padded = {w: F.pad(causal[None, None] if m is None else m, (0, padded_keys(w)), value=False)
              for w, m in ((width, mask_p), (width + length, mask_r)) if padded_keys(w)}

    def attend(attn, q, k, v, mask):
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
        if eager and trains_eager(q, k):
            half = q.dtype if q.dtype in HALF else torch.get_autocast_dtype("cpu")  # as sdpa_trains_eager's
            return eager_half(q, k, v, mask, mask is None, attn.scaling, half)
        if k.shape[2] in padded:
            mask = padded[k.shape[2]]
            k, v = (F.pad(t, (0, 0, 0, mask.shape[-1] - t.shape[2])) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=attn.scaling)

    def heads(t, rows, positions):
        return t.view(rows, positions, -1, head_dim).transpose(1, 2)

    for layer in core.layers:
        attn = layer.self_attn
        h = _norm(layer.input_layernorm, x)
        q, k, v = (F.linear(h, p.weight, p.bias).view(len(h), -1, head_dim) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        q_p, k_p, v_p = (heads(t[:split], u, width) for t in (q, k, v))
        q_r, k_r, v_r = (heads(t[split:], n, length) for t in (q, k, v))
        o_p = attend(attn, q_p, k_p, v_p, mask_p)
        o_r = attend(attn, q_r, torch.cat([k_p[inverse], k_r], 2), torch.cat([v_p[inverse], v_r], 2), mask_r)
        o = torch.cat([o_p.transpose(1, 2).reshape(split, -1), o_r.transpose(1, 2).reshape(n * length, -1)])
        x = x + F.linear(o, attn.o_proj.weight, attn.o_proj.bias)
        x = x + _mlp(layer.mlp, _norm(layer.post_attention_layernorm, x))
    last = x[:split].view(u, width, -1)[:, -1][inverse]
    x = torch.cat([last[:, None], x[split:].view(n, length, -1)], 1)
    return _norm(core.norm, x)


def lean_generate(model, query: torch.Tensor, pad: int, eos: int, max_new_tokens: int, temperature: float | None):
    """(response (n, R), log-probs (n, R) or None) for left-padded `query`, as `HFGenerator._generate` returns
    them: sampled at `temperature` (None: greedy, no log-probs), a row's tokens after its EOS are `pad`, and R is
    the longest completion (the loop stops once every row has ended).

    The loop runs under inference mode, whose ops skip autograd's bookkeeping (version counters, view tracking):
    the same tokens and log-probs as under no_grad in 0.89x / 0.92x / 0.93x the time for 32 / 64 / 128 rows of up to
    9 tokens of vs_trl's tiny policy (per-pair medians of 150 interleaved calls, 1 thread). What it returns is
    cloned out of it: inference tensors could not be modified in place or saved for backward later."""
    with torch.inference_mode():
        response, logprobs = _sample(model, query, pad, eos, max_new_tokens, temperature)
    return _checked(response.clone(), None if logprobs is None else logprobs.clone())


def _checked(response: torch.Tensor, logprobs: torch.Tensor | None):
    """torch.multinomial's refusal of NaN/Inf probabilities, once for the whole loop (`_draw` skips its checks): a
    token drawn from such a row has a NaN log-prob (NaN logits, or +Inf ones: softmax NaN, and argmax takes the
    NaN), so the same error as multinomial raised at that token (hf.diverged_as_nonfinite words it)."""
    if logprobs is not None and bool(logprobs.isnan().any()):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    return response, logprobs


# The fewest rows either part of lean_generate_split samples. Fewer move the part's log-probs (not its tokens) off
# the whole batch's: on the AMD EPYC host (MKL, AVX-512) parts of 1-3 rows by 2.4e-7 (tiny width) and 2.4e-6 (the
# 113M preset's), 4 rows and up bit for bit at both (every cut of 64 rows). rollout/hf.py splits no smaller batch.
SPLIT_MIN_ROWS = 4


def lean_generate_split(model, query: torch.Tensor, pad: int, eos: int, max_new_tokens: int,
                        temperature: float | None, other):
    """lean_generate's tokens and log-probs (and the generator's state after them), the rows shared with a second
    process: this one samples the first `other.cut(rows)` rows while `other(query rows, rng state, offset, batch
    rows, pad, eos, max_new_tokens, temperature)`, submitted first, samples the rest on the same weights
    (lit/reference.SplitRows, ReferenceProcess.generate) and returns a callable for its (response, log-probs) numpy
    arrays and the seconds it sampled; `other.took(rows, these seconds, those)` then moves the cut.

    Bit for bit: each token is `_draw`'s argmax(p / q) with q one exponential draw for the whole batch, as
    torch.multinomial draws it; both sides start from this process's generator state and draw every row's noise,
    each reading its own rows. A row's numbers do not depend on the rows beside it (as `_prefill` relies on), and
    the generator ends as many draws on as the longer part took, as the whole batch's loop would have."""
    rows = len(query)
    cut = other.cut(rows)
    state = torch.get_rng_state()
    result = other(query[cut:], state, cut, rows, pad, eos, max_new_tokens, temperature)
    try:
        started = time.perf_counter()
        with torch.inference_mode():
            mine, mine_logprobs = _sample(model, query[:cut], pad, eos, max_new_tokens, temperature, batch_rows=rows)
        mine_s = time.perf_counter() - started
    finally:  # read even when this part failed: no reply is left in the pipe for the next request
        theirs, theirs_logprobs, theirs_s = result()
    other.took(rows, mine_s, theirs_s)
    theirs, theirs_logprobs = (None if a is None else torch.from_numpy(a) for a in (theirs, theirs_logprobs))
    width = max(mine.shape[1], theirs.shape[1])
    if temperature is not None:
        for _ in range(width - mine.shape[1]):  # the other part's draws past this part's end
            torch.empty(rows, model.lm_head.weight.shape[0], dtype=torch.float32).exponential_(1)
    response = torch.cat([F.pad(mine, (0, width - mine.shape[1]), value=pad),
                          F.pad(theirs, (0, width - theirs.shape[1]), value=pad)])
    if temperature is None:
        return response, None
    # past a part's end every row of it has ended (EOS): its log-probs there are masked out as generate()'s are
    logprobs = torch.cat([F.pad(mine_logprobs, (0, width - mine.shape[1])),
                          F.pad(theirs_logprobs, (0, width - theirs.shape[1]))])
    return _checked(response, logprobs)


def _draw(probs: torch.Tensor, rows: slice | None = None, batch_rows: int = 0) -> torch.Tensor:
    """torch.multinomial(probs, 1).squeeze(1), the same draw: for one sample, multinomial takes argmax(p / q) with q
    `empty_like(p).exponential_(1)` (ATen's Distributions.cpp), here without its per-call checks of the
    probabilities (`_checked` does them once). rows / batch_rows: `probs` are these rows of a batch of batch_rows,
    whose noise is drawn whole, as the whole batch's call would draw it (`lean_generate_split`)."""
    if rows is None:
        q = torch.empty_like(probs).exponential_(1)
    else:
        q = torch.empty((batch_rows, probs.shape[1]), dtype=probs.dtype).exponential_(1)[rows]
    return torch.div(probs, q, out=q).argmax(-1)


def _sample(model, query: torch.Tensor, pad: int, eos: int, max_new_tokens: int, temperature: float | None,
            share_prefill: bool = True, offset: int = 0, batch_rows: int = 0):
    """lean_generate's loop. share_prefill: each prompt's forward once for its k samples (`_prefill`); False runs it
    for every row, as generate() does (what the test compares with). offset / batch_rows: `query` is rows offset..
    of a batch of batch_rows (0: the whole batch), whose noise each token draws whole (`_draw`)."""
    core = model.model
    rows, prompt = query.shape
    mine = slice(offset, offset + rows) if batch_rows else None
    width = prompt + max_new_tokens
    dtype = model.lm_head.weight.dtype

    keep = query != pad
    position = keep.long().cumsum(-1) - 1
    position.masked_fill_(~keep, 1)  # generate()'s position of a padding token
    cos, sin = _angles(core.rotary_emb, torch.cat([position, position[:, -1:] + torch.arange(1, max_new_tokens + 1)], 1),
                       dtype)
    kv_shape = (rows, model.config.num_key_value_heads, width, core.layers[0].self_attn.head_dim)
    caches = [(torch.empty(kv_shape, dtype=dtype), torch.empty(kv_shape, dtype=dtype)) for _ in core.layers]
    attends = torch.zeros(rows, width, dtype=torch.bool)  # which cache slots hold a real token
    attends[:, :prompt] = keep
    # No prompt padded: a new token's attention without a mask, as generate()'s (its sdpa mask is None then). The
    # same floats (a kept key's score + 0.0 is that score), 0.71-0.80x sdpa's time for 64 rows x 4 heads x 7-15 keys.
    unpadded = bool(keep.all())
    causal = torch.ones(prompt, prompt, dtype=torch.bool).tril()

    def forward(tokens: torch.Tensor, start: int, caches=caches, rows=slice(None)) -> torch.Tensor:
        """Last position's final-normed hidden state (`lm_head` makes its logits); writes the tokens' keys and
        values at slots start.. of the caches. rows: which rows of the batch `tokens` are (the prefill of each
        prompt once)."""
        end = start + tokens.shape[1]
        if tokens.shape[1] > 1:
            mask = causal[None, None] & attends[rows, None, None, :end]
        else:  # a new token attends to every slot before it, unless a prompt was padded
            mask = None if unpadded else attends[rows, None, None, :end]
        x = _embed(core.embed_tokens, tokens)
        angles = cos[rows, :, start:end], sin[rows, :, start:end]
        for layer, cache in zip(core.layers, caches):
            x = _layer(layer, x, *angles, mask, cache, start)
        return _norm(core.norm, x[:, -1:])

    def lm_head(x: torch.Tensor) -> torch.Tensor:
        """float32 logits of every row (the shared prefill's too: `_prefill`)."""
        return F.linear(x, model.lm_head.weight, model.lm_head.bias)[:, -1].float()

    logits = lm_head(_prefill(forward, query, caches) if share_prefill else forward(query, 0))
    done = torch.zeros(rows, dtype=torch.bool)
    pads = torch.full((rows,), pad, dtype=torch.long)
    tokens, logprobs = [], []
    for step in range(max_new_tokens):
        if temperature is None:
            token = logits.argmax(-1)
        else:
            scores = logits / temperature if temperature != 1.0 else logits
            token = _draw(scores.softmax(-1), mine, batch_rows)
            logprobs.append(scores.log_softmax(-1))
        token = torch.where(done, pads, token)
        if logprobs:
            logprobs[-1] = logprobs[-1].gather(-1, token[:, None]).squeeze(1)
        tokens.append(token)
        done |= token == eos
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        if not unpadded:
            attends[:, prompt + step] = True
        logits = lm_head(forward(token[:, None], prompt + step))
    response = torch.stack(tokens, 1)
    return response, (torch.stack(logprobs, 1) if logprobs else None)


def _prefill(forward, query: torch.Tensor, caches: list) -> torch.Tensor:
    """The prompt's forward (`_sample`'s `forward(query, 0)`: last hidden states): each run of equal consecutive
    rows (a prompt's k samples, `repeat_prompts`) once, its keys, values and last hidden state then copied to each of
    its rows; the caller's LM head runs on every row, as the whole batch's does (an 8-row head product's logits
    differed by ~5e-7 from the same rows' among 32, for the 113M preset's width on the Intel Xeon host with AMX). The
    layers' numbers did not depend on the rows beside them there, so they are the whole batch's forward's:
    tests/test_lean_decode.py checks tokens and log-probs bit for bit against the prefill of every row
    (`_sample(share_prefill=False)`), on the tiny shapes and the 113M preset's width."""
    _, inverse, counts = torch.unique_consecutive(query, dim=0, return_inverse=True, return_counts=True)
    if len(counts) == len(query):
        return forward(query, 0)
    rows = counts.cumsum(0) - counts  # each prompt's first row
    prompt = query.shape[1]
    once = [tuple(torch.empty((len(rows), c.shape[1], prompt, c.shape[3]), dtype=c.dtype) for c in pair)
            for pair in caches]
    hidden = forward(query[rows], 0, once, rows)
    for pair, small in zip(caches, once):
        for cache, part in zip(pair, small):
            cache[:, :, :prompt] = part[inverse]
    return hidden[inverse]
