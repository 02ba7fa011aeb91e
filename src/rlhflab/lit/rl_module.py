"""The one LightningModule for every RL algorithm (manual optimisation)."""

from __future__ import annotations

import logging
import math
import time

import lightning as L
import torch

from rlhflab.algos import functional as F
from rlhflab.algos.registry import Algorithm, Scored
from rlhflab.perf import ActivationMeter, model_state_bytes, peak_memory_mb
from rlhflab.lit.data import encode_prompts, prompt_loader
from rlhflab.rollout.batch import Rollout

log = logging.getLogger(__name__)


class RLHFModule(L.LightningModule):
    """Generate -> score -> reference log-probs -> advantages -> updates, one prompt batch per step.

    `memory` answers policy/reference log-probs, values and scores; `algo`
    turns them into targets and losses; `source` produces rollouts (now with
    the current weights in sync mode, ahead of time in async mode).
    """

    def __init__(self, memory, algo: Algorithm, reward, source, task, tokenizer, train_prompts, eval_prompts, rl_cfg, seed: int) -> None:
        super().__init__()
        self.memory = memory
        self.algo = algo
        self.reward = reward
        self.source = source
        self.task = task
        self.tokenizer = tokenizer
        self.train_prompts = train_prompts
        self.train_query = encode_prompts(tokenizer, train_prompts)
        self.eval_query = encode_prompts(tokenizer, eval_prompts)
        self.eval_prompts = eval_prompts
        self.cfg = rl_cfg
        self.seed = seed
        self.temperature = source.generator.temperature
        self.policy_version = 0  # rollout batches trained on so far
        self.automatic_optimization = False
        self.eval_history: list[tuple[int, float, float]] = []  # (rl step, gold reward, KL)
        self.generation_rows: list[dict] = []
        self.step_times: list[tuple[int, float, float, float]] = []  # (samples, gen busy, train busy, step) seconds

    def train_dataloader(self):
        return prompt_loader(self.train_query, self.cfg.prompts_per_step, self.seed)

    def on_fit_start(self) -> None:
        self.activations = ActivationMeter(p for m in self.memory.trainable_modules() for p in m.parameters())
        # The async generator iterates its own copy of the same loader: same prompts, same order.
        self.source.start(self.memory.generation_model, self.train_dataloader(), self.train_prompts, self.algo, self.seed)

    def configure_optimizers(self):
        groups = [{"params": self.memory.policy_parameters(), "lr": self.cfg.lr}]
        if self.algo.needs_values:
            groups.append({"params": self.memory.value_parameters(), "lr": self.cfg.value_lr or self.cfg.lr})
        return torch.optim.AdamW(groups, weight_decay=0.0, eps=1e-5)

    # ---- the training step ---------------------------------------------------------------

    def training_step(self, batch, batch_idx):
        t0 = time.perf_counter()
        # 1. generate (sync: now, with the current weights; async: a batch made earlier)
        query, index = batch
        prompts = [self.train_prompts[i] for i in index.tolist()]
        rollout = self.source.get(self.memory.generation_model, query, prompts, self.policy_version, self.algo).to(self.device)
        t_gen = time.perf_counter() - t0
        # 2. score (a completion that never ends gets the EOS penalty instead)
        with torch.no_grad():
            scores = self.reward.score(self.memory, self.task, rollout)
            scores = F.eos_penalty(scores, rollout.has_eos(self.tokenizer.eos_token_id), self.cfg.eos_penalty)
            baseline = self.reward.score_baseline(self.memory, self.task, rollout) if self.algo.needs_greedy_baseline else None
            # 3. log-probs before the update (or the generator's, for stale batches), reference log-probs, values
            if self.source.off_policy == "behaviour":
                old_logprobs = rollout.logprobs  # no forward: the generator's are the old policy
            else:
                old_logprobs = self.memory.policy_logprobs(rollout.query, rollout.response, self.temperature)
            ref_logprobs = self.memory.reference_logprobs(rollout.query, rollout.response, self.temperature)
            values = self.memory.values(rollout.query, rollout.response) if self.algo.needs_values else None
        mask = rollout.response_mask
        # 4. + 5. rewards and advantages
        scored = Scored(scores, old_logprobs * mask, ref_logprobs * mask, mask, values, baseline)
        targets, metrics = self.algo.prepare(scored)
        if self.source.off_policy == "tis" and "advantages" in targets:
            targets["advantages"] = targets["advantages"] * self._tis_weights(scored.old_logprobs, rollout, targets["advantages"])
        targets |= {"query": rollout.query, "response": rollout.response, "response_mask": mask,
                    "old_logprobs": scored.old_logprobs, "ref_logprobs": scored.ref_logprobs}
        # 6. updates: epochs x mini-batches of whole prompt groups
        metrics |= self._update(targets, rollout.num_samples)
        self.policy_version += 1
        t_sync = time.perf_counter()
        self.source.after_update(self.memory.generation_model, self.policy_version)
        t_step = time.perf_counter() - t0
        t_sync = time.perf_counter() - t_sync
        # 7. log
        gen_busy = rollout.extras.get("gen_busy_s", t_gen)  # async: the generator's own busy time
        train_busy = t_step - t_gen
        self.step_times.append((rollout.num_samples, gen_busy, train_busy, t_step))
        metrics |= {
            "train/response_len": mask.sum(1).mean(),
            "train/eos_rate": rollout.has_eos(self.tokenizer.eos_token_id).float().mean(),
            "rollout/staleness": float(self.policy_version - 1 - rollout.version),
            "perf/gen_s": gen_busy,
            "perf/train_s": train_busy,
            "perf/wait_s": t_gen,
            "perf/sync_s": t_sync,
            "perf/step_s": t_step,
            "perf/samples_per_s": rollout.num_samples / t_step,
            # 1.0 = the step took only as long as the slower side (perfect overlap)
            "perf/overlap_eff": max(gen_busy, train_busy) / t_step,
        }
        if "engine_sync_s" in rollout.extras:  # generator=vllm: loading new weights into the engine
            metrics["perf/engine_sync_s"] = rollout.extras["engine_sync_s"]
        metrics |= self.memory_metrics()
        self._log_step(metrics)
        if self.cfg.eval_every and self.policy_version % self.cfg.eval_every == 0:
            self.evaluate()

    def _tis_weights(self, learner_old, rollout: Rollout, advantages):
        """Truncated importance weights pi_learner_old / pi_behaviour, per sequence or per token like the advantages."""
        mask = rollout.response_mask
        if advantages.dim() == 1:
            log_ratio = F.masked_sum(learner_old - rollout.logprobs, mask, dim=1)
            return torch.exp(log_ratio.clamp(max=math.log(self.source.tis_cap)))
        return F.truncated_importance_weights(learner_old, rollout.logprobs, mask, self.source.tis_cap)

    def _update(self, targets: dict, n: int) -> dict:
        opt = self.optimizers()
        k = self.algo.samples_per_prompt
        groups = F.divide_exact(n, k, "rollout samples per prompt group")
        per_mb = F.divide_exact(groups, self.algo.num_minibatches, "algo.num_minibatches (prompts per step must divide)") * k
        sums: dict[str, float] = {}
        count = 0
        for _ in range(self.algo.epochs):
            order = torch.randperm(groups).repeat_interleave(k) * k + torch.arange(k).repeat(groups)
            for start in range(0, n, per_mb):
                idx = order[start : start + per_mb]
                mb = {key: v[idx] for key, v in targets.items()}
                with self.activations.track():
                    logprobs = self.memory.policy_logprobs(mb["query"], mb["response"], self.temperature) * mb["response_mask"]
                    values = self.memory.values(mb["query"], mb["response"]) if self.algo.needs_values else None
                    loss, m = self.algo.loss(logprobs, values, mb)
                opt.zero_grad(set_to_none=True)
                self.manual_backward(loss)
                self.activations.reset()
                self.clip_gradients(opt, gradient_clip_val=self.cfg.max_grad_norm, gradient_clip_algorithm="norm")
                opt.step()
                m["train/loss"] = loss.detach()
                for key, value in m.items():
                    sums[key] = sums.get(key, 0.0) + float(value)
                count += 1
        return {key: v / count for key, v in sums.items()}

    def timing_summary(self) -> dict[str, float]:
        """Run-level throughput over RL steps after the first (warm-up), evaluation excluded.

        overlap_eff: achieved samples/s over the perfect-overlap bound 1 / max(t_gen, t_train).
        """
        steps = self.step_times[1:] or self.step_times
        n, gen, train, step = (sum(col) for col in zip(*steps))
        k = len(steps)
        return {
            "perf/mean_samples_per_s": n / step,
            "perf/mean_gen_s": gen / k,
            "perf/mean_train_s": train / k,
            "perf/mean_step_s": step / k,
            "perf/mean_overlap_eff": max(gen, train) / step,
        }

    def memory_metrics(self) -> dict[str, float]:
        """Model-state bytes by kind and the peak memory (see rlhflab.perf for the method)."""
        state = model_state_bytes(self.memory.model_modules(), self.optimizers().optimizer)
        peak, self.mem_method = peak_memory_mb(state, self.activations.peak, self.device)
        return state | {"perf/peak_mem_mb": peak, "perf/activation_peak_mb": self.activations.peak / 2**20}

    def _log_step(self, metrics: dict) -> None:
        metrics = {k: float(v) for k, v in metrics.items()}
        for key in ("train/reward", "train/kl"):
            self.log(key, metrics.pop(key), prog_bar=True, on_step=True, on_epoch=False, batch_size=1)
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    # ---- evaluation ----------------------------------------------------------------------

    def on_train_start(self) -> None:
        self.evaluate()

    def on_train_end(self) -> None:
        if not self.eval_history or self.eval_history[-1][0] != self.policy_version:
            self.evaluate()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Gold reward of sampled completions on held-out prompts (same seed every time)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.eval_seed)
            rollout: Rollout = self.source.eval_generator.generate(
                self.memory.generation_model, self.eval_query.to(self.device), self.eval_prompts,
                self.cfg.eval_samples_per_prompt, self.policy_version,
            )
        gold = self.task.gold_reward(rollout.prompts, rollout.texts)
        ref = self.memory.reference_logprobs(rollout.query, rollout.response, self.temperature)
        kl = F.masked_sum(rollout.logprobs - ref * rollout.response_mask, rollout.response_mask, dim=1)
        value = float(gold.mean())
        self.eval_history.append((self.policy_version, value, float(kl.mean())))
        metrics = {"eval/gold_reward": value, "eval/kl": float(kl.mean()), "eval/eos_rate": float(rollout.has_eos(self.tokenizer.eos_token_id).float().mean())}
        if self.logger is not None:
            self.logger.log_metrics(metrics, step=self.global_step)
        log.info("eval after %d RL steps: gold reward %.3f, KL %.2f", self.policy_version, value, metrics["eval/kl"])
        scores = self.reward.score(self.memory, self.task, rollout) if self.cfg.log_generations else None
        for i in range(min(self.cfg.log_generations, rollout.num_samples)):
            self.generation_rows.append(
                {"rl_step": self.policy_version, "prompt": rollout.prompts[i], "response": rollout.texts[i],
                 "reward": float(scores[i]), "gold_reward": float(gold[i])}
            )
        return value
