"""Generation with Hugging Face `generate()`: the CPU backend (and a GPU fallback)."""

from __future__ import annotations

import logging
import weakref
from contextlib import contextmanager

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from rlhflab.errors import ConfigError, DivergedWeights
from rlhflab.rollout.batch import Rollout, repeat_prompts, response_mask_from_eos
from rlhflab.rollout.lean import SPLIT_MIN_ROWS, lean_generate, lean_generate_split, lean_unsupported
from rlhflab.rollout.sources import autocast_cache, casts_once, packs_once

log = logging.getLogger(__name__)


@contextmanager
def diverged_as_nonfinite():
    """Sampling from NaN/Inf logits (weights blown up by too large a step; the update's own checks saw finite
    values) fails in torch.multinomial with a bare RuntimeError: say what it means, in one line."""
    try:
        yield
    except RuntimeError as err:
        if "probability tensor contains" not in str(err):
            raise
        raise DivergedWeights("the policy's sampling probabilities (NaN/Inf logits: its weights have diverged)") from None


# What a generation config keeps while the policy samples: token ids and cache settings, nothing that shapes the
# distribution.
PLAIN_SAMPLING_KEEPS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "cache_implementation",
                        "use_cache")
# Set aside without a word: passed by every generate() call here (so replaced anyway), or shaping only what
# generate() returns (a hub config's return_dict_in_generate would have broken the call).
QUIET = ("do_sample", "temperature", "top_k", "top_p", "max_new_tokens", "min_length", "max_length",
         "transformers_version", "_from_model_config", "output_attentions", "output_hidden_states", "output_scores",
         "output_logits", "return_dict_in_generate")


_PLAIN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> ([(module, its config, plain)], set aside)


def _plain_configs(model) -> tuple[list, list[str]]:
    """Each generation config in the model with its plain stand-in, found once per model (generate() runs every
    batch: the module walk and the configs' copies are not redone), again if a config was replaced since."""
    from transformers import GenerationConfig

    known = _PLAIN.get(model)
    if known is not None and all(module.__dict__.get("generation_config") is config for module, config, _ in known[0]):
        return known
    swaps, dropped = [], set()
    for module in model.modules():
        config = module.__dict__.get("generation_config")
        if isinstance(config, GenerationConfig):
            own = config.to_diff_dict()
            dropped |= {f"{k}={v}" for k, v in own.items() if k not in PLAIN_SAMPLING_KEEPS + QUIET}
            swaps.append((module, config, GenerationConfig(**{k: v for k, v in own.items() if k in PLAIN_SAMPLING_KEEPS})))
    _PLAIN[model] = (swaps, sorted(dropped))
    return _PLAIN[model]


@contextmanager
def eval_mode(model):
    """model.eval() for Hugging Face's generate(), whose modules read the mode (dropout; activation checkpointing, which
    they apply in training only), then the mode it had. Not around the lean loop, whose ops read no mode (it runs only
    where no checkpointing is on, on policies whose dropout `without_dropout` zeroed): switching both ways walks every
    module, 153 us a sampling call on vs_trl's tiny policy."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextmanager
def plain_sampling(model):
    """generate() fills every setting it is not passed from the model's generation_config.json: a hub model's
    repetition_penalty (Qwen2.5-Instruct: 1.05), no_repeat_ngram_size, min_new_tokens, suppress_tokens or
    bad_words_ids reshaped the distribution the policy was sampled from, which the learner's, the reference's and
    every KL estimate's log-probs know nothing of (and `behaviour` log-probs then differ from the learner's in sync
    mode). For the call, each generation config in the model keeps only PLAIN_SAMPLING_KEEPS; it is put back after.
    Yields the settings that were set aside (name=value), for the log."""
    swaps, dropped = _plain_configs(model)
    for module, _, plain in swaps:
        module.generation_config = plain
    try:
        yield dropped
    finally:
        for module, config, _ in swaps:
            module.generation_config = config


class BehaviourLogprobs(LogitsProcessor):
    """Each sampled token's log-prob under the distribution it was drawn from (the tempered logits: the model's own
    generation config is set aside, see `plain_sampling`), kept as (n,) per step.

    generate()'s own record (output_logits) holds an (n, V) tensor per step, and stacking and tempering it made
    two more copies: on a 32,000-token vocabulary, 32 completions x 32 tokens, 390 MB. Placed after generate()'s
    processors (none with top_k=0 and temperature 1.0 passed to it), it applies the temperature itself (as
    transformers' TemperatureLogitsWarper: scores / T) and keeps one step's log-softmax: at step t+1, whose input
    ends in the token drawn at step t, it reads that token's log-prob; `logprobs` reads the last one.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.last: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.temperature != 1.0:
            scores = scores / self.temperature
        if self.last is not None:
            self.steps.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.last = scores.float().log_softmax(-1)
        return scores

    def logprobs(self, sequences: torch.Tensor) -> torch.Tensor:
        """(n, steps) log-probs of the generated tokens, given generate()'s output (prompt + completion)."""
        last = self.last.gather(-1, sequences[:, -1:]).squeeze(-1)
        return torch.stack([*self.steps, last], dim=1)


DECODES = ("auto", "lean", "generate")


class HFGenerator:
    """Samples k completions per prompt with `model.generate`, recording behaviour log-probs.

    temperature: sampling temperature; the learner divides logits by the same value.
    top_k: must be 0 (the full distribution): the learner, the reference and every KL estimate use
      untruncated log-probs, so samples from a truncated distribution would make each ratio wrong.
    max_new_tokens: null = the task's budget.
    decode: how tokens are drawn. `auto`: `lean_generate` (rollout/lean.py: the same tokens and log-probs as
      generate() from the same seed, without its per-token overhead) where it can run, a plain Llama on the CPU
      outside autocast, else generate(); `lean`: that loop or an error saying why not; `generate`: always
      Hugging Face generate().
    prepack: under CPU bf16 autocast (`trainer.precision=bf16-mixed`), where generate() runs, lay each linear
      layer's bf16 weight out for oneDNN once per call rather than at every token (`rollout.sources.packs_once`:
      1.11-1.14x the 113M model's generation on an Intel Xeon with AMX, 1.19x on an AMD EPYC without it, the same
      numbers); false: autocast's own products.
    autocast_cache: under CPU half-precision autocast, where generate() runs, keep its key/value cache in autocast's
      dtype, the keys attention reads, rather than float32 keys cast again at every token
      (`rollout.sources.autocast_cache`: 1.16-1.19x the 113M model's generation on the Xeon, 1.08x on the EPYC, the
      same numbers); false: generate()'s own cache.
    """

    needs_spawn = False  # the generator process may be forked
    synced = False  # set when the model is sharded over ranks: every rank runs the same number of forward steps
    told = False  # the settings plain_sampling set aside are logged once
    told_decode = False  # auto's choice of generate() is logged once, with its reason
    # mode.split_generation: () -> the sampler of a batch's last rows (lit/reference.SplitRows)
    # or None; set by the RL module while a reference process with the policy runs
    split_with = None
    told_split = False  # the first split batch is logged
    told_packed = False  # generator.prepack's first packed call is logged
    told_cache = False  # generator.autocast_cache's first call is logged

    def __init__(self, temperature: float = 1.0, top_k: int = 0, max_new_tokens: int | None = None,
                 decode: str = "auto", prepack: bool = True, autocast_cache: bool = True) -> None:
        if top_k != 0:
            raise ConfigError(
                f"generator.top_k={top_k}: the learner's and the reference's log-probs are those of the full distribution, "
                "so top-k sampling would make every importance ratio and KL estimate wrong; set generator.top_k=0"
            )
        if decode not in DECODES:
            raise ConfigError(f"generator.decode={decode!r} is not one of {', '.join(DECODES)}; set generator.decode=auto")
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.decoding = decode
        self.prepack = prepack
        self.autocast_cache = autocast_cache

    def check_model(self, model_cfg) -> None:
        """Raise ConfigError for a model this backend cannot run (called before any model loads)."""

    def setup(self, tokenizer, max_new_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.max_new_tokens = self.max_new_tokens or max_new_tokens

    def for_learner(self) -> "HFGenerator":
        """What the learner samples evaluation completions with while a generator process runs: this one."""
        return self

    @torch.no_grad()
    def _generate(self, model, query: torch.Tensor, greedy: bool):
        """(response (n, R) right-padded, behaviour log-probs (n, R) or None when greedy)."""
        if self.decoding != "generate":
            why = lean_unsupported(model, sampling=True) if not self.synced else "the policy is sharded over ranks"
            if why is None:
                split = self.split_with is not None and len(query) >= 2 * SPLIT_MIN_ROWS
                other = self.split_with() if split else None
                if other is not None and not self.told_split:
                    log.info("generator: the reference's process samples the last rows of each batch, half at first, "
                             "then as many as end with this process's (mode.split_generation); this process the first")
                    self.told_split = True
                with diverged_as_nonfinite():
                    args = (model, query, self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, self.max_new_tokens,
                            None if greedy else self.temperature)
                    return lean_generate(*args) if other is None else lean_generate_split(*args, other)
            if self.decoding == "lean":
                raise ConfigError(f"generator.decode=lean cannot run here: {why}; set generator.decode=auto "
                                  "(generate() where the lean loop cannot run)")
            if not self.told_decode:
                log.info("generator: Hugging Face generate(), as %s", why)
                self.told_decode = True
        attention_mask = (query != self.tokenizer.pad_token_id).long()
        recorder = None if greedy else BehaviourLogprobs(self.temperature)
        with eval_mode(model), diverged_as_nonfinite(), plain_sampling(model) as dropped, \
                casts_once(enabled=not self.synced), \
                packs_once(model, len(query), enabled=self.prepack and not self.synced) as packed:
            if packed and not self.told_packed:
                log.info("generator: bf16 products through %d linear layers' weights laid out for oneDNN once per "
                         "generate() call (generator.prepack=true)", packed)
                self.told_packed = True
            if dropped and not self.told:
                log.info("generator: sampling the policy as it is, without its generation_config.json's %s",
                         ", ".join(dropped))
                self.told = True
            cache = autocast_cache(model, enabled=self.autocast_cache and not self.synced)
            if cache is not None and not self.told_cache:
                log.info("generator: generate()'s key/value cache held in %s, as autocast's attention reads it "
                         "(generator.autocast_cache=true)", str(cache.store_dtype).removeprefix("torch."))
                self.told_cache = True
            sequences = model.generate(
                **({} if cache is None else {"past_key_values": cache}),
                input_ids=query,
                attention_mask=attention_mask,
                do_sample=not greedy,
                temperature=1.0 if not greedy else None,  # the temperature is applied by the recorder, no warper here
                top_k=0 if not greedy else None,  # 0: no truncation (transformers' default would be 50)
                top_p=None,
                max_new_tokens=self.max_new_tokens,
                min_length=0,  # no forced length (min_new_tokens=0 would add a no-op processor that costs every token)
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.tokenizer.eos_token_id,
                logits_processor=LogitsProcessorList([recorder] if recorder else []),
                synced_gpus=self.synced,  # a sharded model's forward is a collective: no rank may stop early
            )
        # generate() stops once every row has finished: the batch is as wide as its longest completion, not the
        # budget, and every forward after it (the reference, the update, a reward model) runs on that width only.
        response = sequences[:, query.shape[1] :]
        if recorder is None:
            return response, None
        return response, recorder.logprobs(sequences)

    def generate(
        self, model, query: torch.Tensor, prompts: list[str], samples_per_prompt: int, version: int, greedy_baseline: bool = False
    ) -> Rollout:
        """query: (b, P) left-padded prompts -> a Rollout of b * samples_per_prompt completions."""
        q, p = repeat_prompts(query, prompts, samples_per_prompt)
        response, logprobs = self._generate(model, q, greedy=False)
        mask = response_mask_from_eos(response, self.tokenizer.eos_token_id)
        rollout = Rollout(
            query=q,
            response=response,
            response_mask=mask,
            logprobs=logprobs * mask,  # 0 after EOS (the recorder read the pad tokens generate() put there)
            version=version,
            prompts=p,
            texts=self.decode(response),
        )
        if greedy_baseline:
            baseline, _ = self._generate(model, query, greedy=True)
            rollout.baseline_response = baseline
            rollout.baseline_texts = self.decode(baseline)
        return rollout

    def decode(self, response: torch.Tensor) -> list[str]:
        return self.tokenizer.batch_decode(response, skip_special_tokens=True)
