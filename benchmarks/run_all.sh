#!/usr/bin/env bash
# The benchmark sweeps behind the README's tables, run one after another on an otherwise idle machine.
# Each is a Hydra multirun tracked in MLflow (sqlite:///mlflow.db here); `python src/report.py
# sweep=<parent>` turns one into a table and plots. Takes about 50 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
Q="trainer.enable_progress_bar=false"

# Issue 5: sync vs async (staleness 1, 2, 4) for online DPO, RLOO and PPO; evaluation every 10 steps
# for the time-to-gold curves.
python src/train.py -m algo=online_dpo,rloo,ppo rl.eval_every=10 $Q
python src/train.py -m algo=online_dpo,rloo,ppo mode=async staleness=1,2,4 rl.eval_every=10 $Q

# Issue 3: the five algorithms at their defaults.
python src/train.py experiment=sweep_algos $Q

# Issue 4: algo x memory on the tiny task (gold reward at equal steps) ...
python src/train.py -m algo=ppo,rloo memory=full,lora,hydra $Q
# ... and on a 113M-parameter model where model state dominates: memory and latency only
# (equal batch for both algorithms: 16 prompts x 2 samples, one update per batch; SFT batch 32
# is the full fine-tune reference point).
python src/train.py -m model=llama100m algo=ppo,rloo memory=full,lora,hydra \
  algo.samples_per_prompt=2 algo.num_minibatches=1 algo.epochs=1 rl.prompts_per_step=16 trainer.max_steps=4 \
  rl.eval_every=0 rl.eval_samples_per_prompt=1 task.num_eval_prompts=8 \
  task.num_demonstrations=64 task.num_preference_pairs=64 stages.sft.epochs=1 stages.rm.epochs=1 \
  stages.sft.batch_size=32 stages.rm.batch_size=32 $Q
# ... and J-Hydra-PPO (the critic on the policy adapter's trunk) at the same settings, then at 2x and 3x the
# batch (3x still fits under LoRA-PPO's peak: the paper spends the memory Hydra frees on the batch)
python src/train.py -m model=llama100m algo=ppo memory=hydra memory.actor_critic=joint \
  algo.samples_per_prompt=2 algo.num_minibatches=1 algo.epochs=1 rl.prompts_per_step=16,32,48 trainer.max_steps=4 \
  rl.eval_every=0 rl.eval_samples_per_prompt=1 task.num_eval_prompts=8 \
  task.num_demonstrations=64 task.num_preference_pairs=64 stages.sft.epochs=1 stages.rm.epochs=1 \
  stages.sft.batch_size=32 stages.rm.batch_size=32 $Q
# ... the same LoRA-PPO and J-Hydra-PPO runs with both cores (torch_threads=null; the default 1 leaves one idle) ...
python src/train.py -m model=llama100m algo=ppo memory=lora torch_threads=null \
  algo.samples_per_prompt=2 algo.num_minibatches=1 algo.epochs=1 rl.prompts_per_step=16 trainer.max_steps=6 \
  rl.eval_every=0 rl.eval_samples_per_prompt=1 task.num_eval_prompts=8 \
  task.num_demonstrations=64 task.num_preference_pairs=64 stages.sft.epochs=1 stages.rm.epochs=1 \
  stages.sft.batch_size=32 stages.rm.batch_size=32 $Q
python src/train.py -m model=llama100m algo=ppo memory=hydra memory.actor_critic=joint torch_threads=null \
  algo.samples_per_prompt=2 algo.num_minibatches=1 algo.epochs=1 rl.prompts_per_step=16,32,48 trainer.max_steps=6 \
  rl.eval_every=0 rl.eval_samples_per_prompt=1 task.num_eval_prompts=8 \
  task.num_demonstrations=64 task.num_preference_pairs=64 stages.sft.epochs=1 stages.rm.epochs=1 \
  stages.sft.batch_size=32 stages.rm.batch_size=32 $Q
# ... and where a PPO step's time and FLOPs go, on one core and on both (each part's rate against the matmul peak)
python benchmarks/step_flops.py --out benchmarks/step_flops.md
python benchmarks/step_flops.py --overrides torch_threads=null --out benchmarks/step_flops_2threads.md

# Issue 11: the default experiment on 1 process, DDP and FSDP2 over 2 processes (gloo), 3 seeds each ...
python src/train.py -m trainer=cpu,ddp,fsdp seed=0,1,2 $Q
# ... and model state per rank on the 113M model, at the memory sweep's settings.
python src/train.py -m model=llama100m trainer=ddp,fsdp trainer.devices=2 algo=rloo \
  algo.samples_per_prompt=2 algo.num_minibatches=1 algo.epochs=1 rl.prompts_per_step=16 trainer.max_steps=4 \
  rl.eval_every=0 rl.eval_samples_per_prompt=1 task.num_eval_prompts=8 \
  task.num_demonstrations=64 task.num_preference_pairs=64 stages.sft.epochs=1 stages.rm.epochs=1 \
  stages.sft.batch_size=32 stages.rm.batch_size=32 $Q
