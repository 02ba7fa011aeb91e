"""The policy as a plain checkpoint: what an inference engine (vLLM) loads and is re-sent after updates.

An engine knows nothing of LoRA adapters or of the memory strategy's other
roles. It gets the generation model's weights under the names of a plain
`from_pretrained` checkpoint, with the active adapters merged in
(W + scale * B @ A), so the engine samples from exactly the learner's policy.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from rlhflab.models.build import module_name


def _base(model: nn.Module) -> nn.Module:
    """The transformers model under peft's wrapper (the model itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _lora_layers(model: nn.Module):
    """(name, layer) of every LoRA layer whose adapters are switched on and not merged already."""
    from peft.tuners.lora import LoraLayer

    for name, module in _base(model).named_modules():
        if isinstance(module, LoraLayer) and not module.disable_adapters and not module.merged:
            active = [a for a in module.active_adapters if a in module.lora_A]
            if active:
                yield name, module, active


@torch.no_grad()
def policy_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """{checkpoint name: tensor} of the generation model, active LoRA adapters merged in.

    Plain models give their state dict; peft-wrapped ones (memory=lora, hydra) drop
    the adapter tensors and other adapters (e.g. hydra's value adapter) and fold the
    active ones into the base weights. Tensors stay on the model's device.
    """
    state = {}
    for name, tensor in _base(model).state_dict().items():
        if ".lora_" in name:
            continue
        state[name.replace(".base_layer.", ".")] = tensor.detach()
    for name, module, active in _lora_layers(model):
        key = f"{name}.weight"
        state[key] = state[key] + sum(module.get_delta_weight(a) for a in active).to(state[key].dtype)
    return state


def output_head_adapted(model: nn.Module) -> bool:
    """Does a LoRA adapter sit on the LM head (so a head tied to the embeddings no longer equals them)?"""
    head = _base(model).get_output_embeddings()
    return any(module is head for _, module, _ in _lora_layers(model))


def save_policy_checkpoint(model: nn.Module, path) -> Path:
    """Write the merged policy as a `from_pretrained` directory (config.json + model.safetensors, and the
    generation_config.json the model has).

    With an adapter on a tied LM head, the written config unties the head and the
    checkpoint carries both matrices; otherwise an engine would read the head from
    the embeddings and silently drop the head's adapter.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = _base(model).config.to_dict()
    config.pop("_name_or_path", None)
    if config.get("tie_word_embeddings") and output_head_adapted(model):
        config["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(config, indent=2, default=str))
    # safetensors refuses tensors that share storage (a tied head): every entry gets its own copy.
    tensors = {n: t.to("cpu").contiguous().clone() for n, t in policy_weights(model).items()}
    if config.get("tie_word_embeddings"):
        base = _base(model)
        tensors.pop(f"{module_name(base, base.get_output_embeddings())}.weight", None)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    generation = getattr(_base(model), "generation_config", None)
    if generation is not None:  # as save_pretrained writes it: a hub model's eos_token_id list, sampling defaults
        generation.save_pretrained(path)
    return path
