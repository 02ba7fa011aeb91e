"""rlhflab against TRL, side by side: same SFT policy, prompts, rule reward and settings, interleaved runs.

    pip install -e ".[bench]"          # TRL (never a runtime dependency of rlhflab)
    nice -n 19 python benchmarks/vs_trl.py                      # 60 steps, 3 reps, RLOO / GRPO / online DPO, sync + async
    python benchmarks/vs_trl.py --steps 5 --reps 1 --algos rloo  # a smoke run
    # a second setting, with each framework's best thread count (2 intra-op threads pay on a 113M model), at a rate
    # where no side's policy learns to stop early within the steps (at lr 1e-3 TRL's did: see completion tokens):
    python benchmarks/vs_trl.py --model llama100m --max-new-tokens 32 --prompts-per-step 8 --steps 15 --lr 1e-4 --reps 1 --sides rlhflab,rlhflab_2threads,rlhflab_async,trl,trl_2threads

What is compared
- The policy: the SFT policy of rlhflab's default run (stage `sft` of `python src/train.py`, in batches of 64 at lr
  1e-3 as every recorded table used: PREP below), made once by
  rlhflab's own CLI into --cache and loaded by both sides from that directory (`model.sft_path=` for rlhflab,
  `from_pretrained` for TRL). The reference model is a frozen copy of it on both sides.
- The prompts: the embedded sentiment task's train prompts (`SentimentTask(...).prompts("train")`).
- The reward: the task's gold rule, `reward=rule` in rlhflab; for TRL a plain Python reward function that
  calls the same `SentimentTask.gold_reward`. No EOS penalty on either side by default (`rl.eos_penalty=null`);
  --eos-penalty X gives both sides the same one (rlhflab's semantics: it replaces the score of a completion
  without EOS; TRL's own `missing_eos_penalty` subtracts instead, so it is applied inside the reward function).
- The settings: RLHFLAB_OVERRIDES and TRL_COMMON / TRL_ALGO below, every TRL default that differs set to rlhflab's.
- The optimizer: AdamW on PyTorch's fused kernel on both sides (TRL's default `adamw_torch_fused`; rlhflab's RL update:
  `rlhflab.lit.optim.adamw`, since 2026-11-25; the tables measured before then had rlhflab on torch's per-tensor
  loop, 0.4 ms of a 30-40 ms tiny step), lr, betas, eps 1e-5, no weight decay, clip 1.0.

Sides (--sides; the default is the first five)
- `rlhflab sync`: mode=sync, one process, 1 torch thread per Python thread: generate with the current weights,
  then learn (as TRL), with the reference's forward beside the update's policy forward where the default
  mode.reference=auto puts it (fastest: in a forked process for steps 1-5, in a second thread for steps 6-10, each
  timed, then the faster of the two for the rest; the choice is made before step 11, where --log-every 10's timing
  starts): the same numbers, on the second core. `rlhflab sync thread` (not a default side): a second thread
  from the start, mode.reference=thread (what `auto` picked before 2026-12-04, and this side's setting then).
- `rlhflab sync process`: the same with mode.reference=process: the reference's forward in a forked process
  beside the update's policy forward instead of a thread (its own GIL; on the tiny model the thread's two forwards
  partly take turns for it). The same numbers again.
- `rlhflab sync 1 thread`: the same with mode.reference=learner: one thread, the reference's forward before the
  update's, exactly TRL's use of the machine.
- `rlhflab async`: mode=async staleness=1 mode.reference=generator: a forked generator process (1 torch thread)
  makes batch i with the weights after update i-1, and its reference log-probs, while the learner (1 torch
  thread) trains on batch i-1. Two processes, so both of the machine's 2 cores; batches are one update stale.
- `rlhflab sync, every row's prompt run` and `rlhflab async, every row's prompt run` (not default sides): the same as
  `rlhflab sync` and `rlhflab async` with rl.prompt_once=false, the learner's log-prob forwards over every row's
  prompt as before 2026-12-06: what running each prompt's positions once for its k samples gives, side by side.
- `TRL`: one process, 1 torch thread. TRL has no way to put a second CPU core to work but intra-op threads.
- `TRL 2 threads` and `rlhflab sync 2 threads` (mode.reference=learner, torch_threads=2): each framework's use of
  both cores through intra-op threads. Which thread count is a framework's best depends on the model, so the
  ratios are taken against the fastest TRL side run ("best TRL"). On the tiny model 2 threads slow both down
  (TRL 1,122-1,321 against 1,391-1,794 completions/s with 1 thread, 3 reps, 2026-11-23); on llama100m, whose
  matmuls are large, they speed both up ~1.5x, and TRL's best there is 2 threads.
- `TRL + MLflow`: TRL with report_to="mlflow" (its MLflowCallback, a metric set every step as logging_steps=1) into
  a SQLite store like rlhflab's: both frameworks tracking the same way, for the memory comparison.

How it is measured
- Every run is its own subprocess (the same Python, torch and thread settings: OMP_WAIT_POLICY=PASSIVE,
  the side's torch threads), run interleaved: for each rep, for each algorithm, each side (the order turns
  between reps).
- Memory, two ways: peak RSS, the child's ru_maxrss from os.wait4 (imports, model load and all; for a process
  tree, the largest process's); and peak PSS of the whole process tree, sampled once a second from
  /proc/<pid>/smaps_rollup (pages shared after fork counted once: the async side's generator and learner together).
  Reading smaps_rollup of a 700 MB process took 22 ms of kernel time: sampled every 50 ms it took ~40% of a core
  from the runs (the async side, which uses both cores, lost most); the peak is a plateau from model load to exit.
- Logging: both sides log the mean of each metric once per --log-every steps (default 10, TRL's own
  `logging_steps` default; rlhflab `trainer.log_every_n_steps`), rlhflab into MLflow, TRL to nothing. The side
  `rlhflab_log1` writes every step's metrics whatever --log-every says (rlhflab's default): what that costs.
- completions/s = completions of steps L+1..N / wall time from the end of step L to the end of step N, where L is
  --log-every (steps 2..N at --log-every 1), on both sides (model load, startup, the first steps' warm-up and
  rlhflab's before/after evaluation excluded). The end of a step is the time rlhflab logs its step metrics (the
  MLflow metric timestamp, taken in the step after its optimizer update) and TRL's `on_step_end` callback (after its
  optimizer update).
- completion tokens = the mean completion length over the same timed steps, in tokens up to and including the
  first EOS (both frameworks' masks): rlhflab's `train/response_len`, TRL's `completion_ids` as its reward function
  gets them. completions/s compares the frameworks' speed only where these match: a policy that has learned to stop
  early is cheaper to sample and to train on. At lr 1e-3 on llama100m TRL's RLOO policy fell to 1-4 token
  completions within 15 steps (its steps 7.1 -> 1.3 s) while rlhflab's async one still wrote 30-32.
- final reward = the mean batch reward (mean gold score of the step's completions, before any KL term) over the
  last 10 steps: rlhflab's `train/reward` (each logged value the mean over its steps), TRL's reward function's mean
  on each call (once per step). On the async
  side a step's batch was sampled by the policy one update older, so a rising curve reads one step low there.
- policy reward = the trained policy itself, judged after the run by one piece of code for every side (`_eval`, its
  own process, outside every measurement): each side saves its final policy (rlhflab: the run's `policy/`; TRL:
  `trainer.save_model`), which is loaded with `from_pretrained` and samples --eval-samples completions for each of
  --eval-prompts held-out prompts (the task's eval split, which never shares a seed with the train prompts) at the
  training temperature and token budget, with the same torch seed for every side; the mean gold reward. This is
  "learning per step" without the async lag: every side's policy after the same number of updates.
- The table gives medians over reps.

Unfairness that is not removed (see also the comments in TRL_COMMON / TRL_ALGO)
- rlhflab logs ~20-40 metrics per step to MLflow (SQLite, written in one batch a second, logger.flush_every_s) and runs its evaluation at start and
  end (64 prompts x 4 samples, outside the timed window); TRL logs to nothing (`report_to="none"`), its best case,
  except on the `TRL + MLflow` side.
- Prompt order: each side shuffles the same prompt pool with its own seeded sampler.
- GRPO: the std epsilon in (r - mean) / (std + eps) is 1e-4 in TRL (hard-coded), 1e-6 in rlhflab.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "src" / "train.py"
ALGOS = ("rloo", "grpo", "online_dpo")
LABEL = {"rloo": "RLOO", "grpo": "GRPO", "online_dpo": "online DPO"}
LAST = 10  # final reward: mean batch reward over the last LAST steps

# ---- rlhflab's side: its CLI with these overrides (values that are already defaults are stated anyway) ----
RLHFLAB_OVERRIDES = [
    "reward=rule",                       # the task's gold rule scores completions (no reward model)
    "memory=full",                       # separate policy and frozen reference copy (as TRL)
    "generator=hf",                      # HF generate(), as TRL without vLLM
    "trainer=cpu",
    "trainer.precision=32-true",         # float32, no autocast (--precision bf16: bf16-mixed, PRECISION below)
    "memory.gradient_checkpointing=false",
    "rl.eval_every=0",                   # evaluate only before and after RL (outside the timed window)
    "trainer.enable_progress_bar=false",
    "output.log_policy=false",           # do not copy the policy into MLflow's artifact store at the end
    "rl.max_grad_norm=1.0",
]
RLHFLAB_ALGO = {
    "rloo": ["algo.kl_coef=0.05", "algo.kl_estimator=k1", "algo.clip_eps=0.2", "algo.loss_agg=seq-mean-token-sum",
             "algo.epochs=1", "algo.num_minibatches=1"],
    # off_policy=decoupled (algo=grpo's default): in sync mode pi_prox = the update's own forward, TRL's old
    # log-probs at num_iterations=1; in async mode AReaL's correction of the one-update-stale samples.
    "grpo": ["algo.kl_loss_coef=0.04", "algo.clip_eps=0.2", "algo.scale_by_std=true", "algo.loss_agg=seq-mean-token-mean",
             "algo.epochs=1", "algo.num_minibatches=1", "off_policy=decoupled"],
    # ties=keep: TRL's OnlineDPOTrainer has no tie handling (a tied pair trains its first sample over its
    # second, `first >= second`); rlhflab's default skips tied groups, `keep` does what TRL does.
    "online_dpo": ["algo.beta=0.1", "algo.loss_type=sigmoid", "algo.ties=keep", "algo.loss_agg=seq-mean-token-sum",
                   "algo.epochs=1", "algo.num_minibatches=1"],
}

# Each rlhflab side's mode and torch threads. Sync (generate with the current weights, then learn, as TRL) with the
# reference's forward beside the update's policy forward as the default mode.reference=auto puts it on this machine
# (fastest: a forked process for the first 5 steps, a second thread for the next 5, then the faster of the two), or
# in a second thread or a forked process from the start, or in the one thread before it (exactly TRL's use of the
# machine), or that with 2 intra-op threads; async: a forked generator process, 1 torch thread per process, so 1 + 1
# on the 2 cores.
SIDE_MODE = {
    "rlhflab": ["mode=sync", "mode.reference=auto", "torch_threads=1"],
    "rlhflab_thread": ["mode=sync", "mode.reference=thread", "torch_threads=1"],
    "rlhflab_process": ["mode=sync", "mode.reference=process", "torch_threads=1"],
    # The same with the learner sampling every row (the process computes the reference only): what
    # mode.split_generation, the process sampling half of each batch, gives side by side.
    "rlhflab_process_whole": ["mode=sync", "mode.reference=process", "mode.split_generation=false", "torch_threads=1"],
    "rlhflab_1thread": ["mode=sync", "mode.reference=learner", "torch_threads=1"],
    "rlhflab_2threads": ["mode=sync", "mode.reference=learner", "torch_threads=2"],
    # rlhflab sync writing its step metrics to MLflow at every step whatever --log-every says (the default, before
    # TRL's logging interval was set equal): what logging costs, side by side.
    "rlhflab_log1": ["mode=sync", "mode.reference=auto", "torch_threads=1", "trainer.log_every_n_steps=1"],
    "rlhflab_async": ["mode=async", "staleness=1", "mode.reference=generator", "mode.generator_threads=1",
                      "mode.learner_threads=1", "torch_threads=1"],
    # The same with each batch's reference rows split between generator and learner so both are equally busy.
    "rlhflab_async_balance": ["mode=async", "staleness=1", "mode.reference=balance", "mode.generator_threads=1",
                              "mode.learner_threads=1", "torch_threads=1"],
    # The async side with autocast's own bf16 products in generate() (no weights laid out once per call): what
    # generator.prepack gives under --precision bf16, side by side (float32 runs the same code either way).
    "rlhflab_async_noprepack": ["mode=async", "staleness=1", "mode.reference=generator", "mode.generator_threads=1",
                                "mode.learner_threads=1", "torch_threads=1", "generator.prepack=false"],
    "rlhflab_2threads_noprepack": ["mode=sync", "mode.reference=learner", "torch_threads=2", "generator.prepack=false"],
    # The default sync side and the async side with one forward over every row in the learner's log-prob forwards
    # (rl.prompt_once=false, as before it): what running each prompt's positions once gives, side by side.
    "rlhflab_whole_prompts": ["mode=sync", "mode.reference=auto", "torch_threads=1", "rl.prompt_once=false"],
    "rlhflab_async_whole_prompts": ["mode=async", "staleness=1", "mode.reference=generator", "mode.generator_threads=1",
                                    "mode.learner_threads=1", "torch_threads=1", "rl.prompt_once=false"],
}
# TRL's sides: torch.set_num_threads in its one process, and its tracker (report_to): none, or MLflow into a
# SQLite store in the run's directory as rlhflab's (TRL's MLflowCallback, logging every step as logging_steps=1).
TRL_SIDE = {"trl": {"threads": 1, "report_to": "none"}, "trl_2threads": {"threads": 2, "report_to": "none"},
            "trl_mlflow": {"threads": 1, "report_to": "mlflow"}}
SIDES = (*SIDE_MODE, *TRL_SIDE)
DEFAULT_SIDES = ("rlhflab", "rlhflab_process", "rlhflab_1thread", "rlhflab_async", "trl")
SIDE_LABEL = {"rlhflab": "rlhflab sync", "rlhflab_thread": "rlhflab sync thread", "rlhflab_log1": "rlhflab sync logging every step", "rlhflab_process": "rlhflab sync process", "rlhflab_process_whole": "rlhflab sync process, the learner sampling every row", "rlhflab_1thread": "rlhflab sync 1 thread", "rlhflab_2threads": "rlhflab sync 2 threads",
              "rlhflab_async": "rlhflab async", "rlhflab_async_balance": "rlhflab async balance",
              "rlhflab_async_noprepack": "rlhflab async without prepack",
              "rlhflab_2threads_noprepack": "rlhflab sync 2 threads without prepack",
              "rlhflab_whole_prompts": "rlhflab sync, every row's prompt run",
              "rlhflab_async_whole_prompts": "rlhflab async, every row's prompt run", "trl": "TRL",
              "trl_2threads": "TRL 2 threads",
              "trl_mlflow": "TRL + MLflow"}

# ---- TRL's side: every TRL default that differs from rlhflab's, set to rlhflab's ----
TRL_COMMON = {
    "bf16": False,                       # TRL default True (bf16 autocast, also on CPU); rlhflab: float32
    "fp16": False,
    "gradient_checkpointing": False,     # TRL default True; rlhflab: memory.gradient_checkpointing=false
    "lr_scheduler_type": "constant",     # TRL default linear decay to 0; rlhflab: constant lr
    "warmup_steps": 0,                   # (transformers default 0 too)
    "adam_epsilon": 1e-5,                # transformers default 1e-8; rlhflab's AdamW eps=1e-5
    "weight_decay": 0.0,                 # (default 0.0 too); rlhflab weight_decay=0.0
    "adam_beta1": 0.9,                   # (defaults, as torch.optim.AdamW's)
    "adam_beta2": 0.999,
    "max_grad_norm": 1.0,                # (default 1.0); rlhflab rl.max_grad_norm=1.0
    "gradient_accumulation_steps": 1,    # one optimizer step per rollout batch
    "use_cpu": True,
    "seed": 0,                           # rlhflab seed=0
    "logging_steps": None,               # set from --log-every (TRL default 10: the mean of each metric over 10 steps;
                                         # rlhflab trainer.log_every_n_steps, the same mean)
    "report_to": "none",                 # no tracker (rlhflab tracks to MLflow: counted against rlhflab)
    "save_strategy": "no",               # no checkpoints (rlhflab: checkpoint.every_n_steps=null)
    "disable_tqdm": True,                # no progress bar (rlhflab: trainer.enable_progress_bar=false)
    "dataloader_num_workers": 0,
}
# For RLOO / GRPO, per_device_train_batch_size counts completions (prompts x k); for online DPO, prompts.
TRL_ALGO = {
    "rloo": {
        "beta": 0.05,                        # TRL default 0.05 = rlhflab algo.kl_coef (k1, summed, folded into the reward)
        "num_iterations": 1,                 # mu=1 (default): one update per batch, as rlhflab algo.epochs=1
        "epsilon": 0.2,                      # (default) = rlhflab algo.clip_eps (inactive at ratio 1)
        "normalize_advantages": False,       # (default) rlhflab RLOO does not whiten
        "mask_truncated_completions": False, # (default) rlhflab trains on truncated completions too
        "temperature": None,                 # set from --temperature (TRL RLOO default 1.0)
        "top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0,  # full distribution, as rlhflab
        "disable_dropout": True,             # TRL default False; the models have no dropout anyway (p=0)
    },
    "grpo": {
        "beta": 0.04,                        # TRL default 0.0 (no KL, no reference model); rlhflab algo.kl_loss_coef=0.04 (k3 in the loss)
        "loss_type": "grpo",                 # TRL default "dapo" (token sum / batch tokens); rlhflab seq-mean-token-mean = TRL "grpo"
        "scale_rewards": "group",            # (default) (r - group mean) / group std, as rlhflab algo.scale_by_std=true
        "use_bias_correction_kl": False,     # TRL default True multiplies the k3 term by the (differentiable) ratio; rlhflab does not
        "importance_sampling_level": "token",  # (default) token ratio, as rlhflab
        "num_iterations": 1,                 # mu=1 (default)
        "epsilon": 0.2,                      # (default) = rlhflab algo.clip_eps
        "mask_truncated_completions": False,
        "top_entropy_quantile": 1.0,         # (default) every token in the loss
        "temperature": None,                 # set from --temperature (TRL GRPO default 1.0)
        "top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0,
        "disable_dropout": True,
    },
    "online_dpo": {
        "beta": 0.1,                         # (default) = rlhflab algo.beta
        "loss_type": "sigmoid",              # (default) = rlhflab algo.loss_type
        "missing_eos_penalty": None,         # (default) the EOS penalty, if any, is applied in the reward function (rlhflab semantics)
        "temperature": None,                 # TRL default 0.9; set from --temperature. TRL's online DPO computes
                                             # training log-probs at temperature 1 whatever it samples with; rlhflab
                                             # divides by the temperature: identical only at temperature 1.0
        "top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0,
        "disable_dropout": True,             # (default)
    },
}
# --precision: float32, no autocast, on both sides (the setting), or bf16 autocast over float32 weights on both (TRL's own
# default, bf16=True; rlhflab trainer.precision=bf16-mixed): on a CPU with AMX (Intel Xeon 4th gen and after) its
# matmuls run 2-3x faster. Each side generates, scores and learns under its autocast.
PRECISION = {"fp32": {"rlhflab": "trainer.precision=32-true", "trl": {}},
             "bf16": {"rlhflab": "trainer.precision=bf16-mixed", "trl": {"bf16": True}}}

ENV = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

# Models: the overrides of the (untimed) run that makes the SFT policy; tiny = the default run's stage sft, at the
# batch and rate every recorded table used (train.yaml's before 128 at 2e-3: the same policy, cached in --cache),
# in one forward a batch as before stages.batch_threads (whose shares round otherwise: another policy's last digits).
PREP = {
    "tiny": ["stages.sft.batch_size=64", "stages.sft.lr=1e-3", "stages.batch_threads=1"],
    # A 113M-parameter Llama is slow on CPU: a short SFT (its completions run to the token budget more often).
    "llama100m": ["task.num_demonstrations=64", "stages.sft.epochs=1", "stages.sft.batch_size=32", "stages.batch_threads=1"],
}
# Per model, rlhflab overrides of every run that only shorten its untimed before/after evaluation
# (64 held-out prompts x 4 samples take minutes on a 113M model on CPU); TRL evaluates nothing.
EVAL = {
    "llama100m": ["rl.eval_samples_per_prompt=1", "task.num_eval_prompts=8"],
}

# Per model, the policy reward's held-out prompts x samples: 4,096 completions judge a tiny policy in seconds to a
# standard error of ~0.005; a 113M policy samples ~10 completions/s on this CPU.
JUDGE = {"tiny": (512, 8), "llama100m": (32, 4)}

# ---------------------------------------------------------------------------------------------------------
# Children
# ---------------------------------------------------------------------------------------------------------

def child_env() -> dict:
    env = dict(os.environ)
    for k, v in ENV.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def tree_pids(pid: int) -> set[int]:
    """A process and all its descendants."""
    pids, todo = set(), [pid]
    while todo:
        p = todo.pop()
        pids.add(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone meanwhile
    return pids


def pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def tree_pss_kb(pid: int) -> int | None:
    """PSS (KiB) of a process and its descendants (shared pages split between the processes mapping them),
    or None when the tree changed while it was read: a process forked between two reads (MLflow runs `git`)
    would have its parent's pages counted at full size in the one and at half in the other."""
    pids = tree_pids(pid)
    total = sum(pss_kb(p) for p in pids)
    return total if tree_pids(pid) == pids else None


class PeakPss(threading.Thread):
    """Samples tree_pss_kb(pid) every `every` seconds until stopped; .peak_mb is the largest sample."""

    def __init__(self, pid: int, every: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.pid, self.every, self.peak_kb = pid, every, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every):
            self.peak_kb = max(self.peak_kb, tree_pss_kb(self.pid) or 0)

    @property
    def peak_mb(self) -> float:
        return self.peak_kb / 1024


def run_child(cmd: list[str], log: Path, timeout: float, env: dict) -> tuple[int, float, float, float]:
    """Run cmd in its own process group -> (exit code, peak RSS MB of the child, peak PSS MB of its tree, wall seconds)."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        # Everything after the child starts is inside the try: a SIGTERM (stop_on_signals) that came while the PSS
        # thread started (its start() waits for it, longer on a loaded machine) left the child running and the
        # timer's thread, not yet cancelled, holding the interpreter's exit for `timeout` s. A daemon timer too.
        timer = pss = status = None
        try:
            timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
            timer.daemon = True
            timer.start()
            pss = PeakPss(proc.pid)
            pss.start()
            _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (ru_maxrss in KiB on Linux)
        finally:
            if pss is not None:
                pss.done.set()
                if pss.ident is not None:  # started
                    pss.join()
            if timer is not None:
                timer.cancel()
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # anything it left behind
            except ProcessLookupError:
                pass
            if status is None:  # stopped before wait4 returned: reap the child killed above
                proc.wait()
        proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss / 1024, pss.peak_mb, time.perf_counter() - t0


def rlhflab_cmd(a, algo: str, sft: str | None, steps: int, out_dir: Path, extra: list[str], side: str = "rlhflab",
                precision: str | None = None) -> list[str]:
    """An rlhflab run's command line; `precision` (default --precision) is fp32 for the SFT policy's run, so every
    --precision starts from the same policy."""
    k = a.k if algo != "online_dpo" else 2
    overrides = [PRECISION[precision or a.precision]["rlhflab"] if o.startswith("trainer.precision=") else o
                 for o in RLHFLAB_OVERRIDES]
    if not any(o.startswith("trainer.log_every_n_steps=") for o in SIDE_MODE[side]):
        overrides.append(f"trainer.log_every_n_steps={a.log_every}")
    cmd = [sys.executable, str(TRAIN), f"model={a.model}", f"algo={algo}", *overrides, *SIDE_MODE[side], *RLHFLAB_ALGO[algo],
           f"algo.samples_per_prompt={k}", f"trainer.max_steps={steps}", f"rl.prompts_per_step={a.prompts_per_step}",
           f"rl.lr={a.lr}", f"generator.temperature={a.temperature}", "model.dtype=float32",
           f"generator.max_new_tokens={a.max_new_tokens if a.max_new_tokens else 'null'}",
           f"rl.eos_penalty={'null' if a.eos_penalty is None else a.eos_penalty}", f"seed={a.seed}",
           f"task.response_words={a.response_words}", f"output.dir={out_dir}",
           f"hydra.run.dir={out_dir}",  # Hydra's train.log and .hydra/ as well: else outputs/<date>/<time>/ in ROOT, one a run
           *EVAL.get(a.model, []), *extra]
    if sft:
        cmd.append(f"model.sft_path={sft}")
    return cmd


def read_rlhflab(db: Path, run_id: str) -> dict:
    """The logged steps, their end times (MLflow metric timestamps, s) and batch rewards (each the mean over the steps
    since the one logged before: trainer.log_every_n_steps) of one rlhflab run."""
    with sqlite3.connect(db) as c:
        rows = c.execute("select step, value, timestamp from metrics where run_uuid=? and key='train/reward' order by step",
                         (run_id,)).fetchall()
        lengths = dict(c.execute("select step, value from metrics where run_uuid=? and key='train/response_len'",
                                 (run_id,)).fetchall())
        own = c.execute("select value from metrics where run_uuid=? and key='perf/mean_samples_per_s'", (run_id,)).fetchone()
        params = dict(c.execute("select key, value from params where run_uuid=?", (run_id,)).fetchall())
    return {"steps": [r[0] for r in rows], "rewards": [r[1] for r in rows], "step_end": [r[2] / 1000 for r in rows],
            "lengths": [lengths[r[0]] for r in rows],
            "own_samples_per_s": own[0] if own else None, "policy_start": params.get("rlhflab.policy_start")}


def completion_length(ids: list[int], eos: int) -> int:
    """A TRL completion's length as rlhflab's `train/response_len` counts it (rlhflab.rollout.batch.
    response_mask_from_eos): up to and including the first EOS, else all of it (TRL's online DPO passes padded rows)."""
    return ids.index(eos) + 1 if eos in ids else len(ids)


def trl_child(a) -> None:
    """One TRL run (this process is the measured child): writes step end times and batch rewards to a.json."""
    import torch

    torch.set_num_threads(a.threads)  # as rlhflab's torch_threads
    torch.manual_seed(a.seed)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from rlhflab.tasks.sentiment import SentimentTask

    t_start = time.perf_counter()
    task = SentimentTask(response_words=a.response_words, seed=a.seed)  # conf/task/sentiment.yaml's other defaults
    max_new = a.max_new_tokens or task.max_new_tokens
    tok = AutoTokenizer.from_pretrained(a.sft)
    model = AutoModelForCausalLM.from_pretrained(a.sft, dtype=torch.float32)
    eos = tok.eos_token_id
    rewards: list[float] = []
    lengths: list[float] = []

    def gold(prompts, completions, completion_ids, **kwargs):
        """The task's gold rule (rlhflab reward=rule); the EOS penalty, if any, replaces the score as rlhflab's does.
        Records the batch's mean reward and mean completion length (up to and including the first EOS)."""
        r = task.gold_reward(list(prompts), list(completions))
        ids = [list(row) for row in completion_ids]
        if a.eos_penalty is not None:
            no_eos = torch.tensor([eos not in row for row in ids])
            r[no_eos] = a.eos_penalty
        rewards.append(float(r.mean()))
        lengths.append(sum(completion_length(row, eos) for row in ids) / len(ids))
        return r.tolist()

    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    ds = Dataset.from_dict({"prompt": task.prompts("train")})
    settings = {**TRL_COMMON, **TRL_ALGO[a.algo], **PRECISION[a.precision]["trl"], "report_to": a.report_to, "temperature": a.temperature, "learning_rate": a.lr,
                "logging_steps": a.log_every, "max_steps": a.steps, "output_dir": str(Path(a.json).parent / "trl-out")}
    if a.algo in ("rloo", "grpo"):
        from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

        Config, Trainer = (RLOOConfig, RLOOTrainer) if a.algo == "rloo" else (GRPOConfig, GRPOTrainer)
        cfg = Config(**settings, per_device_train_batch_size=a.prompts_per_step * a.k, num_generations=a.k,
                     max_completion_length=max_new)
        trainer = Trainer(model=model, reward_funcs=gold, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[Clock()])
    else:
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

        cfg = OnlineDPOConfig(**settings, per_device_train_batch_size=a.prompts_per_step, max_new_tokens=max_new)
        trainer = OnlineDPOTrainer(model=model, reward_funcs=gold, args=cfg, train_dataset=ds, processing_class=tok,
                                   callbacks=[Clock()])
    t_ready = time.perf_counter()
    trainer.train()
    trainer.save_model(str(Path(a.json).parent / "policy"))  # after the timed steps: for the policy reward
    Path(a.json).write_text(json.dumps({"step_end": ends, "rewards": rewards, "lengths": lengths, "startup_s": t_ready - t_start,
                                        "settings": {k: v for k, v in cfg.to_dict().items() if k in settings or k in
                                                     ("per_device_train_batch_size", "num_generations", "max_completion_length",
                                                      "max_new_tokens", "optim")}}))


def policy_reward(policy: str, temperature: float, max_new_tokens: int | None, response_words: int, num_prompts: int,
                  samples: int, seed: int) -> tuple[float, float]:
    """(mean, standard error) of the gold reward of a saved policy's sampled completions on held-out prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhflab.tasks.sentiment import SentimentTask

    task = SentimentTask(response_words=response_words, num_eval_prompts=num_prompts, seed=seed)
    tok = AutoTokenizer.from_pretrained(policy, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    rewards = []
    prompts = task.prompts("eval")
    for i in range(0, len(prompts), 64):
        batch = prompts[i:i + 64]
        enc = tok(batch, add_special_tokens=False, padding=True, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new_tokens or task.max_new_tokens, num_return_sequences=samples,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        rewards.append(task.gold_reward([p for p in batch for _ in range(samples)], texts))
    r = torch.cat(rewards)
    return float(r.mean()), float(r.std() / len(r) ** 0.5)


def eval_child(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    for name in ("--policy", "--json"):
        p.add_argument(name, required=True)
    for name in ("--response-words", "--prompts", "--samples", "--seed"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--temperature", type=float, required=True)
    p.add_argument("--max-new-tokens", type=int, default=None)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    mean, se = policy_reward(a.policy, a.temperature, a.max_new_tokens, a.response_words, a.prompts, a.samples, a.seed)
    Path(a.json).write_text(json.dumps({"policy_reward": mean, "policy_reward_se": se}))


# ---------------------------------------------------------------------------------------------------------
# The parent
# ---------------------------------------------------------------------------------------------------------

def summarize(steps: list[int], step_end: list[float], rewards: list[float], lengths: list[float], per_step: int,
              first: int) -> dict:
    """Completions/s over the steps after `first` (from the end of step `first` to the end of the last step), the
    mean completion length over those steps and the final reward, the mean batch reward over the last LAST steps, of
    a run whose `rewards` and `lengths` were recorded at `steps`, each the mean over the steps since the one recorded
    before (TRL's: one a step)."""
    timed = [(step, end) for step, end in zip(steps, step_end) if step >= first]
    if len(timed) < 2 or timed[0][0] != first:
        raise RuntimeError(f"steps {steps[:3]}..{steps[-1:]} recorded: the end of step {first} and a later one are "
                           f"needed to time steps {first + 1}..N")
    (s0, t0), (s1, t1) = timed[0], timed[-1]
    if len(lengths) != len(steps):
        raise RuntimeError(f"{len(lengths)} completion lengths recorded for {len(steps)} steps")
    later = [(step, length) for step, length in zip(steps, lengths) if step > s0]  # each the mean since the one before
    since = [s0] + [step for step, _ in later[:-1]]
    total = weight = before = 0
    for step, reward in zip(steps, rewards):  # each value weighted by its steps among the last LAST
        covered = max(0, step - max(before, steps[-1] - LAST))
        total, weight, before = total + covered * reward, weight + covered, step
    return {"completions_per_s": (s1 - s0) * per_step / (t1 - t0), "rl_s": t1 - t0, "first": s0, "steps": s1,
            "completion_tokens": sum((step - p) * length for p, (step, length) in zip(since, later)) / (s1 - s0),
            "final_reward": total / weight, "rewards": rewards, "lengths": lengths}


def child_failed(what: str, code: int, wall: float, log: Path, timeout: float) -> SystemExit:
    """One line for a child that failed: why (its exit code, or --timeout), its own error line (or last line), and
    its log, which main() keeps (it was deleted with the work directory, and the message pointed at it)."""
    why = f"killed at --timeout {timeout:g} s" if code == -signal.SIGKILL and wall >= timeout else f"exit {code}"
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.is_file() else []
    lines = [line for line in lines if not line.startswith("Set the environment variable HYDRA_FULL_ERROR")]  # Hydra's tail
    said = next((line for line in reversed(lines) if line.startswith("error:")), None)  # rlhflab's one line
    said = said or next((line for line in reversed(lines) if re.match(r"[\w.]*(Error|Exception|Interrupt)\b", line)),
                        lines[-1] if lines else "(no output)")  # else a traceback's last exception
    return SystemExit(f"{what} failed ({why}): {said}\n  its log: {log}")


# What both sides run from one flag (rlhflab_cmd gives rlhflab the flag's value; the TRL child reads the same flag):
# an --rlhflab-override of it changes one side only
SHARED_KEYS = {"rl.lr": "--lr", "generator.temperature": "--temperature", "algo.samples_per_prompt": "--k",
               "rl.prompts_per_step": "--prompts-per-step", "trainer.max_steps": "--steps",
               "generator.max_new_tokens": "--max-new-tokens", "rl.eos_penalty": "--eos-penalty", "seed": "--seed",
               "task.response_words": "--response-words", "model.dtype": "float32 on both sides",
               "trainer.log_every_n_steps": "--log-every",
               "trainer.precision": "--precision"}


def one_sided(overrides: list[str]) -> list[str]:
    """A warning for each --rlhflab-override that changes what the TRL side runs alike (a shared flag's key, the
    task's settings, the algorithm's matched ones): the table then compares unequal settings, without a word."""
    said = []
    for override in overrides:
        key = override.partition("=")[0].lstrip("+~")
        if key in SHARED_KEYS:
            why = f"the TRL side keeps {SHARED_KEYS[key]}" + ("" if " " in SHARED_KEYS[key] else "'s value; give that flag instead")
        elif key.startswith("task."):
            why = "the TRL side keeps conf/task/sentiment.yaml's task"
        elif key.startswith(("algo.", "off_policy.")):
            why = "the TRL side keeps its matched settings (TRL_ALGO in benchmarks/vs_trl.py)"
        else:
            continue
        said.append(f"vs_trl.py: warning: --rlhflab-override {override}: {why}; the sides no longer run the same setting")
    return said


def check_commands(a) -> None:
    """Every rlhflab command the benchmark will run, through rlhflab's own preflight (no model, ~0.5 s each), before
    the SFT policy is made: a bad --model, --k or --rlhflab-override failed only in its child, after the SFT run
    (an override that one algorithm lacks, halfway through the benchmark)."""
    import contextlib
    import io

    from rlhflab.cli import preflight

    scratch = Path(tempfile.gettempdir()) / "vs_trl-check"
    commands = [("preparing the SFT policy", rlhflab_cmd(a, "rloo", None, 1, scratch, PREP.get(a.model, []) + a.prep_override,
                                                                 precision="fp32"))]
    commands += [(f"rlhflab {algo} ({side})", rlhflab_cmd(a, algo, a.sft, a.steps, scratch, a.rlhflab_override, side))
                 for algo in a.algos for side in a.sides if side in SIDE_MODE]
    for what, cmd in commands:
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):
                preflight(cmd[2:])
        except SystemExit:
            raise SystemExit(f"{what}: rlhflab would refuse its command: {said.getvalue().strip()}") from None


def prepare(a, work: Path, env: dict) -> str:
    """The SFT policy both sides start from, made by rlhflab's own CLI (stage sft, cached in --cache)."""
    if a.sft:
        return a.sft
    out = work / "prep"
    db = work / "prep.db"
    env = env | {"MLFLOW_TRACKING_URI": f"sqlite:///{db}", "RLHFLAB_CACHE": str(a.cache)}
    cmd = rlhflab_cmd(a, "rloo", None, 1, out, PREP.get(a.model, []) + a.prep_override, precision="fp32")
    code, _, _, wall = run_child(cmd, work / "prep.log", a.timeout, env)
    if code != 0:
        raise child_failed("preparing the SFT policy", code, wall, work / "prep.log", a.timeout)
    run_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    sft = read_rlhflab(db, run_id)["policy_start"]
    print(f"SFT policy: {sft} (made or found by rlhflab in {wall:.0f} s)", flush=True)
    return sft


def one_run(a, side: str, algo: str, rep: int, sft: str, work: Path, env: dict) -> dict:
    d = work / f"{algo}-{side}-{rep}"
    d.mkdir(parents=True, exist_ok=True)
    k = 2 if algo == "online_dpo" else a.k
    per_step = a.prompts_per_step * k
    if side in SIDE_MODE:
        db = d / "mlflow.db"
        cmd = rlhflab_cmd(a, algo, sft, a.steps, d / "run", a.rlhflab_override, side)
        code, rss, pss, wall = run_child(cmd, d / "log.txt", a.timeout,
                                    env | {"MLFLOW_TRACKING_URI": f"sqlite:///{db}", "RLHFLAB_CACHE": str(a.cache)})
        if code != 0:
            raise child_failed(f"rlhflab {algo} ({side}) rep {rep}", code, wall, d / "log.txt", a.timeout)
        run_id = json.loads((d / "run" / "mlflow_run.json").read_text())["run_id"]
        raw = read_rlhflab(db, run_id)
        res = summarize(raw["steps"], raw["step_end"], raw["rewards"], raw["lengths"], per_step, a.log_every) | {"own_samples_per_s": raw["own_samples_per_s"]}
    else:
        js = d / "trl.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "_trl", "--algo", algo, "--sft", sft, "--json", str(js),
               "--steps", str(a.steps), "--prompts-per-step", str(a.prompts_per_step), "--k", str(k), "--lr", str(a.lr),
               "--temperature", str(a.temperature), "--seed", str(a.seed), "--response-words", str(a.response_words),
               "--threads", str(TRL_SIDE[side]["threads"]), "--report-to", TRL_SIDE[side]["report_to"],
               "--precision", a.precision, "--log-every", str(a.log_every)]
        if a.max_new_tokens:
            cmd += ["--max-new-tokens", str(a.max_new_tokens)]
        if a.eos_penalty is not None:
            cmd += ["--eos-penalty", str(a.eos_penalty)]
        code, rss, pss, wall = run_child(cmd, d / "log.txt", a.timeout,
                                         env | {"MLFLOW_TRACKING_URI": f"sqlite:///{d / 'mlflow.db'}"})
        if code != 0:
            raise child_failed(f"TRL {algo} ({side}) rep {rep}", code, wall, d / "log.txt", a.timeout)
        raw = json.loads(js.read_text())
        steps = list(range(1, len(raw["step_end"]) + 1))
        res = summarize(steps, raw["step_end"], raw["rewards"], raw["lengths"], per_step, a.log_every) | {"startup_s": raw["startup_s"], "settings": raw["settings"]}
    res |= {"peak_rss_mb": rss, "peak_pss_mb": pss, "wall_s": wall}
    if a.eval_prompts:
        res |= judge_policy(a, d / "run" / "policy" if side in SIDE_MODE else d / "policy", d, env)
    judged = f", policy reward {res['policy_reward']:+.3f}" if a.eval_prompts else ""
    print(f"  rep {rep} {algo:10s} {side:13s}: {res['completions_per_s']:7.1f} completions/s over steps {res['first'] + 1}..{res['steps']}, "
          f"{res['completion_tokens']:.1f} tokens each, RL {res['rl_s']:.1f} s, peak RSS {rss:.0f} MB, tree PSS {pss:.0f} MB, reward(last {min(LAST, res['steps'])}) "
          f"{res['final_reward']:+.3f}{judged}, wall {wall:.0f} s", flush=True)
    return res


def judge_policy(a, policy: Path, d: Path, env: dict) -> dict:
    """The policy reward of a run's saved policy (eval_child in its own process, after the run)."""
    js = d / "eval.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "_eval", "--policy", str(policy), "--json", str(js),
           "--response-words", str(a.response_words), "--prompts", str(a.eval_prompts), "--samples", str(a.eval_samples),
           "--seed", str(a.seed), "--temperature", str(a.temperature)]
    if a.max_new_tokens:
        cmd += ["--max-new-tokens", str(a.max_new_tokens)]
    code, _, _, wall = run_child(cmd, d / "eval.log", a.timeout, env)
    if code != 0:
        raise child_failed(f"judging the policy {policy}", code, wall, d / "eval.log", a.timeout)
    return json.loads(js.read_text())


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    def one(package: str) -> str:
        try:
            return f"{package} {version(package)}"
        except PackageNotFoundError:
            return f"{package} not installed"

    return ", ".join(one(p) for p in ("torch", "transformers", "trl", "accelerate", "lightning", "mlflow"))


def num(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def side_settings(side: str) -> str:
    """How a side runs, as the table's header states it: an rlhflab side's own overrides (SIDE_MODE), TRL's threads
    and tracker (TRL_SIDE)."""
    if side in TRL_SIDE:
        return f"{TRL_SIDE[side]['threads']} torch thread(s), report_to={TRL_SIDE[side]['report_to']}"
    return " ".join(SIDE_MODE[side])


def table(a, results: dict) -> str:
    med = statistics.median
    sides = [side for side in a.sides if any(results[algo][side] for algo in a.algos)]
    trls = [side for side in sides if side in TRL_SIDE]
    ours = [side for side in sides if side in SIDE_MODE]
    base = "TRL" if trls == ["trl"] else "best TRL"  # with several TRL sides, each algorithm's fastest one
    labels = [SIDE_LABEL[side] for side in sides]
    judged = all("policy_reward" in x for algo in a.algos for side in sides for x in results[algo][side])
    settings = "; ".join(f"{SIDE_LABEL[side]}: {side_settings(side)}" for side in sides)
    lines = [
        f"`python benchmarks/vs_trl.py {' '.join(a.argv)}`".replace(" `", "`"),
        "",
        f"rlhflab vs TRL: model={a.model}, {a.prompts_per_step} prompts/step, k={a.k} (online DPO 2), "
        f"max_new_tokens={a.max_new_tokens or 'task (9)'}, lr {a.lr}, temperature {a.temperature}, "
        f"eos_penalty {a.eos_penalty}, {a.steps} steps, logging every {a.log_every}, "
        f"{'float32' if a.precision == 'fp32' else 'bf16 autocast over float32 weights (TRL bf16=True, rlhflab trainer.precision=bf16-mixed)'}; {f'medians of {a.reps} interleaved reps' if a.reps > 1 else 'one rep'}. "
        f"Sides: {settings}.",
        f"({versions()}; {os.cpu_count()} CPUs; OMP_WAIT_POLICY=PASSIVE)",
        "",
        "| algo | " + " | ".join(f"{label} completions/s" for label in labels)
        + "".join(f" | {SIDE_LABEL[side]} / {base}" for side in ours if trls)
        + " | completion tokens " + " / ".join(labels)
        + " | peak RSS MB " + " / ".join(labels) + " | peak tree PSS MB " + " / ".join(labels)
        + " | final reward " + " / ".join(labels) + " |" + (" policy reward " + " / ".join(labels) + " |" if judged else ""),
        "|---" * (1 + len(sides) + (len(ours) if trls else 0) + 4 + judged) + "|",
    ]
    for algo in a.algos:
        runs = {side: results[algo][side] for side in sides}
        if not all(runs.values()):
            continue
        keys = ("completions_per_s", "peak_rss_mb", "peak_pss_mb", "final_reward") + (("policy_reward",) if judged else ())
        m = {side: {key: med(x[key] for x in rs) for key in keys + ("completion_tokens",)} for side, rs in runs.items()}
        cells = [num(m[side]["completions_per_s"]) for side in sides]
        if trls:
            best = max(m[side]["completions_per_s"] for side in trls)
            cells += [f"{m[side]['completions_per_s'] / best:.2f}x" for side in ours]
        cells.append(" / ".join(f"{m[side]['completion_tokens']:.1f}" for side in sides))
        cells += [" / ".join(f"{m[side][key]:.0f}" for side in sides) for key in ("peak_rss_mb", "peak_pss_mb")]
        cells += [" / ".join(f"{m[side][key]:.3f}" for side in sides) for key in keys[3:]]
        lines.append(f"| {LABEL[algo]} | " + " | ".join(cells) + " |")
    lines += ["", f"completions/s: completions of steps {a.log_every + 1}..N over the wall time from the end of step "
              f"{a.log_every} to the end of step N; both sides log each metric's mean once per {a.log_every} step(s) "
              "(TRL logging_steps, rlhflab trainer.log_every_n_steps), except rlhflab_log1: every step; "
              + "completion tokens: the mean completion length over the same steps, up to and including the first EOS "
              "(completions/s compares the frameworks' speed where these match); "
              f"final reward: mean batch gold reward over the last {min(LAST, a.steps)} steps; "
              + (f"policy reward: the final policy's mean gold reward on {a.eval_prompts} held-out prompts x {a.eval_samples} "
                 "samples, judged by one piece of code for every side; " if judged else "")
              + "peak RSS: the child process's ru_maxrss "
              "(for the async side, its largest process); peak tree PSS: the child and its descendants together, sampled "
              "once a second."]
    return "\n".join(lines)


def save(a, text: str, sft: str, results: dict) -> None:
    """The table to a.out, and beside it a JSON of the arguments (as JSON values: lists, numbers, null), the SFT policy
    and every run's numbers."""
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text + "\n")
    args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}
    a.out.with_suffix(".json").write_text(json.dumps({"args": args, "sft": sft, "results": results}, indent=1))


def parse(argv=None):
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        def _get_help_string(self, action):  # a help that says its default already is left as it is
            return action.help if "default" in (action.help or "") else super()._get_help_string(action)

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=Formatter)
    p.add_argument("--algos", default=",".join(ALGOS), help="comma-separated subset of rloo,grpo,online_dpo")
    p.add_argument("--sides", default=",".join(DEFAULT_SIDES), help="comma-separated subset of " + ",".join(SIDES))
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions (the table gives medians)")
    p.add_argument("--steps", type=int, default=60, help="RL steps (optimizer updates) per run")
    p.add_argument("--model", default="tiny", help="rlhflab model preset (tiny, llama100m)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="completion budget (default: the task's, 9)")
    p.add_argument("--response-words", type=int, default=8, help="the sentiment task's response length (gold denominator)")
    p.add_argument("--prompts-per-step", type=int, default=32, help="prompts per RL step, both sides")
    p.add_argument("--k", type=int, default=4, help="samples per prompt for RLOO and GRPO (online DPO: always 2)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate, constant, both sides")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, both sides and the policy reward")
    p.add_argument("--eos-penalty", type=float, default=None, help="score of a completion without EOS, both sides (default none)")
    p.add_argument("--precision", choices=tuple(PRECISION), default="fp32",
                   help="fp32 on both sides, or bf16 autocast on both (TRL's default bf16=True; rlhflab "
                        "trainer.precision=bf16-mixed; 2-3x faster matmuls on a CPU with AMX)")
    p.add_argument("--seed", type=int, default=0, help="seed of the SFT policy, prompts, sampling and the policy reward")
    p.add_argument("--log-every", type=int, default=None,
                   help="both sides log the mean of each metric once per this many steps (TRL logging_steps, rlhflab "
                        "trainer.log_every_n_steps), and completions/s times the steps after the first logged; default: "
                        "10, TRL's default, or 1 where --steps is under 20")
    def judge(i: int) -> str:  # --eval-samples said 'default: None', though tiny's is 8
        return ", ".join(f"{model} {n[i]}" for model, n in JUDGE.items()) + f", other models {JUDGE['tiny'][i]}"

    p.add_argument("--eval-prompts", type=int, default=None,
                   help=f"held-out prompts for the policy reward (0: do not judge; default per model: {judge(0)})")
    p.add_argument("--eval-samples", type=int, default=None,
                   help=f"samples per held-out prompt for the policy reward (default per model: {judge(1)})")
    p.add_argument("--sft", default=None, help="a ready SFT policy directory (default: rlhflab's stage sft, made into --cache)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "rlhflab" / "vs_trl", help="RLHFLAB_CACHE of the runs")
    p.add_argument("--prep-override", action="append", default=[], help="extra rlhflab override for the SFT-making run")
    p.add_argument("--rlhflab-override", action="append", default=[], help="extra rlhflab override for every rlhflab run (one of a setting both sides share, e.g. rl.lr, is warned: give its flag)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a child run is killed")
    p.add_argument("--keep", action="store_true", help="keep the runs' work directory (logs, MLflow dbs, JSON); a failed "
                   "benchmark keeps it always")
    p.add_argument("--out", type=Path, default=None, help="write the table (markdown) here; results JSON next to it")
    a = p.parse_args(argv)
    a.argv = list(argv if argv is not None else sys.argv[1:])
    a.algos = [x.strip() for x in a.algos.split(",") if x.strip()]
    bad = [x for x in a.algos if x not in ALGOS]
    if bad:
        p.error(f"unknown algos {bad}; choose from {', '.join(ALGOS)}")
    a.sides = [x.strip() for x in a.sides.split(",") if x.strip()]
    prompts, samples = JUDGE.get(a.model, JUDGE["tiny"])
    a.eval_prompts = prompts if a.eval_prompts is None else a.eval_prompts
    a.eval_samples = samples if a.eval_samples is None else a.eval_samples
    bad = [x for x in a.sides if x not in SIDES]
    if bad:
        p.error(f"unknown sides {bad}; choose from {', '.join(SIDES)}")
    for name in ("algos", "sides"):  # a name given twice ran twice into one median, and its table row or column twice
        twice = sorted({x for x in getattr(a, name) if getattr(a, name).count(x) > 1})
        if twice:
            p.error(f"--{name}: {', '.join(twice)} given more than once")
    # Each of these failed in a child after minutes (or gave an empty table, or a traceback), if at all.
    if not a.algos or not a.sides:
        p.error(f"--{'algos' if not a.algos else 'sides'}: none given; name at least one")
    a.log_every = (10 if a.steps >= 20 else 1) if a.log_every is None else a.log_every
    at_least = {"reps": 1, "steps": 2, "log_every": 1, "prompts_per_step": 1, "k": 2, "response_words": 1, "eval_prompts": 0}
    if a.eval_prompts:
        at_least["eval_samples"] = 1
    if a.max_new_tokens is not None:
        at_least["max_new_tokens"] = 1
    for name, least in at_least.items():
        if getattr(a, name) < least:
            why = " (completions/s times steps 2..N)" if name == "steps" else ""
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: give {least} or more{why}")
    if a.steps < 2 * a.log_every:
        p.error(f"--steps {a.steps} with --log-every {a.log_every}: completions/s times the steps after the first logged "
                f"one, so give --steps {2 * a.log_every} or more, or a smaller --log-every")
    if a.timeout <= 0:
        p.error(f"--timeout {a.timeout:g}: give a number of seconds above 0")
    for name in ("lr", "temperature", "eos_penalty"):  # nan or inf: refused by the first run, after the SFT run's ~10 s
        value = getattr(a, name)
        if value is not None and not math.isfinite(value):
            p.error(f"--{name.replace('_', '-')} {value}: give a finite number")
    if a.out is not None:  # found only when the table was written, after the whole benchmark (its JSON lost)
        from rlhflab.errors import ConfigError
        from rlhflab.schema import writable_dir

        if a.out.is_dir():
            p.error(f"--out {a.out}: a directory; give a file path (the table, its JSON beside it)")
        try:
            writable_dir("--out", a.out.parent, make=False)
        except ConfigError as err:
            p.error(f"--out {a.out}: {a.out.parent} is not a writable directory ({str(err).removeprefix('--out: ')})")
    models = sorted(f.stem for f in (ROOT / "conf" / "model").glob("*.yaml"))
    if a.model not in models:
        p.error(f"--model {a.model}: not an rlhflab model preset; choose from {', '.join(models)}")
    return a


def parse_child(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--algo", required=True)
    p.add_argument("--sft", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--prompts-per-step", type=int, required=True)
    p.add_argument("--k", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--temperature", type=float, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--response-words", type=int, required=True)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--eos-penalty", type=float, default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--report-to", default="none")
    p.add_argument("--precision", choices=tuple(PRECISION), default="fp32")
    p.add_argument("--log-every", type=int, default=1)
    return p.parse_args(argv)


@contextlib.contextmanager
def work_directory(prefix: str, keep: bool, what: str = ""):
    """A new directory under the system's temp for a benchmark's runs (logs, MLflow dbs, JSON). Removed when the
    benchmark ends well, unless `keep`; a failed or stopped one keeps it, since its error line names a log in it.
    (benchmarks/step_flops.py uses it too.)"""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    print(f"work directory: {work}{what}", flush=True)
    done = False
    try:
        yield work
        done = True
    finally:
        if keep or not done:
            print(f"kept: {work}", file=sys.stdout if done else sys.stderr, flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


def stop_on_signals(script: str = "vs_trl.py") -> None:
    """SIGTERM (`timeout`, `kill`, a scheduler) or SIGHUP ended the benchmark at once, without its `finally`s: the
    running child, in a session of its own, trained on alone (and with mode=async its generator), its work directory
    kept without a word. Now they end as Ctrl-C does: the child's process group killed, the work directory named.
    (benchmarks/step_flops.py runs its children with run_child too.)"""
    def stop(signum, frame):
        raise SystemExit(f"{script}: stopped by {signal.Signals(signum).name}")

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)


def slow_bf16(precision: str) -> str | None:
    """What --precision bf16 measures on a CPU without oneDNN's bf16 kernels (both sides' products in torch's fallback
    loops), said before the runs; None where it has them, or in float32."""
    import torch

    from rlhflab.rollout.sources import HALF_KERNELS, cpu_has_half_kernels

    if precision != "bf16" or cpu_has_half_kernels(torch.bfloat16):
        return None
    return (f"--precision bf16: this CPU has no bfloat16 kernels (oneDNN's need {HALF_KERNELS['bfloat16']}), so both "
            "sides run far slower than in float32 (a 113M Llama's forward and backward 24x on an AVX2 CPU); --precision "
            "fp32 measures the frameworks, not the fallback")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_trl"]:
        return trl_child(parse_child(argv[1:]))
    if argv[:1] == ["_eval"]:
        return eval_child(argv[1:])
    a = parse(argv)
    stop_on_signals()
    if any(side in TRL_SIDE for side in a.sides):  # rlhflab's sides alone run without it
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit('TRL is not installed: pip install -e ".[bench]" (or --sides with rlhflab\'s sides only)') from None
    check_commands(a)
    if note := slow_bf16(a.precision):
        print(note, file=sys.stderr)
    if any(side in TRL_SIDE for side in a.sides):  # (rlhflab's sides alone all get the same overrides)
        for line in one_sided(a.rlhflab_override):
            print(line, file=sys.stderr)
    env = child_env()
    with work_directory("vs_trl-", a.keep) as work:
        sft = prepare(a, work, env)
        results = {algo: {side: [] for side in a.sides} for algo in a.algos}
        for rep in range(1, a.reps + 1):
            for algo in a.algos:
                turn = (rep - 1) % len(a.sides)  # each side goes first in turn
                for side in a.sides[turn:] + a.sides[:turn]:
                    results[algo][side].append(one_run(a, side, algo, rep, sft, work, env))
        text = table(a, results)
        print("\n" + text)
        if a.out:
            save(a, text, sft, results)


if __name__ == "__main__":
    main()
