"""Llama-family stage models and their parallelization, kept apart (torchtitan's pattern).

How the runtime runs one stage on one rank (groups come from backends/, created in one order on all ranks):

    with torch.device("meta"):
        model = build_stage_model(spec, first_layer=a, last_layer=b, is_first=k == 0, is_last=k == last)
    parallelize_stage(model, layout=stage_spec.layout, tp_group=tp_group,     # tp / sp / cp / ep / recompute
                      cp_group=cp_group, ep_group=ep_group, token_group=...)
    materialize(model, device)                                          # keeps shards and ties
    if train.init_from: load_hf_weights(model, job.resolve_path(train.init_from), job_spec=job.model)
    else:               init_weights(model, seed=train.seed)
    opt = DataParallelAdamW(model, dp_group=dp_group, tp_group=tp_group, zero=stage_spec.layout.zero, ...)
    # (ExpertDataParallelAdamW when experts have a layout of their own: experts over expert-dp, the rest over dp)

    per micro-batch (input layout: see parallelize.py; dp rank d holds its contiguous batch share):
      first stage: out = model(token_ids)          else: x.requires_grad_(); out = model(x)
      last stage:  loss_sum = model(x, labels); (loss_sum / global_num_tokens).backward()
      other:       out.backward(received_grad);  send x.grad upstream (the same on every tp rank without sp)

    per step:
      sync_tied_grads(model, group=first_and_last_stage_ranks, tp_rank=..., dp_rank=...)  # if tied across stages
      opt.reduce_grads(); share = opt.grad_sq_norm_share(); all_reduce(share) over the world
      opt.step(lr=lr_t, grad_scale=min(1, clip / (sqrt(total) + 1e-6))); opt.zero_grad()
"""

from heteroflow.models.data_parallel import DataParallelAdamW, all_reduce_partial_grads, sync_tied_grads
from heteroflow.models.hf_checkpoint import HFCheckpoint, check_against, load_hf_weights, model_spec_from_hf_config
from heteroflow.models.init import init_weights, materialize
from heteroflow.models.llama import IGNORE_INDEX, StageModel, build_stage_model, count_tokens, tied_parameter_names
from heteroflow.models.parallelize import parallelize_stage
from heteroflow.models.shard import ParamShard, shard_of

__all__ = [
    "DataParallelAdamW", "HFCheckpoint", "IGNORE_INDEX", "ParamShard", "StageModel",
    "all_reduce_partial_grads", "build_stage_model", "check_against", "count_tokens", "init_weights",
    "load_hf_weights", "materialize", "model_spec_from_hf_config", "parallelize_stage", "shard_of", "sync_tied_grads",
    "tied_parameter_names",
]
