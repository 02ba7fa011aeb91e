"""peft's LoRA Linear with the adapter's output added inside one addmm.

peft computes `result = base(x) + lora_B(lora_A(dropout(x))) * scaling`: after the two small matmuls, a multiply and
an add over the module's whole output, and two more passes in the backward. At rank 8 those passes, not the
adapter's arithmetic, are what LoRA adds to a step: py-spy put them at 0.77 s of J-Hydra-PPO's 3.52 s forward with
grad on the 113M model. Here the scaling multiplies the rank-r activations instead and the add is addmm's
`base + h @ B^T`, one kernel that writes the output once: on the 113M Llama, 32 x 48 tokens, 1 thread, a forward
and backward took 4.55 against 6.04 s (a no-grad forward 2.02 against 2.11 s), with outputs equal to peft's
(`python benchmarks/lora_add.py`).

Only the plain case takes this path (one active adapter, unmerged, no variant such as DoRA, no adapter bias, no
forward arguments beyond x, one dtype throughout); every other call is peft's own forward.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear
from torch import nn


class FusedAddLinear(Linear):
    """peft's `lora.Linear`, whose plain forward is `addmm(base(x), lora_A(dropout(x)) * scaling, B^T)`."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        name = self.active_adapters[0] if len(self.active_adapters) == 1 else None
        if (args or kwargs or name is None or self.disable_adapters or self.merged or name not in self.lora_A
                or name in self.lora_variant or self.lora_B[name].bias is not None):
            return super().forward(x, *args, **kwargs)
        base = self.base_layer(x)
        h = self.lora_A[name](self.lora_dropout[name](self._cast_input_dtype(x, self.lora_A[name].weight.dtype)))
        h = h * self.scaling[name]
        weight = self.lora_B[name].weight
        if not base.dtype == h.dtype == weight.dtype and not torch.is_autocast_enabled(base.device.type):
            return (base + nn.functional.linear(h, weight)).to(base.dtype)  # e.g. float32 adapters on bf16 weights
        return torch.addmm(base.reshape(-1, base.shape[-1]), h.reshape(-1, h.shape[-1]), weight.t()).view(base.shape)


def fuse_lora_adds(model: nn.Module) -> int:
    """Give every peft `lora.Linear` in `model` the fused add, in place (the same module, parameters and state
    dict; only its forward changes) -> how many modules. Call after each get_peft_model or add_adapter."""
    swapped = 0
    for module in model.modules():
        if type(module) is Linear:
            module.__class__ = FusedAddLinear
            swapped += 1
    return swapped
