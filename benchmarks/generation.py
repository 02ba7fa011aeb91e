"""Where sync mode's generation time goes on a small model (docs/MEASUREMENTS.md, "Against TRL").

Times rlhflab's generator (`HFGenerator`, Hugging Face `generate()`) on the benchmark's prompts at 32, 64 and 128
rows, and a plain decode loop (prefill, then one forward per token on a `DynamicCache`, sampling as `generate()`
does) on the same 64 rows, interleaved, each call from the same torch seed. The loop is a measurement, not a
backend: it first checks that it draws the same tokens and log-probs as the generator, then times both.

    SFT=~/.cache/rlhflab/vs_trl/stages/sft-f354fe44e62a   # the SFT policy vs_trl.py made (its first line says where)
    python benchmarks/generation.py --sft $SFT
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def decode_loop(model, query: torch.Tensor, pad: int, eos: int, max_new_tokens: int):
    """(tokens, log-probs) sampled at temperature 1 from left-padded `query`, stopping once every row has EOS."""
    mask = (query != pad).long()
    position = mask.cumsum(-1) - 1
    position.masked_fill_(mask == 0, 1)  # as generate() sets a padded position
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=query, attention_mask=mask, position_ids=position, past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    last = position[:, -1:]
    done = torch.zeros(len(query), dtype=torch.bool)
    tokens, logprobs = [], []
    for step in range(max_new_tokens):
        scores = out.logits[:, -1, :].float()
        token = torch.multinomial(scores.softmax(-1), 1).squeeze(1)
        token = torch.where(done, torch.full_like(token, pad), token)
        logprobs.append(scores.log_softmax(-1).gather(-1, token[:, None]).squeeze(1))
        tokens.append(token)
        done |= token == eos
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, mask.new_ones(len(query), 1)], 1)
        last = last + 1
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=last, past_key_values=cache,
                    use_cache=True)
    return torch.stack(tokens, 1), torch.stack(logprobs, 1)


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
    from rlhflab.tasks.sentiment import SentimentTask

    tokenizer = AutoTokenizer.from_pretrained(args.sft)
    model = AutoModelForCausalLM.from_pretrained(args.sft, dtype=torch.float32).eval()
    prompts = SentimentTask(seed=0).prompts("train")[:32]
    query = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)["input_ids"]
    generator = HFGenerator()
    generator.setup(tokenizer, args.max_new_tokens)
    pairs, fours = (repeat_prompts(query, prompts, k)[0] for k in (2, 4))
    rows = {32: pairs[:32], 64: pairs, 128: fours}  # as the 2026-11-29 numbers were measured
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    with torch.no_grad():
        for seed in range(5):
            torch.manual_seed(seed)
            ours = generator._generate(model, rows[64], greedy=False)
            torch.manual_seed(seed)
            loop = decode_loop(model, rows[64], pad, eos, args.max_new_tokens)
            same = torch.equal(ours[0], loop[0]) and torch.equal(ours[1], loop[1])
            print(f"seed {seed}: the loop draws {'the same' if same else 'OTHER'} tokens and log-probs as generate()")
        calls = {f"generate(), {n} rows": (lambda n=n: generator._generate(model, rows[n], greedy=False)) for n in rows}
        calls["decode loop, 64 rows"] = lambda: decode_loop(model, rows[64], pad, eos, args.max_new_tokens)
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
