"""Read (and write) Hugging Face-format Llama / Qwen2 / Qwen3 checkpoints with safetensors only.

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
from heteroflow.errors import ConfigError, Problem, UserError
from heteroflow.models.hf_files import CONFIG_FILE, check_inside, index_files, read_hf_config
from heteroflow.models.shard import shard_of

MODEL_TYPES = ("llama", "qwen2", "qwen3")
_LAYER_NAMES = {  # ours (inside layers.{i}.) -> Hugging Face (inside model.layers.{i}.)
    "attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj", "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm",
    "mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj", "mlp.w2": "mlp.down_proj",
}
_TOP_NAMES = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "head.weight": "lm_head.weight"}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def hf_name(name: str) -> str:
    """The Hugging Face tensor name of our parameter `name` (`layers.3.attn.wq.weight` ->
    `model.layers.3.self_attn.q_proj.weight`)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _LAYER.match(name)
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
    if model_type != "qwen2" and config.get("attention_bias"):
        unsupported.append("attention_bias (bias on o_proj)")
    if config.get("use_sliding_window"):
        unsupported.append("use_sliding_window")
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
        qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3")


# How each ModelSpec field is spelled in config.json, for error messages.
_HF_KEYS = {"num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size",
            "num_kv_heads": "num_key_value_heads", "norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
            "tie_embeddings": "tie_word_embeddings", "qkv_bias": "model_type (qwen2 has q/k/v biases)",
            "qk_norm": "model_type (qwen3 has q/k norms)", "activation": "hidden_act",
            "normalization": "its RMSNorm", "position_embedding": "its RoPE"}


def check_against(job_spec: ModelSpec, ckpt_spec: ModelSpec, *, ckpt_dir: str,
                  path: str = "train.init_from") -> None:
    """Raise a `ConfigError` with one line per architecture field where the job and config.json differ."""
    problems = []
    for f in fields(ModelSpec):
        if f.name == "seq_length":
            continue
        ours, theirs = getattr(job_spec, f.name), getattr(ckpt_spec, f.name)
        if f.name == "head_dim":
            ours, theirs = job_spec.kv_channels, ckpt_spec.kv_channels
        if ours != theirs:
            problems.append(Problem(path, f"{ckpt_dir}: model.{f.name} is {ours} but config.json says "
                                    f"{_HF_KEYS.get(f.name, f.name)} = {theirs}; set model.{f.name}: {theirs}"))
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
        theirs = hf_name(name)
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
    tensors = {hf_name(k): v.detach().contiguous().cpu() for k, v in state.items()
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

