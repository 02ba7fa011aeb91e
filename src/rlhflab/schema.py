"""Typed schemas of every config group (Hydra structured configs), and the checks they carry.

Each option file in conf/ starts from its schema (`defaults: [/schema/<group>/<name>@_here_]`),
so OmegaConf types every value when the config is composed: `trainer.max_steps=abc` fails
there. Ranges and choices ride on the fields (`setting(ge=..., choices=...)`) and
`check(cfg)` enforces them, together with keys no schema declares (a `+key` override) and
the cross-field rules that need no model. This module imports neither torch nor the classes
the schemas describe: the checks run in well under a second, before anything heavy loads.
A test keeps every schema's fields equal to its `_target_`'s parameters.
"""

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from rlhflab.errors import ConfigError, chosen, no_such_file
from rlhflab.models.checks import DATA_SUFFIXES, check_pretrained
from rlhflab.naming import EVAL_METRICS, home_expanded

KL_KINDS = ("k1", "k2", "k3")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
DTYPES = ("float32", "bfloat16", "float16")


def setting(default: Any = MISSING, *, ge=None, gt=None, le=None, lt=None, choices=None, example=None, why=None,
            file=None, model=False, data=False, path=False, inf_ok=False):
    """A dataclass field whose value `check` keeps in range (ge/gt/le/lt) or in `choices`;
    `example` is the value the fix suggests, `why` a reason the error gives. `file`: the value
    is a path that must exist (the text is the fix); `model`: a local path must be a saved model;
    `data`: a path with a data file's suffix must exist (anything else may be a hub dataset);
    `path`: a path or a URI (these four have a leading `~` expanded, see naming.home_expanded). A number must be finite
    (rl.lr=inf passed `gt=0` and diverged at RL step 2; rl.eos_penalty=nan made every EOS-less reward NaN) unless
    `inf_ok`: an infinite bound that only switches its limit off (rl.max_grad_norm, clip_eps, a cap, kl_budget)."""
    meta = {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt, choices=choices, example=example, why=why, file=file,
                                  model=model or None, data=data or None, inf_ok=inf_ok or None,
                                  path=(path or model or data or file is not None) or None).items() if v is not None}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: default, metadata=meta)
    return field(default=default, metadata=meta)


# ---- the run ----------------------------------------------------------------------------------

@dataclass
class SFTStage:
    epochs: int = setting(ge=1)
    batch_size: int = setting(ge=1)
    lr: float = setting(gt=0, example=1e-3)
    seed: int = setting(ge=0)


@dataclass
class RMStage(SFTStage):
    held_out_fraction: float = setting(gt=0, lt=1, example=0.1)


@dataclass
class HydraSFTStage:
    reward_loss_weight: float = setting(ge=0, example=1.0)


@dataclass
class Stages:
    torch_threads: Optional[int] = setting(ge=1)
    batch_threads: int = setting(ge=1)
    sft: SFTStage = MISSING
    rm: RMStage = MISSING
    hydra_sft: HydraSFTStage = MISSING


@dataclass
class RL:
    prompts_per_step: int = setting(ge=1)
    lr: float = setting(gt=0, example=1e-3)
    value_lr: Optional[float] = setting(gt=0, example=1e-3)
    max_grad_norm: Optional[float] = setting(gt=0, example=1.0, inf_ok=True)
    eos_penalty: Optional[float] = setting(example=-1.0)
    eval_every: int = setting(ge=0)
    eval_samples_per_prompt: int = setting(ge=1)
    eval_seed: int = setting(ge=0)
    log_generations: int = setting(ge=0)
    on_nonfinite: str = setting(choices=("stop", "skip_batch"))
    length_buckets: int = setting(ge=1)
    prompt_once: bool = MISSING


@dataclass
class Output:
    dir: Optional[str] = setting(path=True)
    merge_lora: bool = MISSING
    log_policy: bool = MISSING


@dataclass
class Checkpointing:
    every_n_steps: Optional[int] = setting(ge=1)
    keep: int = setting(ge=1)


@dataclass
class Train:
    """The root config (conf/train.yaml); each group's node is typed by its option's schema."""

    task: Any = MISSING
    model: Any = MISSING
    algo: Any = MISSING
    reward: Any = MISSING
    memory: Any = MISSING
    mode: Any = MISSING
    off_policy: Any = MISSING
    generator: Any = MISSING
    trainer: Any = MISSING
    logger: Any = MISSING
    staleness: int = setting(ge=0)
    seed: int = setting(ge=0)
    cache_dir: str = setting(path=True)
    torch_threads: Optional[int] = setting(ge=1)
    train_attention: str = setting(choices=("eager", "sdpa"))
    optimized_metric: str = MISSING
    kl_budget: Optional[float] = setting(None, ge=0, example=3.0, inf_ok=True)  # sweep_optuna: nats of eval KL before the penalty
    kl_penalty: float = setting(0.1, ge=0, example=0.1)  # sweep_optuna: gold reward off per nat above the budget
    stages: Stages = MISSING
    rl: RL = MISSING
    output: Output = MISSING
    checkpoint: Checkpointing = MISSING
    resume: Optional[str] = setting(path=True)


# ---- tasks and models -------------------------------------------------------------------------

@dataclass
class SentimentTask:
    _target_: str = "rlhflab.tasks.sentiment.SentimentTask"
    words_file: Optional[str] = setting(file="point it at a JSON file with 'positive', 'negative', 'neutral' word lists, or set task.words_file=null")
    prompt_words: int = setting(ge=1)
    response_words: int = setting(ge=1)
    num_train_prompts: int = setting(ge=1)
    num_eval_prompts: int = setting(ge=1)
    num_demonstrations: int = setting(ge=1)
    num_preference_pairs: int = setting(ge=2)
    seed: int = setting(ge=0)


@dataclass
class PromptsTask:
    _target_: str = "rlhflab.tasks.files.PromptsTask"
    path: str = setting(data=True)
    split: str = MISSING
    prompt_field: str = MISSING
    eval_path: Optional[str] = setting(data=True)
    eval_split: Optional[str] = MISSING
    eval_fraction: float = setting(gt=0, lt=1, example=0.1)
    num_eval_prompts: int = setting(ge=1)
    chat_template: bool = MISSING
    max_prompt_tokens: int = setting(ge=1)
    overlong: str = setting(choices=("drop", "truncate"))
    demonstrations_path: Optional[str] = setting(data=True)
    completion_field: str = MISSING
    preferences_path: Optional[str] = setting(data=True)
    chosen_field: str = MISSING
    rejected_field: str = MISSING
    max_new_tokens: int = setting(ge=1)
    gold_fn: Optional[str] = MISSING
    tokenizer: str = setting(choices=("word", "char"))
    seed: int = setting(ge=0)


@dataclass
class HubPromptTask:
    _target_: str = "rlhflab.tasks.hub.HubPromptTask"
    dataset: str = MISSING
    prompt_key: str = MISSING
    train_split: str = MISSING
    eval_split: str = MISSING
    num_train_prompts: int = setting(ge=1)
    num_eval_prompts: int = setting(ge=1)
    max_new_tokens: int = setting(ge=1)
    gold_model_path: Optional[str] = setting(path=True)
    seed: int = setting(ge=0)


@dataclass
class Model:
    name: str = MISSING
    name_or_path: Optional[str] = setting(model=True)
    tokenizer: Optional[str] = setting(model="tokenizer")
    sft_path: Optional[str] = setting(model=True)
    reward_model_path: Optional[str] = setting(model=True)
    dtype: str = setting(choices=DTYPES)
    init_seed: int = setting(ge=0)
    arch: Optional[Dict[str, Any]] = MISSING


# ---- algorithms -------------------------------------------------------------------------------

@dataclass
class Algo:
    _target_: str = MISSING
    samples_per_prompt: int = setting(ge=1)
    kl_estimator: str = setting(choices=KL_KINDS)
    loss_agg: str = setting(choices=LOSS_AGG_MODES)
    epochs: int = setting(ge=1)
    num_minibatches: int = setting(ge=1)


@dataclass
class WholeCompletionReinforce(Algo):  # rloo, remax
    kl_coef: float = setting(ge=0, example=0.05)
    clip_eps: float = setting(gt=0, example=0.2, inf_ok=True)


@dataclass
class RLOO(WholeCompletionReinforce):
    samples_per_prompt: int = setting(ge=2, why="the baseline is the mean of the other k-1 samples")


@dataclass
class ReinforcePP(Algo):
    kl_coef: float = setting(ge=0, example=0.05)
    gamma: float = setting(ge=0, le=1, example=1.0)
    clip_eps: float = setting(gt=0, example=0.2, inf_ok=True)


@dataclass
class GRPO(Algo):  # grpo, dr_grpo
    samples_per_prompt: int = setting(ge=2, why="advantages are normalised within each prompt's group")
    kl_loss_coef: float = setting(ge=0, example=0.04)
    clip_eps: float = setting(gt=0, example=0.2, inf_ok=True)
    scale_by_std: bool = MISSING


@dataclass
class PPO(Algo):
    kl_coef: float = setting(ge=0, example=0.05)
    gamma: float = setting(ge=0, le=1, example=1.0)
    lam: float = setting(ge=0, le=1, example=0.95)
    clip_eps: float = setting(gt=0, example=0.2, inf_ok=True)
    value_clip_eps: float = setting(gt=0, example=0.2, inf_ok=True)
    vf_coef: float = setting(ge=0, example=0.1)
    whiten_advantages: bool = MISSING


@dataclass
class OnlineDPO(Algo):
    samples_per_prompt: int = setting(ge=2, why="the best and the worst sample of a prompt form its pair")
    beta: float = setting(gt=0, example=0.1)
    loss_type: str = setting(choices=("sigmoid", "ipo"))
    ties: str = setting(choices=("skip", "keep"))


# ---- reward, memory, mode, off-policy, generation -----------------------------------------------

@dataclass
class Reward:
    _target_: str = MISSING


@dataclass
class FunctionReward(Reward):
    fn: Optional[str] = MISSING
    fns: List[str] = MISSING
    weights: Optional[List[float]] = MISSING


@dataclass
class FullMemory:
    _target_: str = "rlhflab.memory.full.FullMemory"
    gradient_checkpointing: bool = MISSING


@dataclass
class LoraMemory(FullMemory):  # lora, hydra
    r: int = setting(ge=1)
    lora_alpha: float = setting(gt=0, example=16)
    lora_dropout: float = setting(ge=0, lt=1)
    target_modules: Any = MISSING  # a list of module names, or "all-linear"


@dataclass
class HydraMemory(LoraMemory):
    actor_critic: str = setting(choices=("separate", "joint"))


@dataclass
class SyncMode:
    _target_: str = "rlhflab.rollout.sources.SyncSource"
    reference: str = setting(choices=("auto", "learner", "thread", "process", "fastest"))
    split_generation: bool = MISSING


@dataclass
class AsyncMode:
    _target_: str = "rlhflab.rollout.async_source.AsyncSource"
    staleness: int = setting(ge=0)
    sync_every: int = setting(ge=1)
    generator_threads: int = setting(ge=1)
    learner_threads: int = setting(ge=1)
    device: Optional[str] = MISSING
    start_method: str = setting(choices=("auto", "fork", "spawn"))
    reference: str = setting(choices=("auto", "learner", "generator", "balance"))


@dataclass
class OffPolicy:
    _target_: str = MISSING


@dataclass
class TruncatedIS(OffPolicy):
    cap: float = setting(gt=1, example=2.0, inf_ok=True)


@dataclass
class Decoupled(OffPolicy):
    cap: Optional[float] = setting(gt=1, example=5.0, inf_ok=True)


@dataclass
class HFGenerator:
    _target_: str = "rlhflab.rollout.hf.HFGenerator"
    temperature: float = setting(gt=0, example=1.0)
    top_k: int = setting(choices=(0,), why="the learner and the reference never truncate, so top-k samples would make every ratio and KL wrong")
    max_new_tokens: Optional[int] = setting(ge=1)
    decode: str = setting(choices=("auto", "lean", "generate"))
    prepack: bool = MISSING
    autocast_cache: bool = MISSING


@dataclass
class VLLMGenerator(HFGenerator):
    gpu_memory_utilization: float = setting(gt=0, le=1, example=0.3)
    kv_cache_memory_bytes: Optional[int] = setting(ge=1)
    dtype: str = setting(choices=("auto", *DTYPES))
    enforce_eager: bool = MISSING
    max_model_len: Optional[int] = setting(ge=1)


@dataclass
class Trainer:
    _target_: str = "lightning.Trainer"
    accelerator: str = MISSING
    devices: Any = MISSING
    num_nodes: int = setting(ge=1)
    strategy: Any = MISSING  # a Lightning strategy name, or a node with its _target_
    max_steps: int = setting(ge=1)
    precision: str = setting(choices=("32-true", "32", "bf16-mixed", "16-mixed", "bf16-true", "64-true"))
    log_every_n_steps: int = setting(ge=1)
    enable_checkpointing: bool = MISSING
    enable_model_summary: bool = MISSING
    enable_progress_bar: bool = MISSING
    num_sanity_val_steps: int = setting(ge=0)


@dataclass
class MlflowLogger:
    _target_: str = "rlhflab.tracking.MlflowTracker"
    tracking_uri: str = setting(path=True)
    experiment_name: str = MISSING
    run_name: Optional[str] = MISSING
    flush_every_s: float = setting(ge=0, example=1.0, inf_ok=True)


# The option files and the schema each starts from (conf/<group>/<option>.yaml -> schema/<group>/<name>).
SCHEMAS: dict[str, dict[str, type]] = {
    "task": {"sentiment": SentimentTask, "tldr": HubPromptTask, "prompts": PromptsTask},
    "model": {"model": Model},
    "algo": {"rloo": RLOO, "remax": WholeCompletionReinforce, "reinforce_pp": ReinforcePP,
             "grpo": GRPO, "dr_grpo": GRPO, "ppo": PPO, "online_dpo": OnlineDPO},
    "reward": {"reward": Reward, "function": FunctionReward},
    "memory": {"full": FullMemory, "lora": LoraMemory, "hydra": HydraMemory},
    "mode": {"sync": SyncMode, "async": AsyncMode},
    "off_policy": {"plain": OffPolicy, "tis": TruncatedIS, "decoupled": Decoupled},
    "generator": {"hf": HFGenerator, "vllm": VLLMGenerator},
    "trainer": {"trainer": Trainer},
    "logger": {"mlflow": MlflowLogger},
}


def register() -> None:
    """Put the schemas in Hydra's ConfigStore (idempotent): before any config is composed. src/train.py and its
    preflight both call it, and a store that holds them already is left as it is (storing them again took 40 ms)."""
    from hydra.core.config_store import ConfigStore

    # ${rlhflab.ranks:} = trainer.devices x trainer.num_nodes (trainer=fsdp's data_parallel_size: every rank shards)
    OmegaConf.register_new_resolver("rlhflab.ranks", lambda *, _root_: ranks(_root_.trainer), replace=True)
    store = ConfigStore.instance()
    held = store.repo.get("schema", {})
    if "train_schema.yaml" in store.repo and all(f"{name}.yaml" in held.get(group, {})
                                                  for group, options in SCHEMAS.items() for name in options):
        return
    store.store(name="train_schema", node=Train)
    for group, options in SCHEMAS.items():
        for name, node in options.items():
            store.store(group=f"schema/{group}", name=name, node=node)


# ---- the checks -------------------------------------------------------------------------------

class SettingError(ConfigError):
    """One bad setting: `key` and a message that ends with the fix."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


_BOUNDS = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b),
           "le": ("<=", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}


def _check_value(key: str, value: Any, meta: dict) -> None:
    """`value` with its `~` already expanded where it is a path (_walk's _expand_home runs first)."""
    if value is None or not meta:
        return
    if "file" in meta and not Path(value).is_file():
        raise SettingError(key, f"{no_such_file(value)}; {meta['file']}")
    if "model" in meta:
        check_pretrained(key, value, tokenizer=meta["model"] == "tokenizer")
    if "data" in meta and Path(value).suffix in DATA_SUFFIXES and not Path(value).is_file():
        raise SettingError(key, f"{no_such_file(value)}; give a .jsonl, .json, .csv or .parquet file, or a hub dataset name")
    why = f" ({meta['why']})" if "why" in meta else ""
    if isinstance(value, float) and not math.isfinite(value) and not (math.isinf(value) and "inf_ok" in meta):
        example = meta.get("example", meta.get("ge", meta.get("gt")))
        raise SettingError(key, f"{value} is not a finite number; set e.g. {key}={example}")
    if "choices" in meta and value not in meta["choices"]:
        options = ", ".join(map(str, meta["choices"]))
        raise SettingError(key, f"{value!r} is not one of {options}{why}; set e.g. {key}={meta['choices'][0]}")
    broken = [f"{sign} {meta[k]}" for k, (sign, ok) in _BOUNDS.items() if k in meta and not ok(value, meta[k])]
    if broken:
        wanted = " and ".join(f"{sign} {meta[k]}" for k, (sign, _) in _BOUNDS.items() if k in meta)
        example = meta.get("example", meta.get("ge", meta.get("gt")))
        raise SettingError(key, f"{value} must be {wanted}{why}; set e.g. {key}={example}")


def _expand_home(node: DictConfig, key: str) -> None:
    """A path setting's leading `~` made the home directory (naming.home_expanded), also where the value came from
    ${oc.env:...}; one that resolves only inside a job (${hydra:job.num}) is left to resolve there."""
    try:
        value = node[key]
    except InterpolationResolutionError:
        return
    if isinstance(value, str) and (expanded := home_expanded(value)) != value:
        node[key] = expanded


def _walk(node: DictConfig, prefix: str = "") -> None:
    schema = OmegaConf.get_type(node)
    declared = {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    for key in node.keys():
        name = f"{prefix}{key}"
        if declared is not None and key not in declared:
            valid = ", ".join(k for k in declared if not k.startswith("_"))
            raise SettingError(name, f"not a setting of {prefix.rstrip('.') or 'the config'}; valid keys: {valid}")
        if OmegaConf.is_missing(node, key):
            raise SettingError(name, f"has no value; set it, e.g. {name}=...")
        if declared is not None and "path" in declared[key].metadata:
            _expand_home(node, key)
        if OmegaConf.is_interpolation(node, key):
            continue  # e.g. task.seed: ${seed}; the key it points to is checked where it lives
        value = node[key]
        if isinstance(value, DictConfig):
            _walk(value, f"{name}.")
        elif declared is not None and not isinstance(value, ListConfig):
            _check_value(name, value, declared[key].metadata)


def check_typed(cfg: DictConfig, choices: dict) -> None:
    """Every group's option starts from a schema. One that does not (a new conf/algo/X.yaml without the
    `/schema/...@_here_` line) would have none of its values checked: a typo'd key or a bad value would
    fail only when its class is built, after the models load."""
    for group, options in SCHEMAS.items():
        if group in cfg and not dataclasses.is_dataclass(OmegaConf.get_type(cfg[group])):
            option = choices.get(group, "?")
            known = ", ".join(sorted(options))
            raise SettingError(f"{group}={option}", f"its config has no schema, so none of its values would be checked; put "
                               f"'- /schema/{group}/NAME@_here_' first in its defaults (NAME: one of {known}, or a "
                               f"dataclass of your own added to SCHEMAS['{group}'] in src/rlhflab/schema.py)")


def check_own_gpu(cfg: DictConfig, choices: dict) -> None:
    """generator=vllm_own_gpu lets its engine take most of a GPU, meant to be the generator's own. Without mode=async
    and mode.device=cuda:N that GPU is the learner's, which would be left the rest (0.15 of it), and the run would
    fail once the learner allocated on it, after the models loaded (found by reading; no GPU here to see it)."""
    if choices.get("generator") != "vllm_own_gpu":
        return
    if OmegaConf.get_type(cfg.mode) is AsyncMode and cuda_index(cfg.mode.get("device")) is not None:
        return
    share = cfg.generator.gpu_memory_utilization
    where = "mode.device is not set" if OmegaConf.get_type(cfg.mode) is AsyncMode else "mode=sync generates on it"
    raise SettingError("generator=vllm_own_gpu", f"its engine takes {share} of a GPU of its own, and {where}, so it "
                       "would share the learner's; add mode=async mode.device=cuda:1 (the generator's GPU), or use "
                       "generator=vllm, which leaves the learner most of the GPU they share")


def trainer_devices(trainer: DictConfig):
    """trainer.devices as Lightning reads it: an int (a count, or -1), a list of GPU indices, or another string
    (auto); a string of digits is a count and "0,1" a list, as Lightning parses them."""
    devices = trainer.devices
    if isinstance(devices, ListConfig):
        return list(devices)
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        return int(devices)
    if isinstance(devices, str) and "," in devices:
        parts = [p.strip() for p in devices.split(",") if p.strip()]
        return [int(p) if p.isdigit() else p for p in parts]
    return devices


def check_trainer_devices(trainer: DictConfig) -> None:
    """trainer.devices as Lightning takes it: a count >= 1, -1 (every GPU), a list of GPU indices, or auto; on CPU a
    count. trainer.devices=0 passed, made an MLflow run, and stopped at Lightning's Trainer in Hydra's
    'Error executing job ... MisconfigurationException'."""
    devices = trainer_devices(trainer)
    gpu = str(trainer.accelerator) in ("gpu", "cuda", "auto")
    if isinstance(devices, list):
        if not gpu:
            raise SettingError("trainer.devices", f"{devices} is a list of GPU indices, and trainer.accelerator="
                               f"{trainer.accelerator}; on CPU give a count of processes, e.g. trainer.devices={len(devices) or 1}")
        if not devices or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in devices) \
                or len(set(devices)) != len(devices):
            raise SettingError("trainer.devices", f"{devices} is not a list of distinct GPU indices; give e.g. trainer.devices=[0,1]")
        return
    if devices == "auto" or (isinstance(devices, int) and not isinstance(devices, bool) and (devices >= 1 or (devices == -1 and gpu))):
        return
    raise SettingError("trainer.devices", f"{devices!r} is not a device count; give N >= 1 (processes on CPU, GPUs with "
                       "trainer=gpu), " + ("-1 (every GPU), a list of GPU indices e.g. [0,1], " if gpu else "") + "or auto")


def ranks(trainer: DictConfig) -> int:
    """Processes a trainer config starts (1 when `devices` is not a count, e.g. auto or -1, or a list of one)."""
    devices = trainer_devices(trainer)
    count = len(devices) if isinstance(devices, list) else devices if isinstance(devices, int) and devices > 0 else 1
    return count * trainer.num_nodes


def cuda_index(device) -> int | None:
    """N of mode.device=cuda:N (0 for cuda); None for no device or the CPU. Anything else (gpu, 0, a typo) passed as
    the CPU here and failed in the generator process, after the models had loaded, as 'died without a traceback'."""
    device = str(device or "")
    if device in ("", "cpu"):
        return None
    index = device.partition(":")[2] or "0"
    if device.partition(":")[0] != "cuda" or not index.isdigit():
        raise SettingError(f"mode.device={device}", "not a device; give cuda:N (N a visible GPU's index), cpu, or null (the CPU)")
    return int(index)


def check_generator_device(cfg: DictConfig, gpus: tuple[str, ...] = ("gpu", "cuda")) -> None:
    """mode.device=cuda:N puts each rank's generator on GPU N + its local rank: those must not be training GPUs.
    `gpus`: the trainer.accelerator values that train on GPUs; check_devices adds `auto` where GPUs are visible (here,
    without torch, auto may be CPUs, where the clash was said and the fix it gave then found no GPU)."""
    device = OmegaConf.select(cfg, "mode.device")
    first = cuda_index(device)
    if first is None or cfg.trainer.accelerator not in gpus:
        return
    devices = trainer_devices(cfg.trainer)
    training = devices if isinstance(devices, list) else list(range(devices)) if isinstance(devices, int) and devices > 0 else [0]
    generators = list(range(first, first + len(training)))
    clash = sorted(set(training) & set(generators))
    if clash:
        free = max(training) + 1
        raise SettingError("mode.device", f"{device} gives the generator(s) GPU {', '.join(map(str, generators))}, and "
                           f"trainer.devices trains on GPU {', '.join(map(str, training))}; set mode.device=cuda:{free}")


def check_sharding(cfg: DictConfig) -> None:
    """trainer=fsdp (ModelParallelStrategy) with what it cannot shard: one line each."""
    strategy = cfg.trainer.strategy
    if not (isinstance(strategy, DictConfig) and str(strategy.get("_target_", "")).endswith("ModelParallelStrategy")):
        return
    if OmegaConf.get_type(cfg.mode) is AsyncMode:
        raise SettingError("mode=async", "with trainer=fsdp the policy is sharded over the ranks, and a generator process "
                           "needs all of it; use trainer=ddp for async runs (or mode=sync)")
    if issubclass(OmegaConf.get_type(cfg.generator), VLLMGenerator):
        raise SettingError(chosen("generator", "vllm"), "an inference engine needs the whole policy, which trainer=fsdp shards; "
                           "use generator=hf with trainer=fsdp, or trainer=ddp")
    if cfg.output.merge_lora:
        raise SettingError("output.merge_lora", "not with trainer=fsdp (the adapter is saved; merge it from policy/ after the run)")


def check(cfg: DictConfig) -> None:
    """Raise SettingError for the first bad value of a composed config: an undeclared key, a value
    out of range or not among its choices, or a cross-field rule that needs no model."""
    _walk(cfg)
    check_trainer_devices(cfg.trainer)
    metric = str(OmegaConf.select(cfg, "optimized_metric", default=None) or "")
    if metric.startswith("eval/") and metric not in EVAL_METRICS:  # found only once the run (every job) had trained
        raise SettingError("optimized_metric", f"{metric}: no run logs it; give one of {', '.join(EVAL_METRICS)}, or a "
                           "train/ or perf/ value the run logs at its end")
    if not str(OmegaConf.select(cfg, "logger.experiment_name", default="x")).strip():  # MLflow's AttributeError
        raise SettingError("logger.experiment_name", "empty; give the MLflow experiment a name, e.g. logger.experiment_name=rlhflab")
    uri = str(OmegaConf.select(cfg, "logger.tracking_uri", default="x")).strip()
    if uri in ("sqlite://", "sqlite:///:memory:"):  # the run 'FINISHED' and its closing line linked a store that was gone
        raise SettingError("logger.tracking_uri", f"{uri} is an in-memory database, gone when the run ends (its metrics, "
                           "params and record with it); give a file, e.g. logger.tracking_uri=sqlite:///mlflow.db")
    if not uri:  # MLflow's default store, then Lightning's
        # refused ./mlruns: a run made, then a 50-line traceback (an empty MLFLOW_TRACKING_URI= in the environment too)
        raise SettingError("logger.tracking_uri", "empty (from MLFLOW_TRACKING_URI= or logger.tracking_uri=); give a store, e.g. "
                           "logger.tracking_uri=sqlite:///mlflow.db, or unset MLFLOW_TRACKING_URI for that default")
    if not str(OmegaConf.select(cfg, "cache_dir", default="x")).strip():  # built models and stages in the working directory
        raise SettingError("cache_dir", "empty (from RLHFLAB_CACHE= or cache_dir=), which would cache models and stages in "
                           "the working directory; give a directory, e.g. cache_dir=.cache/rlhflab, or unset RLHFLAB_CACHE "
                           "for that default")
    mode = OmegaConf.get_type(cfg.mode)
    if mode is SyncMode and cfg.staleness != 0:
        raise SettingError("staleness", f"{cfg.staleness}: mode=sync runs with staleness 0; use mode=async for staleness > 0 (or staleness=0)")
    if mode is AsyncMode and cfg.mode.staleness != cfg.staleness:  # it ran at 2, its tag, param and report said 1
        raise SettingError("mode.staleness", f"{cfg.mode.staleness}: give staleness={cfg.mode.staleness} instead (the top-level key; "
                           "mode.staleness follows it, and the run's tag and sweeps read it)")
    if mode is AsyncMode and cfg.mode.reference in ("generator", "balance") and cfg.mode.start_method == "spawn":
        raise SettingError("mode.reference", f"{cfg.mode.reference} needs mode.start_method=fork (the forked generator shares the learner's "
                           "reference model); set mode.start_method=fork (CPU) or mode.reference=learner")
    world = ranks(cfg.trainer)
    if world > 1 and cfg.rl.prompts_per_step % world:
        raise SettingError("rl.prompts_per_step", f"{cfg.rl.prompts_per_step} prompts do not split evenly over {world} ranks "
                           f"(trainer.devices x trainer.num_nodes); make it a multiple of {world}")
    eval_prompts = OmegaConf.select(cfg, "task.num_eval_prompts")
    if world > 1 and isinstance(eval_prompts, int) and 0 < eval_prompts < world:
        raise SettingError("task.num_eval_prompts", f"{eval_prompts} held-out prompts for {world} ranks (each evaluates a share); "
                           f"set task.num_eval_prompts={world} or more")
    strategy = cfg.trainer.strategy
    backend = strategy.get("process_group_backend") if isinstance(strategy, DictConfig) else None
    shards = strategy.get("data_parallel_size") if isinstance(strategy, DictConfig) else None
    if isinstance(shards, int) and shards * strategy.get("tensor_parallel_size", 1) != world:
        raise SettingError("trainer.strategy.data_parallel_size", f"{shards} shards for {world} ranks (trainer.devices x "
                           f"trainer.num_nodes); set trainer.strategy.data_parallel_size={world}")
    if backend == "nccl" and cfg.trainer.accelerator == "cpu":
        raise SettingError("trainer.strategy.process_group_backend", "nccl needs GPUs, and trainer.accelerator=cpu; "
                           "use gloo (or null to choose by device), or trainer.accelerator=gpu")
    check_generator_device(cfg)
    check_sharding(cfg)
    minibatches = cfg.algo.num_minibatches
    if cfg.rl.prompts_per_step % minibatches:
        raise SettingError("rl.prompts_per_step", f"{cfg.rl.prompts_per_step} is not divisible by algo.num_minibatches={minibatches}; "
                           f"make rl.prompts_per_step a multiple of {minibatches}")
    if world > 1 and (cfg.rl.prompts_per_step // world) % minibatches:  # each rank splits its own share
        raise SettingError("rl.prompts_per_step", f"{cfg.rl.prompts_per_step} prompts give each of {world} ranks "
                           f"{cfg.rl.prompts_per_step // world}, which algo.num_minibatches={minibatches} does not divide; "
                           f"make rl.prompts_per_step a multiple of {world * minibatches} (ranks x minibatches)")
    for stage in ("sft", "rm"):
        size = OmegaConf.select(cfg, f"stages.{stage}.batch_size")
        if world > 1 and isinstance(size, int) and size % world:  # a global batch, split over the ranks
            raise SettingError(f"stages.{stage}.batch_size", f"{size} does not split evenly over {world} ranks "
                               f"(trainer.devices x trainer.num_nodes); make it a multiple of {world}")


def writable_dir(key: str, path: Path, make: bool = True) -> Path:
    """`path`, made if missing (with `make`; else only judged, so a bad run leaves nothing behind); a directory that
    cannot be made or written is one line naming `key` before any run exists (output.dir=/mnt/ro/x, or a cache_dir
    that is a file, stopped at a FileNotFoundError or NotADirectoryError traceback)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}: '{path}' is a file, not a directory; give a directory you can write")
    if make:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"{key}: cannot make the directory '{path}' ({err.strerror}); give a directory you can write") from None
    nearest = path.absolute()
    while not nearest.exists():
        nearest = nearest.parent
    if not nearest.is_dir():
        raise ConfigError(f"{key}: '{nearest}' is a file, so '{path}' cannot be a directory; give a directory you can write")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: '{nearest}' is not writable; give a directory you can write")
    return path
