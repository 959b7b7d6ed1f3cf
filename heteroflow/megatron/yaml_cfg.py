"""Megatron's `--yaml-cfg` files: arguments by destination name, with `language_model:` and
`model_parallel:` sections holding `TransformerConfig` / `ModelParallelConfig` fields.

When `--yaml-cfg` is given Megatron reads every argument from the file and ignores the command line
(`load_yaml`: "argparse arguments will be ignored"); the importer does the same and says so.
"""

from __future__ import annotations

from dataclasses import replace

from heteroflow.errors import UserError
from heteroflow.megatron.args import MegatronArgs, Setting, build_args, make_setting
from heteroflow.megatron.argtable import TABLE, UNMAPPED, ArgDef, by_dest, group_of_unknown
from heteroflow.megatron.report import Entry
from heteroflow.megatron.shell import Field

# TransformerConfig / ModelParallelConfig fields whose names differ from the argparse destination.
_RENAMES = {"layernorm_epsilon": "norm_epsilon", "layernorm_zero_centered_gamma": "apply_layernorm_1p",
            "num_moe_experts": "num_experts"}
# Fields that exist only in the YAML sections, by argument group.
_YAML_ONLY = {
    "kernel": ("bias_activation_fusion", "persist_layer_norm", "memory_efficient_layer_norm", "bias_swiglu_fusion",
               "masked_softmax_fusion", "bias_dropout_fusion", "apply_rope_fusion", "gradient_accumulation_fusion"),
    "init": ("init_method", "output_layer_init_method", "perform_initialization", "use_cpu_initialization"),
    "fp8": ("fp8", "fp8_margin", "fp8_interval", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad"),
    "comm": ("async_tensor_model_parallel_allreduce", "tp_comm_split_ag", "tp_comm_atomic_ag", "tp_comm_split_rs",
             "tp_comm_atomic_rs", "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad", "overlap_p2p_comm", "batch_p2p_comm",
             "batch_p2p_sync", "use_ring_exchange_p2p", "delay_grad_reduce", "delay_param_gather"),
    "runtime": ("params_dtype", "timers", "finalize_model_grads_func", "pipeline_dtype", "grad_scale_func",
                "variable_seq_lengths", "deallocate_pipeline_outputs", "no_sync_func", "grad_sync_func",
                "param_sync_func", "_cpu_offloading_context", "clone_scatter_output_in_embedding", "barrier_with_L1_time",
                "check_for_nan_in_loss_and_grad", "enable_one_logger", "log_loss_scale_to_tensorboard",
                "manual_gc_eval", "scatter_gather_tensors_in_pipeline"),
    "numerics": ("enable_autocast", "autocast_dtype"),
    "other_models": ("pipeline_model_parallel_split_rank",),
}
_YAML_GROUP = {name: group for group, names in _YAML_ONLY.items() for name in names}
# Keys whose Megatron meaning in YAML mode is fixed by another key.
_SHADOWED = {
    "swiglu": "in --yaml-cfg files the activation comes from language_model.activation_func",
    "squared_relu": "in --yaml-cfg files the activation comes from language_model.activation_func",
    "openai_gelu": "in --yaml-cfg files the activation comes from language_model.activation_func",
    "gated_linear_unit": "implied by language_model.activation_func",
    "virtual_pipeline_model_parallel_size": "Megatron derives it from num_layers_per_virtual_pipeline_stage",
    "cpu_offloading": "on when cpu_offloading_num_layers > 0",
    "cpu_offloading_weights": "part of cpu_offloading_num_layers (activations are what heteroflow offloads)",
    "cpu_offloading_activations": "part of cpu_offloading_num_layers",
}


def definition_for(key: str) -> ArgDef | None:
    """The argument table entry a destination-style name refers to."""
    found = by_dest().get(key)
    if found is not None:
        return found
    flag = "--" + key.replace("_", "-")
    for candidate in (flag, "--no-" + flag[2:], "--disable-" + flag[2:]):
        if candidate in TABLE:
            return TABLE[candidate]
    return None


def _typed(definition: ArgDef, value: object) -> list[Field]:
    if isinstance(value, list):
        return [Field(str(v)) for v in value]
    if isinstance(value, bool):
        return [Field(str(value).lower())]
    if definition.kind == "int" and isinstance(value, float) and value.is_integer():
        # YAML values are typed already (Megatron sets them without argparse): 1000000.0 is the integer.
        return [Field(str(int(value)))]
    return [Field(str(value))]


def settings_from_mapping(items: list[tuple], origin: str, problems: list[str],
                          shadowed: dict[str, str] | None = None) -> tuple[list[Setting], list[Entry]]:
    """Settings for (shown key, destination-style name, value[, value as written]) items; entries for
    keys decided here (nulls, and `shadowed` names whose meaning another key fixes)."""
    settings: list[Setting] = []
    entries: list[Entry] = []
    shadowed = shadowed or {}
    for item in items:
        key, name, value = item[:3]
        written = _show(item[3] if len(item) > 3 else value)
        if value is None:
            entries.append(Entry(key, "null", "ignored", "null: not set (Megatron's default applies)", None, origin))
            continue
        if name in shadowed:
            entries.append(Entry(key, written, "ignored", shadowed[name], None, origin))
            continue
        if name == "activation_func":
            name, value = _activation(str(value))
        definition = definition_for(_RENAMES.get(name, name))
        if definition is None or (definition.group == UNMAPPED and name in _YAML_GROUP):
            group = _YAML_GROUP.get(name) or group_of_unknown("--" + name.replace("_", "-"))
            settings.append(Setting(key, None, (written,), value, None, origin, (), group, len(settings)))
            continue
        if definition.takes_value and definition.kind != "bool":
            setting = make_setting(key, definition, _typed(definition, value), None, origin, problems, len(settings))
            setting = replace(setting, raw=(written,))
        else:
            # YAML gives the destination's value itself (store_false destinations included).
            setting = Setting(key, definition.dest, (written,), bool(value), None, origin, (), definition.group,
                              len(settings))
        settings.append(setting)
    return settings, entries


def _activation(value: str) -> tuple[str, object]:
    """`language_model.activation_func` as the argparse switch it corresponds to."""
    if value == "swiglu":
        return "swiglu", True
    if value == "squaredrelu":
        return "squared_relu", True
    if value == "gelu":
        return "swiglu", False
    raise UserError(f"language_model.activation_func: {value!r} is not a supported activation function "
                    "(Megatron accepts swiglu, squaredrelu, gelu)")


def _show(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)


def read_megatron_yaml(data: dict, origin: str = "yaml") -> tuple[MegatronArgs, list[Entry]]:
    """Arguments of a `--yaml-cfg` file (already parsed), and entries decided while reading it."""
    if not isinstance(data, dict):
        raise UserError("a Megatron --yaml-cfg file must hold a mapping of argument names")
    items: list[tuple[str, str, object]] = []
    for key, value in data.items():
        if key in ("language_model", "model_parallel") and isinstance(value, dict):
            items += [(f"{key}.{k}", str(k), v) for k, v in value.items()]
        else:
            items.append((str(key), str(key), value))
    problems: list[str] = []
    settings, entries = settings_from_mapping(items, origin, problems, _SHADOWED)
    return build_args(settings, (), problems), entries


_LANGUAGE_MODEL = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                   "kv_channels", "hidden_dropout", "attention_dropout", "add_bias_linear", "add_qkv_bias",
                   "normalization", "recompute_granularity", "recompute_method", "recompute_num_layers")
_MODEL_PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                   "sequence_parallel", "fp16", "bf16")


def yaml_key(dest: str) -> str:
    """Where a --yaml-cfg file keeps `dest` (for messages about missing values)."""
    if dest in _LANGUAGE_MODEL:
        return f"language_model.{dest}"
    if dest == "norm_epsilon":
        return "language_model.layernorm_epsilon"
    return f"model_parallel.{dest}" if dest in _MODEL_PARALLEL else dest
