"""Seed-only weight initialization: the same seed gives the same weights under every plan.

Each parameter's full logical tensor is drawn from its own CPU generator, seeded by a stable hash
(SHA-256, not Python's salted `hash()`) of the training seed and the parameter's global name; a
rank then keeps the slice it holds (`ParamShard`). Neither the layer split, nor the tp degree, nor
the order in which parameters are visited can change a value.

Llama-style values: matrices (embeddings, projections, head) ~ N(0, 0.02), norm weights 1, biases 0.
With `scaled_output=True` the residual output projections (`attn.wo`, `mlp.w2`) use
0.02 / sqrt(2 * num_layers) as in GPT-2 / Megatron; off by default (Llama and torchtitan's default
keep one std). With tied embeddings the head copy on the last stage is drawn under the name
`embed.weight`, so both copies start equal.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from heteroflow.models.shard import _ATTR, shard_of

DEFAULT_STD = 0.02


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from the training seed and a parameter name, stable across runs."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def canonical_name(name: str, *, tie_embeddings: bool) -> str:
    """The name whose values a parameter takes: the head copy of a tied embedding is `embed.weight`."""
    return "embed.weight" if tie_embeddings and name == "head.weight" else name


def full_init_value(name: str, shape: tuple[int, ...], *, seed: int, num_layers: int, std: float = DEFAULT_STD,
                    scaled_output: bool = False) -> torch.Tensor:
    """The full fp32 CPU tensor that parameter `name` of logical `shape` starts from."""
    leaf = name.rsplit(".", 1)
    if leaf[-1] == "bias":
        return torch.zeros(shape)
    if len(leaf) == 2 and leaf[0].rsplit(".", 1)[-1].endswith("norm"):  # attn_norm, mlp_norm, norm, q_norm, ...
        return torch.ones(shape)
    if scaled_output and (name.endswith(".attn.wo.weight") or (".mlp." in name and name.endswith(".w2.weight"))):
        std = std / math.sqrt(2 * num_layers)
    generator = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
    return torch.randn(shape, generator=generator, dtype=torch.float32) * std


@torch.no_grad()
def init_weights(model: nn.Module, *, seed: int, std: float = DEFAULT_STD, scaled_output: bool = False) -> None:
    """Fill every parameter of a stage model (sharded or not, on any device) from the seed alone.

    `model` needs a `spec` attribute (a `StageModel`, before or after `parallelize_stage`).
    """
    spec = model.spec
    for name, param in model.named_parameters():
        shard = shard_of(param)
        full = full_init_value(canonical_name(name, tie_embeddings=spec.tie_embeddings), shard.full_shape,
                               seed=seed, num_layers=spec.num_layers, std=std, scaled_output=scaled_output)
        param.copy_(shard.take(full))


def materialize(model: nn.Module, device: torch.device | str, *, dtype: torch.dtype | None = None) -> nn.Module:
    """Allocate (uninitialized) storage on `device` for a model built under `torch.device("meta")`; `dtype`
    changes the parameters' (not the buffers') dtype on the way.

    Unlike `Module.to_empty`, which replaces each Parameter, this keeps every `ParamShard` record and
    keeps tied parameters tied (the same Parameter in two modules stays one Parameter).
    """
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is None:
                continue
            if id(param) not in new:
                fresh = nn.Parameter(torch.empty_like(param, device=device, dtype=dtype),
                                     requires_grad=param.requires_grad)
                if hasattr(param, _ATTR):
                    setattr(fresh, _ATTR, getattr(param, _ATTR))
                new[id(param)] = fresh
            module._parameters[key] = new[id(param)]
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = torch.empty_like(buffer, device=device)
    return model
