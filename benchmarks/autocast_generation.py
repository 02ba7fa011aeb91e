"""Where bf16 autocast's gain in generation goes (docs/MEASUREMENTS.md, "Against TRL", the bf16 setting).

Times Hugging Face `generate()` of one policy, 1 torch thread, three ways, interleaved:
- `float32`: no autocast;
- `around the call`: one `torch.autocast("cpu", bfloat16)` around the whole `generate()` call, as rlhflab's
  generators run under `trainer.precision=bf16-mixed` (sync mode inside the training step's autocast; the async
  generator enters the learner's). Autocast keeps the bf16 copy of each parameter that requires grad until the
  outermost autocast exits, so every weight is cast once per call;
- `around each forward`: autocast wrapped around `model.forward`, as accelerate's `prepare_model` does for
  `bf16=True` (TRL's default), whose `unwrap_model_for_generation` keeps that wrapper for `generate()`: the cache is
  dropped at each forward's exit, so every weight is cast again at every decoding step;
- `cache off (Lightning's step)`: inside `torch.autocast(..., cache_enabled=False)`, as Lightning's bf16-mixed
  plugin runs each training step (and so rlhflab's sync generation until `rollout.sources.casts_once`): every
  weight cast at every use;
- `cache off, rlhflab's generator`: the same context, through rlhflab's `HFGenerator`, which casts each trainable
  weight once per call (`casts_once`); it also records the behaviour log-probs, as it does in every run;
- with --options, the same generator with `generator.prepack=false` (autocast's own products, not weights laid
  out for oneDNN once per call), and with `generator.autocast_cache=false` (generate()'s own float32 key cache):
  what each of the two CPU bf16 options, measured on an AMX CPU first, gives on the host at hand.

Every kind samples from the same prompts with the same seeds, up to --max-new-tokens tokens (a call stops when every
row has ended); the table gives the median number of decoding steps beside each time (the 113M SFT policy's
completions run to the budget).

    SFT=~/.cache/rlhflab/vs_trl/stages/sft-96def2b71151   # the llama100m SFT policy vs_trl.py made (its first line says where)
    python benchmarks/autocast_generation.py --sft $SFT
    python benchmarks/autocast_generation.py --sft $SFT --options --out benchmarks/autocast_generation_epyc.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft", required=True, help="a from_pretrained directory (vs_trl.py's SFT policy)")
    parser.add_argument("--rows", type=int, default=32, help="prompts x samples per call (vs_trl's 113M setting: 8 x 4)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--calls", type=int, default=5, help="timed calls of each kind (medians)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--options", action="store_true",
                        help="also rlhflab's generator with generator.prepack=false, and with generator.autocast_cache=false")
    parser.add_argument("--out", default=None, help="also write the table here (markdown)")
    a = parser.parse_args()
    for flag in ("rows", "max_new_tokens", "calls", "threads"):
        if getattr(a, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(a, flag)}: give 1 or more")
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhflab.tasks.sentiment import SentimentTask

    tok = AutoTokenizer.from_pretrained(a.sft)
    model = AutoModelForCausalLM.from_pretrained(a.sft, dtype=torch.float32)  # trainable: parameters require grad
    from rlhflab.lit.data import encode_prompts

    prompts = (SentimentTask().prompts("train") * a.rows)[: a.rows]
    ids = encode_prompts(tok, prompts)  # left-padded, as every rlhflab run's queries
    query = {"input_ids": ids, "attention_mask": (ids != tok.pad_token_id).long()}
    plain = model.forward
    per_forward = torch.autocast("cpu", dtype=torch.bfloat16)(plain)

    def generate(seed: int):
        torch.manual_seed(seed)
        with torch.no_grad():
            return model.generate(**query, do_sample=True, top_k=0, top_p=None, temperature=1.0,
                                  max_new_tokens=a.max_new_tokens, pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id)

    def float32(seed):
        return generate(seed)

    def around_the_call(seed):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return generate(seed)

    def around_each_forward(seed):
        model.forward = per_forward
        try:
            return generate(seed)
        finally:
            model.forward = plain

    def cache_off(seed):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            return generate(seed)

    from rlhflab.rollout.hf import HFGenerator

    generator = HFGenerator(temperature=1.0, max_new_tokens=a.max_new_tokens)
    generator.setup(tok, a.max_new_tokens)

    def through(gen):
        def sample(seed):
            torch.manual_seed(seed)
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                rollout = gen.generate(model, query["input_ids"], prompts, 1, 0)
            return torch.cat([query["input_ids"], rollout.response], 1)
        return sample

    ours = "bf16, cache off, rlhflab's generator"
    kinds = {"float32": float32, "bf16 autocast around the call": around_the_call,
             "bf16 autocast around each forward (TRL bf16=True)": around_each_forward,
             "bf16, cache off (Lightning's step)": cache_off, ours: through(generator)}
    if a.options:  # the generator's two CPU bf16 options, each turned off alone
        for option in ("prepack", "autocast_cache"):
            other = HFGenerator(temperature=1.0, max_new_tokens=a.max_new_tokens, **{option: False})
            other.setup(tok, a.max_new_tokens)
            kinds[f"{ours}, generator.{option}=false"] = through(other)
    times = {name: [] for name in kinds}
    steps = {name: [] for name in kinds}
    for name, fn in kinds.items():  # warm-up
        fn(0)
    same = {name: 0 for name in kinds if name.startswith(ours + ",")}  # calls whose tokens are the generator's own
    for call in range(a.calls):
        drawn = {}
        for name, fn in (list(kinds.items()) if call % 2 == 0 else list(kinds.items())[::-1]):
            t0 = time.perf_counter()
            out = drawn[name] = fn(call)
            times[name].append(time.perf_counter() - t0)
            steps[name].append(out.shape[1] - query["input_ids"].shape[1])
        for name in same:
            same[name] += drawn[name].shape == drawn[ours].shape and bool(torch.equal(drawn[name], drawn[ours]))
    base = statistics.median(times["float32"])
    lines = [f"| generate(), {a.rows} rows, up to {a.max_new_tokens} tokens, {a.threads} thread(s) | median s ({a.calls} "
             "interleaved calls) | speed vs float32 | decoding steps (median) |", "|---|---|---|---|"]
    for name, ts in times.items():
        lines.append(f"| {name} | {statistics.median(ts):.2f} | {base / statistics.median(ts):.2f}x | "
                     f"{statistics.median(steps[name]):.0f} |")
    lines += [""] + [f"{name.split(', ')[-1]}: the same tokens as the generator as it runs in {n} of {a.calls} calls"
                     for name, n in same.items()]
    print("\n".join(lines))
    if a.out:
        from step_flops import host  # (benchmarks/, this script's folder, is first on sys.path)

        head = [f"# benchmarks/autocast_generation.py, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
                "", f"`python {' '.join(sys.argv)}`", "", f"torch {torch.__version__}, {host()}", ""]
        Path(a.out).write_text("\n".join(head + lines) + "\n")


if __name__ == "__main__":
    main()
