"""Build, save and load models and tokenizers through `from_pretrained`.

A model preset is a `from_pretrained` name or path. The embedded `tiny` preset
has none: it is built from `model.arch` (random init) with the task's own
tokenizer, saved with `save_pretrained` under the cache and loaded back by the
same `from_pretrained` code a real preset uses.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch

from rlhflab.errors import ConfigError
from rlhflab.models.attention import use_for_training
from rlhflab.models.cache import Saved, cached, config_key
from rlhflab.rng import fixed_seed

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Saved next to a reward model by the stage that trained it: the mean/std of its scores on
# demonstrations, which RL standardises scores with (so a KL coefficient means the same thing
# whatever scale the reward model happened to learn).
REWARD_NORM_FILE = "rlhflab_reward_norm.json"


def ensure_base_model(model_cfg: dict, task, cache_dir: Path) -> Saved | None:
    """The base policy: a `from_pretrained` name, or the tiny one built from `model.arch` (cached); None under a
    model.sft_path alone, where no stage starts from a base (it was built, unused, and logged as the base model)."""
    if model_cfg.get("name_or_path"):
        return Saved(model_cfg["name_or_path"], f"pretrained:{model_cfg['name_or_path']}")
    if model_cfg.get("sft_path"):
        return None
    from transformers import AutoModelForCausalLM

    tokenizer = task.build_tokenizer()
    arch = dict(model_cfg["arch"])
    seed = model_cfg["init_seed"]
    key = config_key(arch, tokenizer.get_vocab(), seed)

    def build(tmp: Path) -> None:
        config = arch_config(arch, tokenizer)
        with fixed_seed(seed):  # the weights depend on model.init_seed alone
            model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        n = sum(p.numel() for p in model.parameters())
        log.info("model: built %s (%s, %.2fM params, init seed %d)", model_cfg["name"], config.model_type, n / 1e6, seed)

    path = cached(cache_dir, "models", model_cfg["name"], key, "model", build)
    return Saved(path, f"model:{path.name}")


def arch_config(arch: dict, tokenizer):
    """The transformers config of a model built from `model.arch`, for `tokenizer`'s vocabulary."""
    from transformers import AutoConfig

    arch = dict(arch)
    return AutoConfig.for_model(arch.pop("model_type"), vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, **arch)


def check_arch(arch: dict, tokenizer, target_modules=None) -> None:
    """`model.arch` as transformers takes it, judged on the meta device (no weights) before the run is made:
    model.arch.hidden_size=abc, num_attention_heads=3 (64 is no multiple of it) or +model.arch.rope_theta=abc were
    transformers' tracebacks when the model was built, after the MLflow run was made. A forward of two tokens, on
    the meta device too: num_key_value_heads=3 beside 4 attention heads built, and failed in stage sft's first step
    (a 160-line traceback, the broken model cached). num_hidden_layers=0 built and trained a model without layers.
    `target_modules` (memory=lora, hydra): the LoRA targets, checked against the same model."""

    def refused(what: str, err: Exception) -> ConfigError:
        said = " ".join(str(err).split())[:300] or type(err).__name__
        return ConfigError(f"model.arch: transformers cannot {what} a model of it ({type(err).__name__}: {said}); fix "
                           "the setting it names, or the one that does not fit the others (python src/train.py --cfg "
                           "job shows model.arch)")

    try:
        config = arch_config(arch, tokenizer)
        model = skeleton(config)
    except Exception as err:  # a config class's validation, a module's __init__: any of their errors
        raise refused("build", err) from None
    check_arch_keys(arch, type(config))
    layers = getattr(config, "num_hidden_layers", 1)
    if isinstance(layers, int) and layers < 1:
        raise ConfigError(f"model.arch.num_hidden_layers={layers}: a model needs at least one layer; give "
                          "model.arch.num_hidden_layers=1 or more")
    try:
        with torch.device("meta"):
            model(input_ids=torch.zeros(1, 2, dtype=torch.long))
    except Exception as err:  # shapes that do not fit one another
        raise refused("run", err) from None
    from rlhflab.models.targets import check_targets

    check_targets(model, target_modules)


def skeleton(config, auto_class=None):
    """A model of `config` on the meta device: its modules and shapes, no weights (AutoModelForCausalLM, or
    `auto_class`)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return (auto_class or AutoModelForCausalLM).from_config(config)


def saved_config(name_or_path):
    """The transformers config of a given model, read without a download: a local directory's config.json, or a
    hub id's in the local Hugging Face cache; None where there is none to read so (a hub id not cached, a config
    transformers cannot read: the model's load says what is wrong)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(name_or_path), local_files_only=True)
    except Exception:  # OSError (not cached), ValueError (an unknown model_type), a remote-code config, ...
        return None


def check_given_targets(name_or_path, target_modules, auto_class=None, of: str = "", keep=()) -> None:
    """check_arch's target check for a given model (model.name_or_path, model.sft_path, model.reward_model_path):
    memory.target_modules=[nope] passed every check before the run for a model loaded by from_pretrained, and was
    adapt's line once the MLflow run was made and the stages had run (in a sweep, in each job's FAILED child). Judged
    on its skeleton on the meta device, built from its config where it can be read without a download
    (saved_config); otherwise left to adapt. `auto_class`: the class the strategy adapts (the critic's
    AutoModelForTokenClassification), so that the line names the model as adapt's would; `of`, `keep`: which model it is
    and what the list keeps for the policy (targets_reach_nothing)."""
    from rlhflab.models.targets import check_targets

    if not name_or_path:
        return
    config = Path(str(name_or_path)).expanduser() / "config.json"
    stamp = config.stat().st_mtime_ns if config.is_file() else None  # a directory saved again: read again
    try:
        model = given_skeleton(str(name_or_path), auto_class, stamp)
    except Exception:  # a config transformers reads but cannot build a model of: its load says what is wrong
        return
    if model is not None:
        check_targets(model, target_modules, of, keep)


@functools.lru_cache(maxsize=16)
def given_skeleton(name_or_path: str, auto_class=None, stamp: int | None = None):
    """skeleton(saved_config(name_or_path)), or None; kept per model and its config.json's `stamp` (a sweep's jobs
    share one)."""
    config = saved_config(name_or_path)
    return None if config is None else skeleton(config, auto_class)


def check_arch_keys(arch: dict, config_class) -> None:
    """A transformers config keeps a key it does not know as one more attribute, which no module reads:
    +model.arch.hiden_size=128 built the default width without a word. A key is unknown where the class's default
    config has no such attribute and setting it changes nothing but itself (rope_theta, which transformers 5 reads
    into rope_parameters, changes those)."""
    import difflib

    base = config_class().to_dict()
    for key, value in arch.items():
        if key == "model_type" or key in base:
            continue
        given = config_class(**{key: value}).to_dict()
        if {k for k in set(given) | set(base) if given.get(k) != base.get(k)} == {key}:
            close = difflib.get_close_matches(key, list(base), n=1)
            raise ConfigError(f"model.arch.{key}: not a setting of {config_class.__name__}, which would keep it unused"
                              f"{f' (did you mean {close[0]}?)' if close else ''}; fix its name, or remove it")


def check_vocabulary(tokenizer, prompts: list, key: str, most: float = 0.2) -> None:
    """The tokenizer reads the task's text: a model trained on another task (model.sft_path=<the reverse example's
    policy, a 15-character vocabulary> under the sentiment task) read its prompts as [UNK] and trained on that
    without a word (gold 0.000 -> 0.000, rewards of -132 and +45). Tokenizers without an unknown token (byte-level
    BPE) read anything; conversations are left to the chat template."""
    unk = tokenizer.unk_token_id
    texts = [p for p in prompts[:256] if isinstance(p, str)]
    if unk is None or not texts:
        return
    ids = [i for row in tokenizer(texts, add_special_tokens=False)["input_ids"] for i in row]
    share = sum(i == unk for i in ids) / max(len(ids), 1)
    if share > most:
        raise ConfigError(f"{key}: its tokenizer reads {share:.0%} of the task's prompt tokens as its unknown token "
                          f"{tokenizer.unk_token!r}: it was made for other text; give a model (and tokenizer) of this "
                          "task's vocabulary")


def saved_tokenizer(name_or_path, **kwargs):
    """AutoTokenizer.from_pretrained, but a local directory without a tokenizer is an OSError: transformers then made
    an empty tokenizer of its config's class (a GPT-2 model's: GPT2Tokenizer of 2 tokens, which reads every text as no
    ids), and stage sft failed in an IndexError after the run was made; a reward model saved without one scored
    empty texts."""
    from transformers import AutoTokenizer

    from rlhflab.models.checks import tokenizer_damage

    local = Path(str(name_or_path)).expanduser()
    if local.is_dir() and (problem := tokenizer_damage(local)):
        raise OSError(problem)
    return AutoTokenizer.from_pretrained(name_or_path, **kwargs)


def load_tokenizer(name_or_path, model_path=None):
    """The policy's tokenizer, left-padding. One without a pad token (Llama, GPT-2, Pythia), or whose pad is its EOS,
    gets one that its model (`model_path`, default `name_or_path`) has an embedding row for; see `pad_token_for`."""
    from transformers import AutoConfig

    tokenizer = saved_tokenizer(name_or_path, padding_side="left")
    # A pad that is EOS (Qwen2.5's base tokenizers; many saved by SFT recipes: pad_token = eos_token) hides the EOS
    # from every mask, so the reward model cannot tell a completion that ended from one cut at the budget.
    shared = tokenizer.pad_token is not None and tokenizer.pad_token_id == tokenizer.eos_token_id
    if tokenizer.pad_token is None or shared:
        try:
            rows = getattr(AutoConfig.from_pretrained(model_path or name_or_path).get_text_config(), "vocab_size", None)
        except (OSError, ValueError):  # no config.json (e.g. an adapter): no row count to respect
            rows = None
        pad = pad_token_for(tokenizer, rows or len(tokenizer) + 1)
        if pad is None and shared:
            log.warning("tokenizer: its pad token is its EOS (%s) and it has no other to pad with; the reward model "
                        "cannot tell a completion that ended from one cut at the budget", tokenizer.eos_token)
            return tokenizer
        if pad is None:
            raise ConfigError(
                f"model.tokenizer: {name_or_path} has no pad token, and neither an unknown-token, a reserved special "
                f"token nor a spare embedding row ({rows} rows for {len(tokenizer)} tokens) to pad with; give "
                "model.tokenizer=<a tokenizer with a pad token its model has a row for>")
        tokenizer.add_special_tokens({"pad_token": pad})
        log.info("tokenizer: %s; padding with %s (id %d)", f"its pad token is its EOS ({tokenizer.eos_token})" if shared
                 else "no pad token", pad, tokenizer.pad_token_id)
    return tokenizer


def pad_token_for(tokenizer, rows: int) -> str | None:
    """A pad token for a tokenizer that has none, or None. It must differ from EOS and BOS (the reward model scores
    the last non-pad token; masks treat pad as absent) and from any token a prompt or chat template holds, and its id
    must be below the model's `rows` embedding rows: a new [PAD] after the last id only fits where the embedding has
    spare rows (Pythia: 50,304 rows for 50,277 tokens); Llama 2's 32,000 rows hold exactly its tokens, and its id
    32,000 failed at the first forward with an embedding IndexError. In order: the unknown token (Llama 1/2, Mistral:
    byte fallback never emits it), a special token named for padding or reserved (Llama 3: <|finetune_right_pad_id|>,
    <|reserved_special_token_N|>), a new [PAD] in a spare row."""
    taken = {tokenizer.eos_token_id, tokenizer.bos_token_id}
    if tokenizer.unk_token is not None and tokenizer.unk_token_id not in taken and tokenizer.unk_token_id < rows:
        return tokenizer.unk_token
    spare = [(("pad" not in t.content.lower()), i, t.content) for i, t in tokenizer.added_tokens_decoder.items()
             if t.special and i not in taken and i < rows and ("pad" in t.content.lower() or "reserved" in t.content.lower())]
    if spare:
        return min(spare)[2]
    return "[PAD]" if len(tokenizer) < rows else None


def load_causal_lm(name_or_path, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    return use_for_training(AutoModelForCausalLM.from_pretrained(name_or_path, dtype=DTYPES[dtype]))


def load_reward_model(name_or_path, dtype: str = "float32", pad_token_id: int | None = None):
    """A sequence classifier with one output; a causal-LM checkpoint gets a fresh score head."""
    from transformers import AutoModelForSequenceClassification

    model = use_for_training(AutoModelForSequenceClassification.from_pretrained(name_or_path, num_labels=1,
                                                                                dtype=DTYPES[dtype]))
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return model


def read_reward_norm(path) -> tuple[float, float]:
    """(mean, std) the reward stage measured; (0, 1) for a reward model it did not train."""
    f = Path(path) / REWARD_NORM_FILE
    if f.is_file():
        d = json.loads(f.read_text())
        return float(d["mean"]), float(d["std"])
    return 0.0, 1.0


def leading_bos(tokenizer) -> int | None:
    """The BOS id that the tokenizer's own default, `tokenizer(text)`, puts first (Llama's, Gemma's, Mistral's), else
    None (GPT-2's, Pythia's, Qwen's)."""
    bos = tokenizer.bos_token_id
    return bos if bos is not None and tokenizer("")["input_ids"][:1] == [bos] else None


def prompt_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Prompt texts as the model was trained to read them: BOS first where its tokenizer puts one, once.

    A chat template writes its BOS into the text, so prompts are tokenized without special tokens; a plain-text
    prompt then lacked the BOS that `tokenizer(text)` gives (TRL's GRPO has that defect, trl#3520: garbage from
    Gemma). A rendering that already starts with BOS keeps its one.
    """
    rows, bos = tokenizer(prompts, add_special_tokens=False)["input_ids"], leading_bos(tokenizer)
    return rows if bos is None else [r if r[:1] == [bos] else [bos, *r] for r in rows]


def foreign_tokenizer(model_path, tokenizer):
    """The tokenizer saved with a reward model if its vocabulary differs from the policy's, else None."""
    try:
        own = saved_tokenizer(model_path)
    except (OSError, ValueError):
        return None  # no tokenizer saved with it: it reads the policy's tokens
    if own.get_vocab() == tokenizer.get_vocab():
        return None
    return for_text_scores(own)


def for_text_scores(tokenizer):
    """A sequence classifier's own tokenizer made ready for `text_scores`: right padding, and a pad token (EOS or
    UNK where it has none: the texts hold no EOS, and the mask, not the token, hides the padding)."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    tokenizer.padding_side = "right"
    return tokenizer


NO_REWARD_TEMPLATE = ("model.reward_model_path: the prompts are conversations, and the reward model's tokenizer has no "
                      "chat template to render them; save one with its tokenizer, or use plain-text prompts")


def check_reward_chat_template(model_cfg, task) -> None:
    """Before anything trains: conversations scored by a given reward model of a tokenizer of its own need that
    tokenizer's chat template (scored_texts). Loads the two tokenizers (from the hub where they are hub names: a
    few files), no model; one that cannot be loaded is left to the model's load to report."""
    from rlhflab.models.checks import check_hub

    path = model_cfg.get("reward_model_path")
    policy_key = next((k for k in ("tokenizer", "sft_path", "name_or_path") if model_cfg.get(k)), None)
    policy = model_cfg.get(policy_key) if policy_key else None
    if not (path and policy and getattr(task, "conversational", False)):
        return
    check_hub("model.reward_model_path", path)  # a hub id not cached and no hub: its one line, not retries
    check_hub(f"model.{policy_key}", policy)
    try:
        policy_tokenizer = saved_tokenizer(policy)
    except (OSError, ValueError):
        return
    own = foreign_tokenizer(path, policy_tokenizer)
    if own is not None and own.chat_template is None:
        raise ConfigError(NO_REWARD_TEMPLATE)


def scored_texts(tokenizer, prompts: list, completions: list) -> tuple[list[str], bool]:
    """What a sequence classifier of its own tokenizer reads, and whether its special tokens are to be added.

    Text prompts: prompt + completion, with its special tokens (its BOS). Conversations (TRL's shapes: lists of
    messages, the completion `[{"role": "assistant", ...}]`): the whole conversation rendered with its own chat
    template, which writes its special tokens, as TRL does. Before, it read the policy's rendering (another
    model's markup, e.g. Qwen's <|im_start|> for a Llama 3 reward model)."""
    if not prompts or isinstance(prompts[0], str):
        return [p + c for p, c in zip(prompts, completions)], True
    if tokenizer.chat_template is None:
        raise ConfigError(NO_REWARD_TEMPLATE)
    return [tokenizer.apply_chat_template(list(p) + list(c), tokenize=False) for p, c in zip(prompts, completions)], False


@torch.no_grad()
def text_scores(model, tokenizer, prompts: list, completions: list, batch_size: int = 64) -> torch.Tensor:
    """(n,) raw scores of a sequence classifier on prompts and completions, read its own way (scored_texts)."""
    out = []
    device = next(model.parameters()).device
    texts, special = scored_texts(tokenizer, prompts, completions)
    for i in range(0, len(texts), batch_size):
        batch = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=special).to(device)
        out.append(model(**batch).logits.squeeze(-1).float())
    return torch.cat(out)


def freeze(model):
    """Frozen and in eval mode: a reference or reward model."""
    model.requires_grad_(False)
    return model.eval()


def lower_linears(model, dtype) -> int:
    """Store each plain nn.Linear of a frozen `model` in `dtype`, the half dtype autocast computes it in
    (trainer.precision=bf16-mixed: MemoryStrategy.frozen_models, such as memory=full's reference); -> the bytes freed.

    Under autocast a linear casts its float32 weight and bias to `dtype` at every call (autocast caches casts of
    trainable weights only), so one stored cast gives the same products bit for bit, without the float32 copy or the
    cast. Every other module (embeddings, norms: autocast runs them in float32) and a linear whose weight another
    module shares (tied embeddings) keep their dtype. The model can then run only under that autocast."""
    from collections import Counter

    from torch import nn

    owners = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
    freed = 0
    for m in model.modules():
        params = list(m.parameters(recurse=False))
        lowerable = all(owners[id(p)] == 1 and p.dtype == torch.float32 and not p.requires_grad for p in params)
        if type(m) is nn.Linear and lowerable:
            before = sum(p.numel() * p.element_size() for p in params)
            m.to(dtype)
            freed += before - sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    return freed


# The attributes transformers' attention classes pass to their attention function as its dropout rate in training
# (`dropout=0.0 if not self.training else self.attention_dropout` in LlamaAttention and GPTNeoXAttention, and the
# other names in the rest), where no nn.Dropout module holds it.
ATTENTION_DROPOUT = ("attention_dropout", "dropout", "dropout_p", "dropout_prob", "attn_dropout", "attn_drop")


def without_dropout(model):
    """Zero the model's own dropout (e.g. the 0.1 a token classifier gets by default): the rollout pass
    and the update pass must compute the same log-probs and values. Both kinds: nn.Dropout modules and the
    attention's rate held as a number (a Llama's `config.attention_dropout`, which its attention applies to the
    update's forward, in train mode, and not to sampling's). Call before adding adapters, so that lora_dropout
    stays what the config says."""
    from torch import nn

    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for name in ATTENTION_DROPOUT:
            rate = m.__dict__.get(name)
            if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate:
                setattr(m, name, 0.0)
    return model


def load_value_model(name_or_path, dtype: str = "float32", pad_token_id: int | None = None):
    """A per-token scalar head on a backbone: V at every position (dropout off, see without_dropout)."""
    from transformers import AutoModelForTokenClassification

    model = use_for_training(AutoModelForTokenClassification.from_pretrained(name_or_path, num_labels=1,
                                                                             dtype=DTYPES[dtype]))
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return without_dropout(model)


def module_name(model, module) -> str:
    """The dotted name of `module` inside `model` (e.g. lm_head or embed_out)."""
    return next(name for name, m in model.named_modules() if m is module)
