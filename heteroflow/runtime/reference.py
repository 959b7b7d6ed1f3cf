"""A single-process reference trainer: the whole model on one device, plain torch.optim.AdamW.

It shares the model code and the data order with the distributed runtime but none of its parallel
machinery (no tp, dp, pipeline, remap or our optimizer), so a heterogeneous plan that matches it is
trained correctly.
"""

from __future__ import annotations

import torch

from heteroflow.config import JobConfig
from heteroflow.runtime.lr import learning_rate


def train_reference(job: JobConfig, *, steps: int, data_dir: str, micro_batch_size: int | None = None,
                    init_from: str | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train `steps` steps in fp32 on this process; return the per-step losses and the final weights."""
    from heteroflow.data.builtin import open_train_data
    from heteroflow.models.init import init_weights
    from heteroflow.models.llama import build_stage_model
    from heteroflow.models.moe import set_aux_loss_scale

    train, spec = job.train, job.model
    model = build_stage_model(spec, first_layer=0, last_layer=spec.num_layers, is_first=True, is_last=True)
    init_weights(model, seed=train.seed)
    if init_from is not None:
        from heteroflow.models.hf_checkpoint import load_hf_weights
        load_hf_weights(model, init_from, job_spec=spec)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": train.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps)
    data = open_train_data(job, work_dir=data_dir, steps=steps)
    order = data.order
    mbs = micro_batch_size or train.micro_batch_size
    global_tokens = train.global_batch_size * spec.seq_length
    set_aux_loss_scale(model, step_tokens=global_tokens)  # as the runtime weighs each micro-batch's aux loss
    losses = []
    for step in range(steps):
        indices = order.global_batch(step)
        loss_sum = 0.0
        for start in range(0, len(indices), mbs):
            tokens, labels = data.batch(indices[start:start + mbs])
            loss = model(tokens, labels=labels)
            (loss / global_tokens).backward()
            loss_sum += float(loss.detach())
        if train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, train)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum / global_tokens)
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}
