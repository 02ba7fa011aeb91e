"""peft's LoRA Linear with the adapter's output added inside one addmm (models/lora_add.py): peft's numbers."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as PeftLinear
from transformers import LlamaConfig, LlamaForCausalLM

from rlhflab.models.lora_add import FusedAddLinear, fuse_lora_adds

TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj", "lm_head"]


def lora_llama(dtype=torch.float32, **lora):
    """A tiny Llama with trained-looking adapters: B drawn nonzero (peft starts it at 0, where any add is exact)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=4, vocab_size=50, max_position_embeddings=32)).to(dtype)
    # lora_alpha / r = 1.75: a scaling whose product rounds, unlike a power of two
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=7, target_modules=TARGETS, **lora))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model


TOKENS = torch.randint(0, 50, (3, 9), generator=torch.Generator().manual_seed(1))


def test_the_fused_add_gives_peft_s_outputs_and_gradients_on_the_same_parameters():
    peft_model, fused = lora_llama(), lora_llama()
    keys = list(fused.state_dict())
    assert fuse_lora_adds(fused) == 2 * 4 + 1  # q, v, gate, down in each of 2 layers, and the head
    assert all(type(m) is FusedAddLinear for m in fused.modules() if isinstance(m, PeftLinear))
    assert list(fused.state_dict()) == keys  # checkpoints, merges and adapter files see the same module
    expected, got = peft_model(input_ids=TOKENS).logits, fused(input_ids=TOKENS).logits
    assert (expected - got).abs().max() < 1e-6
    expected.pow(2).mean().backward()
    got.pow(2).mean().backward()
    grads = [(a.grad, b.grad) for a, b in zip(peft_model.parameters(), fused.parameters()) if a.requires_grad]
    assert len(grads) == 2 * 9 and all((a - b).abs().max() < 1e-6 * max(1.0, a.abs().max()) for a, b in grads)


def test_every_other_case_is_peft_s_own_forward():
    peft_model, fused = lora_llama(), lora_llama()
    fuse_lora_adds(fused)
    with peft_model.disable_adapter(), fused.disable_adapter():  # the reference: adapters off, bit for bit
        assert torch.equal(peft_model(input_ids=TOKENS).logits, fused(input_ids=TOKENS).logits)
    peft_model.merge_adapter()
    fused.merge_adapter()
    assert torch.equal(peft_model(input_ids=TOKENS).logits, fused(input_ids=TOKENS).logits)


@pytest.mark.parametrize("where", ["bf16 weights, float32 adapters", "bf16 autocast"])
def test_mixed_dtypes_give_peft_s_dtype_and_values(where):
    dtype = torch.bfloat16 if where.startswith("bf16 weights") else torch.float32
    peft_model, fused = lora_llama(dtype), lora_llama(dtype)
    fuse_lora_adds(fused)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=where == "bf16 autocast"):
        expected, got = peft_model(input_ids=TOKENS).logits, fused(input_ids=TOKENS).logits
    assert got.dtype == expected.dtype
    assert (expected.float() - got.float()).abs().max() < 0.05  # bf16 rounding at different points
