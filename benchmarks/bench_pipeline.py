"""Two-stage pipeline training throughput: heteroflow vs torch.distributed.pipelining vs DeepSpeed.

    python benchmarks/bench_pipeline.py                       # tiny-llama, 8 x 2 samples of 128 tokens
    python benchmarks/bench_pipeline.py --rounds 6 --steps 8 --num-layers 12

One homogeneous layout for all three: pp=2, tp=1, dp=1 (two local CPU processes over gloo, one
stage each, 1 thread each), the same Llama stage modules (heteroflow.models), split at the same
layer, the same seed-initialized weights, fp32, the same micro-batches (count and size), the same
samples in the same order, the same loss normalization (summed token loss / global tokens), global
gradient-norm clipping and AdamW with weight decay on matrices only, at a constant learning rate:
- heteroflow: `run_worker` (1F1B) as `heteroflow train` runs it, its own DataParallelAdamW;
- torch: `PipelineStage` + `Schedule1F1B` over the heteroflow stage models, then clipping and
  `torch.optim.AdamW`;
- deepspeed: `PipelineModule` of `LayerSpec`s (embedding, heteroflow `Block`s, norm + head),
  gradient_accumulation_steps = number of micro-batches, the engine's clipping, `torch.optim.AdamW`.
All three run in the same two processes, in rounds, cycling through the six orders of the three, so
they share the machine's load. In every round each framework is built afresh from the initial weights
(run_worker is a whole training run, so heteroflow has to be; the others are too, to match) and trains
from step 0: warm-up steps (not timed), then timed steps. A step's time is rank 0's wall time from
reading the batch to the end of the optimizer step (every framework syncs the two ranks inside a
step). Tokens/s = global tokens / median step time over all rounds. Same weights and samples in every
round: the three frameworks' losses must agree step for step.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from heteroflow.config import parse_job  # noqa: E402
from heteroflow.testing import run_ranks  # noqa: E402

FRAMEWORKS = ("heteroflow", "torch", "deepspeed")
LR = 1e-3


QUICK = ["--preset", "micro-llama", "--num-layers", "2", "--micro-batches", "2", "--micro-batch-size", "1",
         "--rounds", "1", "--steps", "1", "--loss-steps", "1", "--out", ""]
"""The sizes `--quick` runs (tests/benchmarks/test_quick_modes.py)."""


def make_job(args, *, steps: int):
    """The job and plan every framework trains: two single-device stages on one CPU node."""
    half = args.num_layers // 2
    model = {"preset": args.preset, "num_layers": args.num_layers}
    return parse_job({
        "cluster": {"nodes": [{"name": "cpu-0", "device": "cpu", "count": 2}]},
        "model": model,
        "train": {"global_batch_size": args.micro_batches * args.micro_batch_size,
                  "micro_batch_size": args.micro_batch_size, "precision": "fp32", "steps": steps, "lr": LR,
                  "min_lr": LR, "warmup_steps": 0, "weight_decay": 0.1, "grad_clip": 1.0, "seed": 1234},
        "plan": {"schedule": "1f1b", "micro_batch_size": args.micro_batch_size, "stages": [
            {"devices": ["cpu-0:0"], "layers": half, "tp": 1, "dp": 1},
            {"devices": ["cpu-0:1"], "layers": args.num_layers - half, "tp": 1, "dp": 1}]},
    })


def adamw(params_by_name, train) -> torch.optim.AdamW:
    """torch's AdamW with heteroflow's grouping: weight decay on matrices only."""
    params = [p for _, p in params_by_name]
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": train.weight_decay},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=LR, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps)


def initial_stage_model(job, stage: int):
    """This rank's heteroflow stage model with the seed-only initial weights heteroflow trains from."""
    from heteroflow.models.init import init_weights
    from heteroflow.models.llama import build_stage_model

    first, last = job.plan.layer_ranges()[stage]
    model = build_stage_model(job.model, first_layer=first, last_layer=last, is_first=stage == 0,
                              is_last=stage == len(job.plan.stages) - 1)
    init_weights(model, seed=job.train.seed)
    return model


class Batches:
    """The samples of each step, as heteroflow reads them (the same order for every framework)."""

    def __init__(self, job, data_dir: str):
        from heteroflow.data.builtin import open_train_data
        from heteroflow.data.tokens import SampleOrder

        t = job.train
        self.data = open_train_data(job, work_dir=data_dir)
        self.order = SampleOrder(num_samples=self.data.num_samples, global_batch_size=t.global_batch_size,
                                 seed=t.seed)
        self.mbs = t.micro_batch_size
        self.num_micro_batches = t.global_batch_size // t.micro_batch_size

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        indices = self.order.global_batch(step)
        return [self.data.batch(indices[m * self.mbs:(m + 1) * self.mbs]) for m in range(self.num_micro_batches)]


# ---- heteroflow ---------------------------------------------------------------------------------------------

def heteroflow_round(rank: int, args, data_dir: str, steps: int) -> tuple[list[float], list[float]]:
    """Train `steps` steps from the initial weights with run_worker; (step times, losses) on rank 0."""
    from heteroflow.runtime.metrics import read_step_records
    from heteroflow.runtime.worker import WorkerArgs, run_worker

    job = make_job(args, steps=steps)
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        result = run_worker(WorkerArgs(job=job, plan=job.plan, emulate=True, steps=steps, data_dir=data_dir,
                                       metrics_path=metrics, show_progress=False, timeout_s=300))
        if rank != 0:
            return [], []
        records = read_step_records(Path(metrics))
    return [r["step_time_s"] for r in records], list(result.losses)


# ---- torch.distributed.pipelining -----------------------------------------------------------------------------

class TorchPipeline:
    """PipelineStage + Schedule1F1B over this rank's heteroflow stage model."""

    def __init__(self, rank: int, args, batches: Batches):
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        from heteroflow.models.llama import token_loss_sum

        self.job = job = make_job(args, steps=1)
        self.rank, self.batches, self.dist = rank, batches, dist
        self.model = initial_stage_model(job, rank)
        global_tokens = job.train.global_batch_size * job.model.seq_length

        def loss_fn(logits, labels):  # heteroflow's normalization: summed token loss / global tokens
            return token_loss_sum(logits, labels) / global_tokens

        stage = PipelineStage(self.model, stage_index=rank, num_stages=2, device=torch.device("cpu"))
        self.schedule = Schedule1F1B(stage, n_microbatches=batches.num_micro_batches, loss_fn=loss_fn,
                                     scale_grads=False)
        self.params = [p for p in self.model.parameters()]
        self.optimizer = adamw(self.model.named_parameters(), job.train)

    def step(self, step: int) -> float:
        micro = self.batches.micro_batches(step)
        tokens = torch.cat([t for t, _ in micro])
        labels = torch.cat([lab for _, lab in micro])
        losses: list[torch.Tensor] = []
        if self.rank == 0:
            self.schedule.step(tokens)
        else:
            self.schedule.step(target=labels, losses=losses)
        # Global clipping as heteroflow does it: one all-reduce of the squared norm (and the loss).
        sq = sum(p.grad.pow(2).sum() for p in self.params)
        totals = torch.stack([sq, sum(losses) if losses else torch.zeros(())])
        self.dist.all_reduce(totals)
        norm = float(totals[0]) ** 0.5
        torch.nn.utils.clip_grads_with_norm_(self.params, self.job.train.grad_clip, torch.tensor(norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(totals[1])


# ---- DeepSpeed ------------------------------------------------------------------------------------------------

class DSEmbed(torch.nn.Module):
    """The first pipeline layer: heteroflow's token embedding."""

    def __init__(self, spec):
        super().__init__()
        self.embed = torch.nn.Embedding(spec.vocab_size, spec.hidden_size)

    def forward(self, tokens):
        return self.embed(tokens)


class DSHead(torch.nn.Module):
    """The last pipeline layer: heteroflow's final norm and output head (logits; the loss is loss_fn's)."""

    def __init__(self, spec):
        super().__init__()
        from heteroflow.models.llama import OutputHead, make_norm
        self.norm = make_norm(spec, spec.hidden_size)
        self.head = OutputHead(spec.hidden_size, spec.vocab_size)

    def forward(self, x):
        return self.head(self.norm(x))


class DeepSpeedPipeline:
    """deepspeed.pipe.PipelineModule with the heteroflow layers, driven by engine.train_batch."""

    def __init__(self, rank: int, args, batches: Batches):
        import deepspeed
        from deepspeed.pipe import LayerSpec, PipelineModule

        from heteroflow.models.llama import Block, token_loss_sum

        self.job = job = make_job(args, steps=1)
        spec, train = job.model, job.train
        self.batches = batches
        os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2")  # read by PipelineModule
        deepspeed.init_distributed(dist_backend="gloo")
        tokens_per_micro_batch = train.micro_batch_size * spec.seq_length

        def loss_fn(logits, labels):  # the engine divides by gradient_accumulation_steps: sum / global tokens
            return token_loss_sum(logits, labels) / tokens_per_micro_batch

        layers = [LayerSpec(DSEmbed, spec)] + [LayerSpec(Block, spec) for _ in range(spec.num_layers)]
        layers.append(LayerSpec(DSHead, spec))
        module = PipelineModule(layers=layers, num_stages=2, loss_fn=loss_fn, partition_method="type:Block")
        # Same split as heteroflow: embedding + first half of the blocks, then the rest + head.
        half = job.plan.layer_ranges()[0][1]
        expected = range(0, half + 1) if rank == 0 else range(half + 1, spec.num_layers + 2)
        assert list(range(module._local_start, module._local_stop)) == list(expected), \
            (module._local_start, module._local_stop)
        self._load_heteroflow_weights(module, rank)
        for param in module.parameters():
            # DeepSpeed's fp32 clipping counts a stage's gradients only on model-parallel rank 0 (stage 0
            # here) unless they are marked model-parallel; no parameter is replicated, so count them all.
            param.model_parallel = True
        config = {"train_micro_batch_size_per_gpu": train.micro_batch_size,
                  "gradient_accumulation_steps": batches.num_micro_batches,
                  "train_batch_size": train.global_batch_size, "gradient_clipping": train.grad_clip,
                  "steps_per_print": 1 << 30, "fp16": {"enabled": False}, "bf16": {"enabled": False},
                  "zero_optimization": {"stage": 0}}
        optimizer = adamw(module.named_parameters(), train)
        self.engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)

    def _load_heteroflow_weights(self, module, rank: int) -> None:
        """Copy heteroflow's initial weights into the DeepSpeed layers, mapping the names."""
        source = dict(initial_stage_model(self.job, rank).named_parameters())
        num_layers = self.job.model.num_layers
        with torch.no_grad():
            for name, param in module.named_parameters():
                index, rest = name.split(".", 1)
                index = int(index)
                hf_name = rest if index in (0, num_layers + 1) else f"layers.{index - 1}.{rest}"
                param.copy_(source.pop(hf_name))
        assert not source, f"parameters left unmapped: {sorted(source)}"

    def step(self, step: int) -> float:
        return float(self.engine.train_batch(iter(self.batches.micro_batches(step))))


# ---- the benchmark ----------------------------------------------------------------------------------------------

def _timed_steps(run_step, first_step: int, num_steps: int) -> tuple[list[float], list[float]]:
    times, losses = [], []
    for step in range(first_step, first_step + num_steps):
        started = time.perf_counter()
        losses.append(run_step(step))
        times.append(time.perf_counter() - started)
    return times, losses


def worker(rank: int, world_size: int, args, data_dir: str) -> dict:
    """Every round: each framework is built from the initial weights and trains warm-up + timed steps from
    step 0; returns rank 0's step times and every round's losses."""
    assert torch.get_num_threads() == 1
    batches = Batches(make_job(args, steps=1), data_dir)
    builders = {"torch": TorchPipeline, "deepspeed": DeepSpeedPipeline}
    steps = args.warmup_steps + args.steps
    times: dict[str, list[list[float]]] = {name: [] for name in FRAMEWORKS}
    losses: dict[str, list[list[float]]] = {name: [] for name in FRAMEWORKS}
    orders = list(itertools.permutations(FRAMEWORKS))  # each framework equally often in each position
    for r in range(args.rounds):
        for name in orders[r % len(orders)]:
            torch.set_num_threads(1)  # one thread per rank for every framework, whatever the last one set
            if name == "heteroflow":
                step_times, step_losses = heteroflow_round(rank, args, data_dir, steps)
            else:
                # Rebuilt every round, as run_worker rebuilds heteroflow: a model and optimizer state that
                # stay alive across rounds ran up to ~5% faster than freshly allocated ones here, which
                # would favour whichever framework is built only once.
                runner = builders[name](rank, args, batches)
                step_times, step_losses = _timed_steps(runner.step, 0, steps)
                del runner
            times[name].append(step_times[args.warmup_steps:])
            losses[name].append(step_losses)
    return {"times": times, "losses": losses}


def report(args, result: dict, *, load_before: tuple[float, ...], wall_s: float) -> str:
    """The printed results."""
    import deepspeed

    job = make_job(args, steps=1)
    spec, train = job.model, job.train
    tokens = train.global_batch_size * spec.seq_length
    load = " ".join(f"{v:.2f}" for v in load_before)
    lines = [f"# {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}, shared 2-core machine (other engineers' jobs), "
             f"load average {load} before the run; whole run {wall_s:.0f} s",
             f"pipeline 2 stages x (tp1 dp1), 1F1B, fp32: {args.preset} {spec.num_layers} layers, hidden "
             f"{spec.hidden_size}, ffn {spec.ffn_hidden_size}, vocab {spec.vocab_size}; {args.micro_batches} "
             f"micro-batches x {args.micro_batch_size} samples x {spec.seq_length} tokens = {tokens} tokens/step",
             f"ranks: 2 local processes over gloo, 1 thread each; {args.rounds} rounds, orders cycled; per round "
             f"and framework {args.warmup_steps} warm-up + {args.steps} timed steps; torch {torch.__version__}, "
             f"deepspeed {deepspeed.__version__}"]
    losses = {name: rounds[0][:args.loss_steps] for name, rounds in result["losses"].items()}
    lines.append(f"losses of the first {args.loss_steps} steps (same initial weights, same samples):")
    for name in FRAMEWORKS:
        lines.append(f"  {name:<11}" + "  ".join(f"{v:.6f}" for v in losses[name]))
    ref = losses["heteroflow"][0]
    first = max(abs(losses[n][0] - ref) / ref for n in FRAMEWORKS)
    # Every round starts from the initial weights at step 0 in every framework: all its losses must agree.
    every = max(abs(a - b) / b for rounds in result["losses"].values() for got, want in
                zip(rounds, result["losses"]["heteroflow"]) for a, b in zip(got, want))
    lines.append(f"first-step loss {ref:.6f}: largest relative difference {first:.1e}; over every step of "
                 f"every round {every:.1e}")
    lines.append(f"{'framework':<12}{'tokens/s':>9}{'median s':>10}{'p10 s':>8}   per-round median tokens/s")
    median = {}
    for name in FRAMEWORKS:
        samples = sorted(t for rnd in result["times"][name] for t in rnd)
        median[name] = statistics.median(samples)
        p10 = samples[len(samples) // 10]
        per_round = " ".join(f"{tokens / statistics.median(rnd):.0f}" for rnd in result["times"][name])
        lines.append(f"{name:<12}{tokens / median[name]:>9.0f}{median[name]:>10.3f}{p10:>8.3f}   {per_round}")
    lines.append("(tokens/s from the median step time; p10: the 10th-percentile step time, the steps least disturbed "
                 "by other jobs)")
    for other in ("torch", "deepspeed"):
        paired = statistics.median(statistics.median(o) / statistics.median(h) for h, o in
                                   zip(result["times"]["heteroflow"], result["times"][other]))
        lines.append(f"heteroflow / {other:<10} {median[other] / median['heteroflow']:.3f}x tokens/s "
                     f"(median of per-round ratios {paired:.3f}x)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-llama")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=18, help="a multiple of 6 runs every order equally often")
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round and framework")
    parser.add_argument("--loss-steps", type=int, default=3, help="first-round losses to print")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_pipeline.txt"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (what the test suite runs)")
    args = parser.parse_args()
    if args.quick:  # later arguments still override the quick sizes
        args = parser.parse_args([*QUICK, *(sys.argv[1:])])
    if args.loss_steps > args.warmup_steps + args.steps:
        parser.error("--loss-steps must not exceed --warmup-steps + --steps")
    load_before, started = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as data_dir:
        from heteroflow.data.builtin import open_train_data
        open_train_data(make_job(args, steps=1), work_dir=data_dir)  # written once, as `heteroflow train` does
        results = run_ranks(worker, 2, args, data_dir, timeout_s=900, env={"DS_ACCELERATOR": "cpu"})
    text = (f"$ python benchmarks/{Path(__file__).name} {' '.join(sys.argv[1:])}".rstrip() + "\n"
            + report(args, results[0], load_before=load_before, wall_s=time.perf_counter() - started))
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
