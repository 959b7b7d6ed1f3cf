"""A Llama-family decoder built from `ModelSpec`, one pipeline stage at a time.

Model code only: nothing here knows about tensor, sequence or data parallelism. `parallelize.py`
swaps or wraps modules afterwards (the torchtitan pattern), which is why the code below reads head
counts and sequence lengths from tensor shapes instead of from the spec.

Parameter names are global and independent of the plan, so checkpoints, initialization and Hugging
Face loading key on them:

    embed.weight                    token embedding                 (first stage)
    pos_embed.weight                learned positions, if any       (first stage)
    layers.{i}.attn_norm.weight     i is the global layer index
    layers.{i}.attn.{wq,wk,wv,wo}.weight   (+ wq/wk/wv .bias with qkv_bias)
    layers.{i}.attn.{q_norm,k_norm}.weight (qk_norm)
    layers.{i}.mlp_norm.weight
    layers.{i}.mlp.{w1,w2,w3}.weight        w1 gate, w3 up, w2 down (gelu: w1, w2 only)
    layers.{i}.mlp.router.weight            MoE layers (`moe.py`) instead: router [experts, hidden],
    layers.{i}.mlp.experts.{j}.{w1,w2,w3}.weight   expert j (global index; gelu: w1, w2 only),
    layers.{i}.mlp.shared_expert.{w1,w2,w3}.weight, layers.{i}.mlp.shared_expert_gate.weight
    norm.weight                     final norm                      (last stage)
    head.weight                     LM head                         (last stage)

LayerNorm adds `.bias` next to each norm weight.

Tied embeddings: when one stage holds both ends, `head.weight` *is* `embed.weight` (one Parameter).
When the first and last stages differ, the last stage's `head.weight` is a copy initialized from the
same values; the runtime keeps the copies equal by summing their gradients across the two stages
(`TIED_PARAMETERS`, `tied_parameter_names`, `data_parallel.sync_tied_grads`).

RoPE follows the Hugging Face / GPT-NeoX "rotate half" layout (the two halves of each head are the
real and imaginary parts), so Hugging Face Llama and Qwen weights load without permuting q and k.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from heteroflow.config.model import ModelSpec
from heteroflow.models.cross_entropy import IGNORE_INDEX, chunked_loss_sum
from heteroflow.models.ffn import FeedForward
from heteroflow.models.moe import MoE

TIED_PARAMETERS = ("embed.weight", "head.weight")
"""Names of the two parameters that hold one logical tensor when `tie_embeddings` is set."""


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, then scaled in the input dtype (as Hugging Face does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def make_norm(spec: ModelSpec, dim: int) -> nn.Module:
    """The normalization layer the spec asks for."""
    if spec.normalization == "layernorm":
        return nn.LayerNorm(dim, eps=spec.norm_eps)
    return RMSNorm(dim, spec.norm_eps)


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device,
                dtype: torch.dtype, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [seq, head_dim], in the rotate-half layout, computed in fp32, for token
    `positions` ([seq] integers; 0..seq_len-1 when None)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    if positions is None:
        positions = torch.arange(seq_len, device=device)
    freqs = torch.outer(positions.to(device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x_BSND: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys [batch, seq, heads, head_dim] by position."""
    half = x_BSND.shape[-1] // 2
    rotated = torch.cat((-x_BSND[..., half:], x_BSND[..., :half]), dim=-1)
    return x_BSND * cos[:, None, :] + rotated * sin[:, None, :]


Positions = Callable[[int, torch.device], torch.Tensor]
"""`positions(seq_len, device)`: the global positions of the `seq_len` tokens a module sees (context parallelism's
`ChunkPositions`); a module without one sees positions 0..seq_len-1."""


class RotaryTables:
    """A stage's RoPE cos and sin tables, built once per (length, positions, device, dtype) and shared by all
    its blocks and micro-batches: every block rotates the same positions, so the tables autograd saves for the
    backward are one storage per stage, not one per block and micro-batch (`stagemap.memory.rope_table_bytes`).

    A plain object, not a module: the tables are no state (nothing to save, load or shard)."""

    MAX_ENTRIES = 4
    """Distinct shapes kept (training uses one; evaluation at other lengths adds a few)."""

    def __init__(self, head_dim: int, theta: float):
        self.head_dim, self.theta = head_dim, theta
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, seq_len: int, device: torch.device, dtype: torch.dtype,
            positions: Positions | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [seq_len, head_dim] for the tokens `positions` names (0..seq_len-1 when None)."""
        key = (seq_len, device, dtype, positions)
        tables = self._tables.get(key)
        if tables is None:
            if len(self._tables) >= self.MAX_ENTRIES:
                self._tables.clear()
            with torch.no_grad():
                tables = rope_tables(seq_len, self.head_dim, self.theta, device, dtype,
                                     positions=None if positions is None else positions(seq_len, device))
            self._tables[key] = tables
        return tables


@cache
def sdpa_groups_kv_heads() -> bool:
    """Whether this torch's `F.scaled_dot_product_attention` takes `enable_gqa` (torch >= 2.5): kv heads used by
    groups of query heads inside the kernel, without copying K and V to every query head first."""
    q, kv = torch.zeros(1, 2, 1, 1, device="cpu"), torch.zeros(1, 1, 1, 1, device="cpu")
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


class AttentionCore(nn.Module):
    """Causal scaled-dot-product attention of query heads over grouped-query kv heads (query head j uses kv head
    j // (heads / kv heads), as Hugging Face's repeat_kv): the fused kernel groups them itself (`enable_gqa`);
    a torch without it gets K and V repeated to the query heads first.

    A module of its own so that selective recompute can checkpoint exactly this part.
    """

    def __init__(self):
        super().__init__()
        self.groups_kv_heads = sdpa_groups_kv_heads()  # decided here, not in a (compiled) forward

    def forward(self, q_BNSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor) -> torch.Tensor:
        repeats = q_BNSD.shape[1] // k_BKSD.shape[1]
        if repeats == 1:
            return F.scaled_dot_product_attention(q_BNSD, k_BKSD, v_BKSD, is_causal=True)
        if self.groups_kv_heads:
            return F.scaled_dot_product_attention(q_BNSD, k_BKSD, v_BKSD, is_causal=True, enable_gqa=True)
        k_BNSD = k_BKSD.repeat_interleave(repeats, dim=1)
        v_BNSD = v_BKSD.repeat_interleave(repeats, dim=1)
        return F.scaled_dot_product_attention(q_BNSD, k_BNSD, v_BNSD, is_causal=True)


class Attention(nn.Module):
    """Multi-head attention with GQA, optional q/k/v bias, per-head q/k RMSNorm and RoPE (`rope`: the stage's
    shared tables; None builds tables of its own)."""

    def __init__(self, spec: ModelSpec, rope: RotaryTables | None = None):
        super().__init__()
        h, d = spec.hidden_size, spec.kv_channels
        self.head_dim = d
        self.rope = None
        if spec.position_embedding == "rope":
            self.rope = rope if rope is not None else RotaryTables(d, spec.rope_theta)
        self.positions: Positions | None = None
        """The global positions of the tokens this module sees, or None for 0..seq_len-1 (a layout that holds
        other tokens, such as context parallelism's chunks, sets this)."""
        self.wq = nn.Linear(h, spec.num_attention_heads * d, bias=spec.qkv_bias)
        self.wk = nn.Linear(h, spec.num_kv_heads * d, bias=spec.qkv_bias)
        self.wv = nn.Linear(h, spec.num_kv_heads * d, bias=spec.qkv_bias)
        self.wo = nn.Linear(spec.num_attention_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, spec.norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, spec.norm_eps) if spec.qk_norm else None
        self.core = AttentionCore()

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        # Shapes come from the projections: under tensor/sequence parallelism they hold a subset of
        # the heads and the full sequence, whatever the input held.
        q = self.wq(x_BSH)
        b, s = q.shape[:2]
        q = q.view(b, s, -1, self.head_dim)
        k = self.wk(x_BSH).view(b, s, -1, self.head_dim)
        v = self.wv(x_BSH).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            cos, sin = self.rope.get(s, q.device, q.dtype, self.positions)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x)); the MLP of global layer `layer` is
    a `MoE` where the spec says so."""

    def __init__(self, spec: ModelSpec, layer: int = 0, rope: RotaryTables | None = None):
        super().__init__()
        self.attn_norm = make_norm(spec, spec.hidden_size)
        self.attn = Attention(spec, rope)
        self.mlp_norm = make_norm(spec, spec.hidden_size)
        if spec.is_moe_layer(layer):
            self.mlp = MoE(spec.hidden_size, spec.moe, swiglu=spec.activation == "swiglu")
        else:
            self.mlp = FeedForward(spec.hidden_size, spec.ffn_hidden_size, swiglu=spec.activation == "swiglu")

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_BSH = x_BSH + self.attn(self.attn_norm(x_BSH))
        return x_BSH + self.mlp(self.mlp_norm(x_BSH))


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy in fp32, computed in chunks of tokens (`cross_entropy.chunked_loss_sum`:
    no fp32 copy of all logits); labels equal to `IGNORE_INDEX` do not count."""
    return chunked_loss_sum(logits.flatten(0, -2), labels.flatten())


class OutputHead(nn.Module):
    """Projection to the vocabulary, and the summed loss when labels are given."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, x_BSH: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = F.linear(x_BSH, self.weight)
        return logits if labels is None else token_loss_sum(logits, labels)


class PositionEmbedding(nn.Module):
    """Learned absolute positions; returns [seq, hidden] for positions 0..seq-1 (or `positions`)."""

    def __init__(self, seq_length: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(seq_length, hidden_size))
        self.positions: Positions | None = None
        """As `Attention.positions`: None for 0..seq_len-1."""

    def forward(self, seq_len: int) -> torch.Tensor:
        if self.positions is None:
            return self.weight[:seq_len]
        return self.weight[self.positions(seq_len, self.weight.device)]


class StageModel(nn.Module):
    """Layers `[first_layer, last_layer)` of the decoder, plus the ends this stage owns.

    forward(x, labels=None):
      x: token ids [batch, seq] on the first stage, hidden states [batch, seq, hidden] otherwise.
      returns hidden states; on the last stage logits [batch, seq, vocab], or with `labels`
      [batch, seq] the summed token loss (fp32 scalar) for the runtime to divide by the global
      number of tokens.
    """

    def __init__(self, spec: ModelSpec, *, first_layer: int, last_layer: int, is_first: bool, is_last: bool):
        super().__init__()
        self.spec = spec
        self.first_layer, self.last_layer = first_layer, last_layer
        self.is_first, self.is_last = is_first, is_last
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size) if is_first else None
        learned = is_first and spec.position_embedding == "learned"
        self.pos_embed = PositionEmbedding(spec.seq_length, spec.hidden_size) if learned else None
        rope = RotaryTables(spec.kv_channels, spec.rope_theta) if spec.position_embedding == "rope" else None
        # A ModuleDict keyed by the global index keeps `layers.{i}` names identical under any split.
        self.layers = nn.ModuleDict({str(i): Block(spec, i, rope) for i in range(first_layer, last_layer)})
        self.norm = make_norm(spec, spec.hidden_size) if is_last else None
        self.head = OutputHead(spec.hidden_size, spec.vocab_size) if is_last else None
        if spec.tie_embeddings and is_first and is_last:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = x
        if self.embed is not None:
            h = self.embed(x)
            if self.pos_embed is not None:
                h = h + self.pos_embed(x.shape[1])
        for layer in self.layers.values():
            h = layer(h)
        if self.head is None:
            assert labels is None, "labels are only used by the last stage"
            return h
        return self.head(self.norm(h), labels)

    def tied_parameter_names(self) -> tuple[str, ...]:
        """Parameters of this stage whose gradient must be summed with another stage's (see module doc)."""
        return tied_parameter_names(self.spec, is_first=self.is_first, is_last=self.is_last)


def tied_parameter_names(spec: ModelSpec, *, is_first: bool, is_last: bool) -> tuple[str, ...]:
    """`("embed.weight",)` on a first stage / `("head.weight",)` on a last stage when the embedding is
    tied and the two ends live on different stages; `()` otherwise."""
    if not spec.tie_embeddings or is_first == is_last:
        return ()
    return (TIED_PARAMETERS[0],) if is_first else (TIED_PARAMETERS[1],)


def build_stage_model(spec: ModelSpec, *, first_layer: int, last_layer: int, is_first: bool,
                      is_last: bool) -> StageModel:
    """A stage's modules with placeholder values; call `init.init_weights` or load a checkpoint next.

    Build under `torch.device("meta")` to skip allocation for large models, then `to_empty`.
    """
    if not 0 <= first_layer <= last_layer <= spec.num_layers:
        raise ValueError(f"layers [{first_layer}, {last_layer}) are outside the model's 0..{spec.num_layers}")
    if (is_first and first_layer != 0) or (is_last and last_layer != spec.num_layers):
        raise ValueError(f"stage [{first_layer}, {last_layer}) of {spec.num_layers} layers cannot hold the "
                         f"{'embedding' if is_first and first_layer else 'head'}")
    return StageModel(spec, first_layer=first_layer, last_layer=last_layer, is_first=is_first, is_last=is_last)


def count_tokens(labels: torch.Tensor) -> int:
    """Tokens that count in the loss (the runtime's normalizer sums this over the global batch)."""
    return int((labels != IGNORE_INDEX).sum())


__all__ = ["IGNORE_INDEX", "TIED_PARAMETERS", "RotaryTables", "StageModel", "build_stage_model", "count_tokens",
           "rope_tables", "apply_rope", "sdpa_groups_kv_heads", "tied_parameter_names", "token_loss_sum"]
