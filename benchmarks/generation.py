"""Where sync mode's generation time goes on a small model (docs/MEASUREMENTS.md, "Against TRL").

Times rlhflab's generator two ways on the benchmark's prompts at 32, 64 and 128 rows, interleaved, each call from
the same torch seed: Hugging Face `generate()` (`generator.decode=generate`) and rlhflab's own decode loop
(`generator.decode=lean`, rollout/lean.py, what `auto` picks for a plain Llama on the CPU), and the loop alone
(`lean._sample`) with each prompt's prefill once (what it runs) against every row's, at k = 2 and 4 samples a prompt.
It first checks that the loop draws generate()'s tokens and log-probs and that the prefill once draws what every
row's does, then times them all.

    SFT=~/.cache/rlhflab/vs_trl/stages/sft-f354fe44e62a   # the SFT policy vs_trl.py made (its first line says where)
    python benchmarks/generation.py --sft $SFT
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft", required=True, help="a from_pretrained directory (vs_trl.py's SFT policy)")
    parser.add_argument("--calls", type=int, default=40, help="timed calls of each kind (medians)")
    parser.add_argument("--max-new-tokens", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhflab.rollout.batch import repeat_prompts
    from rlhflab.rollout.hf import HFGenerator
    from rlhflab.rollout.lean import _sample
    from rlhflab.tasks.sentiment import SentimentTask

    tokenizer = AutoTokenizer.from_pretrained(args.sft)
    model = AutoModelForCausalLM.from_pretrained(args.sft, dtype=torch.float32).eval()
    prompts = SentimentTask(seed=0).prompts("train")[:32]
    query = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)["input_ids"]
    generators = {decode: HFGenerator(decode=decode) for decode in ("generate", "lean")}
    for generator in generators.values():
        generator.setup(tokenizer, args.max_new_tokens)
    lean = generators["lean"]

    def each_row(rows: torch.Tensor, share: bool):
        """The lean loop as lean_generate runs it, with each prompt's prefill once (share) or every row's."""
        with torch.inference_mode():
            return _sample(model, rows, tokenizer.pad_token_id, tokenizer.eos_token_id, lean.max_new_tokens,
                           lean.temperature, share_prefill=share)

    pairs, fours = (repeat_prompts(query, prompts, k)[0] for k in (2, 4))
    rows = {32: pairs[:32], 64: pairs, 128: fours}  # as the 2026-11-29 numbers were measured
    with torch.no_grad():
        for seed in range(5):
            drawn = []
            for generator in generators.values():
                torch.manual_seed(seed)
                drawn.append(generator._generate(model, rows[64], greedy=False))
            same = torch.equal(drawn[0][0], drawn[1][0]) and torch.equal(drawn[0][1], drawn[1][1])
            print(f"seed {seed}: the loop draws {'the same' if same else 'OTHER'} tokens and log-probs as generate()")
        for seed in range(5):  # the loop with each prompt's prefill once, against every row's (as generate() runs it)
            drawn = []
            for share in (True, False):
                torch.manual_seed(seed)
                drawn.append(each_row(rows[128], share))
            same = torch.equal(drawn[0][0], drawn[1][0]) and torch.equal(drawn[0][1], drawn[1][1])
            print(f"seed {seed}: each prompt's prefill once draws {'the same' if same else 'OTHER'} tokens and "
                  "log-probs as every row's")
        calls = {f"{'generate()' if decode == 'generate' else 'lean loop'}, {n} rows":
                 (lambda n=n, g=g: g._generate(model, rows[n], greedy=False))
                 for n in rows for decode, g in generators.items()}
        for n in (64, 128):  # the prefill's own share of the loop (k = 2 and 4): the loop alone, either way
            for share, how in ((True, "each prompt's prefill once"), (False, "every row's prefill")):
                calls[f"lean loop alone, {how}, {n} rows"] = lambda n=n, share=share: each_row(rows[n], share)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for name, call in calls.items():  # once each, untimed
            call()
        for i in range(args.calls):
            for name, call in calls.items():
                torch.manual_seed(i)
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
    print(f"| call | median ms ({args.calls} interleaved calls, 1 torch thread) |\n|---|---|")
    for name, spent in times.items():
        print(f"| {name} | {1000 * statistics.median(spent):.1f} |")


if __name__ == "__main__":
    main()
