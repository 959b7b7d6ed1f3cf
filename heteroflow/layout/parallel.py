"""`ParallelLayout`: one pipeline stage's intra-operator layout, and the rules that make it valid.

The one definition of a stage's layout, shared by the plan (config), the planner (stagemap), the runtime
(models, backends) and the Megatron importer. Ranks of a stage are ordered tp innermost, then cp, then dp,
so the devices of one tp group are consecutive.

Torch-free and independent of config: a model is anything with the shape attributes of `ModelShape`
(`config.ModelSpec` has them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

PRECISIONS = ("bf16", "fp16", "fp32")
RECOMPUTE = ("none", "selective", "full")
STATE_TIERS = ("device", "cpu", "ssd")
ACTIVATION_TIERS = ("device", "cpu")
ZERO_STAGES = (0, 1, 2, 3)


class MoEShape(Protocol):
    """The mixture-of-experts attributes the layout rules and per-rank counts read (`config.MoESpec`)."""

    num_experts: int
    top_k: int
    ffn_hidden_size: int
    shared_expert_ffn_hidden_size: int
    shared_expert_gate: bool
    capacity_factor: float | None
    load_imbalance: float
    aux_loss_type: str


class ModelShape(Protocol):
    """The model attributes the layout rules and per-rank counts read (`config.ModelSpec` provides them)."""

    num_layers: int

    num_attention_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    hidden_size: int
    vocab_size: int
    seq_length: int
    qkv_bias: bool
    qk_norm: bool
    tie_embeddings: bool
    activation: str
    normalization: str
    position_embedding: str
    moe: MoEShape | None

    def is_moe_layer(self, layer: int) -> bool: ...

    @property
    def kv_channels(self) -> int: ...


class LayoutProblem(NamedTuple):
    """A broken rule: the layout `key` it is about (a plan stage's YAML key) and what to change."""

    key: str
    message: str


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadSpec:
    """Where a stage keeps its training state."""

    optimizer: str = "device"
    """fp32 master weights and Adam moments: device, cpu or ssd."""
    params: str = "device"
    """Parameters between uses: device, cpu or ssd (fetched layer by layer)."""
    activations: str = "device"
    """Checkpointed activations: device or cpu."""

    @property
    def any(self) -> bool:
        """Whether anything leaves the device."""
        return (self.optimizer, self.params, self.activations) != ("device", "device", "device")

    @property
    def moves_state(self) -> bool:
        """Whether optimizer state or parameters leave the device (activations alone do not)."""
        return self.optimizer != "device" or self.params != "device"

    def to_dict(self) -> dict:
        """Only the tiers that differ from `device`."""
        return {k: getattr(self, k) for k in ("optimizer", "params", "activations") if getattr(self, k) != "device"}


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelLayout:
    """tp x cp x dp over a stage's devices (tp innermost), plus sp, ZeRO, recompute, offload and, for
    mixture-of-experts layers, the expert layout etp x ep x expert-dp folded over the same devices."""

    tp: int = 1
    """Tensor-parallel degree (Megatron-style column / row splits inside one node)."""
    dp: int = 1
    """Data-parallel degree: each dp rank takes an equal share of every micro-batch."""
    cp: int = 1
    """Context-parallel degree."""
    sp: bool = False
    """Megatron-style sequence parallelism over the tp group."""
    zero: int = 0
    """ZeRO stage over this stage's dp group: 0, 1, 2 or 3."""
    recompute: str = "none"
    """Activation recompute: none, selective (attention core) or full (whole block)."""
    offload: OffloadSpec = field(default_factory=OffloadSpec)
    precision: str | None = None
    """The stage's compute precision (bf16, fp16 or fp32); None: the job's `train.precision`."""
    ep: int = 1
    """Expert-parallel degree of the stage's MoE layers: each ep rank holds num_experts / ep experts and tokens
    reach them by all-to-all. Folded as Megatron-core does: etp x ep x expert-dp = tp x cp x dp."""
    etp: int | None = None
    """Expert tensor-parallel degree (each expert's matrices split over etp ranks); None: the same as tp."""

    @property
    def expert_tp(self) -> int:
        """The degree experts are tensor-split over: `etp`, or tp when it is not set."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts (the expert layout's data-parallel degree): tp*cp*dp / (etp*ep)."""
        return self.num_devices // (self.expert_tp * self.ep)

    @property
    def separate_experts(self) -> bool:
        """Whether routed experts are laid out apart from the rest (ep > 1 or etp != tp): their gradients are then
        summed (and ZeRO-sharded) over expert-dp instead of cp and dp."""
        return self.ep > 1 or self.expert_tp != self.tp

    @property
    def num_devices(self) -> int:
        """Devices (ranks) the layout spans."""
        return self.tp * self.cp * self.dp

    @property
    def replicas(self) -> int:
        """Ranks of the stage holding the same weights: cp x dp (cp splits only the sequence). ZeRO-3 shards each
        parameter over them (`models.zero3`), ZeRO 1 and 2 over dp alone."""
        return self.cp * self.dp

    def axis_groups(self, axis: str) -> tuple[tuple[int, ...], ...]:
        """The stage-local ranks of every `axis` group (tp, cp or dp), each in rank order: local rank
        `(d * cp + c) * tp + t` holds dp index d, cp index c and tp index t."""
        dp, cp, tp = range(self.dp), range(self.cp), range(self.tp)
        rank = [[[(d * self.cp + c) * self.tp + t for t in tp] for c in cp] for d in dp]
        if axis == "tp":
            return tuple(tuple(rank[d][c]) for d in dp for c in cp)
        if axis == "cp":
            return tuple(tuple(rank[d][c][t] for c in cp) for d in dp for t in tp)
        assert axis == "dp", axis
        return tuple(tuple(rank[d][c][t] for d in dp) for c in cp for t in tp)

    def compute_precision(self, default: str) -> str:
        """The precision the stage computes in: its own, or `default` (the job's) when it sets none."""
        return self.precision or default

    def validate(self, model: ModelShape, *, num_devices: int | None = None,
                 micro_batch_size: int | None = None) -> list[LayoutProblem]:
        """Every rule this layout breaks for `model` (empty when valid). With `num_devices`, the layout must
        use exactly that many devices; with `micro_batch_size`, dp must split it evenly."""
        problems: list[LayoutProblem] = []
        for key in ("tp", "dp", "cp"):
            if getattr(self, key) < 1:
                problems.append(LayoutProblem(key, f"{key} must be at least 1, got {getattr(self, key)}"))
        if problems:
            return problems
        if num_devices is not None and self.num_devices != num_devices:
            problems.append(LayoutProblem("devices", f"{num_devices} devices, but tp * cp * dp = {self.tp} * {self.cp} * "
                                          f"{self.dp} = {self.num_devices}; the layout must use exactly the stage's devices"))
        problems += tp_problems(model, self.tp)
        # cp cuts the sequence into 2 * cp chunks (causal load balancing), which sp splits again over tp
        if self.cp > 1 and model.seq_length % (2 * self.cp):
            problems.append(LayoutProblem("cp", f"seq_length {model.seq_length} is not divisible by 2 * cp = "
                                          f"{2 * self.cp} (each cp rank holds two mirrored chunks)"))
        elif self.sp and model.seq_length % (self.tp * (2 * self.cp if self.cp > 1 else 1)):
            ways = self.tp * (2 * self.cp if self.cp > 1 else 1)
            problems.append(LayoutProblem("sp", f"seq_length {model.seq_length} is not divisible by "
                                          f"tp * {'2 * cp' if self.cp > 1 else 'cp'} = {ways}"))
        problems += self._expert_problems(model)
        if micro_batch_size is not None and micro_batch_size % self.dp:
            problems.append(LayoutProblem("dp", f"dp {self.dp} does not divide micro_batch_size {micro_batch_size}; "
                                          "each dp rank takes an equal share of every micro-batch"))
        if self.zero not in ZERO_STAGES:
            problems.append(LayoutProblem("zero", f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero}"))
        if self.recompute not in RECOMPUTE:
            problems.append(LayoutProblem("recompute", f"recompute must be one of {', '.join(RECOMPUTE)}, "
                                          f"got {self.recompute!r}"))
        if self.precision is not None and self.precision not in PRECISIONS:
            problems.append(LayoutProblem("precision", f"precision must be one of {', '.join(PRECISIONS)}, "
                                          f"got {self.precision!r}"))
        for key, tiers in (("optimizer", STATE_TIERS), ("params", STATE_TIERS), ("activations", ACTIVATION_TIERS)):
            if getattr(self.offload, key) not in tiers:
                problems.append(LayoutProblem("offload", f"offload.{key} must be one of {', '.join(tiers)}, "
                                              f"got {getattr(self.offload, key)!r}"))
        # ZeRO 1/2 shard only the optimizer state: offloaded parameters would stay whole on every dp rank, each
        # rank's tier rewritten with the whole stage after every step. Parameters are sharded and offloaded
        # together under ZeRO-3 (ZeRO-Infinity; DeepSpeed's offload_param is a ZeRO-3 option too).
        if self.zero in (1, 2) and self.offload.params != "device":
            problems.append(LayoutProblem("offload", f"params: {self.offload.params} needs zero 3 or 0, got zero "
                                          f"{self.zero} (ZeRO 1/2 do not shard parameters); use zero: 3 to shard and "
                                          "offload them (ZeRO-Infinity), or keep params on the device"))
        return problems

    def _expert_problems(self, model: ModelShape) -> list[LayoutProblem]:
        """The expert layout (ep, etp) must fold over the stage's ranks and split the experts evenly."""
        problems = [LayoutProblem(key, f"{key} must be at least 1, got {getattr(self, key)}")
                    for key in ("ep", "etp") if getattr(self, key) is not None and getattr(self, key) < 1]
        if problems:
            return problems
        moe = model.moe
        if moe is None:
            return [LayoutProblem(key, f"{key} is set but the model has no experts (model.moe is null); remove it")
                    for key in ("ep", "etp") if getattr(self, key) not in (None, 1)]
        if moe.num_experts % self.ep:
            problems.append(LayoutProblem("ep", f"ep {self.ep} does not divide model.moe.num_experts "
                                          f"{moe.num_experts}; each ep rank holds an equal share of the experts"))
        if self.num_devices % (self.expert_tp * self.ep):
            problems.append(LayoutProblem("ep", f"etp * ep = {self.expert_tp} * {self.ep} does not divide the stage's "
                                          f"tp * cp * dp = {self.num_devices} ranks; the expert layout folds over "
                                          "the same ranks"))
        if self.expert_tp not in (1, self.tp):
            problems.append(LayoutProblem("etp", f"etp {self.expert_tp} is neither 1 nor tp {self.tp}; the runtime "
                                          "splits experts over the whole tp group or not at all"))
        if self.separate_experts and (self.zero == 3 or self.offload.optimizer != "device"
                                      or self.offload.params != "device"):
            problems.append(LayoutProblem("ep", "experts with a layout of their own (ep > 1 or etp != tp) run with "
                                          "ZeRO 0-2 and without optimizer or parameter offload; set ep: 1 and leave "
                                          "etp out, or change zero / offload"))
        if moe.aux_loss_type == "sequence" and self.sp and self.tp > 1:
            problems.append(LayoutProblem("sp", "the sequence load-balancing loss (model.moe.aux_loss_type: sequence) "
                                          "runs without sp: its per-sequence counts are pooled over cp only; set "
                                          "sp: false or aux_loss_type: batch"))
        if moe.ffn_hidden_size % self.expert_tp:
            problems.append(LayoutProblem("etp" if self.etp is not None else "tp", f"expert tensor parallelism "
                                          f"{self.expert_tp} does not divide model.moe.ffn_hidden_size "
                                          f"{moe.ffn_hidden_size}"))
        return problems

    def to_dict(self) -> dict:
        """The layout keys of a plan stage, defaults left out (tp and dp always written)."""
        out: dict = {"tp": self.tp, "dp": self.dp}
        if self.cp != 1:
            out["cp"] = self.cp
        if self.sp:
            out["sp"] = True
        if self.zero:
            out["zero"] = self.zero
        if self.recompute != "none":
            out["recompute"] = self.recompute
        if self.offload.any:
            out["offload"] = self.offload.to_dict()
        if self.precision is not None:
            out["precision"] = self.precision
        if self.ep != 1:
            out["ep"] = self.ep
        if self.etp is not None:
            out["etp"] = self.etp
        return out

    def describe(self) -> str:
        """Short text: `tp4 dp2 sp zero1 rc=full off=opt:cpu`."""
        parts = [f"tp{self.tp}", f"dp{self.dp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.sp:
            parts.append("sp")
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.recompute != "none":
            parts.append(f"rc={self.recompute}")
        if self.offload.any:
            parts.append("off=" + ",".join(f"{k[:3]}:{v}" for k, v in self.offload.to_dict().items()))
        if self.precision is not None:
            parts.append(self.precision)
        if self.ep != 1:
            parts.append(f"ep{self.ep}")
        if self.etp is not None:
            parts.append(f"etp{self.etp}")
        return " ".join(parts)


def tp_problems(model: ModelShape, tp: int) -> list[LayoutProblem]:
    """tp must split the query heads and the MLP evenly, and split the kv heads or replicate them (tp and the kv
    heads divide one another)."""
    problems = []
    if model.num_attention_heads % tp:
        problems.append(LayoutProblem("tp", f"tp {tp} does not divide num_attention_heads {model.num_attention_heads}"))
    elif model.num_kv_heads % tp and tp % model.num_kv_heads:
        problems.append(LayoutProblem("tp", f"tp {tp} and num_kv_heads {model.num_kv_heads} must divide one another"))
    if model.ffn_hidden_size % tp:
        problems.append(LayoutProblem("tp", f"tp {tp} does not divide ffn_hidden_size {model.ffn_hidden_size}"))
    moe = model.moe
    for name in ("ffn_hidden_size", "shared_expert_ffn_hidden_size"):
        if moe is not None and getattr(moe, name) % tp:
            problems.append(LayoutProblem("tp", f"tp {tp} does not divide model.moe.{name} {getattr(moe, name)}"))
    return problems


def tp_valid(model: ModelShape, tp: int) -> bool:
    """Whether tensor parallelism of degree `tp` can split `model` (see `tp_problems`)."""
    return tp >= 1 and not tp_problems(model, tp)
