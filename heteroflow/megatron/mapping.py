"""Megatron arguments -> heteroflow's `model:` section, with Megatron's defaults and rules.

Each function reads the arguments through a `Context`, records the disposition of every argument it
reads, and returns plain dicts in the job YAML schema (validated later by `heteroflow.config`).
"""

from __future__ import annotations

import math
import re

from heteroflow.megatron.context import Context
from heteroflow.megatron.moe import map_moe
from heteroflow.megatron.versions import null_tokenizer_vocab

# Tokenizer vocabularies Megatron reads from the tokenizer itself (len(tokenizer) for Hugging Face ones).
_KNOWN_TOKENIZERS = ((re.compile(r"llama[-_ ]?3|meta-llama-3", re.I), 128256, "Llama-3"),
                     (re.compile(r"llama[-_ ]?2|llama-2", re.I), 32000, "Llama-2"),
                     (re.compile(r"mixtral|mistral", re.I), 32000, "Mistral / Mixtral"),
                     (re.compile(r"(^|/)gpt2", re.I), 50257, "GPT-2"))
_GPT2_VOCAB = 50257


def map_model(ctx: Context, tp: int, vocab_override: int | None) -> dict:
    """The `model:` section (every ModelSpec field written out)."""
    num_layers = ctx.value("num_layers")
    if num_layers is None and ctx.given("encoder_num_layers"):
        num_layers = ctx.value("encoder_num_layers")
        ctx.mark("encoder_num_layers", "mapped", f"model.num_layers = {num_layers}")
    elif ctx.given("encoder_num_layers"):
        ctx.error("cannot have both num-layers and encoder-num-layers specified (Megatron)")
    pattern = ctx.get("hybrid_layer_pattern")
    if num_layers is None and isinstance(pattern, str):
        # Current Megatron counts the layers of --hybrid-layer-pattern (the model is refused as hybrid).
        num_layers = sum(pattern.count(c) for c in "M*-E")
    if num_layers is None:
        ctx.required("num_layers")
    hidden = ctx.required("hidden_size")
    heads = ctx.required("num_attention_heads")
    seq = _seq_length(ctx)
    for dest, value in (("num_layers", num_layers), ("hidden_size", hidden), ("num_attention_heads", heads)):
        ctx.mark(dest, "mapped", f"model.{dest} = {value}")
    if None in (num_layers, hidden, heads, seq):
        return {}
    swiglu = _activation(ctx)
    ffn = ctx.value("ffn_hidden_size")
    if ffn is None:
        ffn = int((4 * hidden * 2 / 3) / 64) * 64 if swiglu else 4 * hidden
        rule = "int(4h * 2/3 / 64) * 64 with --swiglu" if swiglu else "4 * hidden-size"
        ctx.default("ffn_hidden_size", "mapped", f"model.ffn_hidden_size = {ffn} (Megatron's default: {rule})", ffn)
    else:
        ctx.mark("ffn_hidden_size", "mapped", f"model.ffn_hidden_size = {ffn}")
    head_dim = ctx.value("kv_channels")
    if head_dim is None and hidden % heads:
        ctx.error(f"hidden-size {hidden} is not divisible by num-attention-heads {heads} (Megatron asserts it "
                  "when --kv-channels is not given)")
    ctx.mark("kv_channels", "mapped", f"model.head_dim = {head_dim}")
    kv_heads = heads
    if ctx.get("group_query_attention"):
        kv_heads = ctx.get("num_query_groups")
        ctx.mark("group_query_attention", "mapped", f"model.num_kv_heads = {kv_heads} (--num-query-groups)")
        ctx.mark_or_default("num_query_groups", "mapped", f"model.num_kv_heads = {kv_heads}")
    else:
        ctx.mark("group_query_attention", "mapped", "off: one key/value head per query head")
        ctx.mark("num_query_groups", "ignored", "no effect without --group-query-attention (Megatron then uses one "
                                                "key/value head per query head)")
    _tp_rules(ctx, tp, heads, kv_heads, ffn)
    position = _position(ctx, seq)
    base = ctx.get("rotary_base")
    if not isinstance(base, (int, float)):
        # Its conversion problem (or the unresolved value) is already reported; keep Megatron's default.
        base = 10000
    rope_theta = float(base)
    if position == "rope":
        ctx.mark_or_default("rotary_base", "mapped", f"model.rope_theta = {rope_theta:g}")
    else:
        ctx.mark("rotary_base", "ignored", "only used with RoPE (kept as model.rope_theta)")
    normalization = "rmsnorm" if ctx.get("normalization") == "RMSNorm" else "layernorm"
    ctx.mark_or_default("normalization", "mapped", f"model.normalization = {normalization}")
    norm_eps = ctx.get("norm_epsilon")
    ctx.mark_or_default("norm_epsilon", "mapped", f"model.norm_eps = {norm_eps:g}")
    tied = not ctx.get("untie_embeddings_and_output_weights")
    ctx.mark_or_default("untie_embeddings_and_output_weights", "mapped",
                        f"model.tie_embeddings = {str(tied).lower()}"
                        + (" (Megatron ties input and output embeddings by default)" if tied else ""))
    qkv_bias = _biases(ctx)
    qk_norm = bool(ctx.get("qk_layernorm"))
    ctx.mark("qk_layernorm", "mapped", f"model.qk_norm = {str(qk_norm).lower()}")
    _dropout(ctx)
    _shape_blockers(ctx)
    vocab = _vocab(ctx, tp, vocab_override)
    model = {"num_layers": num_layers, "hidden_size": hidden, "ffn_hidden_size": ffn, "num_attention_heads": heads,
             "num_kv_heads": kv_heads, "vocab_size": vocab, "seq_length": seq, "head_dim": head_dim,
             "rope_theta": rope_theta, "norm_eps": float(norm_eps), "tie_embeddings": tied, "qkv_bias": qkv_bias,
             "qk_norm": qk_norm, "activation": "swiglu" if swiglu else "gelu", "normalization": normalization,
             "position_embedding": position}
    moe = map_moe(ctx, num_layers, ffn, tp, swiglu)
    if moe is not None:
        model["moe"] = moe
    return model if vocab is not None else {}


def _seq_length(ctx: Context) -> int | None:
    seq = ctx.value("seq_length")
    if ctx.given("encoder_seq_length"):
        if seq is not None:
            ctx.error("--seq-length and --encoder-seq-length are exclusive (Megatron asserts encoder_seq_length "
                      "is None when --seq-length is given)")
        seq = ctx.value("encoder_seq_length")
        ctx.mark("encoder_seq_length", "mapped", f"model.seq_length = {seq}")
    elif seq is None:
        ctx.required("seq_length")
    ctx.mark("seq_length", "mapped", f"model.seq_length = {seq}")
    return seq


def _activation(ctx: Context) -> bool:
    swiglu = bool(ctx.get("swiglu"))
    if swiglu and (ctx.get("squared_relu") or ctx.get("quick_geglu")):
        ctx.error("--swiglu cannot be combined with --squared-relu or --quick-geglu (Megatron asserts not swiglu)")
    ctx.mark_or_default("swiglu", "mapped", "model.activation = swiglu" if swiglu
                        else "model.activation = gelu (Megatron's default activation)")
    return swiglu


def _tp_rules(ctx: Context, tp: int, heads: int, kv_heads: int, ffn: int) -> None:
    if heads % tp:
        ctx.error(f"num_attention_heads ({heads}) must be a multiple of tensor_model_parallel_size ({tp}) (Megatron)")
    if kv_heads % tp and kv_heads != heads:
        ctx.error(f"num_query_groups ({kv_heads}) must be a multiple of tensor_model_parallel_size ({tp}) (Megatron)")
    if ffn % tp:
        ctx.error(f"ffn-hidden-size {ffn} is not divisible by tensor_model_parallel_size {tp} (Megatron splits the "
                  "MLP's columns evenly)")


def _position(ctx: Context, seq: int) -> str:
    kind = ctx.get("position_embedding_type")
    if ctx.get("use_rotary_position_embeddings"):
        kind = "rope"
        ctx.mark("use_rotary_position_embeddings", "mapped", "model.position_embedding = rope")
    if not ctx.get("add_position_embedding"):
        if kind != "rope":
            ctx.error("--no-position-embedding is deprecated, use --position-embedding-type (Megatron refuses it "
                      "without RoPE)")
        ctx.mark("add_position_embedding", "ignored", "with RoPE Megatron adds no learned position table anyway")
    max_pos = ctx.value("max_position_embeddings")
    if max_pos is None and not ctx.args.setting("max_position_embeddings"):
        if ctx.args.settings and ctx.args.settings[0].origin == "script":
            ctx.error("--max-position-embeddings is missing: Megatron requires it")
        max_pos = seq
    elif max_pos is not None and max_pos < seq:
        ctx.error(f"max_position_embeddings ({max_pos}) must be greater than or equal to seq_length ({seq}) "
                  "(Megatron)")
    if kind == "learned_absolute":
        detail = "model.position_embedding = learned"
        ctx.mark_or_default("position_embedding_type", "mapped", detail + " (Megatron's default)"
                            if not ctx.given("position_embedding_type") else detail)
        if max_pos is not None and max_pos > seq:
            ctx.mark("max_position_embeddings", "approximated", f"heteroflow's learned position table has seq_length "
                                                                f"= {seq} rows; Megatron allocates {max_pos}")
        else:
            ctx.mark("max_position_embeddings", "mapped", f"learned position table of {seq} rows")
        ctx.mark("rotary_percent", "ignored", "only used with RoPE")
        for dest in ("use_rope_scaling", "rope_scaling_factor", "rotary_seq_len_interpolation_factor", "rope_type"):
            ctx.mark(dest, "ignored", "only used with RoPE")
        return "learned"
    if kind != "rope":
        ctx.block(f"position embedding type {kind!r} ({ctx.key('position_embedding_type')}): heteroflow supports "
                  "RoPE and learned absolute positions")
        ctx.mark("position_embedding_type", "unsupported", f"{kind} position embeddings are not representable")
        return "rope"
    ctx.mark("position_embedding_type", "mapped", "model.position_embedding = rope")
    ctx.mark("max_position_embeddings", "ignored", "sizes a learned position table, which RoPE does not use")
    percent = ctx.get("rotary_percent")
    if percent is not None and percent < 1.0:
        ctx.block(f"partial rotary embeddings ({ctx.key('rotary_percent')} {percent:g}): heteroflow rotates the whole "
                  "head dimension")
        ctx.mark("rotary_percent", "unsupported", "partial rotary embeddings are not representable")
    else:
        ctx.mark("rotary_percent", "mapped", "RoPE over the whole head dimension, as heteroflow")
    if ctx.get("use_rope_scaling"):
        detail = (f"Llama-3.1 RoPE frequency scaling (factor {ctx.get('rope_scaling_factor'):g}) is not in "
                  "heteroflow's ModelSpec: same shapes and cost, different long-context numerics")
        ctx.mark("use_rope_scaling", "approximated", detail)
        ctx.mark("rope_scaling_factor", "approximated", detail)
    else:
        ctx.mark("rope_scaling_factor", "ignored", "no effect without --use-rope-scaling")
    if ctx.get("rotary_seq_len_interpolation_factor"):
        ctx.mark("rotary_seq_len_interpolation_factor", "approximated", "RoPE position interpolation is not in "
                                                                        "heteroflow's ModelSpec: positions unscaled")
    if ctx.get("rope_type") == "yarn":
        ctx.mark("rope_type", "approximated", "YaRN RoPE scaling is not in heteroflow's ModelSpec: plain RoPE")
    else:
        ctx.mark("rope_type", "mapped", "plain RoPE")
    return "rope"


def _biases(ctx: Context) -> bool:
    if ctx.get("add_bias_linear"):
        detail = ("Megatron adds a bias to every linear layer (no --disable-bias-linear); heteroflow's decoder has "
                  "biases only on q/k/v (model.qkv_bias = true): the MLP and output-projection biases are left out "
                  "(<0.1% of the parameters)")
        ctx.mark_or_default("add_bias_linear", "approximated", detail)
        ctx.mark("add_qkv_bias", "mapped", "model.qkv_bias = true (already implied by the linear biases)")
        return True
    ctx.mark("add_bias_linear", "mapped", "no linear biases, as heteroflow")
    qkv = bool(ctx.get("add_qkv_bias"))
    ctx.mark("add_qkv_bias", "mapped", f"model.qkv_bias = {str(qkv).lower()}")
    return qkv


def _dropout(ctx: Context) -> None:
    for dest in ("attention_dropout", "hidden_dropout"):
        value = ctx.get(dest)
        if value:
            ctx.mark_or_default(dest, "approximated", f"heteroflow trains without dropout; Megatron drops {value:g}")
        else:
            ctx.mark(dest, "mapped", "no dropout, as heteroflow")


def _shape_blockers(ctx: Context) -> None:
    """Architecture switches that make a model heteroflow cannot represent."""
    rules = (
        ("squared_relu", lambda v: v, "squared-ReLU MLP activation"),
        ("quick_geglu", lambda v: v, "quick-GeGLU MLP activation"),
        ("glu_linear_offset", lambda v: v, "offset GLU activation"),
        ("activation_func_clamp_value", lambda v: v is not None, "clamped activation"),
        ("apply_residual_connection_post_layernorm", lambda v: v, "post-LayerNorm residual ordering (BERT style)"),
        ("softmax_type", lambda v: v not in (None, "vanilla"), "learnable / off-by-one attention softmax"),
        ("window_size", lambda v: v is not None, "sliding-window attention"),
        ("no_rope_freq", lambda v: v is not None, "layers without RoPE (--no-rope-freq)"),
        ("qk_l2_norm", lambda v: v, "Llama-4 query/key L2 normalisation"),
        ("spec", lambda v: v not in (None, [], ["local"]), "a custom layer spec"),
        ("use_mup", lambda v: v, "muP (maximal-update parametrisation: its own initialisation and per-layer "
                                 "learning rates)"),
        ("attention_output_gate", lambda v: v, "gated attention output"),
        ("experimental_attention_variant", lambda v: v is not None, "experimental attention variant"),
    )
    for dest, active, label in rules:
        value = ctx.get(dest)
        if active(value):
            ctx.block(f"{label} ({ctx.key(dest)} {_shown(value)}".rstrip() + ")")
            ctx.mark(dest, "unsupported", f"{label} is not representable in heteroflow's ModelSpec")
        else:
            ctx.mark(dest, "mapped" if dest == "spec" else "ignored",
                     "local layer spec: same model" if dest == "spec" else "off: same as heteroflow")
    if ctx.get("window_size") is None:
        ctx.mark("window_attn_skip_freq", "ignored", "no effect without --window-size")


def _shown(value) -> str:
    if isinstance(value, bool):
        return ""
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)


def _vocab(ctx: Context, tp: int, override: int | None) -> int | None:
    """The padded vocabulary Megatron builds its embedding with."""
    padded = ctx.value("padded_vocab_size")
    kind = ctx.get("tokenizer_type")
    multiple = ctx.get("make_vocab_size_divisible_by") * tp
    for dest in ("vocab_extra_ids",):
        ctx.mark(dest, "ignored", "extra ids are added by BERT / T5 tokenizers only")
    if padded is not None:
        for dest in ("padded_vocab_size", "tokenizer_type", "vocab_size", "make_vocab_size_divisible_by",
                     "tokenizer_model"):
            ctx.mark(dest, "mapped", f"model.vocab_size = {padded} (--padded-vocab-size)")
        return padded
    base, source = _tokenizer_size(ctx, kind, override)
    if base is None:
        return None
    size = int(math.ceil(base / multiple) * multiple)
    detail = (f"model.vocab_size = {size}: {source}, padded to a multiple of --make-vocab-size-divisible-by "
              f"{ctx.get('make_vocab_size_divisible_by')} x tp {tp} (Megatron's padding rule)")
    for dest in ("tokenizer_type", "vocab_size", "make_vocab_size_divisible_by"):
        ctx.mark(dest, "mapped", detail)
    if not ctx.given("make_vocab_size_divisible_by"):
        ctx.default_value("make_vocab_size_divisible_by", ctx.get("make_vocab_size_divisible_by"), detail)
    return size


def _tokenizer_size(ctx: Context, kind: str | None, override: int | None) -> tuple[int | None, str]:
    vocab_size = ctx.value("vocab_size")
    model_path = ctx.get("tokenizer_model")
    if override is not None:
        ctx.mark("tokenizer_model", "ignored", "the vocabulary size was given to the importer (--vocab-size)")
        return override, f"{override} tokens (given to heteroflow import-megatron --vocab-size)"
    if kind in ("NullTokenizer", "GPT2BPETokenizer"):
        ctx.mark("tokenizer_model", "ignored", f"not used by {kind}")
    if kind == "NullTokenizer":
        if vocab_size is None:
            ctx.error("--tokenizer-type NullTokenizer needs --vocab-size (Megatron asserts it)")
            return None, ""
        return null_tokenizer_vocab(vocab_size, ctx.version)
    if kind == "GPT2BPETokenizer":
        return _GPT2_VOCAB, f"GPT-2 BPE {_GPT2_VOCAB} tokens"
    if kind is None and ctx.given("vocab_file") and ctx.given("merge_file"):
        detail = ("no --tokenizer-type: a vocab and a merge file are GPT-2 BPE files (older Megatron's tokenizer); "
                  f"{_GPT2_VOCAB} tokens")
        ctx.mark("vocab_file", "approximated", detail)
        ctx.mark("merge_file", "approximated", detail)
        return _GPT2_VOCAB, f"GPT-2 BPE {_GPT2_VOCAB} tokens (from --vocab-file / --merge-file)"
    if kind is None and not ctx.given("tokenizer_type") and vocab_size is None:
        ctx.error("the tokenizer is not given (--tokenizer-type), so the vocabulary size is unknown; pass "
                  "--vocab-size N to heteroflow import-megatron")
        return None, ""
    if isinstance(model_path, str):
        for pattern, size, name in _KNOWN_TOKENIZERS:
            if pattern.search(model_path):
                ctx.mark("tokenizer_model", "mapped", f"{name} tokenizer: {size} tokens")
                return size, f"{name} tokenizer {model_path!r}: {size} tokens"
    if vocab_size is not None:
        ctx.mark("tokenizer_model", "approximated", f"the vocabulary size is taken from --vocab-size {vocab_size}; "
                                                    "Megatron reads it from the tokenizer itself")
        return vocab_size, f"--vocab-size {vocab_size}"
    ctx.error(f"cannot tell the vocabulary size of tokenizer {kind} {model_path or ''}".rstrip()
              + "; pass --vocab-size N to heteroflow import-megatron (the tokenizer's size before padding)")
    return None, ""
