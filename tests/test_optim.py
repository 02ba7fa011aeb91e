"""The RL update's optimizer: AdamW on PyTorch's fused kernel, stepping as the per-tensor loop does."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhflab.lit.optim import adamw


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=4, vocab_size=50, max_position_embeddings=32))


def test_adamw_is_fused_on_cpu_keeps_every_group_and_steps_as_the_per_tensor_loop():
    fused_model, loop_model = tiny_llama(), tiny_llama()
    # Groups given as generators (as `model.parameters()` is) must reach the optimizer whole.
    head = {id(p) for p in fused_model.lm_head.parameters()}
    groups = [{"params": (p for p in fused_model.parameters() if id(p) not in head), "lr": 1e-2},
              {"params": fused_model.lm_head.parameters(), "lr": 3e-3}]
    fused = adamw(groups, weight_decay=0.0, eps=1e-5)
    assert fused.defaults["fused"] is True
    assert sum(len(g["params"]) for g in fused.param_groups) == len(list(fused_model.parameters()))
    loop_head = {id(p) for p in loop_model.lm_head.parameters()}
    loop = torch.optim.AdamW([{"params": [p for p in loop_model.parameters() if id(p) not in loop_head], "lr": 1e-2},
                              {"params": list(loop_model.lm_head.parameters()), "lr": 3e-3}],
                             weight_decay=0.0, eps=1e-5, foreach=False)
    tokens = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(5):
        for model, opt in ((fused_model, fused), (loop_model, loop)):
            opt.zero_grad()
            model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
    moved = max((a - b).abs().max().item() for a, b in zip(fused_model.parameters(), tiny_llama().parameters()))
    apart = max((a - b).abs().max().item() for a, b in zip(fused_model.parameters(), loop_model.parameters()))
    assert moved > 1e-2 and apart < 1e-5, (moved, apart)


def test_adamw_falls_back_to_the_default_without_a_fused_kernel(monkeypatch):
    opt = adamw(tiny_llama().parameters(), lr=1e-3)
    assert opt.defaults["fused"] is True
    monkeypatch.setattr("rlhflab.lit.optim._get_fused_kernels_supported_devices", lambda: ["cuda"])  # a CPU without it
    opt = adamw(tiny_llama().parameters(), lr=1e-3)
    assert opt.defaults["fused"] is None
    assert len(opt.param_groups[0]["params"]) == len(list(tiny_llama().parameters()))
