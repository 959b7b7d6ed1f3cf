"""`MoESpec`: the mixture-of-experts FFN of a decoder (`model.moe:` in a job; absent or null is dense)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from heteroflow.config import limits
from heteroflow.config.reader import REQUIRED, Problems, Section

SCORE_FUNCTIONS = ("softmax", "sigmoid")
AUX_LOSS_TYPES = ("batch", "sequence")
NUM_EXPERTS = limits.integers(1, 1 << 16)
"""`model.moe.num_experts` (published models have up to a few hundred)."""
DEFAULT_LOAD_IMBALANCE = 1.1
"""A planning assumption, not a measurement: a router trained with a load-balancing loss keeps its ep ranks'
loads near the mean; set `load_imbalance` from a run's routed-token counts where they are known."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MoESpec:
    """Routed experts (and optional shared experts) replacing the dense MLP in some layers."""

    num_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Experts each token is sent to."""
    ffn_hidden_size: int
    """Inner width of one routed expert (per branch under SwiGLU; experts use `model.activation`)."""
    score_function: str = "softmax"
    """softmax over all experts, or sigmoid per expert (then the top-k weights are always normalised)."""
    normalize_top_k: bool = True
    """Divide the top-k weights by their sum (Mixtral, Qwen3-MoE); Qwen2-MoE keeps the raw probabilities."""
    shared_expert_ffn_hidden_size: int = 0
    """Inner width of the shared expert every token goes through; 0 means none."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(linear(x)) per token (Qwen2-MoE)."""
    first_dense_layers: int = 0
    """The first k layers keep the dense MLP (`ffn_hidden_size` of the model)."""
    layer_freq: int = 1
    """Among the others, layer i is MoE when i % layer_freq == 0 (Megatron's --moe-layer-freq)."""
    aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (Switch / Hugging Face form) added per MoE layer; 0 turns it off."""
    aux_loss_type: str = "batch"
    """batch: the load-balancing loss over the micro-batch's tokens; sequence: over each sequence's tokens,
    averaged over the micro-batch's sequences (Megatron's seq_aux_loss, DeepSeek-V2/V3)."""
    z_loss_coeff: float = 0.0
    """Weight of the router z-loss (ST-MoE, Megatron's --moe-z-loss-coeff): the mean over the micro-batch's
    tokens of logsumexp(router logits)^2, per MoE layer; 0 turns it off."""
    sinkhorn: bool = False
    """Choose each token's top-k experts by Sinkhorn-balanced scores over the micro-batch (S-BASE, Megatron's
    sinkhorn load balancing); the weights are then the chosen experts' sigmoid scores for top_k 1, their softmax
    probabilities otherwise, unnormalised (needs score_function softmax, normalize_top_k false, no aux loss)."""
    topk_scaling_factor: float = 1.0
    """Multiplies the top-k routing weights after their normalisation (Megatron's
    --moe-router-topk-scaling-factor)."""
    capacity_factor: float | None = None
    """None is dropless; otherwise each expert takes at most ceil(factor * tokens * top_k / num_experts)
    tokens per micro-batch share, in token order, and drops the rest (they pass through the residual)."""
    load_imbalance: float = DEFAULT_LOAD_IMBALANCE
    """Planning only: the busiest ep rank's tokens over the mean (max-over-mean load) that expert work and the
    all-to-all are priced at under expert parallelism (`layout.routing.load_allowance`); 1.0 is perfect balance."""

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` has the MoE FFN."""
        return layer >= self.first_dense_layers and layer % self.layer_freq == 0

    def to_dict(self) -> dict:
        """Plain data, every field written out."""
        return asdict(self)


def parse_moe(data: object, problems: Problems, path: str, base: dict | None) -> MoESpec | None:
    """A `MoESpec` from `model.moe:` (fields over the preset's, `base`); None for null or invalid."""
    sec = Section(data, path, problems)
    base = base or {}

    def default(name: str, fallback=REQUIRED):
        return base.get(name, fallback)

    fields = {
        "num_experts": sec.integer("num_experts", default("num_experts"), limit=NUM_EXPERTS),
        "top_k": sec.integer("top_k", default("top_k"), limit=NUM_EXPERTS),
        "ffn_hidden_size": sec.integer("ffn_hidden_size", default("ffn_hidden_size"), limit=limits.HIDDEN_SIZE),
        "score_function": sec.string("score_function", default("score_function", "softmax"),
                                     choices=SCORE_FUNCTIONS),
        "normalize_top_k": sec.boolean("normalize_top_k", default("normalize_top_k", True)),
        "shared_expert_ffn_hidden_size": sec.integer("shared_expert_ffn_hidden_size",
                                                     default("shared_expert_ffn_hidden_size", 0), minimum=0,
                                                     maximum=limits.HIDDEN_SIZE.maximum),
        "shared_expert_gate": sec.boolean("shared_expert_gate", default("shared_expert_gate", False)),
        "first_dense_layers": sec.integer("first_dense_layers", default("first_dense_layers", 0), minimum=0,
                                          maximum=limits.NUM_LAYERS.maximum),
        "layer_freq": sec.integer("layer_freq", default("layer_freq", 1), limit=limits.NUM_LAYERS),
        "aux_loss_coeff": sec.number("aux_loss_coeff", default("aux_loss_coeff", 0.0), minimum=0.0, maximum=1e3),
        "aux_loss_type": sec.string("aux_loss_type", default("aux_loss_type", "batch"), choices=AUX_LOSS_TYPES),
        "z_loss_coeff": sec.number("z_loss_coeff", default("z_loss_coeff", 0.0), minimum=0.0, maximum=1e3),
        "sinkhorn": sec.boolean("sinkhorn", default("sinkhorn", False)),
        "topk_scaling_factor": sec.number("topk_scaling_factor", default("topk_scaling_factor", 1.0),
                                          positive=True, maximum=1e3),
        "capacity_factor": sec.number("capacity_factor", default("capacity_factor", None), positive=True,
                                      maximum=1e3),
        "load_imbalance": sec.number("load_imbalance", default("load_imbalance", DEFAULT_LOAD_IMBALANCE),
                                     minimum=1.0, maximum=1e3),
    }
    sec.finish()
    if not sec.valid or any(fields[n] is None for n in ("num_experts", "top_k", "ffn_hidden_size",
                                                        "score_function", "normalize_top_k", "layer_freq",
                                                        "first_dense_layers", "aux_loss_coeff", "load_imbalance",
                                                        "aux_loss_type", "z_loss_coeff", "topk_scaling_factor",
                                                        "sinkhorn",
                                                        "shared_expert_ffn_hidden_size", "shared_expert_gate")):
        return None
    spec = MoESpec(**fields)
    before = len(problems.items)
    if spec.top_k > spec.num_experts:
        problems.add(f"{path}.top_k", f"{spec.top_k} is more than num_experts {spec.num_experts}")
    if spec.shared_expert_gate and not spec.shared_expert_ffn_hidden_size:
        problems.add(f"{path}.shared_expert_gate", "needs a shared expert; set shared_expert_ffn_hidden_size")
    if spec.sinkhorn:
        weights = "sinkhorn routing weighs the chosen experts by their sigmoid (top_k 1) or softmax scores as they are"
        for name, allowed, shown, why in (
                ("score_function", "softmax", "softmax", weights), ("normalize_top_k", False, "false", weights),
                ("topk_scaling_factor", 1.0, "1", weights),
                ("aux_loss_coeff", 0.0, "0", "sinkhorn routing balances without a load-balancing loss")):
            if getattr(spec, name) != allowed:
                problems.add(f"{path}.{name}", f"{why}; set {name}: {shown}")
    return spec if len(problems.items) == before else None
