"""memory.target_modules against a model's decoder layers: what adapt refuses once the model loads, and check_arch
(a model built from model.arch) and check_given_targets (a given model's config) on the meta device before the run."""

from __future__ import annotations

from torch import nn

from rlhflab.errors import ConfigError
from rlhflab.models.sharding import decoder_layers


def decoder_linear_names(model: nn.Module) -> list[str]:
    """The names (last part) of the linear modules in the model's decoder layers: what memory.target_modules names."""
    from transformers.pytorch_utils import Conv1D

    return sorted({name.rpartition(".")[2] for layer in decoder_layers(model) for name, m in layer.named_modules()
                   if isinstance(m, (nn.Linear, Conv1D))})


def targets_reach_nothing(model: nn.Module, linear: list[str], of: str = "", keep=()) -> ConfigError:
    """`of`: which model, where it is not the policy (memory=lora's critic on model.reward_model_path, of another
    architecture); `keep`: the names the list keeps for the policy, which they reach (the list the line offers has both)."""
    keep = [] if isinstance(keep, str) else [str(name) for name in keep]  # (a regex: not a list to add to)
    return ConfigError(f"memory.target_modules: none of {type(model).__name__}'s decoder layers{of} has a module it names "
                       f"(their linear modules: {', '.join(linear)}); set memory.target_modules=all-linear, or "
                       f"memory.target_modules=[{','.join([*keep, *(n for n in linear if n not in keep)])}]")


def check_targets(model: nn.Module, target_modules, of: str = "", keep=()) -> None:
    """memory.target_modules judged on a model without weights (the meta device) before the run is made: a list whose
    names reach none of the decoder layers' linear modules (adapt's refusal, once the models had loaded). A string
    (all-linear, or a regex) is left to peft. `of`, `keep`: targets_reach_nothing's."""
    if target_modules is None or isinstance(target_modules, str):
        return
    linear = decoder_linear_names(model)
    if linear and not {str(name).rpartition(".")[2] for name in target_modules} & set(linear):
        raise targets_reach_nothing(model, linear, of, keep)
