"""FSDP2 (`fully_shard`) for the models a run holds, under trainer=fsdp (Lightning's ModelParallelStrategy).

A Hugging Face model is sharded in units: each decoder layer, then the backbone (embeddings and
final norm), then each head (the LM head, a score or value head), then the model itself as the root
(under a peft wrapper too: generate() enters the wrapped model, not the wrapper). A head tied to the input
embeddings shares one unit with them. Every unit that
rlhflab's code calls on its own (the trunk for Hydra-RLHF's heads, the LM head) is thus an FSDP unit
that gathers its own parameters. FSDP2 wants the root's forward to run first: `warm_up` does that. Frozen models (reference, reward) are sharded too, so every rank
holds 1/N of every model. Parameters become DTensors; `local` and `full` read them.
"""

from __future__ import annotations

import torch
from torch import nn


def _hf(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (the model itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def tied_head(base: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(input embeddings, output head) where the head's weight is the embeddings' (tie_word_embeddings: GPT-2, Gemma,
    Qwen2.5, Llama 3.2 1B/3B), else None."""
    head, embed = base.get_output_embeddings(), base.get_input_embeddings()
    if head is not None and embed is not None and getattr(head, "weight", None) is embed.weight:
        return embed, head
    return None


def decoder_layers(base: nn.Module) -> list[nn.Module]:
    """The units FSDP shards one by one: the modules of the classes the model names as never to be split
    (`_no_split_modules`: LlamaDecoderLayer, GPTNeoXLayer, GPT2Block, ...). Reading `base_model.layers` found
    Llama's and GPT-NeoX's only: GPT-2 (`transformer.h`) went whole into one unit, unchecked for its tied head,
    and under memory=lora failed in a traceback ('got mixed torch.Tensor and DTensor')."""
    names = set(getattr(base, "_no_split_modules", None) or ())
    return [m for m in base.modules() if type(m).__name__ in names]


# torch warns when a unit returns a view ('... returned a view tensor. An in-place op on this view ... can cause
# backward to fail or produce wrong gradients'): a Linear with a bias on a 3-D input returns a view of its own output
# (addmm, then view), as does the value model whose score head it is; PPO printed it four times. rlhflab changes no
# model output in place, and a sharded value model's gradients are one process's (tests/test_memory.py).
VIEW_WARNING = r"FSDP2-wrapped module \(FSDP(Linear|\w+For(Token|Sequence)Classification)\) returned a view tensor"


def shard(model: nn.Module, mesh) -> nn.Module:
    """Shard `model` over the data-parallel `mesh` in place (see the module docstring); returns it."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore", message=VIEW_WARNING)

    base = _hf(model)
    layers = decoder_layers(base)
    if not layers:
        return fully_shard(model, mesh=mesh)  # a small module (a scalar head): one unit
    backbone = base.base_model
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    tied = tied_head(base)
    if tied:  # one parameter, two modules: one unit, gathered from a forward to its backward (docs/DISTRIBUTED.md)
        fully_shard(list(tied), mesh=mesh, reshard_after_forward=False)
    fully_shard(backbone, mesh=mesh)
    for child in base.children():
        if child is not backbone and (not tied or child is not tied[1]) and any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(base, mesh=mesh)
    return model


@torch.no_grad()
def warm_up(model: nn.Module) -> None:
    """One forward through a sharded model's root, on every rank: FSDP2 initialises its units from the
    root's first forward, and fails if a unit inside ran first on its own (the trunk, the LM head)."""
    base = _hf(model)
    if not hasattr(base, "base_model") or not any(is_sharded(p) for p in model.parameters()):
        return
    device = next(model.parameters()).device
    base(input_ids=torch.ones(1, 2, dtype=torch.long, device=device))


def is_sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a sharded one: every rank must call it)."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def save_whole(model: nn.Module, path) -> None:
    """`model.save_pretrained(path)`, its sharded parameters gathered first: every rank must call it
    (the gather is a collective); rank 0 writes."""
    from rlhflab import distributed

    if not any(is_sharded(p) for p in model.parameters()):
        model.save_pretrained(path)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if distributed.is_main():
        model.save_pretrained(path, state_dict=state)
