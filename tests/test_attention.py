"""models/attention.py: a forward that trains on the CPU in half precision attends eagerly over short keys, as
transformers' eager attention does under autocast; every other forward is transformers' sdpa, bit for bit."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from rlhflab.models import attention
from rlhflab.models.build import load_causal_lm, load_reward_model, load_value_model
from rlhflab.rollout.lean import lean_unsupported


def pair(**arch):
    """The same tiny Llama twice: on transformers' sdpa, and switched by use_for_training."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**dict(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=64), **arch})
    plain = LlamaForCausalLM(config)
    ours = LlamaForCausalLM(copy.deepcopy(config))
    ours.load_state_dict(plain.state_dict())
    return plain, attention.use_for_training(ours)


def forward(model, ids, mask, autocast: bool, grad: bool):
    """Logits and the first layer's query-weight gradient (None without grad)."""
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    grad_q = None
    if grad:
        logits.log_softmax(-1).gather(-1, ids[..., None]).sum().backward()
        grad_q = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
        model.zero_grad(set_to_none=True)
    return logits.detach(), grad_q


def batch(rows=6, length=20):
    torch.manual_seed(1)
    ids = torch.randint(0, 40, (rows, length))
    mask = torch.ones_like(ids)
    mask[::2, :3] = 0  # left padding on some rows, as a prompt batch has
    return ids, mask


def test_use_for_training_names_the_attention_and_lean_decode_still_applies():
    plain, ours = pair()
    assert plain.config._attn_implementation == "sdpa"
    assert ours.config._attn_implementation == attention.NAME
    assert attention.is_sdpa(ours.config) and lean_unsupported(ours.eval()) is None
    eager = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4))
    eager.set_attn_implementation("eager")
    assert attention.use_for_training(eager).config._attn_implementation == "eager"  # a choice made is kept


@pytest.mark.parametrize("autocast,grad", [(False, False), (False, True), (True, False)])
def test_every_other_forward_is_sdpa_bit_for_bit(autocast, grad):
    plain, ours = pair()
    ids, mask = batch()
    logits, grad_q = forward(plain, ids, mask, autocast, grad)
    logits2, grad_q2 = forward(ours, ids, mask, autocast, grad)
    assert torch.equal(logits, logits2)
    assert (grad_q is None and grad_q2 is None) or torch.equal(grad_q, grad_q2)


@pytest.mark.parametrize("masked", [False, True])
def test_training_under_bf16_autocast_attends_as_transformers_eager_attention(masked):
    """The product is transformers' eager attention's under bf16 autocast bit for bit (its query in float32, as a
    Llama's leaves the rotary embedding), with a boolean padding mask or causal without one; the gradients its
    gradients to bf16's rounding, and finite where a padded row masks every key. Longer keys, or no grad: sdpa's."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 30, 16, requires_grad=True) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 1
    mask = torch.ones(30, 30, dtype=torch.bool).tril().expand(2, 1, 30, 30).clone()
    if masked:
        mask[1, :, :, :4] = False  # the second row left-padded by 4: its first 4 positions see no key at all
    additive = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, weights = attention.sdpa_trains_eager(module, q, k, v, mask if masked else None, scaling=0.25)
        theirs, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.25)
    assert weights is None and ours.dtype == theirs.dtype == torch.bfloat16 and ours.shape == theirs.shape
    seen = mask[:, 0].any(-1)  # (rows, positions) that attend to some key: transformers' spreads the others evenly
    assert torch.equal(ours[seen], theirs[seen])
    grad = torch.randn(ours.shape) * seen[..., None, None]
    ours.float().backward(grad)
    mine = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    theirs.float().backward(grad)
    for got, want in zip(mine, (q.grad, k.grad, v.grad)):
        assert got.dtype == torch.float32 and got.isfinite().all()
        assert (got - want).norm() <= 1e-2 * want.norm()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert not attention.trains_eager(q, k)  # no grad: sdpa as it is
    long_k = torch.randn(2, 4, attention.SHORT_KEYS + 1, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention.trains_eager(q, k) and not attention.trains_eager(q, long_k)
    assert not attention.trains_eager(q, k)  # float32 without autocast: sdpa as it is
    assert attention.trains_eager(q.detach().bfloat16().requires_grad_(), k.bfloat16())  # half weights


def test_the_backward_keeps_little_more_than_bf16_sdpa(monkeypatch):
    """What the backward keeps beyond bf16 sdpa's: the softmax's float32 weights and their bf16 rounding, 6 bytes a
    score (4.5 MB a layer at 113M, 32 x 44 tokens), and no float32 copies of query, key or value. Measured as the
    bytes a forward leaves allocated (the profiler's CPU memory events), and seen to catch float32 copies when they
    are kept."""
    from torch.profiler import ProfilerActivity, profile

    plain, ours = pair(hidden_size=128, num_attention_heads=4)
    ids, mask = batch(rows=8, length=40)

    def held(model) -> int:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=ids, attention_mask=mask).logits
        assert logits.requires_grad
        return sum(event.self_cpu_memory_usage for event in prof.events())

    heads, layers, (rows, length) = 4, len(ours.model.layers), ids.shape
    assert held(ours) - held(plain) <= layers * rows * heads * length ** 2 * 6

    def keeps_f32(query, key, value, mask, is_causal, scale, half):  # autograd through float32 sdpa
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=mask,
                                                  is_causal=is_causal, scale=scale).to(half)

    monkeypatch.setattr(attention, "eager_half", keeps_f32)
    assert held(ours) - held(plain) > layers * rows * heads * length ** 2 * 6


@pytest.mark.parametrize("arch", [{}, {"num_key_value_heads": 2}], ids=["mha", "gqa"])
def test_a_bf16_training_forward_stays_as_close_to_float32_as_sdpa(arch):
    """Through a model (left-padded rows; multi-head and grouped-query attention): logits and the query weight's
    gradient near sdpa's under bf16 autocast, and the gradient about as far as sdpa's from the float32 one."""
    plain, ours = pair(**arch)
    ids, mask = batch()
    _, grad_f32 = forward(plain, ids, mask, autocast=False, grad=True)
    logits, grad_q = forward(plain, ids, mask, autocast=True, grad=True)
    logits2, grad_q2 = forward(ours, ids, mask, autocast=True, grad=True)
    assert not torch.equal(grad_q, grad_q2)  # the eager path ran
    assert (logits - logits2).abs().max() < 0.05
    assert (grad_q - grad_q2).norm() / grad_q.norm() < 0.05
    assert (grad_q2 - grad_f32).norm() <= (grad_q - grad_f32).norm() * 1.25


def test_the_loaders_switch_and_a_saved_model_does_not_carry_the_name(tmp_path):
    plain, ours = pair()
    ours.save_pretrained(tmp_path)
    assert attention.NAME not in (tmp_path / "config.json").read_text()  # loads anywhere, as sdpa
    for load in (load_causal_lm, load_reward_model, load_value_model):
        assert load(tmp_path).config._attn_implementation == attention.NAME


def test_train_attention_sdpa_runs_sdpa_in_every_forward():
    """`train_attention=sdpa` (the run's root config, set by train()) turns the eager path off: a forward that trains
    under bf16 autocast is transformers' sdpa bit for bit; `eager` turns it back on."""
    plain, ours = pair()
    ids, mask = batch()
    try:
        attention.configure("sdpa")
        logits, grad_q = forward(plain, ids, mask, autocast=True, grad=True)
        logits2, grad_q2 = forward(ours, ids, mask, autocast=True, grad=True)
        assert torch.equal(logits, logits2) and torch.equal(grad_q, grad_q2)
    finally:
        attention.configure("eager")
    _, grad_q3 = forward(ours, ids, mask, autocast=True, grad=True)
    assert not torch.equal(grad_q, grad_q3)


def test_a_run_configures_its_train_attention(monkeypatch):
    """train() hands `train_attention` to the attention module before any model loads (here it stops at the first
    model load, after the setting is made)."""
    from rlhflab import train as train_mod
    from conftest import compose_cfg

    seen = []
    monkeypatch.setattr(attention, "configure", seen.append)

    class Loaded(Exception):
        pass

    def stop(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(train_mod, "output_dir", stop)
    with pytest.raises(Loaded):
        train_mod.train(compose_cfg(["train_attention=sdpa"]))
    assert seen == ["sdpa"]

