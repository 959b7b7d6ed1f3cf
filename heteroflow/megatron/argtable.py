"""Megatron-LM's command-line arguments: name, type, Megatron's default, and what heteroflow does with it.

Names, types and defaults follow `megatron/training/arguments.py`: the hand-written rules below cover the
flags heteroflow maps or has a reason for (plus flags older scripts still use); every other flag of the
current parser comes from `megatron_flags.tsv`, generated from arguments.py at the commit its first line
names (`versions.CURRENT_COMMIT`) and checked against it by tests/megatron/test_megatron_corpus.py. Arguments in the `mapped` group are read by `mapping.py` / `layout.py`,
which decide their disposition from their values; every other group has one reason for all its
members. Model-feature groups (MLA, Mamba, ...) make the import refuse when the feature is on; the MoE group
is mapped by moe.py, which refuses the MoE variants heteroflow cannot represent one by one.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

MAPPED = "mapped"

IGNORED_GROUPS = {
    "logging": "logging, profiling and monitoring only",
    "checkpoint": "Megatron checkpoint files and their format: heteroflow neither reads nor writes them "
                  "(set train.checkpoint, or train.init_from with a Hugging Face checkpoint)",
    "data": "Megatron data-pipeline detail; heteroflow reads --data-path, its blend and --split (train.data)",
    "eval": "validation schedule; a heteroflow job does not evaluate while training",
    "kernel": "kernel or implementation choice: same model, same layout",
    "fp8": "FP8/FP4 execution in Transformer Engine: a kernel precision that does not change the plan; "
           "heteroflow plans and trains in the job's precision",
    "comm": "communication tuning; heteroflow's runtime and cost model decide overlap and buckets",
    "runtime": "process housekeeping (timeouts, garbage collection, memory, restarts)",
    "init": "weight-initialisation detail; heteroflow initialises the model itself",
    "tokenizer": "tokenizer files: only the vocabulary size enters the job",
    "inference": "inference-only option",
    "numerics": "numerical detail of the same model (same shapes, same cost)",
    "deprecated": "deprecated Megatron flag without effect",
    "optimizer_extra": "used only by an optimizer other than Adam",
    "other_models": "used only by BERT, T5, vision or retrieval models",
}
FEATURE_GROUPS = {
    "moe": "mixture-of-experts",
    "mla": "multi-latent attention",
    "hybrid": "Mamba / hybrid state-space layers",
    "mtp": "multi-token prediction",
    "retro": "Retro retrieval-augmented layers",
    "heterogeneous": "heterogeneous per-layer block configs",
    "rl": "reinforcement-learning (GRPO) training step",
}
# Unknown flags with these prefixes still belong to a group (forks add --moe-* flags all the time).
PREFIX_GROUPS = (("--moe-", "moe"), ("--inference-", "inference"), ("--inprocess-", "runtime"),
                 ("--retro-", "retro"), ("--grpo-", "rl"), ("--rl-", "rl"), ("--langrl-", "rl"),
                 ("--muon-", "optimizer_extra"), ("--mamba-", "hybrid"), ("--hybrid-", "hybrid"),
                 ("--fp8-", "fp8"), ("--fp4-", "fp8"), ("--wandb-", "logging"), ("--tensorboard-", "logging"),
                 ("--log-", "logging"), ("--ckpt-", "checkpoint"), ("--dist-ckpt-", "checkpoint"),
                 ("--tp-comm-", "comm"), ("--ddp-", "comm"), ("--cuda-graph", "kernel"),
                 ("--straggler", "logging"), ("--one-logger", "logging"), ("--profile", "logging"))


@dataclass(frozen=True, slots=True)
class ArgDef:
    """One Megatron argument."""

    flag: str
    dest: str
    kind: str
    """true / false (store_true / store_false), int, float, str, bool, or list (nargs)."""
    default: object
    group: str
    choices: tuple[str, ...] = ()
    elem: str = "str"
    """Element type of a list."""
    nargs: str = "+"
    """`+` (at least one value) or `*` for lists."""
    reason: str = ""
    """Overrides the group's reason."""

    @property
    def takes_value(self) -> bool:
        """Whether the flag is followed by values."""
        return self.kind not in ("true", "false")


TABLE: dict[str, ArgDef] = {}


def _add(group: str, kind: str, *flags: str, default: object = None, dest: str | None = None,
         choices: tuple[str, ...] = (), elem: str = "str", nargs: str = "+", reason: str = "") -> None:
    name = dest or flags[0][2:].replace("-", "_")
    if kind == "false" and default is None:
        default = True
    if kind == "true" and default is None:
        default = False
    for flag in flags:
        assert flag not in TABLE, flag
        TABLE[flag] = ArgDef(flag, name, kind, default, group, choices, elem, nargs, reason)


def _many(group: str, kind: str, *flags: str) -> None:
    for flag in flags:
        _add(group, kind, flag)


# -- network size (mapped) -----------------------------------------------------------------------
_add(MAPPED, "int", "--num-layers")
_add(MAPPED, "int", "--encoder-num-layers")
_add("other_models", "int", "--decoder-num-layers")
_add(MAPPED, "int", "--hidden-size")
_add(MAPPED, "int", "--ffn-hidden-size")
_add(MAPPED, "int", "--num-attention-heads")
_add(MAPPED, "int", "--kv-channels")
_add(MAPPED, "true", "--group-query-attention")
_add(MAPPED, "int", "--num-query-groups", default=1)
_add(MAPPED, "str", "--softmax-type", default="vanilla", choices=("learnable", "vanilla", "off-by-one"))
_add(MAPPED, "str", "--window-size")
_add(MAPPED, "str", "--window-attn-skip-freq")
_add(MAPPED, "int", "--max-position-embeddings")
_add(MAPPED, "str", "--position-embedding-type", default="learned_absolute",
     choices=("learned_absolute", "rope", "mrope", "relative", "none"))
_add(MAPPED, "true", "--use-rotary-position-embeddings")
_add(MAPPED, "int", "--rotary-base", default=10000)
_add(MAPPED, "float", "--rotary-percent", default=1.0)
_add("numerics", "true", "--rotary-interleaved",
     reason="pairing of rotary dimensions: a fixed permutation of the head dimension, same model class and cost")
_add(MAPPED, "int", "--rotary-seq-len-interpolation-factor")
_add(MAPPED, "true", "--use-rope-scaling")
_add(MAPPED, "float", "--rope-scaling-factor", default=8.0)
_add(MAPPED, "str", "--rope-type", choices=("rope", "yarn"))
_add(MAPPED, "str", "--no-rope-freq")
_add(MAPPED, "false", "--no-position-embedding", dest="add_position_embedding")
_add("other_models", "list", "--mrope-section", elem="int")
_add(MAPPED, "int", "--make-vocab-size-divisible-by", default=128)
_add(MAPPED, "str", "--normalization", default="LayerNorm", choices=("LayerNorm", "RMSNorm"))
_add(MAPPED, "float", "--norm-epsilon", "--layernorm-epsilon", default=1e-5, dest="norm_epsilon")
_add("numerics", "true", "--apply-layernorm-1p",
     reason="stores the norm weight as (gamma - 1): a re-parametrisation of the same model")
_add(MAPPED, "true", "--apply-residual-connection-post-layernorm")
_add("numerics", "true", "--openai-gelu", reason="tanh approximation of GELU: same model and cost")
_add(MAPPED, "true", "--squared-relu")
_add(MAPPED, "true", "--swiglu")
_add(MAPPED, "true", "--quick-geglu")
_add(MAPPED, "float", "--activation-func-clamp-value")
_add(MAPPED, "float", "--glu-linear-offset", default=0.0)
_add("kernel", "bool", "--onnx-safe")
_add("other_models", "false", "--bert-no-binary-head", dest="bert_binary_head")
_add(MAPPED, "true", "--untie-embeddings-and-output-weights")
_add(MAPPED, "true", "--multi-latent-attention")
_add(MAPPED, "int", "--mtp-num-layers")
_add("mtp", "float", "--mtp-loss-scaling-factor", default=0.1)
_add(MAPPED, "true", "--qk-layernorm")
_add(MAPPED, "true", "--qk-l2-norm")
_add(MAPPED, "list", "--spec", elem="str", nargs="*")  # a module and a spec name: `--spec MODULE NAME`
_add(MAPPED, "true", "--use-mup")
_many("init", "float", "--mup-width-mult", "--mup-embedding-mult", "--mup-output-mult", "--mup-base-head-dim",
      "--mup-attn-scale-power")
_many("init", "int", "--mup-base-hidden-size")
_add(MAPPED, "true", "--attention-output-gate")
_add(MAPPED, "str", "--experimental-attention-variant")
_add(MAPPED, "str", "--hybrid-layer-pattern")
_add(MAPPED, "float", "--attention-dropout", default=0.1)
_add(MAPPED, "float", "--hidden-dropout", default=0.1)
_add(MAPPED, "false", "--disable-bias-linear", dest="add_bias_linear")
_add(MAPPED, "true", "--add-qkv-bias")
_add("numerics", "true", "--no-query-key-layer-scaling",
     reason="older spelling; query-key layer scaling is a numerically equivalent rescaling")

# -- regularization and optimizer (mapped) -------------------------------------------------------
_add(MAPPED, "float", "--weight-decay", default=0.01)
_add(MAPPED, "float", "--start-weight-decay")
_add(MAPPED, "float", "--end-weight-decay")
_add(MAPPED, "str", "--weight-decay-incr-style", default="constant", choices=("constant", "linear", "cosine"))
_add(MAPPED, "float", "--clip-grad", default=1.0)
_add(MAPPED, "float", "--adam-beta1", default=0.9)
_add(MAPPED, "float", "--adam-beta2", default=0.999)
_add(MAPPED, "float", "--adam-eps", default=1e-8)
_add(MAPPED, "str", "--optimizer", default="adam", choices=("adam", "sgd", "muon", "dist_muon"))
_add("optimizer_extra", "float", "--sgd-momentum", default=0.9)
_add(MAPPED, "true", "--optimizer-cpu-offload")
_add(MAPPED, "float", "--optimizer-offload-fraction", default=1.0)
_add(MAPPED, "true", "--use-precision-aware-optimizer")
for _flag in ("--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype"):
    _add(MAPPED, "str", _flag, default="fp32")
_many("kernel", "true", "--use-torch-optimizer-for-cpu-offload")
_many("comm", "true", "--overlap-cpu-optimizer-d2h-h2d")

# -- training (mapped) ---------------------------------------------------------------------------
_add(MAPPED, "int", "--micro-batch-size")
_add(MAPPED, "int", "--global-batch-size")
_add(MAPPED, "int", "--batch-size")
_add(MAPPED, "list", "--rampup-batch-size", nargs="*")
_add(MAPPED, "int", "--train-iters")
_add(MAPPED, "int", "--train-samples")
_add(MAPPED, "int", "--seed", default=1234)
_add(MAPPED, "true", "--fp16")
_add(MAPPED, "true", "--bf16")
_add(MAPPED, "true", "--recompute-activations")
_add(MAPPED, "true", "--checkpoint-activations")
_add(MAPPED, "str", "--recompute-granularity", choices=("full", "selective"))
_add(MAPPED, "str", "--recompute-method", choices=("uniform", "block"))
_add(MAPPED, "int", "--recompute-num-layers")
_add(MAPPED, "list", "--recompute-modules", nargs="*")
_add(MAPPED, "true", "--distribute-saved-activations")
_add(MAPPED, "int", "--cpu-offloading-num-layers", default=0)
_add(MAPPED, "true", "--sft")
_add(MAPPED, "true", "--perform-rl-step")

# -- learning rate (mapped) ----------------------------------------------------------------------
_add(MAPPED, "float", "--lr")
_add(MAPPED, "str", "--lr-decay-style", default="linear",
     choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"))
_add(MAPPED, "str", "--lr-wsd-decay-style", default="exponential")
_add(MAPPED, "int", "--lr-decay-iters")
_add(MAPPED, "int", "--lr-decay-samples")
_add(MAPPED, "int", "--lr-wsd-decay-samples")
_add(MAPPED, "int", "--lr-wsd-decay-iters")
_add(MAPPED, "float", "--lr-warmup-fraction")
_add(MAPPED, "int", "--lr-warmup-iters", default=0)
_add(MAPPED, "int", "--lr-warmup-samples", default=0)
_add(MAPPED, "float", "--lr-warmup-init", default=0.0)
_add(MAPPED, "int", "--warmup")
_add(MAPPED, "float", "--min-lr", default=0.0)
_add(MAPPED, "float", "--decoupled-lr")
_add(MAPPED, "float", "--decoupled-min-lr")
_add("checkpoint", "true", "--override-opt-param-scheduler", "--override-opt_param-scheduler")
_add("checkpoint", "true", "--use-checkpoint-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler")

# -- parallelism (mapped) ------------------------------------------------------------------------
_add(MAPPED, "int", "--tensor-model-parallel-size", default=1)
_add(MAPPED, "int", "--pipeline-model-parallel-size", default=1)
_add(MAPPED, "int", "--context-parallel-size", default=1)
_add(MAPPED, "int", "--model-parallel-size")
_add(MAPPED, "true", "--sequence-parallel")
_add(MAPPED, "int", "--decoder-first-pipeline-num-layers")
_add(MAPPED, "int", "--decoder-last-pipeline-num-layers")
_add(MAPPED, "str", "--pipeline-model-parallel-layout")
_add(MAPPED, "true", "--account-for-embedding-in-pipeline-split")
_add(MAPPED, "true", "--account-for-loss-in-pipeline-split")
_add(MAPPED, "true", "--standalone-embedding-stage")
_add(MAPPED, "int", "--num-layers-per-virtual-pipeline-stage")
_add(MAPPED, "int", "--num-virtual-stages-per-pipeline-rank")
_add(MAPPED, "true", "--use-distributed-optimizer")
_add(MAPPED, "int", "--num-distributed-optimizer-instances", default=1)
_add(MAPPED, "true", "--use-torch-fsdp2")
_add(MAPPED, "false", "--torch-fsdp2-no-reshard-after-forward", dest="torch_fsdp2_reshard_after_forward")
_add(MAPPED, "true", "--use-megatron-fsdp", "--use-custom-fsdp", dest="use_megatron_fsdp")
_add(MAPPED, "str", "--data-parallel-sharding-strategy", default="no_shard",
     choices=("no_shard", "optim", "optim_grads", "optim_grads_params"))
_add(MAPPED, "true", "--use-tp-pp-dp-mapping")
_add(MAPPED, "true", "--tp-comm-overlap")
_add(MAPPED, "true", "--overlap-grad-reduce")
_add(MAPPED, "true", "--overlap-param-gather")
_add(MAPPED, "int", "--expert-model-parallel-size", default=1)
_add(MAPPED, "int", "--expert-tensor-parallel-size")

# -- tokenizer and data (mapped) -----------------------------------------------------------------
_add(MAPPED, "int", "--vocab-size")
_add(MAPPED, "int", "--padded-vocab-size")
_add(MAPPED, "int", "--vocab-extra-ids", default=0)
_add(MAPPED, "str", "--tokenizer-type", choices=(
    "BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "Llama3Tokenizer", "TikTokenizer",
    "MultimodalTokenizer", "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer"))
_add(MAPPED, "str", "--tokenizer-model")
_add(MAPPED, "int", "--seq-length")
_add(MAPPED, "int", "--encoder-seq-length")
_add(MAPPED, "list", "--data-path", nargs="*")
_add(MAPPED, "list", "--train-data-path", nargs="*")
_add(MAPPED, "true", "--mock-data")
_add(MAPPED, "str", "--yaml-cfg")
_add(MAPPED, "int", "--num-experts")
_add(MAPPED, "true", "--is-hybrid-model")
_add(MAPPED, "str", "--hybrid-override-pattern")
_add(MAPPED, "true", "--retro-add-retriever")
_add("heterogeneous", "str", "--heterogeneous-layers-config-path")
_add("heterogeneous", "str", "--heterogeneous-layers-config-encoded-json")
_add("tokenizer", "str", "--vocab-file")
_add("tokenizer", "str", "--merge-file")
_add("tokenizer", "str", "--tokenizer-metadata")
_add("tokenizer", "str", "--tiktoken-pattern")
_add("tokenizer", "int", "--tiktoken-num-special-tokens", default=1000)
_add("tokenizer", "list", "--tiktoken-special-tokens")
_many("tokenizer", "true", "--legacy-tokenizer", "--trust-remote-code")
for _flag in ("--valid-data-path", "--test-data-path"):
    _add("eval", "list", _flag, nargs="*")
_many("data", "str", "--split", "--data-args-path", "--per-split-data-args-path", "--data-cache-path",
      "--dataloader-type", "--object-storage-cache-path", "--data-impl")
_many("data", "int", "--num-workers", "--num-dataset-builder-threads")
_many("data", "float", "--mid-level-dataset-surplus")
_many("data", "true", "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss",
      "--allow-ambiguous-pad-tokens", "--no-mmap-bin-files", "--no-create-attention-mask-in-dataloader")
_many("other_models", "int", "--decoder-seq-length", "--retriever-seq-length", "--ict-head-size",
      "--biencoder-projection-dim", "--num-classes", "--img-h", "--img-w", "--num-channels", "--patch-dim")
_many("other_models", "float", "--sample-rate", "--mask-prob", "--short-seq-prob")
_many("other_models", "true", "--vision-pretraining", "--biencoder-shared-query-context-model")

# -- fixed groups --------------------------------------------------------------------------------
_many("eval", "int", "--eval-iters", "--eval-interval")
_many("eval", "true", "--full-validation", "--multiple-validation-sets", "--test-mode", "--skip-train")
_many("checkpoint", "str", "--save", "--load", "--pretrained-checkpoint", "--non-persistent-ckpt-type",
      "--non-persistent-global-ckpt-dir", "--non-persistent-local-ckpt-dir", "--non-persistent-local-ckpt-algo",
      "--dist-ckpt-format", "--ckpt-format", "--ckpt-convert-format", "--ckpt-convert-save",
      "--dist-ckpt-strictness")
_add("checkpoint", "int", "--save-interval", "--persistent-save-interval")
_many("checkpoint", "int", "--save-retain-interval", "--non-persistent-save-interval", "--ckpt-step",
      "--replication-jump", "--replication-factor")
_many("checkpoint", "true", "--no-save-optim", "--no-save-rng", "--no-load-optim", "--load-main-params-from-ckpt",
      "--no-load-rng", "--no-strict-fsdp-dtensor-load", "--finetune", "--no-initialization",
      "--use-checkpoint-args", "--use-mp-args-from-checkpoint-args",
      "--no-use-tokenizer-model-from-checkpoint-args", "--exit-on-missing-checkpoint", "--use-dist-ckpt",
      "--use-persistent-ckpt-worker", "--auto-detect-ckpt-format", "--ckpt-convert-update-legacy-dist-opt-format",
      "--ckpt-fully-parallel-save", "--no-ckpt-fully-parallel-save", "--async-save", "--ckpt-fully-parallel-load",
      "--ckpt-assume-constant-structure", "--dist-ckpt-save-pre-mcore-014", "--dist-ckpt-optim-fully-reshardable",
      "--distrib-optim-fully-reshardable-mem-efficient", "--replication")
_add(MAPPED, "int", "--tensorboard-log-interval", default=1)
_add(MAPPED, "str", "--tensorboard-dir")
_many("logging", "int", "--log-interval", "--timing-log-level",
      "--tensorboard-queue-size", "--logging-level", "--profile-step-start", "--profile-step-end",
      "--straggler-ctrlr-port", "--straggler-minmax-count")
_many("logging", "str", "--timing-log-option", "--wandb-project", "--wandb-entity",
      "--wandb-exp-name", "--wandb-save-dir", "--one-logger-project", "--one-logger-run-name",
      "--app-tag-run-name", "--app-tag-run-version", "--config-logger-dir", "--memory-snapshot-path",
      "--result-rejected-tracker-filename")
_many("logging", "list", "--profile-ranks", "--iterations-to-skip")
_many("logging", "true", "--log-params-norm", "--log-num-zeros-in-grad", "--log-throughput", "--log-progress",
      "--log-energy", "--no-barrier-with-level-1-timing", "--log-timers-to-tensorboard",
      "--no-log-loss-scale-to-tensorboard", "--log-loss-scale-to-tensorboard", "--log-validation-ppl-to-tensorboard",
      "--log-memory-to-tensorboard", "--log-world-size-to-tensorboard", "--log-straggler",
      "--disable-straggler-on-startup", "--run-workload-inspector-server", "--no-one-logger", "--one-logger-async",
      "--enable-ft-package", "--calc-ft-timeouts", "--profile", "--use-pytorch-profiler", "--record-memory-history",
      "--log-batch-size-to-tensorboard", "--log-learning-rate-to-tensorboard")
_many("kernel", "str", "--attention-backend", "--transformer-impl", "--cross-entropy-fusion-impl",
      "--cuda-graph-impl", "--cuda-graph-scope")
_many("kernel", "int", "--cuda-graph-warmup-steps")
_many("kernel", "true", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
      "--use-fused-weighted-squared-relu", "--no-bias-dropout-fusion", "--no-rope-fusion",
      "--cross-entropy-loss-fusion", "--use-flash-attn", "--no-persist-layer-norm",
      "--no-gradient-accumulation-fusion", "--use-legacy-models", "--use-te-activation-func", "--te-rng-tracker",
      "--enable-cuda-graph", "--external-cuda-graph", "--use-fused-rmsnorm", "--use-fused-swiglu",
      "--use-fused-rotary-pos-emb", "--masked-softmax-fusion", "--bias-gelu-fusion", "--bias-dropout-fusion")
_many("fp8", "str", "--fp8-format", "--fp8-recipe", "--fp8-quantizer-factory", "--fp8-amax-compute-algo",
      "--fp4-format", "--fp4-recipe", "--fp4-quantizer-factory")
_many("fp8", "int", "--fp8-margin", "--fp8-interval", "--fp8-amax-history-len", "--num-layers-at-start-in-bf16",
      "--num-layers-at-end-in-bf16")
_many("fp8", "true", "--no-fp8-wgrad", "--fp8-param-gather", "--first-last-layers-bf16", "--fp4-param-gather",
      "--fp8-e4m3", "--fp8-hybrid", "--keep-fp8-transpose-cache", "--reuse-grad-buf-for-mxfp8-param-ag")
_many("comm", "str", "--distributed-backend", "--tp-comm-overlap-cfg", "--tp-comm-bootstrap-backend",
      "--pipeline-model-parallel-comm-backend", "--sharp-enabled-group", "--nccl-communicator-config-path",
      "--DDP-impl")
_many("comm", "int", "--wgrad-deferral-limit", "--ddp-num-buckets", "--ddp-bucket-size",
      "--suggested-communication-unit-size", "--microbatch-group-size-per-virtual-pipeline-stage")
_many("comm", "list", "--cp-comm-type", "--hierarchical-context-parallel-sizes", "--high-priority-stream-groups")
_many("comm", "true", "--disable-tp-comm-overlap-ag", "--disable-tp-comm-overlap-rs", "--tp-comm-overlap-rs-dgrad",
      "--disable-tp-comm-bulk-dgrad", "--disable-tp-comm-bulk-wgrad", "--disable-tp-comm-split-ag",
      "--disable-tp-comm-split-rs", "--no-overlap-p2p-communication", "--overlap-p2p-communication-warmup-flush",
      "--defer-embedding-wgrad-compute", "--no-align-grad-reduce", "--ddp-pad-buckets-for-high-nccl-busbw",
      "--ddp-reduce-scatter-with-fp32-accumulation", "--ddp-average-in-collective",
      "--overlap-param-gather-with-optimizer-step", "--no-align-param-gather",
      "--no-scatter-gather-tensors-in-pipeline", "--use-ring-exchange-p2p", "--use-nccl-ub",
      "--disable-symmetric-registration", "--use-sharp", "--no-gradient-reduce-div-fusion", "--fsdp-double-buffer",
      "--enable-full-sharding-in-hsdp", "--grad-reduce-in-bf16", "--disable-gloo-process-groups",
      "--delay-wgrad-compute", "--overlap-moe-expert-parallel-comm", "--use-mc2")
_many("runtime", "int", "--exit-interval", "--exit-duration-in-mins", "--empty-unused-memory-level",
      "--check-weight-hash-across-dp-replicas-interval", "--train-sync-interval", "--manual-gc-interval",
      "--distributed-timeout-minutes", "--distributed-timeout-seconds-after-init", "--local-rank",
      "--adlr-autoresume-interval", "--error-injection-rate")
_many("runtime", "str", "--error-injection-type", "--rerun-mode")
_many("runtime", "bool", "--lazy-mpu-init")
_many("runtime", "true", "--exit-signal-handler", "--no-check-for-nan-in-loss-and-grad", "--check-for-spiky-loss",
      "--check-for-large-grads", "--decrease-batch-size-if-needed", "--no-clone-scatter-output-in-embedding",
      "--deterministic-mode", "--manual-gc", "--no-manual-gc-eval", "--no-pin-cpu-grads", "--no-pin-cpu-params",
      "--adlr-autoresume", "--enable-experimental", "--init-model-with-meta-device", "--enable-msc",
      "--disable-msc", "--inprocess-restart")
_many("init", "float", "--init-method-std", "--embedding-init-method-std")
_many("init", "true", "--data-parallel-random-init", "--init-method-xavier-uniform", "--use-cpu-initialization")
_add(MAPPED, "float", "--loss-scale")
_add(MAPPED, "float", "--initial-loss-scale", default=2.0**32)
_add(MAPPED, "float", "--min-loss-scale", default=1.0)
_add(MAPPED, "float", "--loss-scale-window", default=1000.0)
_add(MAPPED, "int", "--hysteresis", default=2)
_many("numerics", "true", "--fp32-residual-connection", "--apply-query-key-layer-scaling",
      "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32", "--fp16-lm-cross-entropy",
      "--disable-bf16-reduced-precision-matmul")
_add("numerics", "true", "--calculate-per-token-loss",
     reason="loss normalised over non-padded tokens: the same loss on packed pretraining sequences")
_many("deprecated", "true", "--use-mcore-models", "--no-async-tensor-model-parallel-allreduce")
_many("inference", "int", "--max-tokens-to-oom", "--mlp-chunks-for-prefill")
_many("inference", "true", "--output-bert-embeddings", "--flash-decode", "--use-legacy-static-engine",
      "--nccl-all-reduce-for-prefill", "--disable-chunked-prefill", "--decode-only-cuda-graphs",
      "--inference-rng-tracker")
_many("inference", "str", "--bert-embedder-type", "--symmetric-ar-type")
_many("optimizer_extra", "float", "--muon-momentum", "--muon-extra-scale-factor")

# -- feature groups: on only when their switch is on (see features.py) ----------------------------
# Mixture of experts (`--num-experts`): read by moe.py, with Megatron's defaults and choices
# (TransformerConfig's MoE fields, which arguments.py turns into flags).
_add("moe", "int", "--moe-ffn-hidden-size")
_add("moe", "int", "--moe-shared-expert-intermediate-size")
_add("moe", "int", "--moe-router-topk", default=2)
_many("moe", "int", "--moe-router-num-groups", "--moe-router-group-topk", "--moe-router-topk-limited-devices",
      "--moe-deepep-num-sms", "--moe-latent-size")
_add("moe", "int", "--moe-upcycling-granularity", default=1)
_add("moe", "str", "--moe-layer-freq", default=1)
_add("moe", "str", "--moe-router-dtype", choices=("fp32", "fp64"))
_add("moe", "str", "--moe-router-score-function", default="softmax", choices=("softmax", "sigmoid", "sqrtsoftplus"))
_add("moe", "str", "--moe-token-dispatcher-type", default="allgather", choices=("allgather", "alltoall", "flex"))
_add("moe", "str", "--moe-token-drop-policy", default="probs", choices=("probs", "position"))
_add("moe", "list", "--moe-router-load-balancing-type", default="aux_loss",
     choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none"))
_add("moe", "list", "--moe-aux-loss-coeff", default=0.0, elem="float")
_many("moe", "float", "--moe-router-topk-scaling-factor", "--moe-z-loss-coeff", "--moe-input-jitter-eps",
      "--moe-expert-capacity-factor", "--moe-router-force-biased", "--moe-expert-rank-capacity-factor")
_add("moe", "float", "--moe-router-bias-update-rate", default=1e-3)
_many("moe", "true", "--moe-shared-expert-overlap", "--moe-shared-expert-gate", "--moe-grouped-gemm",
      "--moe-use-legacy-grouped-gemm", "--moe-layer-recompute", "--moe-extended-tp", "--moe-use-upcycling",
      "--moe-router-fusion", "--moe-router-pre-softmax", "--moe-router-enable-expert-bias",
      "--moe-router-force-load-balancing", "--moe-router-padding-for-fp8", "--moe-per-layer-logging",
      "--moe-enable-deepep", "--moe-permute-fusion", "--moe-pad-expert-input-to-capacity",
      "--moe-apply-probs-on-input", "--moe-pad-experts-for-cuda-graph-inference", "--moe-token-dropping")
_many("mla", "int", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim")
_many("mla", "float", "--rotary-scaling-factor", "--mscale", "--mscale-all-dim")
_many("mla", "true", "--cache-mla-latents")
_many("hybrid", "float", "--hybrid-attention-ratio", "--hybrid-mlp-ratio")
_many("hybrid", "int", "--mamba-state-dim", "--mamba-head-dim", "--mamba-num-groups", "--mamba-num-heads")
_many("hybrid", "true", "--disable-mamba-mem-eff-path")
_many("retro", "str", "--retro-project-dir")
_many("retro", "int", "--retro-cyclic-train-iters", "--retro-encoder-layers", "--retro-num-neighbors",
      "--retro-num-retrieved-chunks")
_many("retro", "float", "--retro-encoder-hidden-dropout", "--retro-encoder-attention-dropout",
      "--retro-attention-gate")
_many("retro", "true", "--retro-no-verify-neighbor-count")
_many("rl", "int", "--grpo-prompts-per-step", "--grpo-group-size", "--grpo-iterations", "--rl-prompts-per-eval")

# -- Megatron-DeepSpeed (the DeepSpeed fork of Megatron-LM) ----------------------------------------
_add(MAPPED, "true", "--deepspeed")
_add(MAPPED, "int", "--zero-stage", default=1)
_add("runtime", "str", "--deepspeed_config", "--deepspeed-config", dest="deepspeed_config",
     reason="DeepSpeed's JSON config is not read: batch, ZeRO and precision come from the Megatron arguments")
_add("kernel", "true", "--deepspeed-activation-checkpointing",
     reason="DeepSpeed's implementation of the recompute --checkpoint-activations asks for")
_add("deprecated", "true", "--no-pipeline-parallel",
     reason="Megatron-DeepSpeed without its pipeline engine: with pp = 1 the same layout")

FEATURE_SWITCHES = {
    "moe": "--num-experts", "mla": "--multi-latent-attention", "hybrid": "--is-hybrid-model",
    "mtp": "--mtp-num-layers", "retro": "--retro-add-retriever", "rl": "--perform-rl-step",
    "heterogeneous": "--heterogeneous-layers-config-path",
}
"""The argument that turns each feature group on."""


def lookup(flag: str) -> ArgDef | None:
    """The table entry for `flag`, or None when heteroflow does not know it."""
    return TABLE.get(flag)


def group_of_unknown(flag: str) -> str | None:
    """The group an unknown flag belongs to by its prefix (`--moe-*` is MoE), or None."""
    for prefix, group in PREFIX_GROUPS:
        if flag.startswith(prefix):
            return group
    return None


def by_dest() -> dict[str, ArgDef]:
    """One entry per destination (the first flag spelling)."""
    out: dict[str, ArgDef] = {}
    for definition in TABLE.values():
        out.setdefault(definition.dest, definition)
    return out


MEGATRON_FLAGS_FILE = Path(__file__).with_name("megatron_flags.tsv")
"""Every flag of Megatron-LM's current parser, generated from its arguments.py by tools/megatron_flag_table.py."""
UNMAPPED = "megatron_unmapped"


def _read_flag_file(path: Path) -> tuple[str, list[ArgDef]]:
    """The commit line and the flags of the generated table."""
    lines = path.read_text(encoding="utf-8").splitlines()
    header, rows = lines[0], [line.split("\t") for line in lines[1:] if line.strip()]
    out = []
    for flag, dest, kind, default in rows:
        try:
            value = ast.literal_eval(default)
        except (ValueError, SyntaxError):
            value = None  # a computed default: the table has `?`
        out.append(ArgDef(flag, dest, kind, value, group_of_unknown(flag) or UNMAPPED, nargs="*"))
    return header, out


MEGATRON_FLAGS_HEADER, MEGATRON_FLAGS = _read_flag_file(MEGATRON_FLAGS_FILE)
for _definition in MEGATRON_FLAGS:
    if _definition.flag not in TABLE:
        # A current Megatron flag heteroflow has no rule for: known by name, type and default.
        TABLE[_definition.flag] = _definition
