"""Read (and write) Hugging Face-format Llama / Qwen2 / Qwen3 checkpoints, and the mixture-of-experts
Mixtral / Qwen2-MoE / Qwen3-MoE ones, with safetensors only.

A checkpoint directory holds `config.json` and one `model.safetensors`, or several shards listed in
`model.safetensors.index.json`. Pickle files (`*.bin`) are never opened. The architecture comes from
config.json (`model_spec_from_hf_config`); a job's model must agree with it (`check_against`).
Loading reads, through safetensors slices, only the tensors (and the tp slices of them) that a
stage holds, so it works on any plan. Our RoPE uses Hugging Face's rotate-half layout, so q and k
weights load unpermuted.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from dataclasses import fields
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from heteroflow.config import JobConfig
from heteroflow.config.model import ModelSpec
from heteroflow.config.moe import MoESpec
from heteroflow.errors import ConfigError, Problem, UserError
from heteroflow.models.hf_files import CONFIG_FILE, check_inside, index_files, read_hf_config
from heteroflow.models.shard import shard_of

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
_QWEN_MLP = {"1": "gate_proj", "3": "up_proj", "2": "down_proj"}
_MOE_NAMES = {  # ours (inside layers.{i}.) -> theirs, per MoE model type; experts keep their global index
    "mixtral": ((re.compile(r"^mlp\.router\."), "block_sparse_moe.gate."),
                (re.compile(r"^mlp\.experts\.(\d+)\.w([123])\."), r"block_sparse_moe.experts.\1.w\2.")),
    "qwen_moe": ((re.compile(r"^mlp\.router\."), "mlp.gate."),
                 (re.compile(r"^mlp\.shared_expert_gate\."), "mlp.shared_expert_gate."),
                 (re.compile(r"^mlp\.shared_expert\.w([123])\."), lambda m: f"mlp.shared_expert.{_QWEN_MLP[m[1]]}."),
                 (re.compile(r"^mlp\.experts\.(\d+)\.w([123])\."),
                  lambda m: f"mlp.experts.{m[1]}.{_QWEN_MLP[m[2]]}.")),
}
_LAYER_NAMES = {  # ours (inside layers.{i}.) -> Hugging Face (inside model.layers.{i}.)
    "attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj", "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm",
    "mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj", "mlp.w2": "mlp.down_proj",
}
_TOP_NAMES = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "head.weight": "lm_head.weight"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def hf_name(name: str, model_type: str = "llama") -> str:
    """The Hugging Face tensor name of our parameter `name` (`layers.3.attn.wq.weight` ->
    `model.layers.3.self_attn.q_proj.weight`) in a checkpoint of `model_type`."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _LAYER.match(name)
    moe_names = _MOE_NAMES.get("qwen_moe" if model_type in ("qwen2_moe", "qwen3_moe") else model_type, ())
    for pattern, theirs in moe_names if match else ():
        rest, found = pattern.subn(theirs, match[2])
        if found:
            return f"model.layers.{match[1]}.{rest}"
    if match:
        for ours, theirs in _LAYER_NAMES.items():
            rest = match[2]
            if rest == ours or rest.startswith(ours + "."):
                return f"model.layers.{match[1]}.{theirs}{rest[len(ours):]}"
    raise KeyError(f"{name} has no Hugging Face counterpart")


def _rope_theta(config: dict) -> float:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise UserError(f"train.init_from: {CONFIG_FILE} uses rope scaling {kind!r}; heteroflow supports plain "
                        "RoPE only")
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


def model_spec_from_hf_config(config: dict, *, seq_length: int | None = None) -> ModelSpec:
    """The `ModelSpec` a Llama / Qwen2 / Qwen3 config.json describes.

    `seq_length` is a training choice, not part of the architecture: it defaults to
    `max_position_embeddings`. `config` has the shape `read_hf_config` checks.
    """
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UserError(f"train.init_from: config.json has model_type {model_type!r}; heteroflow reads "
                        f"{', '.join(MODEL_TYPES)}")
    unsupported = []
    if config.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act {config['hidden_act']!r} (only silu)")
    if config.get("mlp_bias"):
        unsupported.append("mlp_bias")
    if model_type not in ("qwen2", "qwen2_moe") and config.get("attention_bias"):
        unsupported.append("attention_bias (bias on o_proj)")
    if config.get("use_sliding_window") or (model_type == "mixtral" and config.get("sliding_window")):
        unsupported.append("sliding_window attention")
    if config.get("router_jitter_noise"):
        unsupported.append("router_jitter_noise")
    if unsupported:
        raise UserError(f"train.init_from: config.json asks for {', '.join(unsupported)}, which heteroflow's "
                        "Llama model does not implement")
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim")
    return ModelSpec(
        num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        ffn_hidden_size=config["intermediate_size"], num_attention_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads, vocab_size=config["vocab_size"],
        seq_length=seq_length or config.get("max_position_embeddings", 4096),
        head_dim=None if head_dim in (None, config["hidden_size"] // heads) else head_dim,
        rope_theta=_rope_theta(config), norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=model_type in ("qwen2", "qwen2_moe"), qk_norm=model_type in ("qwen3", "qwen3_moe"),
        moe=_moe_from_hf_config(config))


def _moe_from_hf_config(config: dict) -> MoESpec | None:
    """The `MoESpec` of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json; None for a dense model type."""
    model_type = config["model_type"]
    if model_type not in ("mixtral", "qwen2_moe", "qwen3_moe"):
        return None
    num_experts = config.get("num_local_experts") or config.get("num_experts")
    coeff = float(config.get("router_aux_loss_coef", 0.0))
    if model_type == "mixtral":
        return MoESpec(num_experts=num_experts, top_k=config["num_experts_per_tok"],
                       ffn_hidden_size=config["intermediate_size"], aux_loss_coeff=coeff)
    # Qwen: layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers;
    # heteroflow represents the common case, dense first layers then all sparse.
    dense = sorted(config.get("mlp_only_layers") or [])
    if config.get("decoder_sparse_step", 1) != 1 or dense != list(range(len(dense))):
        raise UserError(f"train.init_from: config.json has decoder_sparse_step {config.get('decoder_sparse_step')} "
                        f"and mlp_only_layers {dense}; heteroflow's MoE layers are the ones after the first "
                        "dense layers (decoder_sparse_step 1, mlp_only_layers [0, ..., k-1])")
    shared = config.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
    return MoESpec(num_experts=num_experts, top_k=config["num_experts_per_tok"],
                   ffn_hidden_size=config["moe_intermediate_size"],
                   normalize_top_k=bool(config.get("norm_topk_prob", False)),
                   shared_expert_ffn_hidden_size=shared, shared_expert_gate=bool(shared),
                   first_dense_layers=len(dense), aux_loss_coeff=coeff)


# How each ModelSpec field is spelled in config.json, for error messages.
_HF_KEYS = {"num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size",
            "num_kv_heads": "num_key_value_heads", "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
            "tie_embeddings": "tie_word_embeddings", "qkv_bias": "model_type (qwen2 has q/k/v biases)",
            "qk_norm": "model_type (qwen3 has q/k norms)", "activation": "hidden_act",
            "normalization": "its RMSNorm", "position_embedding": "its RoPE",
            "moe.num_experts": "num_local_experts / num_experts", "moe.top_k": "num_experts_per_tok",
            "moe.ffn_hidden_size": "intermediate_size (mixtral) / moe_intermediate_size",
            "moe.normalize_top_k": "norm_topk_prob", "moe.shared_expert_ffn_hidden_size":
            "shared_expert_intermediate_size", "moe.shared_expert_gate": "model_type (qwen2_moe gates its shared "
            "expert)", "moe.first_dense_layers": "mlp_only_layers", "moe.layer_freq": "decoder_sparse_step"}
_TRAINING_CHOICES = ("seq_length", "moe.aux_loss_coeff", "moe.capacity_factor")
"""Fields a job sets freely whatever the checkpoint says."""


def _architecture(spec: ModelSpec) -> dict:
    """Field name -> value, MoE fields as `moe.<name>` (None everywhere for a dense model)."""
    out = {f.name: getattr(spec, f.name) for f in fields(ModelSpec) if f.name != "moe"}
    out["head_dim"] = spec.kv_channels
    out["moe"] = spec.moe is not None
    out.update({f"moe.{f.name}": getattr(spec.moe, f.name) if spec.moe else None for f in fields(MoESpec)})
    return out


def check_against(job_spec: ModelSpec, ckpt_spec: ModelSpec, *, ckpt_dir: str,
                  path: str = "train.init_from") -> None:
    """Raise a `ConfigError` with one line per architecture field where the job and config.json differ."""
    problems = []
    ours_all, theirs_all = _architecture(job_spec), _architecture(ckpt_spec)
    if ours_all["moe"] != theirs_all["moe"]:
        kind = "a mixture-of-experts" if theirs_all["moe"] else "a dense"
        problems.append(Problem(path, f"{ckpt_dir}: config.json describes {kind} model "
                                f"(model_type {'MoE' if theirs_all['moe'] else 'dense'}); set model.moe "
                                f"{'to its experts' if theirs_all['moe'] else 'to null'}"))
    for name, ours in ours_all.items():
        theirs = theirs_all[name]
        if name in _TRAINING_CHOICES or name == "moe" or ours is None or theirs is None:
            continue
        if ours != theirs:
            problems.append(Problem(path, f"{ckpt_dir}: model.{name} is {ours} but config.json says "
                                    f"{_HF_KEYS.get(name, name)} = {theirs}; set model.{name}: {theirs}"))
    if problems:
        raise ConfigError(problems)


class HFCheckpoint:
    """An opened checkpoint directory: its config, its spec and where each tensor is stored."""

    def __init__(self, ckpt_dir: str | Path, *, seq_length: int | None = None):
        self.dir = Path(ckpt_dir)
        self.config = read_hf_config(self.dir)
        self.spec = model_spec_from_hf_config(self.config, seq_length=seq_length)
        self.files = self._tensor_files()

    def _tensor_files(self) -> dict[str, Path]:
        indexed = index_files(self.dir)
        if indexed is not None:
            return indexed
        files = safetensors_files(self.dir)
        out: dict[str, Path] = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                out.update({name: file for name in f.keys()})
        return out

    def check_against(self, job_spec: ModelSpec) -> None:
        """Raise a `ConfigError` listing each model field of the job that config.json contradicts."""
        check_against(job_spec, self.spec, ckpt_dir=str(self.dir))

    def source_name(self, name: str) -> str:
        """The stored tensor that our parameter `name` takes its values from."""
        theirs = hf_name(name, self.config["model_type"])
        if name == "head.weight" and self.spec.tie_embeddings and theirs not in self.files:
            return _TOP_NAMES["embed.weight"]  # tied checkpoints usually store the embedding only
        return theirs

    @torch.no_grad()
    def load_into(self, model: nn.Module) -> list[str]:
        """Copy this rank's part of every parameter of a (possibly parallelized) stage model from the
        checkpoint, reading only those slices; returns the names loaded."""
        loaded = []
        with ExitStack() as stack:
            handles: dict[Path, object] = {}
            for name, param in model.named_parameters():
                source = self.source_name(name)
                if source not in self.files:
                    raise UserError(f"train.init_from: {self.dir} has no tensor {source} (needed for {name})")
                file = self.files[source]
                if file not in handles:
                    handles[file] = stack.enter_context(safe_open(file, framework="pt"))
                stored = handles[file].get_slice(source)
                shard = shard_of(param)
                if tuple(stored.get_shape()) != shard.full_shape:
                    raise UserError(f"train.init_from: {source} has shape {tuple(stored.get_shape())}, the model "
                                    f"expects {shard.full_shape} for {name}")
                param.copy_(shard.read(lambda dim, a, b: _read(stored, dim, a, b)))
                loaded.append(name)
        return loaded


def safetensors_files(ckpt_dir: Path) -> list[Path]:
    """The `*.safetensors` files of a directory without an index (each inside it), or a `UserError`."""
    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"train.init_from: no *.safetensors in {ckpt_dir} (pickled *.bin weights are not "
                        "read; convert them with safetensors first)")
    for file in files:
        check_inside(ckpt_dir, file, source=ckpt_dir, name=file.name)
    return files


def check_init_from(job: JobConfig) -> None:
    """Before any worker starts: `train.init_from` (when set) is a checkpoint directory whose config.json
    describes the job's model and whose index, if any, is well formed and names files inside it. Reads
    only config.json and the index, not the weights; a `UserError` (`ConfigError`) otherwise."""
    if not job.train.init_from:
        return
    ckpt_dir = Path(job.resolve_path(job.train.init_from))
    if not ckpt_dir.is_dir():
        raise UserError(f"train.init_from: {ckpt_dir} is not a directory; point init_from at a Hugging Face "
                        "model directory (config.json + *.safetensors)")
    spec = model_spec_from_hf_config(read_hf_config(ckpt_dir), seq_length=job.model.seq_length)
    check_against(job.model, spec, ckpt_dir=str(ckpt_dir))
    if index_files(ckpt_dir) is None:
        safetensors_files(ckpt_dir)


def _read(stored, dim: int | None, start: int, stop: int) -> torch.Tensor:
    if dim is None:
        return stored[:]
    index = tuple([slice(None)] * dim + [slice(start, stop)])
    return stored[index]


def load_hf_weights(model: nn.Module, ckpt_dir: str | Path, *, job_spec: ModelSpec | None = None) -> HFCheckpoint:
    """Check the checkpoint against `job_spec` (default: the model's spec), then load this rank's weights."""
    ckpt = HFCheckpoint(ckpt_dir)
    ckpt.check_against(job_spec or model.spec)
    ckpt.load_into(model)
    return ckpt


def hf_config_from_spec(spec: ModelSpec, *, model_type: str = "llama") -> dict:
    """A config.json for `spec` (the inverse of `model_spec_from_hf_config`)."""
    if model_type not in MODEL_TYPES or (spec.activation, spec.normalization, spec.position_embedding) != (
            "swiglu", "rmsnorm", "rope") or spec.qkv_bias != (model_type == "qwen2") or spec.qk_norm != (
            model_type == "qwen3"):
        raise ValueError(f"{spec} cannot be written as a Hugging Face {model_type} model")
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]
    return {"architectures": [arch], "model_type": model_type, "hidden_act": "silu",
            "num_hidden_layers": spec.num_layers, "hidden_size": spec.hidden_size,
            "intermediate_size": spec.ffn_hidden_size, "num_attention_heads": spec.num_attention_heads,
            "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.kv_channels, "vocab_size": spec.vocab_size,
            "max_position_embeddings": spec.seq_length, "rms_norm_eps": spec.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
            "tie_word_embeddings": spec.tie_embeddings, "attention_bias": False, "torch_dtype": "float32"}


def write_hf_checkpoint(state: dict[str, torch.Tensor], spec: ModelSpec, out_dir: str | Path, *,
                        model_type: str = "llama", num_shards: int = 1) -> None:
    """Write full (unsharded) tensors under our names as a Hugging Face checkpoint directory;
    `num_shards` > 1 splits them over several files with a `model.safetensors.index.json`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config_from_spec(spec, model_type=model_type), indent=2))
    tensors = {hf_name(k, model_type): v.detach().contiguous().cpu() for k, v in state.items()
               if not (spec.tie_embeddings and k == "head.weight")}
    names = sorted(tensors)
    if num_shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for k in range(num_shards):
        file = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::num_shards]}
        save_file(part, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))

