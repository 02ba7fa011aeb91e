"""What peft's LoRA add costs, and rlhflab's fused add instead (src/rlhflab/models/lora_add.py).

peft's `lora.Linear` computes `base(x) + lora_B(lora_A(dropout(x))) * scaling`; rlhflab's `FusedAddLinear` computes
`addmm(base(x), lora_A(dropout(x)) * scaling, B^T)`. Both on the same model: the 113M Llama of `model=llama100m`
(12 layers of width 768), randomly initialised, with rank-8 adapters (lora_alpha 16, memory=lora's and memory=hydra's
defaults) on every linear layer of its blocks and their B matrices drawn nonzero, as after training. One torch thread,
the two kinds interleaved; medians of --reps, the first rep left out.

    python benchmarks/lora_add.py --out benchmarks/lora_add.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32, help="sequences per batch (the memory table's 16 prompts x 2)")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per sequence (prompt and 32 new tokens)")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--out", default=None, help="also write the table here")
    a = parser.parse_args()

    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import Linear as PeftLinear
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhflab.models.lora_add import FusedAddLinear, fuse_lora_adds

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                                         num_key_value_heads=12, vocab_size=512, max_position_embeddings=64))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.01)
    layers = [m for m in model.modules() if isinstance(m, PeftLinear)]
    fuse_lora_adds(model)
    x = torch.randint(0, 512, (a.rows, a.tokens), generator=torch.Generator().manual_seed(1))

    def kind(cls):
        for m in layers:
            m.__class__ = cls

    def train_step():
        model(input_ids=x).logits.pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    def forward():
        with torch.no_grad():
            model(input_ids=x)

    kinds = {"peft": PeftLinear, "fused add": FusedAddLinear}
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(a.reps):
        for label, cls in kinds.items():
            kind(cls)
            for what, fn in (("forward and backward", train_step), ("forward, no grad", forward)):
                t = time.perf_counter()
                fn()
                times.setdefault((what, label), []).append(time.perf_counter() - t)
    outputs = {}
    for label, cls in kinds.items():
        kind(cls)
        with torch.no_grad():
            outputs[label] = model(input_ids=x).logits
    apart = (outputs["peft"] - outputs["fused add"]).abs().max().item()

    lines = [f"`python benchmarks/lora_add.py --rows {a.rows} --tokens {a.tokens} --reps {a.reps}` "
             f"(torch {torch.__version__}, {platform.processor() or platform.machine()}, 1 thread; medians of reps 2..{a.reps})",
             "", "| pass | peft (s) | fused add (s) | fused / peft |", "|---|---|---|---|"]
    for what in ("forward and backward", "forward, no grad"):
        peft_s = statistics.median(times[(what, "peft")][1:])
        fused_s = statistics.median(times[(what, "fused add")][1:])
        lines.append(f"| {what} | {peft_s:.3f} | {fused_s:.3f} | {fused_s / peft_s:.2f}x |")
    lines += ["", f"Largest difference between the two kinds' logits: {apart:.1e}."]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
