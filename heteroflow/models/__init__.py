"""Llama-family stage models (`llama`), seed-only init (`init`), tp/sp/recompute (`parallelize`),
dp gradient reduction and ZeRO-1 AdamW (`data_parallel`), Hugging Face weights (`hf_checkpoint`)."""

from heteroflow.models.data_parallel import DataParallelAdamW, all_reduce_partial_grads, sync_tied_grads
from heteroflow.models.hf_checkpoint import HFCheckpoint, check_against, load_hf_weights, model_spec_from_hf_config
from heteroflow.models.init import init_weights
from heteroflow.models.llama import IGNORE_INDEX, StageModel, build_stage_model, count_tokens, tied_parameter_names
from heteroflow.models.parallelize import StageLayout, parallelize_stage
from heteroflow.models.shard import ParamShard, shard_of

__all__ = [
    "DataParallelAdamW", "HFCheckpoint", "IGNORE_INDEX", "ParamShard", "StageLayout", "StageModel",
    "all_reduce_partial_grads", "build_stage_model", "check_against", "count_tokens", "init_weights",
    "load_hf_weights", "model_spec_from_hf_config", "parallelize_stage", "shard_of", "sync_tied_grads",
    "tied_parameter_names",
]
