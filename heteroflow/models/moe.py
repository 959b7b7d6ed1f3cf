"""The mixture-of-experts FFN: a router (top-k over scores) and routed experts, kept apart.

Model code only, like `llama.py`: `parallelize.py` splits each expert over etp as it splits the dense MLP and
keeps an ep rank's experts only. Routing (`Router`) is separate from expert compute (`Experts`), and `Experts` is
a `ModuleDict` keyed by the *global* expert index, so parameter names (`mlp.experts.{j}.w1.weight`) do not depend
on which experts a rank holds. Token movement is not here either: `Experts` computes the experts it holds, and a
`dispatcher` (set by the parallelization, `moe_dispatch.py`) carries tokens to the ranks holding the others.

Dropless by default: every expert takes every token routed to it. With a capacity factor an expert takes
at most ceil(factor * tokens * top_k / num_experts) of them, in token order, and drops the rest (their
share of the output is zero; the residual carries them).

The load-balancing loss is the Switch Transformer's in Hugging Face's form, per MoE layer:
num_experts * sum_e(f_e * P_e), f_e the fraction of (token, slot) assignments to expert e (summing to
top_k) and P_e the mean routing probability of e, both over the micro-batch. When a micro-batch's tokens are
spread over ranks (dp, cp, sp), `Router.pool` (set by the parallelization) sums the assignment counts and token
counts over them, so each rank's value is its part of the micro-batch's loss: the parts add up to the value
one device computes, and each part's gradient is exact. It does not enter the returned hidden states: an
autograd function adds its gradient, coeff times its weight in the step (`set_aux_loss_scale`), in the
backward pass, as Megatron-core's MoEAuxLossAutoScaler does, so the pipeline's backward needs nothing extra
and the reported `loss` stays the language-model cross entropy. Its value is recorded in backward (which
runs once per micro-batch, also under recompute) for `take_aux_losses`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from heteroflow.config.moe import MoESpec
from heteroflow.models.ffn import FeedForward


Pool = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over the ranks holding the parts of one micro-batch (no gradient)."""


@dataclass(frozen=True, slots=True)
class Routing:
    """Where each of T tokens goes: `indices_TK` experts with `weights_TK` (fp32), and this rank's part of the
    layer's load-balancing loss over the micro-batch's `num_tokens` tokens."""

    weights_TK: torch.Tensor
    indices_TK: torch.Tensor
    aux_loss: torch.Tensor
    num_tokens: int


def load_balancing_loss(probs_TE: torch.Tensor, indices_TK: torch.Tensor,
                        pool: Pool | None = None) -> tuple[torch.Tensor, int]:
    """num_experts * sum_e(fraction of assignments to e * mean probability of e) (Hugging Face's
    `load_balancing_loss_func` for one layer), and the tokens it is over. With `pool`, the fractions and the
    token count are the micro-batch's, and the value is this rank's part: its probabilities' share of the sum."""
    num_tokens, num_experts = probs_TE.shape
    stats = torch.zeros(num_experts + 1, dtype=torch.float32, device=probs_TE.device)
    stats.index_add_(0, indices_TK.flatten(), torch.ones(indices_TK.numel(), device=probs_TE.device))
    stats[-1] = num_tokens
    if pool is not None:
        stats = pool(stats)
    total = int(stats[-1].item())
    return num_experts * torch.sum(stats[:-1] / total * probs_TE.float().sum(0) / total), total


def sort_by_expert(indices_TK: torch.Tensor, num_experts: int,
                   capacity: int | None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The (token, slot) assignments an expert takes, grouped by expert (ascending) and in token order inside a
    group: `(token, slot, counts)`, counts[e] of them for expert e; with `capacity`, each group's first ones."""
    # One stable sort groups the assignments by expert, each group in token order (its earliest tokens first).
    order = torch.argsort(indices_TK.flatten(), stable=True)
    counts = torch.bincount(indices_TK.flatten(), minlength=num_experts).tolist()
    if capacity is not None:
        starts = [0]
        for count in counts:
            starts.append(starts[-1] + count)
        order = torch.cat([order[start:start + min(count, capacity)] for start, count in zip(starts, counts)])
        counts = [min(count, capacity) for count in counts]
    top_k = indices_TK.shape[1]
    return order // top_k, order % top_k, counts


class Router(nn.Module):
    """Linear scores over the experts, top-k per token (softmax or sigmoid scores)."""

    def __init__(self, hidden_size: int, moe: MoESpec):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.top_k = moe.top_k
        self.sigmoid = moe.score_function == "sigmoid"
        self.normalize = moe.normalize_top_k or self.sigmoid  # sigmoid scores do not sum to one
        self.pool: Pool | None = None
        """Sums the load-balancing statistics over the micro-batch's ranks (None: this rank holds it all)."""

    def forward(self, x_TH: torch.Tensor) -> Routing:
        logits = F.linear(x_TH, self.weight).float()
        scores = torch.sigmoid(logits) if self.sigmoid else torch.softmax(logits, dim=-1)
        weights, indices = torch.topk(scores, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        probs = scores / scores.sum(dim=-1, keepdim=True) if self.sigmoid else scores
        aux_loss, num_tokens = load_balancing_loss(probs, indices, self.pool)
        return Routing(weights, indices, aux_loss, num_tokens)


class Dispatcher(Protocol):
    """Carries the tokens to the ranks holding their experts and the results back (`moe_dispatch.py`)."""

    def __call__(self, experts: "Experts", x_TH: torch.Tensor, weights_TK: torch.Tensor,
                 indices_TK: torch.Tensor) -> torch.Tensor: ...


class Experts(nn.ModuleDict):
    """Routed SwiGLU experts keyed by global expert index; forward sums each token's weighted outputs
    over its experts (those held here, or anywhere through `dispatcher`)."""

    def __init__(self, hidden_size: int, moe: MoESpec, expert_ids: range | None = None):
        ids = range(moe.num_experts) if expert_ids is None else expert_ids
        super().__init__({str(j): FeedForward(hidden_size, moe.ffn_hidden_size) for j in ids})
        self.num_experts, self.top_k, self.capacity_factor = moe.num_experts, moe.top_k, moe.capacity_factor
        self.dispatcher: Dispatcher | None = None
        """Set when some experts live on other ranks; None: every expert is here."""

    def capacity(self, num_tokens: int) -> int | None:
        """Most tokens one expert takes from `num_tokens` (None: dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)

    def held(self) -> list[int]:
        """Global indices of the experts held here, ascending."""
        return sorted(int(key) for key in self.keys())

    def run(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each held expert (ascending) on its block of `rows`, `counts[i]` rows for the i-th."""
        blocks = rows.split(counts)
        # An expert without tokens still runs (on none), so its parameters get a zero gradient, not None.
        outputs = [self[str(j)](block) for j, block in zip(self.held(), blocks)]
        return torch.cat(outputs) if outputs else rows

    def forward(self, x_TH: torch.Tensor, weights_TK: torch.Tensor, indices_TK: torch.Tensor) -> torch.Tensor:
        if self.dispatcher is not None:
            return self.dispatcher(self, x_TH, weights_TK, indices_TK)
        token, slot, counts = sort_by_expert(indices_TK, self.num_experts, self.capacity(x_TH.shape[0]))
        assert self.held() == list(range(self.num_experts)), "experts held elsewhere need a dispatcher"
        y = self.run(x_TH[token], counts) * weights_TK[token, slot, None]
        return combine(x_TH, token, y)


def combine(x_TH: torch.Tensor, token: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each token's sum of its weighted expert outputs `y` (row i belongs to `token[i]`), shaped like `x_TH`."""
    return torch.zeros_like(x_TH).index_add_(0, token, y.to(x_TH.dtype))


class _AuxLossGrad(torch.autograd.Function):
    """Identity on the layer output; in backward, gives the aux loss the gradient `grad_weight` and records
    its value times `record_weight` in `sink`."""

    @staticmethod
    def forward(ctx, out, aux_loss, grad_weight: float, record_weight: float, sink: list):
        ctx.aux_value, ctx.grad_weight, ctx.record_weight, ctx.sink = aux_loss.detach(), grad_weight, \
            record_weight, sink
        return out

    @staticmethod
    def backward(ctx, grad_out):
        ctx.sink.append(ctx.aux_value * ctx.record_weight)
        return grad_out, torch.full_like(ctx.aux_value, ctx.grad_weight), None, None, None


class MoE(nn.Module):
    """Router, routed experts and optional (gated) shared expert: y = sum_k w_k expert_k(x) [+ g(x) shared(x)]."""

    def __init__(self, hidden_size: int, moe: MoESpec):
        super().__init__()
        self.router = Router(hidden_size, moe)
        self.experts = Experts(hidden_size, moe)
        shared = moe.shared_expert_ffn_hidden_size
        self.shared_expert = FeedForward(hidden_size, shared) if shared else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if moe.shared_expert_gate else None
        self.aux_loss_coeff = moe.aux_loss_coeff
        self.aux_tokens: int | None = None
        """Routed tokens of the whole step (set by `set_aux_loss_scale`); None: each forward is the batch."""
        self.aux_grad_scale = 1.0
        """Extra factor on the aux loss gradient (the step's loss scale under fp16)."""
        self.aux_losses: list[torch.Tensor] = []
        """Weighted aux values recorded in backward since the last `take_aux_losses`."""

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        routing = self.router(x_TH)
        y_TH = self.experts(x_TH, routing.weights_TK, routing.indices_TK)
        if self.shared_expert is not None:
            shared = self.shared_expert(x_TH)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x_TH)) * shared
            y_TH = y_TH + shared
        if torch.is_grad_enabled():
            share = 1.0 if self.aux_tokens is None else routing.num_tokens / self.aux_tokens
            y_TH = _AuxLossGrad.apply(y_TH, routing.aux_loss, self.aux_loss_coeff * share * self.aux_grad_scale,
                                      share, self.aux_losses)
        return y_TH.view(x_BSH.shape)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE FFNs of a (stage) model, in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_aux_loss_scale(model: nn.Module, *, step_tokens: int, grad_scale: float = 1.0) -> None:
    """Weigh each forward's aux loss by its share of the step's `step_tokens` routed tokens (so the step
    minimises coeff times their token-weighted mean per layer), times `grad_scale` (a loss scale)."""
    for layer in moe_layers(model):
        layer.aux_tokens, layer.aux_grad_scale = step_tokens, grad_scale


def take_aux_losses(model: nn.Module) -> torch.Tensor:
    """Sum over this model's MoE layers of the weighted aux values recorded since the last call (fp32
    scalar, on CPU); clears the records."""
    total = torch.zeros((), dtype=torch.float32)
    for layer in moe_layers(model):
        for value in layer.aux_losses:
            total += value.float().cpu()
        layer.aux_losses.clear()
    return total
