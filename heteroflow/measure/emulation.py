"""What `train --emulate` pays on this host beyond the measured rates: the `emulation` section of a profile.

Measured as a training step meets it:
- `busy_latency_s`: pairs of one-thread processes over gloo that each compute a block's worth of GEMMs between
  all-reduces of an activation-sized buffer (`BUSY_MESSAGE_BYTES`), as the tp ranks of a stage do (the median
  wall time less the buffer's bytes at the idle link's all-reduce bandwidth, per ring step), at 1, 2 and
  4 processes per core (2 and 4 unless quick), every process one of such a pair: an all-reduce then also
  waits for the partner to arrive and to get a core, and the more processes share a core, the longer. The
  other processes block on their partners too, as training ranks do, so the wait is what a training step
  meets (filler processes that compute without pause would make it far longer). The bandwidth stays the idle
  link's (`link.allreduce_gb_per_s`): the wait is per transfer, not per byte;
- `oversubscribed_slowdown`: the CPU time of one-thread forward and backward work units done by the pairs of
  the point-to-point phase below at 2 (and 4, unless quick) processes per core, over the same unit's CPU time
  alone: context switches and caches shared between more processes than cores, as often as training ranks
  switch, every transfer a wake-up (1.0-1.09 at 2 per core over the development machine's profiles, where work
  that runs without pause measured 1.0-1.12: this host's caches barely notice). CPU time, so other jobs' load
  on a shared machine, which only delays the work, does not count; processor sharing prices the delay;
- `thread_speedup`: how much faster one process runs heteroflow's real block with all the host's cores as
  torch threads than with one (`measure.thread.measure_thread_speedup`): what a rank with several threads gets;
- `transfer_cpu_s`: the same pairs, at the same processes per core, alternating bursts of work with a
  point-to-point exchange of the buffer (each rank sends it and receives it, as neighbouring pipeline stages do
  with activations and their gradients): the process's CPU time outside the work (gloo's threads and system
  calls, the wake-ups), per transfer end (a send or a receive). Between processes sharing cores this is core
  time the other ranks cannot compute in (0.5-1.1 ms per end at 2 processes per core over the development
  machine's profiles, 0.2-0.4 ms at 1), which the waits' wall time does not say;
- `tp_block_overhead_s`: the first pair runs heteroflow's decoder blocks at a negligible width as a stage
  runs them (`measure.thread`: the runtime's meter and gradient hooks), parallelized at tp 2 over the pair by
  `models.parallelize.parallelize_stage` and at tp 1, alternately, timed by the runtime's `PartTimer` with its
  collectives timed apart (`models.tp_ops.timing_collectives`), as a training step times them, but in thread CPU
  time (the core the work occupies, which is what the shared-core simulation shares; wall time would add the
  partner's scheduling): what tp adds to a block's forward and backward outside its collectives, per block (the
  median of the rounds' differences).
"""

from __future__ import annotations

import os
import statistics
import time

from heteroflow.errors import UserError
from heteroflow.measure.thread import measure_thread_speedup
from heteroflow.stagemap.profile import EmulationProfile

BUSY_MESSAGE_BYTES = 256 * 1024
"""The buffer of the busy all-reduces: a tiny-llama tp stage's activations (4 x 128 x 128 fp32). Between busy
processes gloo pays far more per message of this size than for one element (a median of 2-3 ms against 0.4 ms
on the development machine, whose idle link moves it in 0.2 ms): that is what a tp step waits."""
LATENCY_REPEATS = 3
"""Repeats of each busy all-reduce phase; a rank reports the median of its repeats' medians."""
TP_ROUNDS = 7
"""Alternated rounds of the tp 2 and tp 1 blocks (3 with --quick)."""
_TP_BLOCKS, _TP_CALLS = 4, 30
"""Blocks of the tp probe's stage, and forward-backward calls per round."""
_WORK_SHAPE = (384, 192, 512)
"""Tokens, hidden and ffn width of the work unit: a small MLP forward and backward (tiny-llama's scale)."""


def measure_emulation(*, quick: bool = False, timeout_s: float = 180.0,
                      allreduce_gb_per_s: float = 0.0) -> EmulationProfile:
    """The `emulation` figures of this host (see the module docstring); `allreduce_gb_per_s`: the idle link's
    all-reduce bandwidth (`LinkProfile`), whose share of the busy all-reduces is not latency."""
    cores = os.cpu_count() or 1
    per_core = (1, 2) if quick else (1, 2, 4)  # processes per core of the busy phases
    # first, while no child process is starting or exiting: a second thread's gain is the first thing load hides
    speedup = ((float(cores), measure_thread_speedup(cores, rounds=2 if quick else 5)),) if cores > 1 else ()
    results = _run_children(max(max(per_core) * cores, 2), _child,
                            (per_core, cores, 8 if quick else 30, 10 if quick else 40, 3 if quick else TP_ROUNDS),
                            timeout_s)
    alone = results[0][1]  # CPU seconds of one work unit
    # One ring step of a two-rank all-reduce is half its time less the bytes, at least a quarter of its time (an idle
    # link bandwidth measured on a shared machine can be too low to subtract whole); the latency and the transfer's
    # CPU (kept positive for the profile's format) never fall with more processes (a quieter period can make a
    # higher level measure less).
    moving = BUSY_MESSAGE_BYTES / (allreduce_gb_per_s * 1e9) if allreduce_gb_per_s > 0 else 0.0
    latency, spent, busy, transfer_cpu, slowdown = 0.0, 1e-7, [], [], []
    for i, k in enumerate(per_core):
        phase = results[:max(2, k * cores)]  # the ranks that took part at k processes per core
        waited = statistics.median(r[0][i] for r in phase)
        latency = max(latency, max(waited - moving, waited / 2) / 2)
        busy.append((float(k), latency))
        spent = max(spent, statistics.median(r[3][i][0] for r in phase))
        transfer_cpu.append((float(k), spent))
        if k > 1:
            slowdown.append((float(k), max(1.0, statistics.median(r[3][i][1] for r in phase) / alone)))
    tp_overhead = tuple(max(0.0, v) for v in results[0][2])  # a difference of two timings can come out below 0
    return EmulationProfile(busy_latency_s=tuple(busy), oversubscribed_slowdown=tuple(slowdown),
                            thread_speedup=speedup, tp_block_overhead_s=tp_overhead,
                            transfer_cpu_s=tuple(transfer_cpu))


def _run_children(n: int, target, args: tuple, timeout_s: float) -> list:
    """Start `n` spawned processes running `target(rank, n, port, queue, barrier, *args)`; their results in
    rank order (a user error when one fails or the whole takes longer than `timeout_s`)."""
    import socket

    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(n)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(rank, n, port, queue, barrier, *args), daemon=True)
             for rank in range(n)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < n:
            rank, value = queue.get(timeout=max(0.1, deadline - time.monotonic()))
            if isinstance(value, str):
                raise UserError(f"emulation measurement failed: {value}")
            results[rank] = value
    except UserError:
        raise
    except Exception:
        raise UserError(f"emulation measurement timed out after {timeout_s:.0f} s") from None
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(n)]


def _work(torch, shapes) -> None:
    """One unit of one-thread work: a small MLP's forward and backward."""
    x, w1, w2 = shapes
    torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(x, w1)), w2).sum().backward()


def _work_tensors(torch):
    tokens, hidden, ffn = _WORK_SHAPE
    return (torch.randn(tokens, hidden), torch.randn(ffn, hidden, requires_grad=True),
            torch.randn(hidden, ffn, requires_grad=True))


def _tp_block_overhead(torch, pair, tp_rounds: int) -> tuple[float, float]:
    """(forward, backward) seconds tp 2 over `pair` adds to one block outside its collectives (see the module
    docstring); called by both ranks of the pair at once."""
    from heteroflow.config.model import ModelSpec
    from heteroflow.devices.facade import NullEvent
    from heteroflow.devices.timing import PartTimer
    from heteroflow.layout import ParallelLayout
    from heteroflow.measure.thread import as_the_runtime_runs
    from heteroflow.models.init import init_weights
    from heteroflow.models.llama import build_stage_model
    from heteroflow.models.parallelize import parallelize_stage
    from heteroflow.models.tp_ops import timing_collectives
    spec = ModelSpec(num_layers=_TP_BLOCKS, hidden_size=16, ffn_hidden_size=16, num_attention_heads=2,
                     num_kv_heads=2, vocab_size=16, seq_length=4)
    stages = {}
    for tp in (1, 2):
        model = build_stage_model(spec, first_layer=0, last_layer=_TP_BLOCKS, is_first=False, is_last=False)
        parallelize_stage(model, layout=ParallelLayout(tp=tp), tp_group=pair if tp > 1 else None)
        init_weights(model, seed=0)
        stages[tp] = (model, as_the_runtime_runs(torch, model))
    x = torch.randn(1, spec.seq_length, spec.hidden_size)
    grad = torch.ones_like(x)

    class ThreadTimeEvent(NullEvent):
        """Records this thread's CPU time instead of the wall clock."""

        def record(self, stream=None) -> None:
            self._recorded_s = time.thread_time()

    timer = PartTimer(lambda enable_timing=False: ThreadTimeEvent())

    def per_block(tp: int) -> tuple[float, float]:
        model, saving = stages[tp]
        with timing_collectives(pair if tp > 1 else None, timer):
            for _ in range(_TP_CALLS):
                inputs = x.clone().requires_grad_()
                with timer.part("forward"), saving():
                    out = model(inputs)
                with timer.part("backward"):
                    out.backward(grad)
        parts = timer.collect()
        return parts["forward"] / (_TP_CALLS * _TP_BLOCKS), parts["backward"] / (_TP_CALLS * _TP_BLOCKS)

    per_block(1), per_block(2)  # warm-up
    added = []
    for _ in range(tp_rounds):  # alternated, so that a disturbed period falls on one round
        one, two = per_block(1), per_block(2)
        added.append((two[0] - one[0], two[1] - one[1]))
    return statistics.median(a[0] for a in added), statistics.median(a[1] for a in added)


def _child(rank: int, n: int, port: int, queue, barrier, per_core: tuple[int, ...], cores: int, rounds: int,
           calls: int, tp_rounds: int) -> None:
    """For each k of `per_core`: ranks 0 .. k x cores - 1 (at least 0 and 1), in pairs (0, 1), (2, 3), ..., time
    all-reduces with their partner between bursts of work, then exchange the buffer with it point to point
    between bursts of work; then ranks 0 and 1 measure what tp adds to a block; then rank 0 times `calls` work
    units alone in CPU time. Ranks outside a phase wait on the barrier, using no core. Reports (median latency
    per phase, CPU seconds of one work unit alone, the tp block overhead, per phase the medians of (CPU seconds
    per transfer end, CPU seconds per work unit) of the point-to-point exchanges)."""
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
        pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(n // 2)]  # every rank creates every group
        pair = pairs[rank // 2] if rank // 2 < len(pairs) else None
        shapes = _work_tensors(torch)
        message = torch.zeros(BUSY_MESSAGE_BYTES // 4)
        _work(torch, shapes)

        def busy_all_reduce() -> float:
            times = []
            for _ in range(rounds):
                for _ in range(2):
                    _work(torch, shapes)
                start = time.perf_counter()
                dist.all_reduce(message, group=pair)
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        def busy_exchange() -> tuple[float, float]:
            """(process CPU seconds outside the work per transfer end, CPU seconds per work unit), over `rounds`
            work-then-exchange rounds."""
            worked, partner = 0.0, rank ^ 1
            start = time.process_time()
            for _ in range(rounds):
                for _ in range(2):
                    began = time.thread_time()
                    _work(torch, shapes)
                    worked += time.thread_time() - began
                if rank % 2 == 0:  # the even rank sends first, so that the two never both wait to receive
                    dist.send(message, partner)
                    dist.recv(message, partner)
                else:
                    dist.recv(message, partner)
                    dist.send(message, partner)
            return (time.process_time() - start - worked) / (2 * rounds), worked / (2 * rounds)

        def cpu_seconds() -> float:
            start = time.thread_time()
            for _ in range(calls):
                _work(torch, shapes)
            return time.thread_time() - start

        latencies = {k: [] for k in per_core}
        exchanges = {k: [] for k in per_core}
        for _ in range(LATENCY_REPEATS):  # the levels interleaved, so that a disturbed period falls on one repeat
            for k in per_core:
                in_phase = rank < max(2, k * cores) and pair is not None
                barrier.wait()
                if in_phase:
                    latencies[k].append(busy_all_reduce())
                barrier.wait()
                if in_phase:
                    exchanges[k].append(busy_exchange())
        latencies = [statistics.median(v) if v else 0.0 for v in latencies.values()]
        exchanges = [(statistics.median(e for e, _ in v), statistics.median(w for _, w in v)) if v else (0.0, 0.0)
                     for v in exchanges.values()]
        barrier.wait()
        tp_overhead = _tp_block_overhead(torch, pairs[0], tp_rounds) if rank < 2 else (0.0, 0.0)
        barrier.wait()
        alone = cpu_seconds() / calls if rank == 0 else 0.0
        barrier.wait()
        dist.destroy_process_group()
        queue.put((rank, (tuple(latencies), alone, tp_overhead, tuple(exchanges))))
    except Exception as exc:  # the parent reports it
        queue.put((rank, f"{type(exc).__name__}: {exc}"))
