"""The one LightningModule for every RL algorithm (manual optimisation)."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import replace

import lightning as L
import torch
from omegaconf import OmegaConf

from rlhflab import distributed
from rlhflab.algos import functional as F
from rlhflab.algos.carriers import Experience, Scored, counts
from rlhflab.algos.registry import Algorithm
from rlhflab.errors import ConfigError, DivergedWeights, NonFiniteError
from rlhflab.contracts import MemoryStrategy, Reward, RolloutSource, Task
from rlhflab.lit.data import PromptBatches, encode_prompts, prompt_loader
from rlhflab.perf import ActivationMeter, model_state_bytes, peak_memory_mb
from rlhflab.rewards.builtin import score_rollout
from rlhflab.lit.checkpoint import Checkpoint
from rlhflab.lit.optim import adamw
from rlhflab.lit.reference import WORKERS
from rlhflab.models.sharding import full
from rlhflab.rng import fixed_seed, rng_state, set_rng_state
from rlhflab.rollout.batch import Rollout, by_length, length_buckets, trim_left
from rlhflab.rollout.sources import autocast_as, casts_once, current_autocast

log = logging.getLogger(__name__)

FLAT_STEPS_WARNING = 10
SKIP_LIMIT = 20  # rl.on_nonfinite=skip_batch: rollout batches skipped in a row that stop the run


def saved_step_times(rows: list) -> list[tuple]:
    """A checkpoint's step_times. Those written before the generator's busy time in each step was kept (4 values)
    count the batch's own generation there, as the overlap efficiency then did."""
    return [tuple(t) if len(t) == 5 else (t[0], t[1], t[1], t[2], t[3]) for t in rows]


def trainer_autocast(trainer: L.Trainer) -> dict:
    """{device type: dtype} autocast runs a trainer's steps in (trainer.precision=bf16-mixed: {"cpu": bfloat16} on
    CPU); empty at full precision."""
    with trainer.precision_plugin.forward_context():
        return current_autocast()


def all_finite(value: torch.Tensor) -> bool:
    """Every element finite on every rank (a collective: every rank decides the same)."""
    return distributed.all_true(bool(torch.isfinite(value).all()))


def unordered(order: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """Rows computed in `order` back in the batch's order, detached: out[order[i]] = logprobs[i]."""
    out = torch.empty_like(logprobs, requires_grad=False)
    out[order] = logprobs.detach()
    return out


class RLHFModule(L.LightningModule):
    """Generate -> score -> old/reference log-probs -> advantages -> updates, one prompt batch per step.

    `memory` answers policy/reference log-probs, values and scores; `algo`
    turns them into targets and losses; `source` produces rollouts (now with
    the current weights in sync mode, ahead of time in async mode) and says
    which log-probs the ratios start from.
    """

    def __init__(self, memory: MemoryStrategy, algo: Algorithm, reward: Reward, source: RolloutSource, task: Task, tokenizer,
                 train_prompts: list[str], eval_prompts: list[str], rl_cfg, seed: int, resume: Checkpoint | None = None) -> None:
        super().__init__()
        self.memory = memory
        memory.prompt_once = bool(rl_cfg.prompt_once)
        memory.split_reference = getattr(source, "reference", None) == "balance"
        self.algo = algo
        self.reward = reward
        self.source = source
        self.task = task
        self.tokenizer = tokenizer
        self.train_prompts = train_prompts
        self.train_query = encode_prompts(tokenizer, train_prompts)
        self.eval_query = encode_prompts(tokenizer, eval_prompts)
        self.eval_prompts = eval_prompts
        # rl's settings as the schema's RL dataclass: a step reads several, and each read of a DictConfig's key
        # costs ~10 us against 0.03 for a dataclass field
        self.cfg = OmegaConf.to_object(rl_cfg)
        self.seed = seed
        self.temperature = source.generator.temperature
        self.policy_version = 0  # rollout batches trained on so far
        self.updates = 0  # optimizer steps taken so far: the step of every RL metric
        self.automatic_optimization = False
        self.eval_history: list[tuple[int, float, float]] = []  # (rl step, gold reward, KL)
        self.generation_rows: list[dict] = []
        # (samples, the batch's generation, the generator's busy time in the step, train busy, step) seconds
        self.step_times: list[tuple[int, float, float, float, float]] = []
        # When the last step ended (after its evaluation), or None where the time since is not the loop's own (a
        # checkpoint, a skipped batch, the first step): a step's time runs from there, so that it holds what the
        # loop does between steps (logging and MLflow's writes, Lightning, the next batch), as the generator sees it.
        self._step_end: float | None = None
        self._gen_busy_mark: float | None = None  # the source's busy_s() at _step_end (async), else None
        self.constants_logged = False
        self._state_bytes = None  # (optimizer states counted, model_state_bytes): see memory_metrics
        self.resume = resume
        self.skipped_batches = 0  # rl.on_nonfinite=skip_batch
        self.skipped_in_a_row = 0  # ... since the last update: SKIP_LIMIT of them stop the run
        self.flat_steps = 0  # consecutive steps in which every completion scored the same (no learning signal)
        self.progress: dict[str, float] = {}  # what the progress bar shows
        self.consistent = True  # False while a batch's updates are under way (no checkpoint can be taken then)
        self.sharded = False  # trainer=fsdp
        self.run_id: str | None = None  # the MLflow run, kept by checkpoints so that a resume continues it
        # perf_counter() at this process's start and at its RL's start (train() sets them), and the seconds of RL and
        # in all the processes before it counted up to the checkpoint it resumed from: a resumed run's perf/rl_s and
        # perf/total_s are the whole run's, not the time since the resume.
        self.clock: tuple[float, float] | None = None
        self.elapsed_before = {"rl_s": 0.0, "total_s": 0.0}
        # perf_counter() as train() called fit, where that fit starts the ranks (stages from the cache, a resume), and
        # the seconds until they were up (setup): moved from RL's clock to the stages', where they are otherwise.
        self.fit_called: float | None = None
        self.launch_s = 0.0
        self._reference_worker = None  # mode.reference=thread/process (sync): lit/reference.py
        self.run_autocast: dict = {}  # {device type: dtype} of the training steps' autocast, known at fit start

    def prompt_batches(self, start: int | None = None) -> PromptBatches:
        """The prompt stream from batch `start` (default: the next to train on)."""
        return PromptBatches(self.train_query, self.cfg.prompts_per_step, self.seed,
                             start=self.policy_version if start is None else start,
                             rank=distributed.rank(), world_size=distributed.world_size(), pad_token_id=self.tokenizer.pad_token_id)

    def train_dataloader(self):
        return prompt_loader(self.prompt_batches())

    def setup(self, stage: str) -> None:
        """Every rank is up (Lightning calls it after the process group's set-up)."""
        if self.fit_called is not None and distributed.world_size() > 1 and self.clock is not None:
            self.launch_s = time.perf_counter() - self.fit_called
            started, rl_started = self.clock
            self.clock = (started, rl_started + self.launch_s)
        self.fit_called = None

    def configure_model(self) -> None:
        """trainer=fsdp: shard every model over the data-parallel ranks (Lightning gives the mesh)."""
        if self.device_mesh is not None:
            self.memory.shard(self.device_mesh["data_parallel"])
            self.sharded = True
            for generator in {self.source.generator, self.source.eval_generator}:
                generator.synced = True

    def on_fit_start(self) -> None:
        if self.sharded:
            self.memory.warm_up()
        self.activations = ActivationMeter(p for m in self.memory.trainable_modules() for p in m.parameters())
        if self.resume is not None:
            self.restore(self.resume)
        else:
            torch.manual_seed(self.seed)  # the mini-batch orders: from the seed, whatever ran before in the process
        self.run_autocast = trainer_autocast(self.trainer)
        self._lower_frozen()  # before the generator's or the reference's process forks
        # The generator continues after the batches a checkpoint kept, with the weights of this version.
        first = self.policy_version + len(self.source.pending)
        self.source.start(self.memory.generation_model, self.prompt_batches(first), self.train_prompts, self.algo, self.seed,
                          self.policy_version, reference=self._reference_logprobs, autocast=self.run_autocast)

    def _lower_frozen(self) -> None:
        """Under half-precision autocast (trainer.precision=bf16-mixed), the frozen models of their own (memory=full's
        reference, a reward model) keep their linear layers in autocast's dtype: every forward of them runs under that
        autocast (the steps, the reference's thread or process, the async generator, the evaluations), which cast
        their float32 weights at each call to the same numbers. 226 MB less for the 113M model's reference. Not with
        trainer=fsdp (its shards are float32 DTensors)."""
        dtype = self.run_autocast.get(self.device.type)
        if dtype is None or self.sharded:
            return
        freed = self.memory.lower_frozen(dtype)
        if freed:
            log.info("frozen models (%s): their linear layers kept in %s, the dtype autocast computes them in (%.0f MB less)",
                     ", ".join(type(m).__name__ for m in self.memory.frozen_models()), str(dtype).removeprefix("torch."),
                     freed / 2**20)

    # ---- checkpoints ---------------------------------------------------------------------

    def _trainable_tensors(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.memory.named_parameters() if p.requires_grad}

    def can_checkpoint(self) -> bool:
        return self.consistent and self.source.can_checkpoint(self.policy_version)

    def why_no_checkpoint(self) -> str:
        """Why can_checkpoint() is False, in words."""
        if not self.consistent:
            return "its rollout batch's updates are not all done"
        return f"the generator has only every mode.sync_every={getattr(self.source, 'sync_every', '?')}th update's weights"

    def checkpoint_state(self) -> tuple[dict, dict, dict]:
        """(trainable tensors, optimizer state, everything else) to continue exactly from here."""
        self._step_end = None  # the next step's time does not hold the checkpoint's
        # What differs between ranks (RNG streams, each generator's pending rollouts), gathered in rank order.
        ranks = distributed.gather({"rng": rng_state(), "source": self.source.checkpoint_state(self.policy_version)})
        state = {
            "updates": self.updates,
            "policy_version": self.policy_version,
            "ranks": ranks,
            "eval_history": [list(e) for e in self.eval_history],
            "generation_rows": self.generation_rows,
            "step_times": [list(t) for t in self.step_times],
            "skipped_batches": self.skipped_batches,
            "precision": self.trainer.precision_plugin.state_dict(),  # 16-mixed: the loss scaler's scale and count
            "run_id": self.run_id,
            "elapsed": self.elapsed(),
        }
        tensors = {name: full(p) for name, p in self._trainable_tensors().items()}  # collective when sharded
        return tensors, self._optimizer_state(), state

    def elapsed(self) -> dict[str, float]:
        """Seconds of RL and in all of the run so far, across resumes (as of now)."""
        now, (started, rl_started) = time.perf_counter(), self.clock or (time.perf_counter(),) * 2
        return {"rl_s": self.elapsed_before["rl_s"] + now - rl_started,
                "total_s": self.elapsed_before["total_s"] + now - started}

    def _optimizer_state(self) -> dict:
        optimizer = self.optimizers().optimizer
        if not self.sharded:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.memory, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def restore(self, checkpoint: Checkpoint, training: bool = True) -> None:
        """The checkpoint's weights, optimizer, counters, history, RNG streams and pending rollouts.
        `training=False` (the checkpoint already reached the step budget): the weights and history only,
        so that the saved policy and the closing numbers are the checkpoint's."""
        params = self._trainable_tensors()
        if set(params) != set(checkpoint.tensors):
            raise ConfigError(f"resume: {checkpoint.path} holds other trainable tensors than this run builds; resume with the same settings")
        if not training:
            with torch.no_grad():
                for name, tensor in checkpoint.tensors.items():
                    params[name].copy_(tensor)
            self.updates, self.policy_version = checkpoint.state["updates"], checkpoint.state["policy_version"]
            self.eval_history = [tuple(e) for e in checkpoint.state["eval_history"]]
            self.generation_rows = checkpoint.state["generation_rows"]  # the table the run ends with holds them too
            self.step_times = saved_step_times(checkpoint.state["step_times"])
            self.elapsed_before = checkpoint.state.get("elapsed", self.elapsed_before)  # none before 2026-11-26
            return
        optimizer = self.optimizers().optimizer
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

            whole = StateDictOptions(full_state_dict=True, strict=False)
            set_model_state_dict(self.memory, checkpoint.tensors, options=whole)
            set_optimizer_state_dict(self.memory, optimizer, checkpoint.optimizer, options=whole)
        else:
            with torch.no_grad():
                for name, tensor in checkpoint.tensors.items():
                    params[name].copy_(tensor)
            optimizer.load_state_dict(checkpoint.optimizer)
        state = checkpoint.state
        self.updates, self.policy_version = state["updates"], state["policy_version"]
        self.eval_history = [tuple(e) for e in state["eval_history"]]
        self.generation_rows = state["generation_rows"]
        self.step_times = saved_step_times(state["step_times"])
        self.elapsed_before = state.get("elapsed", self.elapsed_before)
        self.skipped_batches = state["skipped_batches"]
        if state.get("precision"):  # none before 2026-12-03, or without a loss scaler
            self.trainer.precision_plugin.load_state_dict(state["precision"])
        mine = state["ranks"][distributed.rank()]
        self.source.restore(mine["source"])
        set_rng_state(mine["rng"])

    def configure_optimizers(self):
        groups = [{"params": self.memory.policy_parameters(), "lr": self.cfg.lr}]
        if self.algo.needs_values:
            groups.append({"params": self.memory.value_parameters(), "lr": self.cfg.value_lr or self.cfg.lr})
        return adamw(groups, weight_decay=0.0, eps=1e-5)

    # ---- the training step ---------------------------------------------------------------

    def training_step(self, batch, batch_idx):
        t0 = time.monotonic()
        if self._step_end is None:  # the first step, or the first after a checkpoint: its time starts here
            self._mark_step_end()
        since, gen_since, self._step_end = self._step_end, self._gen_busy_mark, None
        # 1. generate (sync: now, with the current weights; async: a batch made earlier)
        query, index, batch_id = batch
        prompts = [self.train_prompts[i] for i in index.tolist()]
        with self._sampling():
            rollout = self.source.get(self.memory.generation_model, query, prompts, self.policy_version, self.algo, int(batch_id))
        k = self.algo.samples_per_prompt
        rollout = replace(rollout, rows=index.repeat_interleave(k), split="train").to(self.device)
        t_gen = time.monotonic() - t0
        mask = rollout.response_mask
        with torch.no_grad():
            # 2. score (a completion that never ends gets the EOS penalty instead, greedy baselines too)
            scores, baseline = score_rollout(self.reward, self.memory, self.task, rollout, self.tokenizer.eos_token_id,
                                             self.cfg.eos_penalty, self.algo.needs_greedy_baseline)
            if not self._finite(scores, "the rewards (train/reward)") or (baseline is not None and not self._finite(baseline, "the greedy baseline's rewards")):
                return self._skip(rollout)
            reward_parts = dict(getattr(self.reward, "components", {}))  # reward=function: train/reward/<name>
            # 3. reference log-probs, values, and where the ratios start (the source's off-policy correction)
            ref_logprobs = rollout.ref_logprobs  # mode.reference=generator: computed beside generation
            if ref_logprobs is not None and len(ref_logprobs) < rollout.num_samples:  # balance: the generator's first rows
                ref_logprobs = self.source.finish_reference(rollout, self._reference_logprobs)
            beside = ref_logprobs is None and self.reference_beside_update
            if ref_logprobs is None and not beside:
                ref_logprobs = self._reference_logprobs(rollout.query, rollout.response, mask)
            values = None
            if self.algo.needs_values and not self.values_from_update:
                values = self._values(rollout.query, rollout.response, mask)
        first = None  # the update's own policy forward, run now where it serves twice
        if beside:  # mode.reference=thread/process: the reference's forward runs beside the update's own policy forward
            ref_logprobs, first = self._reference_beside_forward(rollout, t_gen)
        elif self.proximal_from_update or self.values_from_update:
            first = self._first_forward(rollout)
        if self.values_from_update:
            values = unordered(first[0], first[2])  # detached: GAE reads them, the value loss the update's own
        with torch.no_grad():
            recompute = (lambda: unordered(first[0], first[1])) if first is not None else (lambda: self._logprobs(rollout))
            old_logprobs, is_weights, metrics = self.source.old_policy(rollout, recompute)
        # 4. + 5. rewards and advantages
        targets, algo_metrics = self.algo.prepare(Scored(scores, old_logprobs, ref_logprobs, mask, values, baseline))
        experience = Experience(rollout.query, rollout.response, mask, old_logprobs, ref_logprobs, targets, is_weights)
        # 6. updates: epochs x mini-batches of whole prompt groups
        self.consistent = False
        updates = self._update(experience, first)
        if updates is None:
            return self._skip(rollout)
        metrics = metrics | algo_metrics | updates | reward_parts
        self._watch_signal(scores, metrics)
        self.skipped_in_a_row = 0
        self.policy_version += 1
        t_sync = time.monotonic()
        self.source.after_update(self.memory.generation_model, self.policy_version)
        self.consistent = True
        self._mark_step_end()  # this step's logging below is in the next step's time
        t_step = self._step_end - since
        t_sync = self._step_end - t_sync
        # async: what the generator worked in this step's time, wherever the batch itself was made
        gen_window = self._gen_busy_mark - gen_since if gen_since is not None else t_gen
        # 7. log
        metrics |= self._step_metrics(rollout, t_gen, t_sync, t_step, gen_window)
        self._log_step(metrics)
        if self.cfg.eval_every and self.policy_version % self.cfg.eval_every == 0:
            self.evaluate()
            self._mark_step_end()  # but not an evaluation

    def _mark_step_end(self) -> None:
        """Where a step's time ends and the next one's starts: the time, and the generator's busy seconds up to it
        (time.monotonic, the clock the generator's busy time is on)."""
        self._step_end = time.monotonic()
        self._gen_busy_mark = self.source.busy_s(self._step_end)

    def _finite(self, value: torch.Tensor, what: str, of_weights: bool = False) -> bool:
        """True if every element is finite; otherwise stop the run (rl.on_nonfinite=stop) or say so and
        let the caller skip the batch (skip_batch). Checked before any optimizer step, so no update uses it.
        of_weights: the value came out of the current weights (a loss, a gradient), which may be the cause:
        a checkpoint of them is then not named as a good one."""
        if all_finite(value):
            return True
        where = f"RL step {self.updates + 1} (rollout batch {self.policy_version})"
        if self.cfg.on_nonfinite == "stop":
            fix = f"; if the weights diverged, lower rl.lr (now {self.cfg.lr:g})" if of_weights else ""
            raise NonFiniteError(f"{what} not finite at {where}; stopped before any update with it{fix}",
                                 self.updates if of_weights else None, shared=True)
        log.warning("%s not finite at %s: batch skipped (rl.on_nonfinite=skip_batch)", what, where)
        return False

    @contextmanager
    def _sampling(self):
        """Sampling that met NaN/Inf logits, named with the step and the fix (no batch can be skipped: the weights
        themselves are bad; rl.on_nonfinite's checks saw a finite loss and gradient, then too large a step)."""
        try:
            yield
        except DivergedWeights as err:
            weights, bad = f"the weights after RL step {self.updates}", self.updates
            if err.version is not None and err.version != self.policy_version:  # an async generator's, older
                weights = f"policy version {err.version} (the generator's)"
                bad = max(0, self.updates - (self.policy_version - err.version) * self.algo.updates_per_batch)
            raise NonFiniteError(f"{err} not finite at RL step {self.updates + 1} (rollout batch {self.policy_version}), "
                                 f"sampling with {weights}; lower rl.lr (now {self.cfg.lr:g}) "
                                 f"or rl.max_grad_norm (now {self.cfg.max_grad_norm:g})", bad) from None

    def _skip(self, rollout: Rollout) -> None:
        """A batch given up on (non-finite values): the weights do not change, the stream goes on."""
        self.activations.reset()  # a forward that ran before the check saved tensors no backward will free
        self.skipped_batches += 1
        self.skipped_in_a_row += 1
        if self.skipped_in_a_row >= SKIP_LIMIT:  # a cause in every batch (a NaN reward weight): skipped for minutes,
            # 47,664 batches, then FINISHED with nothing trained
            raise NonFiniteError(f"rl.on_nonfinite=skip_batch: {self.skipped_in_a_row} rollout batches in a row had "
                                 f"non-finite values (the last at RL step {self.updates + 1}), so nothing is being "
                                 "trained; fix what the warnings above name", shared=True)
        self.policy_version += 1
        self.source.after_update(self.memory.generation_model, self.policy_version)
        self.consistent = True
        self._log_step({"train/skipped_batches": self.skipped_batches})

    def _watch_signal(self, scores: torch.Tensor, metrics: dict) -> None:
        """Warn once when every completion has scored the same for a while: nothing is being learned,
        typically a collapsed policy (e.g. a learning rate far too high)."""
        self.flat_steps = self.flat_steps + 1 if float(scores.std()) == 0.0 else 0
        if self.flat_steps == FLAT_STEPS_WARNING:
            log.warning("every completion has scored %.3f for %d steps: no learning signal (train/kl %.2f); "
                        "the policy may have collapsed; lower rl.lr", float(scores[0]), FLAT_STEPS_WARNING, float(metrics["train/kl"]))

    def _by_length(self, forward, query: torch.Tensor, response: torch.Tensor, mask: torch.Tensor,
                   split: bool = True, rows: slice | None = None, trainable: bool = False) -> torch.Tensor:
        """forward(query, response) -> (n, R), 0 on padding, over groups of rows of similar completion length
        (rl.length_buckets), each padded to its own longest row: one run-on completion no longer pads them all.
        One forward when sharded (trainer=fsdp): every rank must run the same forwards, and their lengths differ.
        rows: only those rows, each in the group the whole batch puts it in (`by_length`).
        trainable: the forward reads trainable weights (the policy's, the critic's), whose casts the groups share."""
        buckets = None
        if split and not self.sharded:
            buckets = length_buckets(mask, query.shape[1], self.cfg.length_buckets)
        # Under bf16 autocast, Lightning's cast cache is off (an optimizer step inside the region would leave stale
        # casts), so each group's forward would cast every trainable weight again, and a forward with grad keeps its
        # casts for the backward: another bf16 copy of the policy per extra group (226 MB on the 113M model). The
        # groups share one cast of each weight instead, dropped from the cache as they end (the graph keeps what it
        # needs): the 113M bf16 sync online DPO side's peak RSS 3,330-3,333 MB against 3,404 side by side, as low as
        # one group's (docs/MEASUREMENTS.md); the groups' gradients of a weight then meet in bf16 at its cast, as one
        # forward's do. Not for the frozen reference: autocast caches no frozen weight (its linears are stored in bf16
        # instead, _lower_frozen), and its cache is one for all threads, which a reference thread's
        # (mode.reference=thread) would empty under the policy's forward.
        with casts_once(enabled=trainable and buckets is not None):
            return by_length(forward, query, response, mask, buckets, self.memory.pad_token_id, rows)

    def _reference_logprobs(self, query: torch.Tensor, response: torch.Tensor, mask: torch.Tensor,
                            rows: slice | None = None) -> torch.Tensor:
        """(n, R) the frozen reference's log-probs at the sampling temperature, 0 on padding (the generator
        process calls this too). Not split by length where the reference shares the scoring forward (hydra).
        rows: only those rows of the batch (mode.reference=balance: its first rows in the generator, the rest
        here), with the numbers they get in the whole batch's forwards."""
        return self._by_length(lambda q, r: self.memory.reference_logprobs(q, r, self.temperature), query, response, mask,
                               split=not getattr(self.memory, "reference_shares_scoring_forward", False), rows=rows)

    def _policy_logprobs(self, query: torch.Tensor, response: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(n, R) the current policy's log-probs (with grad when enabled), 0 on padding."""
        return self._by_length(lambda q, r: self.memory.policy_logprobs(q, r, self.temperature), query, response, mask,
                               trainable=True)

    def _values(self, query: torch.Tensor, response: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(n, R) value estimates (with grad when enabled), 0 on padding (GAE and the value loss read masked positions only)."""
        return self._by_length(self.memory.values, query, response, mask, trainable=True)

    def _policy_logprobs_and_values(self, query: torch.Tensor, response: torch.Tensor,
                                    mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(_policy_logprobs, _values) of the same rows, from the memory strategy's joint call (memory=hydra
        actor_critic=joint: one trunk forward serves both)."""
        return self._by_length(lambda q, r: self.memory.policy_logprobs_and_values(q, r, self.temperature), query, response,
                               mask, trainable=True)

    def _logprobs(self, rollout: Rollout) -> torch.Tensor:
        """(n, R) the current policy's log-probs of the rollout's responses, 0 on padding."""
        return self._policy_logprobs(rollout.query, rollout.response, rollout.response_mask)

    def _order(self, n: int) -> torch.Tensor:
        """One pass's order over n samples: whole prompt groups shuffled, each group's samples together."""
        k = self.algo.samples_per_prompt
        groups = F.divide_exact(n, k, "rollout samples per prompt group")
        return torch.randperm(groups).repeat_interleave(k) * k + torch.arange(k).repeat(groups)

    @property
    def reference_beside_update(self) -> bool:
        """Sync mode, mode.reference=thread/process/fastest: one pass over the batch in one mini-batch, a reference of
        its own."""
        return getattr(self.source, "reference", None) in WORKERS

    def _reference_beside_forward(self, rollout: Rollout, t_gen: float) -> tuple[torch.Tensor, tuple]:
        """The reference's log-probs, computed in a second thread or a forked process while this thread runs the
        update's policy forward (with grad) over the pass's order -> (reference log-probs, _first_forward's).
        Both forwards are the ones the sequential path runs, in the same order of the random stream: the numbers
        are the same. t_gen: this step's generation, which a process with mode.split_generation shares."""
        if self._reference_worker is None:  # started at the first step: a process forks the learner as it is then
            generator = self.source.generator
            split = self.source.split_generation and hasattr(generator, "split_with")
            self._reference_worker = WORKERS[self.source.reference](
                self._reference_logprobs, self.memory.generation_model if split else None)
            if split:  # from the next step's generation on, while a process with the policy runs
                generator.split_with = lambda: None if self._reference_worker is None else self._reference_worker.generating
        started = time.monotonic()
        result = self._reference_worker.submit(rollout.query, rollout.response, rollout.response_mask)
        try:
            first = self._first_forward(rollout)
        finally:
            ref = result()  # waited for even when the forward failed: no step leaves its reference running
        observe = getattr(self._reference_worker, "observe", None)  # mode.reference=fastest: times what it changes
        chosen = observe(t_gen + time.monotonic() - started) if observe is not None else None
        if chosen is not None and self.logger is not None:
            self.logger.log_hyperparams({"rlhflab.reference_kept": chosen})
        return ref, first

    @property
    def proximal_from_update(self) -> bool:
        """An off-policy correction that recomputes the learner's log-probs before this batch's steps
        (off_policy=recompute/tis/decoupled) reads them from the update's own forward, detached, where there is one
        pass over the batch in one mini-batch: that forward runs on exactly those weights, so no forward of their own."""
        correction = getattr(self.source, "correction", None)
        return bool(getattr(correction, "needs_recompute", False)) and self.algo.updates_per_batch == 1

    @property
    def values_from_update(self) -> bool:
        """PPO with one pass over the batch in one mini-batch reads the values before the update (GAE's) from the
        update's own forward, detached: that forward runs on exactly those weights, so the critic needs no forward
        of its own before it (on the 113M model a trunk forward, 0.8-0.9 s of a 5.5-7 s Hydra-PPO step)."""
        return self.algo.needs_values and self.algo.updates_per_batch == 1

    def _first_forward(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(order, policy log-probs with grad, values with grad or None) of a one-pass, one-mini-batch update: its
        forward, run before the update over the pass's order (the same forward `_update` would run, in the same
        order of the random stream); with a critic, its values from the same call (policy_logprobs_and_values)."""
        mask = rollout.response_mask
        order = self._order(len(mask)).to(mask.device)
        rows = rollout.query[order], rollout.response[order], mask[order]
        with self.activations.track():
            if self.algo.needs_values:
                return order, *self._policy_logprobs_and_values(*rows)
            return order, self._policy_logprobs(*rows), None

    def _update(self, experience: Experience, first: tuple | None = None) -> dict | None:
        """The optimizer steps on one batch -> mean metrics, or None when a non-finite value stopped them.
        first: (order, policy log-probs, values or None) of a one-pass, one-mini-batch update whose forward ran
        already (_first_forward)."""
        opt = self.optimizers()
        k = self.algo.samples_per_prompt
        n = len(experience)
        groups = F.divide_exact(n, k, "rollout samples per prompt group")
        per_mb = F.divide_exact(groups, self.algo.num_minibatches, "algo.num_minibatches (prompts per step must divide)") * k
        sums: dict[str, float] = {}
        counted: dict[str, int] = {}  # a step skipped on a float16 overflow has no gradient norm
        for _ in range(self.algo.epochs):
            order = first[0] if first is not None else self._order(n)
            for start in range(0, n, per_mb):
                batch = experience.select(order[start : start + per_mb].to(experience.response.device))
                if distributed.world_size() > 1:  # means over the global mini-batch, not the mean of ranks' means
                    batch = replace(batch, **{k: distributed.total(v) / distributed.world_size() for k, v in counts(batch).items()})
                with self.activations.track():
                    values = None
                    if first is not None:  # used once: it is the forward of the weights before any step
                        (_, logprobs, values), first = first, None
                    elif self.algo.needs_values:  # one forward where the critic reads the policy's trunk
                        logprobs, values = self._policy_logprobs_and_values(batch.query, batch.response, batch.response_mask)
                    else:
                        logprobs = self._policy_logprobs(batch.query, batch.response, batch.response_mask)
                    loss, m = self.algo.loss(logprobs, values, batch)
                if not self._finite(loss, "train/loss", of_weights=True):
                    return None
                opt.zero_grad(set_to_none=True)
                self.manual_backward(loss)  # under 16-mixed: the loss times the scaler's scale, and so the gradients
                torch.clear_autocast_cache()  # casts a checkpointed layer's recompute left there (`_by_length`)
                self.activations.reset()
                # The norm before clipping (as TRL's and verl's grad_norm): finite exactly when the clipped one is.
                params = [p for g in opt.optimizer.param_groups for p in g["params"] if p.grad is not None]
                scaled_norm = full(torch.nn.utils.get_total_norm([p.grad for p in params]))
                scaler = self._loss_scaler()
                scale = float(scaler.get_scale()) if scaler is not None else 1.0
                overflow = self._overflowed(scaled_norm, scale)
                if not overflow and not self._finite(scaled_norm, "the gradient norm", of_weights=True):
                    opt.zero_grad(set_to_none=True)
                    return None
                if self.cfg.max_grad_norm and not overflow:
                    # With the norm just taken: what clip_grad_norm_ (Lightning's self.clip_gradients) does after
                    # taking it again, a pass over every gradient. Lightning's would also refuse the fused AdamW,
                    # which unscales inside its step (lit/optim.py). Scaled gradients clip at the scaled bound,
                    # so that the unscaled ones end at rl.max_grad_norm.
                    torch.nn.utils.clip_grads_with_norm_(params, self.cfg.max_grad_norm * scale, scaled_norm)
                self.source.hold_weights()  # mode=async: the generator may still be copying the last pushed weights
                opt.step()  # under 16-mixed: unscaled, or skipped on an overflow while the scaler lowers its scale
                # Free the gradients now, not before the next backward: otherwise they stay allocated through the
                # next batch's generation and forward passes and add a policy-sized tensor to the step's peak.
                opt.zero_grad(set_to_none=True)
                self.updates += 1
                m["train/loss"] = loss.detach()
                if scaler is not None:
                    m["train/loss_scale"], m["train/overflow"] = scale, float(overflow)
                if not overflow:
                    m["train/grad_norm"] = scaled_norm / scale
                for key, value in m.items():
                    sums[key] = sums.get(key, 0.0) + float(value)
                    counted[key] = counted.get(key, 0) + 1
        return {key: v / counted[key] for key, v in sums.items()}

    def _loss_scaler(self) -> torch.amp.GradScaler | None:
        """16-mixed's loss scaler, whose scale the gradients carry (Lightning's manual_backward scales the loss, and
        the scaler unscales only inside opt.step()); None under every other precision."""
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        return scaler if scaler is not None and scaler.is_enabled() else None

    def _overflowed(self, scaled_norm: torch.Tensor, scale: float) -> bool:
        """A float16 overflow of scaled gradients: the scaler skips the step and lowers its scale, as in any AMP
        loop (Lightning issue #18089: before, it stopped the run as non-finite). Once the scale is down to 1 the
        gradients themselves are not finite: rl.on_nonfinite decides."""
        return scale > 1.0 and not all_finite(scaled_norm)

    def _step_metrics(self, rollout: Rollout, t_gen: float, t_sync: float, t_step: float, gen_window: float) -> dict[str, float]:
        gen_busy = rollout.extras.get("gen_busy_s", t_gen)  # async: the generator's own busy time
        train_busy = t_step - t_gen
        samples = rollout.num_samples * distributed.world_size()  # the global batch (the ranks run side by side)
        self.step_times.append((samples, gen_busy, gen_window, train_busy, t_step))
        eos = self.tokenizer.eos_token_id
        metrics = {
            "train/response_len": float(rollout.response_mask.sum(1).mean()),
            "train/eos_rate": float(rollout.has_eos(eos).float().mean()),
            "rollout/staleness": float(self.policy_version - 1 - rollout.version),
            "perf/gen_s": gen_busy,
            "perf/train_s": train_busy,
            "perf/wait_s": t_gen,
            "perf/sync_s": t_sync,
            "perf/step_s": t_step,
            "perf/samples_per_s": samples / t_step,
        }
        if self.source.name != "sync":
            # 1.0 = the slower side was busy all through the step (perfect overlap). The generator's time in this
            # step, not the batch's own: a batch made ahead (during an evaluation, or the first step) is not this step's.
            metrics["perf/overlap_eff"] = max(gen_window, train_busy) / t_step
        if "ref_rows_generator" in rollout.extras:  # mode.reference=balance: the generator's share of the reference rows
            metrics["perf/ref_rows_generator"] = rollout.extras["ref_rows_generator"]
        if "engine_sync_s" in rollout.extras:  # generator=vllm: loading new weights into the engine
            metrics["perf/engine_sync_s"] = rollout.extras["engine_sync_s"]
        return metrics | self.memory_metrics()

    def timing_summary(self) -> dict[str, float]:
        """Run-level throughput over RL steps after the first (warm-up), evaluation excluded.

        mean_gen_s: a batch's generation. overlap_eff: the share of the steps' time the slower side was busy, the
        generator's time counted where it worked (so at most 1; a batch made during an evaluation is in no step).
        """
        steps = self.step_times[1:] or self.step_times
        n, gen, gen_window, train, step = (sum(col) for col in zip(*steps))
        k = len(steps)
        summary = {
            "perf/mean_samples_per_s": n / step,
            "perf/mean_gen_s": gen / k,
            "perf/mean_train_s": train / k,
            "perf/mean_step_s": step / k,
        }
        if self.source.name != "sync":  # as perf/overlap_eff: sync mode overlaps nothing (it was train / step there)
            summary["perf/mean_overlap_eff"] = max(gen_window, train) / step
        return summary

    def memory_metrics(self) -> dict[str, float]:
        """The peak memory every step; model-state bytes (constant after the first update) once, as params.

        The model-state bytes are counted again only when the optimizer holds state for more parameters (its first
        update of each): a count walks every parameter and optimizer tensor, 1.4% of a sync online DPO step on the
        tiny policy (py-spy) for the same numbers."""
        optimizer = self.optimizers().optimizer
        if self._state_bytes is None or self._state_bytes[0] != len(optimizer.state):
            self._state_bytes = (len(optimizer.state), model_state_bytes(self.memory.model_modules(), optimizer))
        state = self._state_bytes[1]
        peak, self.mem_method = peak_memory_mb(state, self.activations.peak, self.device)
        if not self.constants_logged and self.logger is not None:
            self.logger.log_hyperparams(state)
            self.constants_logged = True
        return {"perf/peak_mem_mb": peak, "perf/activation_peak_mb": self.activations.peak / 2**20}

    def _log_step(self, metrics: dict) -> None:
        # The mean over ranks (each rank trained on its share of the batch); rank 0's logger writes it.
        metrics = distributed.mean({k: float(v) for k, v in metrics.items()})
        reward = "reward" if not self.reward.needs_reward_model else "rm_score"  # a standardised reward-model score
        for label, key in ((reward, "train/reward"), ("kl", "train/kl"), ("staleness", "rollout/staleness")):
            if key in metrics and (key != "rollout/staleness" or self.source.name != "sync"):
                self.progress[label] = metrics[key]
        if self.logger is not None:  # (reduced over trainer.log_every_n_steps RL steps by rlhflab's own logger)
            getattr(self.logger, "log_step", self.logger.log_metrics)(metrics, step=self.updates)

    # ---- evaluation ----------------------------------------------------------------------

    def on_train_start(self) -> None:
        if self.logger is not None:  # the processes that train (trainer.devices=auto: 1 on CPUs), known once they run
            self.logger.log_hyperparams({"rlhflab.ranks": distributed.world_size()})
        if not self.eval_history:  # a resumed run has its evaluations so far
            self.evaluate()

    def on_train_end(self) -> None:
        if self.logger is not None and hasattr(self.logger, "tracker"):
            self.logger.tracker.rl_ended()
        self.final_evaluation()

    def final_evaluation(self) -> None:
        """The evaluation of the last policy, unless the last step's was it (once: the progress bar asks first,
        so that its last `gold` is this one)."""
        if not self.eval_history or self.eval_history[-1][0] != self.policy_version:
            self.evaluate()

    def teardown(self, stage: str) -> None:
        if self._reference_worker is not None:  # mode.reference=thread/process: its thread or process ends with the run
            if getattr(self.source.generator, "split_with", None) is not None:
                self.source.generator.split_with = None
            self._reference_worker.close()
            self._reference_worker = None

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The task's gold reward of sampled completions on held-out prompts (same seed every time); a
        task without a gold judgement reports the training reward on them instead (eval/reward). Logged
        when a trainer runs the module; returned either way. Under the training steps' autocast
        (trainer.precision=bf16-mixed), as Lightning runs a validation step, wherever it is called from: the
        evaluations between steps already ran inside one, those at the start and end now alike."""
        with autocast_as(self.run_autocast, cache_enabled=False):  # Lightning's own autocast caches nothing
            return self._evaluate()

    def _evaluate(self) -> dict[str, float]:
        k = self.cfg.eval_samples_per_prompt
        # Each rank evaluates its own share of the held-out prompts; the results are gathered, never computed twice.
        # Shares differ by at most one prompt when the count does not divide (every prompt is evaluated once).
        rows = torch.tensor_split(torch.arange(len(self.eval_prompts)), distributed.world_size())[distributed.rank()]
        with fixed_seed(self.cfg.eval_seed + distributed.rank()), self._sampling():
            rollout: Rollout = self.source.eval_generator.generate(
                self.memory.generation_model, trim_left(self.eval_query[rows], self.tokenizer.pad_token_id).to(self.device),
                [self.eval_prompts[i] for i in rows], k,
                self.policy_version,
            )
        rollout = replace(rollout, rows=rows.repeat_interleave(k), split="eval")
        scores = self.reward.score(self.memory, self.task, rollout) if self.cfg.log_generations or not self.task.has_gold else None
        gold = self.task.gold_reward(rollout.prompts, rollout.texts, "eval", rollout.rows) if self.task.has_gold else scores
        ref = self._reference_logprobs(rollout.query, rollout.response, rollout.response_mask)
        kl = F.masked_sum(rollout.logprobs - ref, rollout.response_mask, dim=1)
        eos = rollout.has_eos(self.tokenizer.eos_token_id).float()
        gathered = distributed.gather((gold.tolist(), kl.tolist(), eos.tolist()))
        gold_all, kl_all, eos_all = (torch.tensor([v for part in gathered for v in part[i]]) for i in range(3))
        value = float(gold_all.mean())
        self.eval_history.append((self.policy_version, value, float(kl_all.mean())))
        label = "gold" if self.task.has_gold else "eval"  # the bar says what the number is, as the closing line does
        self.progress = {label: value, **{k: v for k, v in self.progress.items() if k != label}}
        judged = "eval/gold_reward" if self.task.has_gold else "eval/reward"
        metrics = {judged: value, "eval/kl": float(kl_all.mean()), "eval/eos_rate": float(eos_all.mean()),
                   # seconds of RL so far, a resumed run's stop left out: the report's time axis (MLflow's
                   # timestamps counted the hours between a stop and its resume)
                   "eval/rl_s": self.elapsed()["rl_s"]}
        if self.logger is not None:
            self.logger.log_metrics(metrics, step=self.updates)
        what = "gold reward" if self.task.has_gold else "reward (the task has no gold_fn)"
        if distributed.is_main():
            # RL steps are optimizer updates, as in trainer.max_steps, MLflow's step and the closing line; PPO's
            # rollout batches hold 4 of them (rl.eval_every counts batches).
            batch = f" (rollout batch {self.policy_version})" if self.policy_version != self.updates else ""
            log.info("eval after %d RL steps%s: %s %.3f, KL %.2f", self.updates, batch, what, value, metrics["eval/kl"])
        for i in range(min(self.cfg.log_generations, rollout.num_samples) if distributed.is_main() else 0):
            self.generation_rows.append(
                {"rl_step": self.updates, "prompt": rollout.prompts[i], "response": rollout.texts[i],
                 "reward": float(scores[i]), **({"gold_reward": float(gold[i])} if self.task.has_gold else {})}
            )  # without a gold_fn, 'gold_reward' was the reward again, as if a judge had agreed
        return metrics
