"""Where a PPO step's time and floating-point work go, per sample: LoRA-PPO against J-Hydra-PPO on the 113M model.

Issue 14 asks Hydra-PPO for 0.5x LoRA-PPO's latency per sample, or a profile of why this CPU cannot. This runs
`src/train.py` itself, one side after another (the README's memory-table settings, `model=llama100m`, sync PPO,
one update per batch), with its step's parts wrapped: each part's wall time is taken on every step after the first,
and on the last step each part runs under torch's FlopCounterMode (its time is not used), which counts every
matmul, attention and convolution of the forward and backward passes. Per sample the table gives each part's
time, its GFLOP and the rate it ran at, against the rate of the forward's widest float32 matmul run alone at the
RL stage's torch thread count (the CPU's float32 peak as torch reaches it; `torch_threads=1` is the default,
`--overrides torch_threads=null` gives the RL stage every core). Where both sides' parts run at the same rates,
J-Hydra-PPO's time per sample is LoRA-PPO's times the ratio of their FLOPs; it goes below that ratio only where its
parts run faster per FLOP (a larger batch's bigger matmuls). Only what runs inside `training_step` counts (not the
final evaluation).

    python benchmarks/step_flops.py --out benchmarks/step_flops.md
    python benchmarks/step_flops.py --overrides torch_threads=null --out benchmarks/step_flops_2threads.md

Each side is a child process (vs_trl.py's: its own process group, ended with the benchmark); the stage cache
(RLHFLAB_CACHE) is shared, so the SFT and reward stages train once. rlhflab as installed (`pip install -e .`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# (benchmarks/, this script's directory, is on sys.path)
from vs_trl import ROOT, child_env, run_child, stop_on_signals, work_directory

TIMEOUT_S = 3600  # per side: a 113M side takes about a minute here

# The README's memory-table settings (section "Memory strategies (issue 4)"); --model and --steps add the rest.
COMMON = ("algo=ppo algo.samples_per_prompt=2 algo.num_minibatches=1 algo.epochs=1 "
          "rl.eval_every=0 rl.eval_samples_per_prompt=1 task.num_eval_prompts=8 task.num_demonstrations=64 "
          "task.num_preference_pairs=64 stages.sft.epochs=1 stages.rm.epochs=1 stages.sft.batch_size=32 "
          "stages.rm.batch_size=32 trainer.enable_progress_bar=false").split()
SIDES = {
    "lora16": ("LoRA-PPO", 16, "memory=lora rl.prompts_per_step=16"),
    "joint16": ("J-Hydra-PPO", 16, "memory=hydra memory.actor_critic=joint rl.prompts_per_step=16"),
    "joint48": ("J-Hydra-PPO", 48, "memory=hydra memory.actor_critic=joint rl.prompts_per_step=48"),
}
# The step's parts, in order: (label, where the wrapped callable lives, its attribute)
PARTS = [
    ("generate", "rlhflab.rollout.sources", "SyncSource.get"),
    ("reward scores", "rlhflab.lit.rl_module", "score_rollout"),
    ("reference log-probs", "rlhflab.lit.rl_module", "RLHFModule._reference_logprobs"),
    ("values before the update", "rlhflab.lit.rl_module", "RLHFModule._values"),
    ("update: first forward", "rlhflab.lit.rl_module", "RLHFModule._first_forward"),
    ("update: the rest (forwards, backward, step)", "rlhflab.lit.rl_module", "RLHFModule._update"),
]


def child(result_path: str, overrides: list[str]) -> None:
    """In the side's own process: wrap the step's parts, then run src/train.py as `python src/train.py` would."""
    import functools
    import importlib
    import runpy

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from rlhflab.lit import rl_module

    max_steps = int(next(o.split("=")[1] for o in overrides if o.startswith("trainer.max_steps=")))
    state = {"step": 0, "depth": 0, "in_step": False}
    times: dict[str, list[float]] = {}
    flops: dict[str, float] = {}
    samples: list[int] = []

    def wrap(label, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if state["depth"] or not state["in_step"]:  # a part inside another part (the update's own forwards)
                return fn(*args, **kwargs)                # belongs to the outer one; the final evaluation to none
            state["depth"] += 1
            try:
                if state["step"] == max_steps:  # the last step: count, don't time
                    with FlopCounterMode(display=False) as counter:
                        out = fn(*args, **kwargs)
                    flops[label] = flops.get(label, 0.0) + counter.get_total_flops()
                    return out
                t = time.perf_counter()
                out = fn(*args, **kwargs)
                if state["step"] > 1:
                    times.setdefault(label, [0.0] * (max_steps - 1))[state["step"] - 2] += time.perf_counter() - t
                return out
            finally:
                state["depth"] -= 1
        return timed

    for label, module, attr in PARTS:
        owner = importlib.import_module(module)
        *path, name = attr.split(".")
        for p in path:
            owner = getattr(owner, p)
        setattr(owner, name, wrap(label, getattr(owner, name)))

    step = rl_module.RLHFModule.training_step

    def counted_step(self, batch, batch_idx):
        state["step"] += 1
        state["threads"] = torch.get_num_threads()  # the RL stage's (torch_threads)
        samples.append(int(batch[1].numel()) * self.algo.samples_per_prompt)
        state["in_step"] = True
        try:
            return step(self, batch, batch_idx)
        finally:
            state["in_step"] = False

    rl_module.RLHFModule.training_step = counted_step
    sys.argv = [str(ROOT / "src" / "train.py"), *overrides]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise
    finally:
        Path(result_path).write_text(json.dumps({"times": times, "flops": flops, "samples": samples,
                                                 "threads": state.get("threads")}))


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def host() -> str:
    """This CPU's model name, its CPU count and whether torch sees AMX tiles on it (oneDNN's bf16 kernels use them
    where it does; the CPU bf16 choices were measured on an AMX CPU first): the line a benchmark's table names its
    host with."""
    import torch

    try:
        amx = "yes" if torch.cpu._is_amx_tile_supported() else "no"
    except AttributeError:
        amx = "unknown (this torch cannot say)"
    return f"{cpu_name()}, {os.cpu_count()} CPUs, AMX tiles: {amx}"


def matmul_peak(rows: int, threads: int, reps: int = 5, calls: int = 4) -> float:
    """GFLOP/s of the forward's widest matmul ((rows x 768) @ (768 x 3072), float32) on `threads` threads, the best of
    `reps` means of `calls` calls: the rate the model's largest matmuls reach when nothing else runs. (At 20 calls a
    mean it took 12 s after every side on a 2-core AMD EPYC at 1 thread, more than a tiny-model side; at 4, 2 s, and
    three tries read 73-78 GFLOP/s against 73-85 at 20.)"""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(rows, 768), torch.randn(768, 3072)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - t) / calls)
    return 2 * rows * 768 * 3072 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sides", default="lora16,joint16,joint48", help=f"comma-separated, of {', '.join(SIDES)}")
    parser.add_argument("--model", default="llama100m", help="the model preset (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=6,
                        help="RL steps: the first is left out, the last counted, the rest timed (default: %(default)s)")
    parser.add_argument("--overrides", default="", help="more overrides for every side, e.g. torch_threads=null")
    parser.add_argument("--out", default=None, help="also write the table here (and its data beside it, as .json)")
    parser.add_argument("--keep", action="store_true", help="keep the runs' work directory (logs, MLflow db, JSON); a "
                        "failed benchmark keeps it always")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.child:
        return child(a.child[0], a.child[1:])

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as src/train.py sets it before torch loads (matmul_peak)
    stop_on_signals("step_flops.py")
    if a.steps < 3:
        sys.exit(f"--steps {a.steps}: at least 3 (one left out, one timed, one counted)")
    if a.out and not Path(a.out).resolve().parent.is_dir():
        sys.exit(f"--out {a.out}: no directory {Path(a.out).resolve().parent} to write it in")
    sides = a.sides.split(",")
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        sys.exit(f"--sides: unknown {', '.join(unknown)}; choose from {', '.join(SIDES)}")
    results = {}
    env = child_env()
    peaks: dict[int, list[float]] = {}

    def measure_peaks():
        for t in sorted({r["threads"] for r in results.values()} or {1}):
            peaks.setdefault(t, []).append(matmul_peak(1536, t))
    with work_directory("step_flops-", a.keep, " (each side's log: <side>.log)") as work:
        env.setdefault("RLHFLAB_CACHE", str(work / "cache"))
        for s in sides:
            out = work / f"{s}.json"
            overrides = [f"model={a.model}", *COMMON, f"trainer.max_steps={a.steps}", *SIDES[s][2].split(),
                         *a.overrides.split(), f"hydra.run.dir={work / s}", f"output.dir={work / s}",
                         f"logger.tracking_uri=sqlite:///{work / 'mlflow.db'}"]
            print(f"{time.strftime('%H:%M:%S')} {s}: python src/train.py {' '.join(overrides)}", flush=True)
            rc, *_ = run_child([sys.executable, __file__, "--child", str(out), *overrides], work / f"{s}.log", TIMEOUT_S, env)
            if rc:
                sys.exit(f"{s} failed (exit {rc}); its output: {work / f'{s}.log'}")
            results[s] = json.loads(out.read_text())
            measure_peaks()
    peak = {t: statistics.median(p) for t, p in peaks.items()}

    lines = [f"# A PPO step's parts per sample: time, GFLOP, rate (`python benchmarks/step_flops.py`)", "",
             f"Host {cpu_name()}, {time.strftime('%Y-%m-%d %H:%M')}, overrides "
             f"`{a.overrides or 'none'}`. Matmul peak: float32 (1536 x 768) @ (768 x 3072) alone, at the RL stage's "
             f"torch threads, measured after each side; " + "; ".join(
                 f"{t} thread{'s' if t > 1 else ''}: {peak[t]:.0f} GFLOP/s (median of {', '.join(f'{p:.0f}' for p in ps)})"
                 for t, ps in peaks.items())
             + f". Model `{a.model}`. Time: mean over steps 2-{a.steps - 1}; FLOPs: step {a.steps}, counted.", ""]
    per_sample = {}
    for s in sides:
        r = results[s]
        n_timed = r["samples"][1:-1]
        n_counted = r["samples"][-1]
        name, prompts, _ = SIDES[s]
        top = peak[r["threads"]]
        threads = f"{r['threads']} torch thread{'s' if r['threads'] > 1 else ''}"
        lines += [f"## {name}, {prompts} prompts x 2 samples a step (`{SIDES[s][2]}`), {threads}", "",
                  "| part | ms/sample | GFLOP/sample | GFLOP/s | of matmul peak |", "|---|---|---|---|---|"]
        tot_t = tot_f = 0.0
        for label, _, _ in PARTS:
            if label not in r["times"] and label not in r["flops"]:
                continue
            t = sum(r["times"].get(label, [0.0])[: len(n_timed)]) / sum(n_timed)
            f = r["flops"].get(label, 0.0) / n_counted / 1e9
            tot_t, tot_f = tot_t + t, tot_f + f
            rate = f / t if t else float("nan")
            lines.append(f"| {label} | {t * 1e3:.3g} | {f:.3g} | {rate:.0f} | {rate / top:.0%} |")
        lines += [f"| **the parts together** | **{tot_t * 1e3:.4g}** | **{tot_f:.4g}** | {tot_f / tot_t:.0f} | "
                  f"{tot_f / tot_t / top:.0%} |", ""]
        per_sample[s] = (tot_t, tot_f)
    if "lora16" in per_sample:
        base_t, base_f = per_sample["lora16"]
        lines += ["## Against LoRA-PPO at 16 prompts", "", "| side | time per sample | FLOPs per sample |", "|---|---|---|"]
        for s in sides:
            t, f = per_sample[s]
            lines.append(f"| {SIDES[s][0]}, {SIDES[s][1]} prompts | {t / base_t:.2f}x | {f / base_f:.2f}x |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
        Path(a.out).with_suffix(".json").write_text(json.dumps({"peak_gflops": peaks, "overrides": a.overrides,
                                                                 "results": results}, indent=1))


if __name__ == "__main__":
    main()
