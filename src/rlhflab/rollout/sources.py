"""Where the learner's rollouts come from: `mode=sync` generates them on demand.

A source also owns the off-policy correction (`off_policy=`): it says which
log-probs the learner's ratios start from and which importance weights apply,
so the LightningModule never knows how fresh a batch is.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack, contextmanager
from functools import cache, partial

import torch

from rlhflab import distributed
from rlhflab.contracts import Generator, OffPolicyCorrection
from rlhflab.rollout.batch import Rollout
from rlhflab.rng import fixed_seed
from rlhflab.rollout.off_policy import Behaviour

log = logging.getLogger("rlhflab")


def current_autocast() -> dict:
    """{device type: dtype} for each device type autocast is on for in this thread (empty at full precision)."""
    return {t: torch.get_autocast_dtype(t) for t in ("cpu", "cuda") if torch.is_autocast_enabled(t)}


@contextmanager
def autocast_as(state: dict | None, cache_enabled: bool | None = None):
    """Enter autocast for each {device type: dtype} in `state` (a learner's, from another thread or process);
    `cache_enabled` None keeps this thread's cast-cache setting."""
    with ExitStack() as stack:
        for device_type, dtype in (state or {}).items():
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=cache_enabled))
        yield


@contextmanager
def casts_once(enabled: bool = True):
    """Under the autocast this thread runs in (trainer.precision=bf16-mixed), each trainable weight is cast to the
    lower precision once for what runs inside (a generate() call: one forward per token), not at every use.

    Lightning's mixed-precision plugin enters `torch.autocast(..., cache_enabled=False)` around each training step
    (an optimizer step inside it would otherwise leave a stale cast of a weight it updated in place), so generation
    in the step re-cast every weight at every token: on this host's AMX CPU, bf16 generation of the 113M model then
    ran at 0.95x float32's speed, and at 1.70x with this (benchmarks/autocast_generation.md).

    Inside, the cache is on; it is emptied on the way out, so no cast outlives the block (the weights may change
    after it). The cache holds a copy of the trainable weights in the lower precision meanwhile (half their float32
    bytes); frozen weights are never cached by autocast and are cast at each use as before. `enabled=False` leaves
    it all as it is: for a model sharded over ranks (trainer=fsdp), whose gathered weights are freed after each
    layer, cached casts would keep a whole copy of the policy on every rank."""
    state = current_autocast()
    if not state or not enabled:
        yield
        return
    # Emptied on the way in too: a checkpointed layer recomputed in a backward (memory.gradient_checkpointing)
    # re-enters the autocast its forward ran in, this one, and its casts stay cached after it, until an optimizer
    # step makes them stale.
    torch.clear_autocast_cache()
    with autocast_as(state, cache_enabled=True):
        try:
            yield
        finally:
            torch.clear_autocast_cache()


def _packed_linear(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """An nn.Linear's forward under CPU bf16 autocast, through its weight laid out for oneDNN (`packs_once`)."""
    return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), weight, bias, "none", [], "")


# What oneDNN's kernels for each half dtype need on x86 (torch.ops.mkldnn._is_mkldnn_bf16_supported / _fp16_supported)
HALF_KERNELS = {"bfloat16": "AVX-512 or AMX", "float16": "AVX-512 FP16 or AMX-FP16"}


def cpu_has_half_kernels(dtype: torch.dtype = torch.bfloat16) -> bool:
    """oneDNN's kernels for this half dtype run on this CPU (`HALF_KERNELS`). Without them (an AVX2-only CPU) torch's
    half products on the CPU run in slow fallback loops (`config.check_cpu_half`), and there is no layout to pack."""
    if not torch.backends.mkldnn.is_available():
        return False
    supported = torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16 else torch.ops.mkldnn._is_mkldnn_fp16_supported
    return bool(supported())


@contextmanager
def packs_once(model, rows: int, enabled: bool = True):
    """Under CPU bf16 autocast (trainer.precision=bf16-mixed), each plain nn.Linear of `model` multiplies through a
    bf16 copy of its weight that oneDNN laid out for its AMX / AVX-512 kernels once for what runs inside (a
    generate() call), not at every product: `rows` is the batch the layout is chosen for (the decode steps').

    An autocast product passes oneDNN a plain bf16 matrix, which its kernel re-packs into its own blocked layout at
    each call; for the few rows of a decode step that copy is a large part of the product. On this host's Xeon
    (AMX), one layer's seven products of the 113M Llama for 32 rows took 1.42 against 1.96 ms on 1 thread, 0.76
    against 1.14 ms on 2; 32 rows x 32 tokens through generate() 1.14x / 1.11x faster on 1 / 2 threads, the same
    tokens and log-probs bit for bit (docs/MEASUREMENTS.md). What autocast computes is unchanged: the input, weight
    and bias cast to bf16, a bf16 product with a bf16 result.

    Only under no_grad (the packed product has no backward), on the CPU, with oneDNN's bf16 support; each layer's
    forward is replaced on the instance for the block and restored after it, and the packed copies (half the
    weights' float32 bytes) are dropped with it. They are of every linear layer, frozen ones too: where `casts_once`
    caches a LoRA policy's adapters only, this holds a bf16 copy of its base for the call (generator.prepack=false
    if that memory matters more than the speed). `enabled=False` leaves it all as it
    is (a model sharded over ranks, generator.prepack=false). Yields how many layers it laid out."""
    if (not enabled or current_autocast().get("cpu") is not torch.bfloat16 or torch.is_grad_enabled()
            or not cpu_has_half_kernels(torch.bfloat16)):
        yield 0
        return
    packed = []
    try:
        for m in model.modules():
            if type(m) is not torch.nn.Linear or "forward" in m.__dict__ or m.weight.device.type != "cpu" \
                    or m.weight.dtype not in (torch.float32, torch.bfloat16):
                continue
            weight = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach().to(torch.bfloat16), rows)
            bias = None if m.bias is None else m.bias.detach().to(torch.bfloat16)
            m.forward = partial(_packed_linear, weight, bias)
            packed.append(m)
        yield len(packed)
    finally:
        for m in packed:
            del m.forward


def autocast_cache(model, enabled: bool = True):
    """For generate() under CPU half-precision autocast (trainer.precision=bf16-mixed): a DynamicCache that keeps each
    layer's keys and values in autocast's dtype, or None (generate() makes its own cache).

    Autocast runs attention's products (sdpa, or eager's matmuls) on bf16 inputs, but a Llama's keys come out of the
    rotary embedding in float32, so generate()'s own cache holds float32 keys, grows them by concatenation at every
    token and hands them to autocast, which casts the whole cache to bf16 again for each layer at each token. Cached
    already in bf16, the keys attention reads are the same numbers (autocast's cast of them), cast once each; the
    values are bf16 already. 32 rows x 32 tokens of the 113M policy through generate() with `generator.prepack`:
    2,072 against 2,460 ms on 1 thread (1.19x), 1,300 against 1,511 ms on 2 (1.16x), the same tokens and log-probs
    bit for bit (docs/MEASUREMENTS.md). None outside CPU half autocast, for a model whose generation config asks for
    another cache, or one generate() gives no dynamic cache (encoder-decoders, recurrent layers)."""
    dtype = current_autocast().get("cpu")
    if (not enabled or dtype not in (torch.bfloat16, torch.float16) or next(model.parameters()).device.type != "cpu"
            or getattr(model.generation_config, "cache_implementation", None) is not None
            or getattr(model.config, "is_encoder_decoder", False) or not model._supports_default_dynamic_cache()):
        return None
    return _autocast_cache_class()(dtype, config=model.config)


@cache
def _autocast_cache_class():
    from transformers import DynamicCache

    class AutocastCache(DynamicCache):
        """A DynamicCache whose keys and values are cast to `dtype` as they are stored (`autocast_cache`)."""

        def __init__(self, dtype: torch.dtype, **kwargs) -> None:
            super().__init__(**kwargs)
            self.store_dtype = dtype  # not `dtype`: transformers' cache layers use that name for their own

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(key_states.to(self.store_dtype), value_states.to(self.store_dtype), layer_idx,
                                  *args, **kwargs)

    return AutocastCache


def seeded(seed: int, batch: int, rank: int = 0):
    """Sampling noise that depends only on (seed, batch index, rank): sync and async draw the same
    samples, and ranks sampling their shares of one batch draw different noise."""
    return fixed_seed(seed * 1_000_003 + batch + rank * 100_000_007)


class SyncSource:
    """Generate each batch with the current weights, then train on it (staleness 0)."""

    name = "sync"
    staleness = 0
    max_staleness = 0

    def __init__(self, generator: Generator, correction: OffPolicyCorrection | None = None, reference: str = "learner",
                 split_generation: bool = False) -> None:
        self.generator = generator
        self.split_generation = split_generation  # the reference's process samples half of each batch (lit/reference.py)
        self.correction = correction or Behaviour()
        self.reference = reference  # mode.reference: learner, or thread / process (beside the update's policy forward)
        self.seed = 0
        self.rank = 0
        self.pending: list[Rollout] = []  # rollouts made ahead of their step and kept by a checkpoint (async)

    @property
    def eval_generator(self) -> Generator:
        """What the learner samples evaluation completions with."""
        return self.generator

    def start(self, model, batches, train_prompts, algo, seed: int, version: int = 0, reference=None, autocast=None) -> None:
        """Sync mode leaves the reference log-probs to the learner: between generation and update, or beside the
        update's own policy forward in a second thread (thread) or a forked process (process), or whichever of the
        two is faster (fastest)."""
        self.seed = seed
        self.rank = distributed.rank()
        where = {"thread": "a second thread", "process": "a forked process",
                 "fastest": "a second thread or a forked process, whichever is faster over the first steps"}
        if self.reference in where:  # (lit/reference.WORKERS: the workers that run it beside the update)
            log.info("mode sync: reference log-probs in %s, beside the update's policy forward", where[self.reference])

    def get(self, model, query, prompts: list[str], version: int, algo, batch: int) -> Rollout:
        """Generate training batch `batch` (its index in the run's prompt stream) with the current weights."""
        with seeded(self.seed, batch, self.rank):
            return self.generator.generate(
                model, query, prompts, algo.samples_per_prompt, version, greedy_baseline=algo.needs_greedy_baseline
            )

    def finish_reference(self, rollout: Rollout, reference) -> torch.Tensor:
        """(n, R) reference log-probs of a rollout whose source computed only its first rows (mode.reference=balance):
        `reference(query, response, response_mask, rows)` computes the rest, which go after them."""
        m = len(rollout.ref_logprobs)
        rest = reference(rollout.query, rollout.response, rollout.response_mask, rows=slice(m, rollout.num_samples))
        return torch.cat([rollout.ref_logprobs, rest])

    def old_policy(self, rollout: Rollout, recompute):
        """(old log-probs, importance weights or None, metrics) from the correction; `recompute()` is
        the learner's log-probs before the update, computed only when the correction needs them."""
        recomputed = recompute() if self.correction.needs_recompute else None
        return self.correction(rollout.logprobs, recomputed, rollout.response_mask)

    def can_checkpoint(self, version: int) -> bool:
        return True

    def checkpoint_state(self, version: int) -> dict:
        """Sync mode owes nothing: every batch is made from the current weights."""
        return {}

    def restore(self, state: dict) -> None:
        pass

    def after_update(self, model, version: int) -> None:
        """Sync mode generates from the live policy: no weights to push."""

    def hold_weights(self) -> None:
        """Nobody else reads the learner's weights."""

    def busy_s(self, now: float) -> float | None:
        """The learner generates: a step's generation is its own wait."""
        return None

    def close(self) -> None:
        pass
