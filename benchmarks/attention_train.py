"""Why a forward that trains on the CPU under bf16 attends eagerly over short keys (`rlhflab.models.attention`).

Two tables, each kind interleaved with the other, medians over --rounds:
1. Attention alone, forward and backward: PyTorch's sdpa on bf16 query/key/value (what bf16 autocast runs) against
   rlhflab's `eager_half` (transformers' eager attention under autocast: half products, a float32 softmax) and
   float32 sdpa as it is, causal with a padding mask as rlhflab's batches carry, 12 heads of 64, about --tokens
   tokens a call at each key length; and the relative error of each bf16 product, and of the query's gradient,
   against float64 over the same bf16-rounded inputs.
2. A 113M Llama (`model=llama100m`'s arch, random init; or --sft, a from_pretrained directory) forward and backward
   under bf16 autocast on --rows x --length tokens: transformers' `sdpa` against rlhflab's `sdpa_trains_eager`, with
   the relative distance of the first query weight's gradient from float32's for each.

    python benchmarks/attention_train.py --out benchmarks/attention_train.md
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F


def timed(fn, rounds: int) -> list[float]:
    fn()  # warm: oneDNN picks its kernels at the first call of a shape
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def attention_table(lengths, tokens: int, rounds: int) -> list[str]:
    from rlhflab.models.attention import eager_half

    rows = ["| keys | rows | bf16 sdpa ms | rlhflab's ms | bf16 / rlhflab's | float32 sdpa ms | error bf16 | "
            "error rlhflab's | query grad error bf16 | query grad error rlhflab's |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for length in lengths:
        batch = max(1, tokens // length)
        torch.manual_seed(0)
        q, k, v = (torch.randn(batch, 12, length, 64, requires_grad=True) for _ in range(3))
        mask = torch.ones(length, length, dtype=torch.bool).tril().expand(batch, 1, length, length).clone()
        mask[::2, :, :, :3] = False  # left padding on every other row
        mask[::2, :, :3, :3] = torch.eye(3, dtype=torch.bool)  # a padded query attends to itself (sdpa would NaN)
        grad = torch.randn(batch, length, 12, 64)
        exact_in = [t.detach().bfloat16().double().requires_grad_() for t in (q, k, v)]
        exact = F.scaled_dot_product_attention(*exact_in, attn_mask=mask).transpose(1, 2)
        exact.backward(grad.double())  # against the bf16-rounded inputs both sides attend over
        exact_dq = exact_in[0].grad

        def bf16():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
            out.float().backward(grad)
            return out

        def ours():  # what a forward that trains under bf16 autocast runs at any length (the bound aside)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = eager_half(q, k, v, mask, False, None, torch.bfloat16).transpose(1, 2)
            out.float().backward(grad)
            return out

        def f32():  # float32 sdpa as it is, keeping its float32 inputs for the backward
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
            out.backward(grad)
            return out

        kinds = {"bf16": bf16, "ours": ours, "f32": f32}
        times = {name: [] for name in kinds}
        for _ in range(rounds):  # interleaved: one call of each per round
            for name, fn in kinds.items():
                times[name] += timed(fn, 1)
        err, dq_err = {}, {}
        for name in ("bf16", "ours"):
            q.grad = None
            err[name] = ((kinds[name]().double() - exact).norm() / exact.norm()).item()
            dq_err[name] = ((q.grad.double() - exact_dq).norm() / exact_dq.norm()).item()
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        rows.append(f"| {length} | {batch} | {ms['bf16']:.1f} | {ms['ours']:.1f} | {ms['bf16'] / ms['ours']:.2f}x | "
                    f"{ms['f32']:.1f} | {err['bf16']:.1e} | {err['ours']:.1e} | {dq_err['bf16']:.1e} | "
                    f"{dq_err['ours']:.1e} |")
    return rows


def model_table(sft: str | None, rows: int, length: int, rounds: int) -> list[str]:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from rlhflab.models.attention import NAME, use_for_training

    torch.manual_seed(0)
    if sft:
        plain = AutoModelForCausalLM.from_pretrained(sft, dtype=torch.float32)
    else:
        plain = LlamaForCausalLM(LlamaConfig(vocab_size=44, hidden_size=768, intermediate_size=3072,
                                             num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                                             max_position_embeddings=max(64, length)))
    ours = use_for_training(copy.deepcopy(plain))
    ids = torch.randint(0, plain.config.vocab_size, (rows, length))
    mask = torch.ones_like(ids)
    mask[::2, :3] = 0

    def step(model, autocast=True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids, attention_mask=mask).logits
        logits.float().log_softmax(-1).gather(-1, ids[..., None]).sum().backward()
        g = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
        model.zero_grad(set_to_none=True)
        return g

    exact = step(plain, autocast=False)
    dist = {m: ((step(m) - exact).norm() / exact.norm()).item() for m in (plain, ours)}
    times = {id(plain): [], id(ours): []}
    for _ in range(rounds):
        for m in (plain, ours):
            times[id(m)] += timed(lambda: step(m), 1)
    ms = {k: statistics.median(v) for k, v in times.items()}
    out = ["| attention | forward + backward s | gradient's distance from float32's |", "|---|---|---|"]
    for m, name in ((plain, "sdpa (transformers')"), (ours, f"{NAME} (rlhflab's)")):
        out.append(f"| {name} | {ms[id(m)]:.3f} | {dist[m]:.2e} |")
    out.append(f"\n{ms[id(plain)] / ms[id(ours)]:.2f}x the speed ({rows} rows x {length} tokens, "
               f"{'the SFT policy ' + sft if sft else 'the 113M arch, random init'}).")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="44,96,128,192,256,512", help="key lengths of table 1")
    parser.add_argument("--tokens", type=int, default=1408, help="tokens a call in table 1 (rows = tokens / length)")
    parser.add_argument("--rows", type=int, default=32, help="table 2's rows (vs_trl's 113M setting: 8 prompts x 4)")
    parser.add_argument("--length", type=int, default=44, help="table 2's tokens a row (prompt + 32 new)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sft", default=None, help="a from_pretrained directory for table 2 (default: built)")
    parser.add_argument("--out", default=None, help="also write the tables here (markdown)")
    a = parser.parse_args()
    try:
        lengths = [int(x) for x in a.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths {a.lengths!r}: give comma-separated integers, e.g. 44,128,256")
    for flag in ("tokens", "rows", "length", "rounds", "threads"):
        if getattr(a, flag) < 1:
            parser.error(f"--{flag} {getattr(a, flag)}: give 1 or more")
    if any(n < 4 for n in lengths):
        parser.error(f"--lengths {a.lengths!r}: each at least 4 (three padded positions and one more)")
    torch.set_num_threads(a.threads)
    from step_flops import host  # (benchmarks/, this script's folder, is first on sys.path)

    text = [f"torch {torch.__version__}, {a.threads} thread(s), medians of {a.rounds} interleaved rounds; {host()}.", "",
            "Attention alone, forward and backward:", "", *attention_table(lengths, a.tokens, a.rounds), "",
            "The model, forward and backward under bf16 autocast:", "",
            *model_table(a.sft, a.rows, a.length, a.rounds)]
    print("\n".join(text))
    if a.out:
        with open(a.out, "w") as f:
            f.write("# " + __doc__.split("\n\n")[0] + "\n\n`python benchmarks/attention_train.py"
                    + (f" --threads {a.threads}" if a.threads != 1 else "") + (f" --sft {a.sft}" if a.sft else "")
                    + "`\n\n" + "\n".join(text) + "\n")


if __name__ == "__main__":
    main()
