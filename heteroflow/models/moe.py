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
one device computes, and each part's gradient is exact. With `aux_loss_type: sequence` the same loss is taken
over each sequence and averaged over the micro-batch's sequences (Megatron's seq_aux_loss); the cp ranks holding
chunks of one sequence pool its counts (`Router.sequence_pool`). The router z-loss (ST-MoE) is the mean over the
micro-batch's tokens of logsumexp(logits)^2, each rank's part its tokens' share. Neither enters the returned
hidden states: an autograd function adds their gradient, coeff (aux_loss_coeff, z_loss_coeff) times the
micro-batch's weight in the step (`set_aux_loss_scale`), in the backward pass, as Megatron-core's
MoEAuxLossAutoScaler does, so the pipeline's backward needs nothing extra and the reported `loss` stays the
language-model cross entropy. The load-balancing loss's value (not the z-loss's) is recorded in backward (which
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
    """Where each of T tokens goes: `indices_TK` experts with `weights_TK` (fp32), and this rank's parts of the
    layer's load-balancing loss and router z-loss over the micro-batch's `num_tokens` tokens."""

    weights_TK: torch.Tensor
    indices_TK: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    num_tokens: int


def _assignments(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per row of `indices` [..., n], how many of its n entries pick each expert: [..., num_experts] (fp32)."""
    counts = torch.zeros(*indices.shape[:-1], num_experts, dtype=torch.float32, device=indices.device)
    return counts.scatter_add_(-1, indices, torch.ones(indices.shape, dtype=torch.float32, device=indices.device))


def load_balancing_loss(probs_TE: torch.Tensor, indices_TK: torch.Tensor,
                        pool: Pool | None = None) -> tuple[torch.Tensor, int]:
    """num_experts * sum_e(fraction of assignments to e * mean probability of e) (Hugging Face's
    `load_balancing_loss_func` for one layer), and the tokens it is over. With `pool`, the fractions and the
    token count are the micro-batch's, and the value is this rank's part: its probabilities' share of the sum."""
    num_tokens, num_experts = probs_TE.shape
    stats = torch.cat([_assignments(indices_TK.flatten(), num_experts),
                       torch.tensor([num_tokens], dtype=torch.float32, device=probs_TE.device)])
    if pool is not None:
        stats = pool(stats)
    total = int(stats[-1].item()) if pool is not None else num_tokens  # a host sync only for a pooled count
    return num_experts * torch.sum(stats[:-1] / total * probs_TE.float().sum(0) / total), total


def sequence_load_balancing_loss(probs_BSE: torch.Tensor, indices_BSK: torch.Tensor, pool: Pool | None = None,
                                 sequence_pool: Pool | None = None) -> tuple[torch.Tensor, int]:
    """`load_balancing_loss` of each sequence (a row of B), averaged over the micro-batch's sequences (Megatron's
    seq_aux_loss in Hugging Face's scale), and the tokens it is over. `sequence_pool` sums over the ranks holding
    chunks of the same sequences (cp), `pool` over all the micro-batch's ranks; the value is this rank's part."""
    batch, seq, num_experts = probs_BSE.shape
    stats = torch.cat([_assignments(indices_BSK.reshape(batch, -1), num_experts).flatten(),
                       torch.tensor([seq], dtype=torch.float32, device=probs_BSE.device)])
    if sequence_pool is not None:
        stats = sequence_pool(stats)
    seq_length = stats[-1]
    if pool is not None:  # a host sync only for a pooled count
        total = int(pool(torch.tensor([batch * seq], dtype=torch.float32, device=probs_BSE.device)).item())
    else:
        total = batch * seq
    counts = stats[:-1].view(batch, num_experts)
    per_sequence = num_experts * torch.sum(counts / seq_length * probs_BSE.float().sum(1) / seq_length)
    return per_sequence / (total / seq_length), total


def sinkhorn(logits_TE: torch.Tensor, pool: Pool | None = None, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn-balanced scores d1_e * exp(logit_te) * d0_t (S-BASE; megatron-core's `sinkhorn`): the token and
    expert factors are iterated until the expert factors change by less than `tol` on average. With `pool`, the
    sums over tokens are the micro-batch's, so every rank iterates alike and chooses as one device would."""
    cost = torch.exp(logits_TE.float())
    tokens = torch.tensor([cost.shape[0]], dtype=torch.float32, device=cost.device)
    total = pool(tokens) if pool is not None else tokens
    eps = 1e-8
    d0 = torch.ones(cost.shape[0], device=cost.device)
    d1 = torch.ones(cost.shape[1], device=cost.device)
    error = math.inf
    while error > tol:
        d0 = 1 / total / (torch.sum(d1 * cost, 1) + eps)
        column = torch.sum(d0[:, None] * cost, 0)
        updated = 1 / cost.shape[1] / ((pool(column) if pool is not None else column) + eps)
        error = torch.mean(torch.abs(d1 - updated)).item()
        d1 = updated
    return d1 * cost * d0[:, None]


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
    """Linear scores over the experts, top-k per token (softmax or sigmoid scores), the weights optionally
    normalised, then scaled by `topk_scaling_factor`."""

    def __init__(self, hidden_size: int, moe: MoESpec):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.top_k, self.scaling = moe.top_k, moe.topk_scaling_factor
        self.sigmoid = moe.score_function == "sigmoid"
        self.normalize = moe.normalize_top_k or self.sigmoid  # sigmoid scores do not sum to one
        self.per_sequence = moe.aux_loss_type == "sequence"
        self.sinkhorn = moe.sinkhorn
        self.pool: Pool | None = None
        """Sums the load-balancing statistics over the micro-batch's ranks (None: this rank holds it all)."""
        self.sequence_pool: Pool | None = None
        """Sums per-sequence statistics over the ranks holding chunks of the same sequences (cp; None: none)."""

    def forward(self, x_TH: torch.Tensor, num_sequences: int = 1) -> Routing:
        """Route `x_TH`, `num_sequences` sequences of equal length one after another (for the sequence loss)."""
        logits = F.linear(x_TH, self.weight).float()
        scores = torch.sigmoid(logits) if self.sigmoid else torch.softmax(logits, dim=-1)
        if self.sinkhorn:
            with torch.no_grad():  # the choice only: the weights are the scores below
                indices = torch.topk(sinkhorn(logits, self.pool), self.top_k, dim=-1).indices
            weights = (torch.sigmoid(logits) if self.top_k == 1 else scores).gather(1, indices)
        else:
            weights, indices = torch.topk(scores, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        probs = scores / scores.sum(dim=-1, keepdim=True) if self.sigmoid else scores
        if self.per_sequence:
            aux_loss, num_tokens = sequence_load_balancing_loss(
                probs.view(num_sequences, -1, probs.shape[-1]), indices.view(num_sequences, -1, self.top_k),
                self.pool, self.sequence_pool)
        else:
            aux_loss, num_tokens = load_balancing_loss(probs, indices, self.pool)
        # z-loss: mean over the micro-batch's tokens of logsumexp^2; this rank's part is its tokens' share.
        z_loss = torch.logsumexp(logits, dim=-1).square().sum() / num_tokens
        return Routing(weights, indices, aux_loss, z_loss, num_tokens)


class Dispatcher(Protocol):
    """Carries the tokens to the ranks holding their experts and the results back (`moe_dispatch.py`)."""

    def __call__(self, experts: "Experts", x_TH: torch.Tensor, weights_TK: torch.Tensor,
                 indices_TK: torch.Tensor) -> torch.Tensor: ...


class Experts(nn.ModuleDict):
    """Routed experts (SwiGLU, or GELU with `swiglu=False`: the model's MLP activation) keyed by global expert
    index; forward sums each token's weighted outputs over its experts (those held here, or anywhere through
    `dispatcher`)."""

    def __init__(self, hidden_size: int, moe: MoESpec, expert_ids: range | None = None, *, swiglu: bool = True):
        ids = range(moe.num_experts) if expert_ids is None else expert_ids
        super().__init__({str(j): FeedForward(hidden_size, moe.ffn_hidden_size, swiglu=swiglu) for j in ids})
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
    """Identity on the layer output; in backward, gives the router's `loss` the gradient `grad_weight` and records
    `record` times `record_weight` in `sink`."""

    @staticmethod
    def forward(ctx, out, loss, record: torch.Tensor, grad_weight: float, record_weight: float, sink: list):
        ctx.shape, ctx.record, ctx.grad_weight, ctx.record_weight, ctx.sink = loss.shape, record.detach(), \
            grad_weight, record_weight, sink
        return out

    @staticmethod
    def backward(ctx, grad_out):
        ctx.sink.append(ctx.record * ctx.record_weight)
        return grad_out, torch.full(ctx.shape, ctx.grad_weight, device=ctx.record.device), None, None, None, None


class MoE(nn.Module):
    """Router, routed experts and optional (gated) shared expert: y = sum_k w_k expert_k(x) [+ g(x) shared(x)];
    the experts and the shared expert use the model's MLP activation (`swiglu`, else GELU), as Megatron's."""

    def __init__(self, hidden_size: int, moe: MoESpec, *, swiglu: bool = True):
        super().__init__()
        self.router = Router(hidden_size, moe)
        self.experts = Experts(hidden_size, moe, swiglu=swiglu)
        shared = moe.shared_expert_ffn_hidden_size
        self.shared_expert = FeedForward(hidden_size, shared, swiglu=swiglu) if shared else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if moe.shared_expert_gate else None
        self.aux_loss_coeff, self.z_loss_coeff = moe.aux_loss_coeff, moe.z_loss_coeff
        self.aux_tokens: int | None = None
        """Routed tokens of the whole step (set by `set_aux_loss_scale`); None: each forward is the batch."""
        self.aux_grad_scale = 1.0
        """Extra factor on the aux loss gradient (the step's loss scale under fp16)."""
        self.aux_losses: list[torch.Tensor] = []
        """Weighted aux values recorded in backward since the last `take_aux_losses`."""

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        routing = self.router(x_TH, x_BSH.shape[0])
        y_TH = self.experts(x_TH, routing.weights_TK, routing.indices_TK)
        if self.shared_expert is not None:
            shared = self.shared_expert(x_TH)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x_TH)) * shared
            y_TH = y_TH + shared
        if torch.is_grad_enabled():
            share = 1.0 if self.aux_tokens is None else routing.num_tokens / self.aux_tokens
            router_loss = self.aux_loss_coeff * routing.aux_loss + self.z_loss_coeff * routing.z_loss
            y_TH = _AuxLossGrad.apply(y_TH, router_loss, routing.aux_loss, share * self.aux_grad_scale, share,
                                      self.aux_losses)
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
    scalar, where they were recorded, not read; on the host when there were none); clears the records."""
    total = None
    for layer in moe_layers(model):
        for value in layer.aux_losses:  # summed where they are, in order; the caller reads the sum once per step
            value = value.detach().float().reshape(())
            total = value if total is None else total + value
        layer.aux_losses.clear()
    return total if total is not None else torch.zeros((), dtype=torch.float32)
