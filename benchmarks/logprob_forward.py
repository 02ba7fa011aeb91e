"""The learner's log-prob forward, side by side in one process: each of two savings against the same call without it.

- `read_before`: the log-prob forward over every response token but the last (rlhflab's), against one over every
  response token whose last logit is dropped (before c2598e1, and TRL's).
- `padded_keys`: `prompt_once_logits` with sdpa's keys padded to whole blocks of the CPU's float32 vector lanes
  (rlhflab's), against the same call unpadded.

Each is timed with grad (the policy's forward and backward of the summed log-probs) and without (the reference's
forward), in pairs whose order alternates; the table gives each side's median and the median of the per-pair ratios
with their quartiles, and the largest difference between the two sides' log-probs and gradients. The models are
vs_trl.py's two settings, randomly initialised (the numbers of a random and a trained model take the same time):
`tiny` (2 layers of width 64, 32 prompts x k = 2, 9 response tokens) and `llama100m` (12 layers of width 768, 8
prompts x k = 2, 32 tokens); 6-token prompts as the embedded task's, a 44-token vocabulary as its tokenizer's. One
torch thread.

    python benchmarks/logprob_forward.py --out benchmarks/logprob_forward.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

SETTINGS = {  # model width, layers, heads, intermediate; prompts, k, response tokens, pairs timed
    "tiny": (64, 2, 4, 128, 32, 2, 9, 300),
    "llama100m": (768, 12, 12, 3072, 8, 2, 32, 10),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", default="tiny,llama100m", help="comma-separated: tiny, llama100m")
    parser.add_argument("--pairs", type=int, default=None, help="timed pairs per row (default: 300 tiny, 10 llama100m)")
    parser.add_argument("--prompt-tokens", type=int, default=6)
    parser.add_argument("--out", default=None, help="also write the table here")
    a = parser.parse_args()
    unknown = set(a.settings.split(",")) - set(SETTINGS)
    if unknown:
        parser.error(f"--settings: unknown {sorted(unknown)}; choose from {sorted(SETTINGS)}")

    from transformers import LlamaConfig, LlamaForCausalLM

    import rlhflab.rollout.lean as lean
    from rlhflab.rollout.batch import join, read_before, token_logprobs

    torch.set_num_threads(1)
    real_padded_keys = lean.padded_keys
    lines = [f"`python benchmarks/logprob_forward.py{' --settings ' + a.settings if a.settings != 'tiny,llama100m' else ''}"
             f"{f' --pairs {a.pairs}' if a.pairs else ''}`", "",
             f"torch {torch.__version__}, {platform.processor() or platform.machine()}, ATen CPU capability "
             f"{torch.backends.cpu.get_cpu_capability()} (sdpa key block {lean.kv_block()}), 1 thread", "",
             "| setting | saving | grad | without (ms) | with (ms) | with / without, median of pairs (quartiles) | "
             "max log-prob diff | max grad diff (relative) |", "|---|---|---|---|---|---|---|---|"]
    for name in a.settings.split(","):
        hidden, layers, heads, inter, prompts, k, tokens, pairs = SETTINGS[name]
        pairs = a.pairs or pairs
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=44, hidden_size=hidden, intermediate_size=inter,
                                             num_hidden_layers=layers, num_attention_heads=heads,
                                             num_key_value_heads=heads, max_position_embeddings=64,
                                             attn_implementation="sdpa")).train()
        query = torch.randint(4, 44, (prompts, a.prompt_tokens)).repeat_interleave(k, 0)
        response = torch.randint(4, 44, (prompts * k, tokens))

        def logits(resp):
            out = lean.prompt_once_logits(model, query, resp, 0)
            if out is None:  # without grad on the tiny model (NO_GRAD_MIN_WORK): one forward over every row
                ids, mask, positions = join(query, resp, 0)
                out = lean.lean_forward(model, ids, mask, positions, logits_to_keep=resp.shape[1] + 1)
            return out

        def whole(_):  # every response token run, the last logit dropped
            return token_logprobs(logits(response)[:, :-1], response, 1.0)

        def before(_):
            return token_logprobs(logits(read_before(response)), response, 1.0)

        def padded(on):
            lean.padded_keys = real_padded_keys if on else (lambda keys: 0)
            try:
                return token_logprobs(lean.prompt_once_logits(model, query, read_before(response), 0), response, 1.0)
            finally:
                lean.padded_keys = real_padded_keys

        def run(f, on, grad):
            with torch.set_grad_enabled(grad):
                t0 = time.perf_counter()
                lp = f(on)
                if grad:
                    lp.sum().backward()
                took = time.perf_counter() - t0
            grads = [p.grad.clone() for p in model.parameters() if p.grad is not None] if grad else []
            model.zero_grad(set_to_none=True)
            return took, lp.detach(), grads

        for saving, (off_f, on_f) in (("read_before", (whole, before)), ("padded_keys", (padded, padded))):
            for grad in (True, False):
                if saving == "padded_keys" and not grad:
                    lean_min = lean.NO_GRAD_MIN_WORK
                    lean.NO_GRAD_MIN_WORK = 0  # the shared forward without grad, whatever the model's size
                _, lp0, g0 = run(off_f, False, grad)
                _, lp1, g1 = run(on_f, True, grad)
                ratios, times = [], {False: [], True: []}
                for i in range(pairs):
                    took = {}
                    for on in ((False, True) if i % 2 == 0 else (True, False)):
                        took[on] = run(on_f if on else off_f, on, grad)[0]
                        times[on].append(took[on])
                    ratios.append(took[True] / took[False])
                if saving == "padded_keys" and not grad:
                    lean.NO_GRAD_MIN_WORK = lean_min
                q = statistics.quantiles(ratios, n=4)
                gd = max((float((x - y).abs().max() / y.abs().max()) for x, y in zip(g1, g0)), default=0.0)
                lines.append(
                    f"| {name} | {saving} | {'forward + backward' if grad else 'forward, no grad'} | "
                    f"{statistics.median(times[False]) * 1e3:.2f} | {statistics.median(times[True]) * 1e3:.2f} | "
                    f"{statistics.median(ratios):.3f}x ({q[0]:.3f}-{q[2]:.3f}) | {float((lp1 - lp0).abs().max()):.1e} | "
                    f"{gd:.1e} |")
                print(lines[-1], flush=True)
    lines += ["", f"Rows: {', '.join(f'{n}: {s[4]} prompts x k = {s[5]}, {s[6]} response tokens, {a.pairs or s[7]} pairs' for n, s in SETTINGS.items() if n in a.settings.split(','))}; "
              f"prompts of {a.prompt_tokens} tokens. `padded_keys` without grad runs the shared-prompt forward on "
              "the tiny model too (which rlhflab declines there, NO_GRAD_MIN_WORK)."]
    print("\n".join(lines))
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
