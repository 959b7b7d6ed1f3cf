"""Seed-only weight initialization: the same seed gives the same weights under every plan, and a rank draws
only its own shard.

A parameter's full logical tensor is cut into tiles by a grid that depends on its shape alone
(`tile_extents`); each tile is drawn from its own CPU generator, seeded by a stable hash (SHA-256, not
Python's salted `hash()`) of the training seed, the parameter's global name and the tile's index. A rank
draws only the tiles that overlap the slice it holds (`ParamShard`), so a tp-8 rank draws 1/8 of a matrix
whose sides the grid divides, never the whole tensor. Neither the layer split, nor the tp degree, nor the
order in which parameters are visited can change a value.

Llama-style values: matrices (embeddings, projections, head) ~ N(0, 0.02), norm weights 1, biases 0.
With `scaled_output=True` the residual output projections (`attn.wo`, `mlp.w2`) use
0.02 / sqrt(2 * num_layers) as in GPT-2 / Megatron; off by default (Llama and torchtitan's default
keep one std). With tied embeddings the head copy on the last stage is drawn under the name
`embed.weight`, so both copies start equal.
"""

from __future__ import annotations

import hashlib
import itertools
import math

import torch
from torch import nn

from heteroflow.models.shard import _ATTR, ParamShard, shard_of

DEFAULT_STD = 0.02


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from the training seed and a parameter name, stable across runs."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def canonical_name(name: str, *, tie_embeddings: bool) -> str:
    """The name whose values a parameter takes: the head copy of a tied embedding is `embed.weight`."""
    return "embed.weight" if tie_embeddings and name == "head.weight" else name


MIN_TILE_NUMEL = 1024
"""Fewest elements a tile of a large enough tensor holds (a generator per tile has a cost)."""
MAX_TILES_PER_DIM = {1: 4096, 2: 64}
"""Most tiles along one dim, by the tensor's number of dims (16 for three and more): at most 4,096 tiles."""


def tile_extents(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The tile's extent along each dim of a tensor of `shape`: the dim cut into a power of two of nearly equal
    parts (the same number along every dim), as many as keep tiles at `MIN_TILE_NUMEL` elements or more, at most
    `MAX_TILES_PER_DIM`. Powers of two: a tp split of a dim the grid divides falls on tile boundaries."""
    numel = math.prod(shape)
    if not shape or numel == 0:
        return tuple(shape)
    limit = min(MAX_TILES_PER_DIM.get(len(shape), 16), (numel / MIN_TILE_NUMEL) ** (1 / len(shape)))
    parts = 1
    while parts * 2 <= limit:
        parts *= 2
    return tuple(max(1, -(-size // parts)) for size in shape)


def draw_normal(name: str, full_shape: tuple[int, ...], box: tuple[tuple[int, int], ...], *,
                seed: int) -> tuple[torch.Tensor, int]:
    """`box` (per dim `[start, stop)`) of parameter `name`'s N(0, 1) values, drawn tile by tile; returns it with
    the number of elements drawn (those of every tile overlapping `box`)."""
    extents = tile_extents(full_shape)
    out = torch.empty([stop - start for start, stop in box], dtype=torch.float32)
    if out.numel() == 0:
        return out, 0
    drawn = 0
    spans = [range(start // e, (stop - 1) // e + 1) for (start, stop), e in zip(box, extents)]
    for index in itertools.product(*spans):
        lo = [i * e for i, e in zip(index, extents)]
        hi = [min(a + e, size) for a, e, size in zip(lo, extents, full_shape)]
        generator = torch.Generator(device="cpu").manual_seed(param_seed(seed, f"{name}#{index}"))
        tile = torch.randn([b - a for a, b in zip(lo, hi)], generator=generator, dtype=torch.float32)
        drawn += tile.numel()
        inner = tuple(slice(max(a, start) - a, min(b, stop) - a) for a, b, (start, stop) in zip(lo, hi, box))
        where = tuple(slice(max(a, start) - start, min(b, stop) - start) for a, b, (start, stop) in zip(lo, hi, box))
        out[where] = tile[inner]
    return out, drawn


def init_value(name: str, shard: ParamShard, *, seed: int, num_layers: int, std: float = DEFAULT_STD,
               scaled_output: bool = False) -> tuple[torch.Tensor, int]:
    """The fp32 CPU tensor of this rank's part (`shard`) of parameter `name`, and the elements drawn for it."""
    shape = shard.local_shape
    leaf = name.rsplit(".", 1)
    if leaf[-1] == "bias":
        return torch.zeros(shape), 0
    if len(leaf) == 2 and leaf[0].rsplit(".", 1)[-1].endswith("norm"):  # attn_norm, mlp_norm, norm, q_norm, ...
        return torch.ones(shape), 0
    if scaled_output and (name.endswith(".attn.wo.weight") or (".mlp." in name and name.endswith(".w2.weight"))):
        std = std / math.sqrt(2 * num_layers)
    box = tuple((shard.start, shard.start + shard.length) if d == shard.dim else (0, size)
                for d, size in enumerate(shard.full_shape))
    values, drawn = draw_normal(name, shard.full_shape, box, seed=seed)
    return values * std, drawn


def full_init_value(name: str, shape: tuple[int, ...], *, seed: int, num_layers: int, std: float = DEFAULT_STD,
                    scaled_output: bool = False) -> torch.Tensor:
    """The full fp32 CPU tensor that parameter `name` of logical `shape` starts from."""
    return init_value(name, ParamShard(full_shape=tuple(shape)), seed=seed, num_layers=num_layers, std=std,
                      scaled_output=scaled_output)[0]


@torch.no_grad()
def init_weights(model: nn.Module, *, seed: int, std: float = DEFAULT_STD, scaled_output: bool = False) -> int:
    """Fill every parameter of a stage model (sharded or not, on any device) from the seed alone, drawing only
    the tiles of each parameter's full tensor that overlap this rank's part; returns the elements drawn.

    `model` needs a `spec` attribute (a `StageModel`, before or after `parallelize_stage`).
    """
    spec = model.spec
    drawn = 0
    for name, param in model.named_parameters():
        value, count = init_value(canonical_name(name, tie_embeddings=spec.tie_embeddings), shard_of(param),
                                  seed=seed, num_layers=spec.num_layers, std=std, scaled_output=scaled_output)
        param.copy_(value)
        drawn += count
    return drawn


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
