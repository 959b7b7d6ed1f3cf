"""`ModelSpec`: the shape of a Llama-family decoder, and presets with published shapes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from heteroflow.config import limits
from heteroflow.config.moe import MoESpec, parse_moe
from heteroflow.config.reader import REQUIRED, Problems, Section
from heteroflow.errors import did_you_mean
from heteroflow.layout.shards import mlp_matrices

ACTIVATIONS = ("swiglu", "gelu")
NORMALIZATIONS = ("rmsnorm", "layernorm")
POSITION_EMBEDDINGS = ("rope", "learned")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A decoder-only Transformer. Defaults are Llama's."""

    num_layers: int
    """Transformer blocks."""
    hidden_size: int
    """Model width."""
    ffn_hidden_size: int
    """MLP inner width (per branch for SwiGLU)."""
    num_attention_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention); equal to the query heads for plain MHA."""
    vocab_size: int
    """Tokenizer vocabulary."""
    seq_length: int
    """Training sequence length in tokens."""
    head_dim: int | None = None
    """Per-head width; None means hidden_size / num_attention_heads."""
    rope_theta: float = 10000.0
    """RoPE base."""
    norm_eps: float = 1e-5
    """Epsilon of the normalization layers."""
    tie_embeddings: bool = False
    """Whether the LM head shares the input embedding's weights."""
    qkv_bias: bool = False
    """Bias on the q/k/v projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm on queries and keys per head (Qwen3)."""
    activation: str = "swiglu"
    """MLP activation: swiglu (three matrices) or gelu (two)."""
    normalization: str = "rmsnorm"
    """rmsnorm or layernorm."""
    position_embedding: str = "rope"
    """rope, or learned absolute positions (GPT-3)."""
    moe: MoESpec | None = None
    """Mixture-of-experts FFN in some layers (`config.moe`); None is a dense model."""

    @property
    def kv_channels(self) -> int:
        """Per-head width actually used."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def num_params(self) -> int:
        """Total parameter count (embedding and head counted once when tied)."""
        h, d = self.hidden_size, self.kv_channels
        attn = h * d * (self.num_attention_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_attention_heads + 2 * self.num_kv_heads)
        norms = 2 * h * (2 if self.normalization == "layernorm" else 1)
        per_layer = attn + norms + (2 * d if self.qk_norm else 0)
        mlps = sum(self.ffn_params(i) for i in range(self.num_layers))
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        positions = self.seq_length * h if self.position_embedding == "learned" else 0
        return self.num_layers * per_layer + mlps + embed + positions + h

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` has the mixture-of-experts FFN."""
        return self.moe is not None and self.moe.is_moe_layer(layer)

    def ffn_params(self, layer: int, *, active: bool = False) -> int:
        """Parameters of layer `layer`'s FFN: all of them, or with `active` those one token uses (top-k
        routed experts, the shared expert and the router)."""
        h, moe = self.hidden_size, self.moe
        matrices = mlp_matrices(self)
        if not self.is_moe_layer(layer):
            return matrices * h * self.ffn_hidden_size
        experts = moe.top_k if active else moe.num_experts
        shared = matrices * h * moe.shared_expert_ffn_hidden_size + (h if moe.shared_expert_gate else 0)
        return experts * matrices * h * moe.ffn_hidden_size + shared + moe.num_experts * h

    def to_dict(self) -> dict:
        """Plain data, every field written out (`moe` as a mapping, or None)."""
        return asdict(self)


# Published shapes: the models' config.json files (Hugging Face) and the GPT-3 paper (Brown et al. 2020).
PRESETS: dict[str, ModelSpec] = {
    "llama2-7b": ModelSpec(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                           num_kv_heads=32, vocab_size=32000, seq_length=4096),
    "llama2-13b": ModelSpec(num_layers=40, hidden_size=5120, ffn_hidden_size=13824, num_attention_heads=40,
                            num_kv_heads=40, vocab_size=32000, seq_length=4096),
    "llama2-70b": ModelSpec(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                            num_kv_heads=8, vocab_size=32000, seq_length=4096),
    "llama3-8b": ModelSpec(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                           num_kv_heads=8, vocab_size=128256, seq_length=8192, rope_theta=500000.0),
    "llama3-70b": ModelSpec(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                            num_kv_heads=8, vocab_size=128256, seq_length=8192, rope_theta=500000.0),
    "qwen2.5-7b": ModelSpec(num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28,
                            num_kv_heads=4, vocab_size=152064, seq_length=32768, rope_theta=1000000.0,
                            norm_eps=1e-6, qkv_bias=True),
    "qwen3-8b": ModelSpec(num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32,
                          num_kv_heads=8, head_dim=128, vocab_size=151936, seq_length=40960,
                          rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True),
    # Mixture of experts: Mixtral-8x7B-v0.1 and Qwen3-30B-A3B config.json (router_aux_loss_coef included).
    "mixtral-8x7b": ModelSpec(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                              num_kv_heads=8, vocab_size=32000, seq_length=32768, rope_theta=1000000.0,
                              moe=MoESpec(num_experts=8, top_k=2, ffn_hidden_size=14336, aux_loss_coeff=0.02)),
    "qwen3-30b-a3b": ModelSpec(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
                               num_kv_heads=4, head_dim=128, vocab_size=151936, seq_length=40960,
                               rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True,
                               moe=MoESpec(num_experts=128, top_k=8, ffn_hidden_size=768, aux_loss_coeff=0.001)),
    "gpt3-175b": ModelSpec(num_layers=96, hidden_size=12288, ffn_hidden_size=49152, num_attention_heads=96,
                           num_kv_heads=96, vocab_size=50257, seq_length=2048, activation="gelu",
                           normalization="layernorm", position_embedding="learned"),
    # Small shapes for CPU emulation and tests: same code paths, seconds per step on 2 cores.
    "tiny-llama": ModelSpec(num_layers=8, hidden_size=128, ffn_hidden_size=344, num_attention_heads=8,
                            num_kv_heads=4, vocab_size=512, seq_length=128),
    "micro-llama": ModelSpec(num_layers=4, hidden_size=64, ffn_hidden_size=172, num_attention_heads=4,
                             num_kv_heads=2, vocab_size=256, seq_length=32),
}

_INT_FIELDS = {"num_layers": limits.NUM_LAYERS, "hidden_size": limits.HIDDEN_SIZE,
               "ffn_hidden_size": limits.HIDDEN_SIZE, "num_attention_heads": limits.NUM_HEADS,
               "num_kv_heads": limits.NUM_HEADS, "vocab_size": limits.VOCAB_SIZE, "seq_length": limits.SEQ_LENGTH}
"""Shape fields and their allowed ranges (`heteroflow.config.limits`)."""


def parse_model(data: object, problems: Problems, path: str = "model") -> ModelSpec | None:
    """Build a `ModelSpec` from the job's `model:` section (a preset name, or fields over a preset)."""
    if isinstance(data, str):
        data = {"preset": data}
    sec = Section(data, path, problems)
    fields: dict = {}
    preset_name = sec.string("preset", None)
    if preset_name is not None:
        if preset_name in PRESETS:
            fields = PRESETS[preset_name].to_dict()
        else:
            problems.add(sec.at("preset"), f"unknown model preset {preset_name!r}"
                         + (did_you_mean(preset_name, PRESETS) or f"; known: {', '.join(PRESETS)}"))
            sec.finish()
            return None
    for name, limit in _INT_FIELDS.items():  # without a preset every shape field is required
        fields[name] = sec.integer(name, fields[name] if preset_name else REQUIRED, limit=limit)
    fields["head_dim"] = sec.integer("head_dim", fields.get("head_dim"), limit=limits.NUM_HEADS)
    fields["rope_theta"] = sec.number("rope_theta", fields.get("rope_theta", 10000.0), limit=limits.ROPE_THETA)
    fields["norm_eps"] = sec.number("norm_eps", fields.get("norm_eps", 1e-5), limit=limits.NORM_EPS)
    for name in ("tie_embeddings", "qkv_bias", "qk_norm"):
        fields[name] = sec.boolean(name, fields.get(name, False))
    for name, choices in (("activation", ACTIVATIONS), ("normalization", NORMALIZATIONS),
                          ("position_embedding", POSITION_EMBEDDINGS)):
        fields[name] = sec.string(name, fields.get(name, choices[0]), choices=choices)
    base_moe = fields.get("moe")
    if sec.has("moe"):
        fields["moe"] = parse_moe(sec.raw("moe"), problems, sec.at("moe"), base_moe)
        moe_ok = fields["moe"] is not None
    else:  # absent: the preset's (or dense); `moe: null`: dense
        sec.raw("moe", None)
        fields["moe"] = MoESpec(**base_moe) if base_moe and "moe" not in sec.data else None
        moe_ok = True
    sec.finish()
    if not sec.valid or not moe_ok or any(fields[n] is None for n in (*_INT_FIELDS, "rope_theta", "norm_eps")):
        return None
    spec = ModelSpec(**fields)
    return spec if check_model(spec, problems, path) else None


def check_model(spec: ModelSpec, problems: Problems, path: str = "model") -> bool:
    """Record shape rules a decoder must satisfy; True when there were none."""
    before = len(problems.items)
    if spec.head_dim is None and spec.hidden_size % spec.num_attention_heads:
        problems.add(f"{path}.hidden_size", f"{spec.hidden_size} is not divisible by num_attention_heads "
                     f"{spec.num_attention_heads}; choose a multiple or set head_dim")
    elif spec.position_embedding == "rope" and spec.kv_channels % 2:
        problems.add(f"{path}.head_dim", f"RoPE needs an even head dimension, got {spec.kv_channels}")
    if spec.num_attention_heads % spec.num_kv_heads:
        problems.add(f"{path}.num_kv_heads", f"num_attention_heads {spec.num_attention_heads} is not "
                     f"divisible by num_kv_heads {spec.num_kv_heads}")
    return len(problems.items) == before
