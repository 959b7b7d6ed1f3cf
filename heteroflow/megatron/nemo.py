"""NeMo (1.x, Megatron-based) model YAML: `trainer:` + `model:` (+ `exp_manager:`), translated into the
Megatron arguments it configures, so the same mapping and rules apply.

OmegaConf interpolations (`${.encoder_seq_length}`, `${model.x}`) are resolved; resolvers such as
`${multiply:...}` and mandatory `???` values are reported as unknown.
"""

from __future__ import annotations

import re

from heteroflow.errors import UserError
from heteroflow.megatron.args import MegatronArgs, build_args
from heteroflow.megatron.report import Entry
from heteroflow.megatron.yaml_cfg import settings_from_mapping

_INTERPOLATION = re.compile(r"\$\{([^}]*)\}")
_UNKNOWN = object()
_RENAMED = {"encoder_seq_length": "seq_length", "layernorm_epsilon": "norm_epsilon",
            "rotary_percentage": "rotary_percent", "num_moe_experts": "num_experts",
            "virtual_pipeline_model_parallel_size": "num_virtual_stages_per_pipeline_rank",
            "activations_checkpoint_granularity": "recompute_granularity",
            "activations_checkpoint_method": "recompute_method",
            "activations_checkpoint_num_layers": "recompute_num_layers"}
_IGNORED_MODEL_KEYS = {
    "pre_process": "always true for a full model", "post_process": "always true for a full model",
    "resume_from_checkpoint": "checkpoint to resume from: heteroflow cannot read NeMo checkpoints",
    "native_amp_init_scale": "fp16 loss-scaling detail", "native_amp_growth_interval": "fp16 loss-scaling detail",
    "hysteresis": "fp16 loss-scaling detail", "megatron_amp_O2": "keeps half-precision weights with fp32 master "
    "copies: heteroflow's mixed precision does the same", "grad_allreduce_chunk_size_mb": "communication tuning",
    "grad_div_ar_fusion": "communication tuning", "gradient_as_bucket_view": "communication tuning",
    "apex_transformer_log_level": "logging", "sync_batch_comm": "communication tuning",
    "mcore_gpt": "selects the Megatron-Core implementation of the same model", "transformer_engine": "kernel choice",
    "use_scaled_init_method": "weight-initialisation detail", "do_layer_norm_weight_decay": "optimizer detail",
    "get_attention_mask_from_fusion": "kernel choice", "overlap_p2p_comm": "communication tuning",
    "batch_p2p_comm": "communication tuning", "bias_dropout_add_fusion": "kernel choice", "ffn_dropout": None, "attention_type": None,
    "transformer_block_type": None, "headscale": None, "normalize_attention_scores": None,
}


def _lookup(root: dict, path: list[str]):
    node = root
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return _UNKNOWN
        node = node[key]
    return node


def _resolve(value, root: dict, parent: list[str], depth: int = 0):
    """A value with OmegaConf interpolations replaced; `_UNKNOWN` when it cannot be known."""
    if depth > 20:
        return _UNKNOWN
    if isinstance(value, str):
        if value == "???":
            return _UNKNOWN
        whole = _INTERPOLATION.fullmatch(value)
        refs = _INTERPOLATION.findall(value)
        if not refs:
            return value
        resolved = []
        for ref in refs:
            if ":" in ref:
                return _UNKNOWN
            if ref.startswith("."):
                dots = len(ref) - len(ref.lstrip("."))
                path = parent[:len(parent) - (dots - 1)] + ref.lstrip(".").split(".")
            else:
                path = ref.split(".")
            target = _lookup(root, path)
            target = _resolve(target, root, path[:-1], depth + 1) if target is not _UNKNOWN else _UNKNOWN
            if target is _UNKNOWN:
                return _UNKNOWN
            resolved.append(target)
        if whole:
            return resolved[0]
        return _INTERPOLATION.sub(lambda _m: str(resolved.pop(0)), value)
    return value


def _flatten(node, prefix: list[str], root: dict, out: list[tuple[str, object, object]]) -> None:
    """(dotted key, value as written, resolved value) for every leaf."""
    for key, value in node.items():
        path = prefix + [str(key)]
        if isinstance(value, dict):
            _flatten(value, path, root, out)
        else:
            out.append((".".join(path), value, _resolve(value, root, prefix)))


def _precision(value) -> str | None:
    text = str(value).lower()
    if text in ("16", "16-mixed", "fp16", "16-true"):
        return "fp16"
    if text in ("bf16", "bf16-mixed", "bf16-true"):
        return "bf16"
    if text in ("32", "32-true", "fp32"):
        return "fp32"
    return None


def read_nemo_yaml(data: dict) -> tuple[MegatronArgs, list[Entry], list[str], int | None, int | None]:
    """Arguments, entries decided here, blockers, nodes and devices per node of a NeMo model config."""
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise UserError("a NeMo config needs a `model:` mapping")
    flat: list[tuple[str, object, object]] = []
    _flatten(data, [], data, flat)
    values = {key: value for key, _, value in flat}
    items: list[tuple[str, str, object]] = []
    entries: list[Entry] = []
    blockers: list[str] = []
    nnodes = nproc = None

    written: dict[str, object] = {key: raw for key, raw, _ in flat}

    def entry(key: str, value, disposition: str, detail: str) -> None:
        raw = written.get(key, value)
        entries.append(Entry(key, "null" if raw is None else str(raw), disposition, detail, None, "yaml"))

    def item(key: str, name: str, value) -> None:
        items.append((key, name, value, written.get(key, value)))

    max_steps = values.get("trainer.max_steps")
    for key, _, value in flat:
        if value is _UNKNOWN:
            entry(key, value, "ignored", "value left open (??? or an OmegaConf resolver): not used")
            continue
        head, _, rest = key.partition(".")
        if head == "trainer":
            if rest == "devices":
                nproc = value if isinstance(value, int) else None
                entry(key, value, "mapped" if nproc else "ignored", f"cluster: {value} devices per node")
            elif rest == "num_nodes":
                nnodes = value if isinstance(value, int) else None
                entry(key, value, "mapped" if nnodes else "ignored", f"cluster: {value} nodes")
            elif rest == "precision":
                precision = _precision(value)
                if precision is None:
                    entry(key, value, "unknown", "precision heteroflow does not know")
                elif precision == "fp32":
                    entry(key, value, "mapped", "train.precision = fp32")
                else:
                    item(key, precision, True)
            elif rest == "max_steps":
                item(key, "train_iters", value)
            elif rest == "gradient_clip_val":
                item(key, "clip_grad", value)
            else:
                entry(key, value, "ignored", "PyTorch Lightning trainer setting (logging, validation, devices)")
            continue
        if head != "model":
            entry(key, value, "ignored", "experiment management (logging, checkpoints)" if head == "exp_manager"
                  else "not part of the model or its training")
            continue
        _model_key(rest, key, value, values, max_steps, item, entry, blockers)
    if nproc and "trainer.num_nodes" not in values:
        nnodes = 1
        entries.append(Entry("trainer.num_nodes", "(absent)", "mapped", "cluster: 1 node (Lightning's default)", None,
                             "yaml"))
    if "model.optim.sched.name" not in values:
        items.append(("model.optim.sched", "lr_decay_style", "constant", "(absent: NeMo keeps the lr constant)"))
    problems: list[str] = []
    settings, more = settings_from_mapping(items, "yaml", problems)
    return build_args(settings, (), problems), entries + more, blockers, nnodes, nproc


def _model_key(rest: str, key: str, value, values: dict, max_steps, item, entry, blockers: list) -> None:
    """Translate one `model.*` key."""
    if rest.startswith("tokenizer."):
        library = str(values.get("model.tokenizer.library", "megatron"))
        field = rest.split(".", 1)[1]
        if field == "type" and value is not None:
            if library == "megatron":
                item(key, "tokenizer_type", value)
            else:
                entry(key, value, "mapped", "tokenizer name (see model.tokenizer.library)")
                item(key, "tokenizer_model", value)
        elif field == "library":
            kinds = {"huggingface": "HuggingFaceTokenizer", "sentencepiece": "SentencePieceTokenizer"}
            if value in kinds:
                item(key, "tokenizer_type", kinds[value])
            else:
                entry(key, value, "mapped", "Megatron's own tokenizers (see model.tokenizer.type)")
        elif field == "model" and value is not None:
            item(key, "tokenizer_model", value)
        else:
            entry(key, value, "ignored", "tokenizer file or option: only the vocabulary size enters the job")
        return
    if rest.startswith("data."):
        if rest == "data.data_prefix":
            item(key, "data_path", value if isinstance(value, list) else [value])
        elif rest == "data.splits_string" and value is not None:
            item(key, "split", str(value))
        else:
            entry(key, value, "ignored", "NeMo data-pipeline detail; heteroflow reads data_prefix and splits_string "
                                         "(train.data)")
        return
    if rest.startswith("optim."):
        _optim_key(rest, key, value, values, max_steps, item, entry)
        return
    if rest.startswith("nsys_profile."):
        entry(key, value, "ignored", "profiling only")
        return
    name = rest
    if name == "normalization":
        kinds = {"layernorm": "LayerNorm", "layernorm1p": "LayerNorm", "rmsnorm": "RMSNorm"}
        if value not in kinds:
            blockers.append(f"normalization {value!r} ({key}): heteroflow supports layernorm and rmsnorm")
            entry(key, value, "unsupported", "normalization not representable")
        else:
            item(key, "normalization", kinds[value])
        return
    if name == "bias":
        item(key, "add_bias_linear", bool(value))
        return
    if name == "activation":
        if value in ("gelu", "swiglu", "fast-swiglu"):
            item(key, "swiglu", value != "gelu")
        else:
            blockers.append(f"{value} MLP activation ({key}): heteroflow supports gelu and swiglu")
            entry(key, value, "unsupported", "activation not representable")
        return
    if name == "share_embeddings_and_output_weights":
        item(key, "untie_embeddings_and_output_weights", not value)
        return
    if name == "num_query_groups":
        if value is not None and value != values.get("model.num_attention_heads"):
            item(key, "group_query_attention", True)
            item(key, "num_query_groups", value)
        else:
            entry(key, value, "mapped", "one key/value head per query head")
        return
    if name == "position_embedding_type":
        if value in ("learned_absolute", "rope"):
            item(key, "position_embedding_type", value)
        else:
            blockers.append(f"{value} position embeddings ({key}): heteroflow supports RoPE and learned positions")
            entry(key, value, "unsupported", "position embedding not representable")
        return
    if name in ("transformer_block_type", "headscale", "normalize_attention_scores", "attention_type"):
        standard = {"transformer_block_type": "pre_ln", "headscale": False, "normalize_attention_scores": True,
                    "attention_type": "multihead"}[name]
        if value == standard:
            entry(key, value, "mapped", "the standard pre-LayerNorm decoder block, as heteroflow")
        else:
            blockers.append(f"{name} {value} ({key}): heteroflow builds a standard pre-LayerNorm decoder")
            entry(key, value, "unsupported", "block variant not representable")
        return
    if name == "ffn_dropout":
        entry(key, value, "approximated" if value else "mapped",
              f"heteroflow trains without dropout; NeMo drops {value} in the MLP" if value else "no dropout")
        return
    if name in _IGNORED_MODEL_KEYS:
        entry(key, value, "ignored", _IGNORED_MODEL_KEYS[name])
        return
    item(key, _RENAMED.get(name, name), value)


def _optim_key(rest: str, key: str, value, values: dict, max_steps, item, entry) -> None:
    field = rest[len("optim."):]
    if field == "name":
        if value in ("fused_adam", "adam", "adamw"):
            entry(key, value, "mapped", "AdamW, as heteroflow")
        elif value == "distributed_fused_adam":
            item(key, "use_distributed_optimizer", True)  # AdamW with the state sharded over dp: ZeRO-1
        else:
            entry(key, value, "approximated", f"heteroflow trains with AdamW, not {value}")
    elif field == "lr":
        item(key, "lr", value)
    elif field == "weight_decay":
        item(key, "weight_decay", value)
    elif field == "betas" and isinstance(value, list) and len(value) == 2:
        item(key + "[0]", "adam_beta1", value[0])
        item(key + "[1]", "adam_beta2", value[1])
    elif field == "eps":
        item(key, "adam_eps", value)
    elif field == "sched.name":
        styles = {"CosineAnnealing": "cosine", "WarmupAnnealing": "linear", "LinearAnnealing": "linear",
                  "InverseSquareRootAnnealing": "inverse-square-root", "ConstantLR": "constant"}
        if value in styles:
            item(key, "lr_decay_style", styles[value])
        else:
            entry(key, value, "approximated", f"heteroflow decays with a cosine, not NeMo's {value}")
    elif field == "sched.warmup_steps":
        if isinstance(value, float) and not value.is_integer():
            # NeMo's schedulers take fractional warmup steps; Megatron counts whole iterations.
            entry(key, value, "approximated", f"warmup of {value:g} steps rounded to {round(value)} iterations")
            value = round(value)
        item(key, "lr_warmup_iters", value)
    elif field == "sched.warmup_ratio":
        item(key, "lr_warmup_fraction", value)
    elif field == "sched.min_lr":
        item(key, "min_lr", value)
    elif field in ("sched.constant_steps", "sched.max_steps"):
        total = values.get("model.optim.sched.max_steps", max_steps)
        constant = values.get("model.optim.sched.constant_steps") or 0
        if field == "sched.max_steps" and constant:
            entry(key, value, "mapped", "decay length (see model.optim.sched.constant_steps)")
        elif isinstance(total, int) and (constant or field == "sched.max_steps"):
            item(key, "lr_decay_iters", total - constant)
        else:
            entry(key, value, "mapped", "no constant phase after the decay")
    else:
        entry(key, value, "ignored", "optimizer detail heteroflow does not use")


_NEMO_KEYS = {dest: f"model.{name}" for name, dest in _RENAMED.items()}
_NEMO_KEYS.update({"train_iters": "trainer.max_steps", "clip_grad": "trainer.gradient_clip_val",
                   "lr": "model.optim.lr", "min_lr": "model.optim.sched.min_lr",
                   "weight_decay": "model.optim.weight_decay", "tokenizer_type": "model.tokenizer.type"})


def nemo_key(dest: str) -> str:
    """Where a NeMo config keeps `dest` (for messages about missing values)."""
    return _NEMO_KEYS.get(dest, f"model.{dest}")
