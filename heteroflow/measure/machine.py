"""This machine's profile, the measurements behind `heteroflow profile` (imports torch lazily):

- GEMM throughput of square n x n x n matmuls over sizes and dtypes, on the local device (the first
  accelerator `heteroflow.devices` finds, through its `Device` facade; the CPU when there is none);
- device memory bandwidth (a large copy) and the device-host link (pinned copies; the same copy on CPU);
- the cost of one small kernel (launch and dispatch overhead);
- one host CPU thread running heteroflow's code (`cpu_thread`, what an emulated rank uses; see
  `measure.thread`);
- the link between two local processes over the backend in use (gloo on CPU; nccl or hccl with two of the
  vendor's devices), in a child process pair on a free port, with a timeout (fastest round trips: waiting for
  a core is not the link);
- sequential disk write and read with O_DIRECT (aligned buffers), falling back to fsync + dropping the
  page cache where the file system refuses O_DIRECT (the profile says which);
- on a CPU host, what emulated ranks pay beyond those rates (`emulation`: all-reduces between busy processes,
  more processes than cores; see `measure.emulation`).
"""

from __future__ import annotations

import mmap
import os
import socket
import tempfile
import time

from heteroflow.config.catalog import CATALOG
from heteroflow.devices import Device, LocalDevice, probe_local_devices
from heteroflow.errors import UserError
from heteroflow.measure.emulation import measure_emulation
from heteroflow.measure.thread import measure_cpu_thread
from heteroflow.measure.timing import PROFILE_DTYPES, square_gemm_tflops, time_calls
from heteroflow.stagemap.profile import DeviceProfile, DiskProfile, HostProfile, LinkProfile, Profile


def measure_profile(*, quick: bool = False, device_type: str | None = None, disk_dir: str | None = None,
                    link: bool = True, link_timeout_s: float = 60.0) -> Profile:
    """Measure this machine's first accelerator (CUDA, ROCm or Ascend, as `devices` probes them), or its CPU
    when it has none. `quick` uses small sizes (seconds, for tests)."""
    import torch
    found = probe_local_devices()
    local = found[0]  # accelerators come first; the CPU is always last
    device = Device.from_local(local)
    accelerator = device.kind != "cpu"
    dtype_name, vendor = _device_type(device_type, local)
    sizes = (64, 128, 256) if quick else (256, 512, 1024, 2048, 4096) if accelerator else (128, 256, 512, 1024, 2048)
    budget = 0.02 if quick else 0.25
    device.set_current()
    gemm = {prec: tuple((n, square_gemm_tflops(torch, device, n, getattr(torch, dt), budget)) for n in sizes)
            for prec, dt in PROFILE_DTYPES.items()}
    copy_mib = 16 if quick else 256
    memory_gb_per_s = _copy_gb_per_s(torch, device, copy_mib, budget)
    host_gb_per_s = _host_link_gb_per_s(torch, device, copy_mib, budget) if accelerator else memory_gb_per_s
    host_mem = _copy_gb_per_s(torch, Device.cpu(), copy_mib, budget) if accelerator else memory_gb_per_s
    dev = DeviceProfile(device_type=dtype_name, vendor=vendor,
                        description=local.name if accelerator else f"{local.name} ({torch.get_num_threads()} threads)",
                        memory_gib=device.total_memory_bytes() / 2**30,
                        memory_gb_per_s=memory_gb_per_s, host_link_gb_per_s=host_gb_per_s,
                        launch_overhead_s=_launch_s(torch, device, 200 if quick else 2000), gemm_tflops=gemm)
    host = HostProfile(name=socket.gethostname(), cpu_cores=os.cpu_count() or 1, memory_gib=_host_memory_gib(),
                       memory_gb_per_s=host_mem)
    # Two local processes over the vendor's backend when there are two such devices, else gloo on the host.
    pair = accelerator and sum(d.vendor == local.vendor for d in found) >= 2
    link_profile = (_measure_link(local.vendor if pair else None, 4 if quick else 64, link_timeout_s)
                    if link else None)
    disk = _measure_disk(disk_dir or tempfile.gettempdir(), 16 if quick else 256)
    cpu_thread = measure_cpu_thread(quick=quick)
    emulation = (measure_emulation(quick=quick, timeout_s=2 * link_timeout_s,
                                   allreduce_gb_per_s=link_profile.allreduce_gb_per_s)
                 if link and not accelerator else None)
    return Profile(host=host, devices=(dev,), link=link_profile, disk=disk, cpu_thread=cpu_thread,
                   emulation=emulation)


def _device_type(given: str | None, local: LocalDevice) -> tuple[str, str]:
    """(device type the profile describes, vendor): `given` (`--device-type`), else the catalog entry the
    probe matched to the device's reported name."""
    if given is not None:
        spec = CATALOG.get(given)
        return given, spec.vendor if spec else local.vendor
    if local.catalog_name is not None:
        return local.catalog_name, local.vendor
    raise UserError(f"{local.torch_device}: no catalog entry matches {local.name!r} "
                    f"({local.memory_gib:.0f} GiB); pass --device-type NAME with a catalog name "
                    "(`heteroflow devices --catalog`) or a name you describe under cluster.device_types")


def _copy_gb_per_s(torch, device: Device, mib: int, budget_s: float) -> float:
    src = torch.empty(mib << 18, dtype=torch.float32, device=device.torch_device).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = time_calls(lambda: dst.copy_(src), budget_s, device.synchronize)
    return 2.0 * src.numel() * 4 / seconds / 1e9  # read + write


def _host_link_gb_per_s(torch, device: Device, mib: int, budget_s: float) -> float:
    host = device.pinned_empty((mib << 18,), torch.float32)
    dev = torch.empty(mib << 18, dtype=torch.float32, device=device.torch_device)
    seconds = time_calls(lambda: dev.copy_(host, non_blocking=True), budget_s, device.synchronize)
    return host.numel() * 4 / seconds / 1e9


def _launch_s(torch, device: Device, calls: int) -> float:
    x = torch.zeros(1, device=device.torch_device)
    sync = device.synchronize
    x.add_(1)
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        x.add_(1)
    sync()
    return (time.perf_counter() - start) / calls


def _host_memory_gib() -> float:
    try:
        import psutil
        return psutil.virtual_memory().total / 2**30
    except ImportError:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measure_link(vendor: str | None, mib: int, timeout_s: float) -> LinkProfile:
    """Ping-pong between two local processes (on `vendor`'s devices 0 and 1 over its backend; on the host
    over gloo when None): latency from 4-byte messages, bandwidth from `mib` MiB; and
    all-reduces of the same two buffers (collectives pay more per byte and per step than point-to-point)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_link_worker, args=(rank, port, vendor, mib, queue), daemon=True) for rank in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        result = queue.get(timeout=timeout_s)
    except Exception:
        result = None
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    if result is None or isinstance(result, str):
        raise UserError(f"link measurement between two local processes failed: {result or 'timed out'}")
    backend, gb_per_s, latency_s, reduce_gb_per_s, reduce_latency_s = result
    return LinkProfile(backend=backend, gb_per_s=gb_per_s, latency_s=latency_s, allreduce_gb_per_s=reduce_gb_per_s,
                       allreduce_latency_s=reduce_latency_s)


def _link_worker(rank: int, port: int, vendor: str | None, mib: int, queue) -> None:
    import torch
    import torch.distributed as dist
    try:
        device = Device.for_vendor(vendor, rank) if vendor is not None else Device.cpu()
        device.set_current()
        backend = device.collective_backend
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=__import__("datetime").timedelta(seconds=60))
        small = torch.zeros(1, device=device.torch_device)
        big = torch.zeros(mib << 18, device=device.torch_device)

        def ping(t: torch.Tensor, rounds: int) -> float:
            """One-way seconds: the fastest of `rounds` round trips, halved. The fastest, because on a
            shared machine the others wait for a core, which is not the link's cost."""
            best = float("inf")
            for _ in range(rounds):
                start = time.perf_counter()
                if rank == 0:
                    dist.send(t, 1)
                    dist.recv(t, 1)
                else:
                    dist.recv(t, 0)
                    dist.send(t, 0)
                device.synchronize()
                best = min(best, time.perf_counter() - start)
            return best / 2

        def all_reduce(t: torch.Tensor, rounds: int) -> float:
            """The fastest of `rounds` two-process all-reduces of `t` (each after a barrier)."""
            best = float("inf")
            for _ in range(rounds):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(t)
                device.synchronize()
                best = min(best, time.perf_counter() - start)
            return best

        ping(small, 5)
        latency = ping(small, 50)
        ping(big, 1)
        one_way = ping(big, 5)
        # A ring all-reduce over 2 ranks is 2 steps of half the buffer: t = bytes / bw + 2 latency. A quarter
        # of the big buffer: collectives of activations and gradient buckets are MBs, not 64 MiB.
        mid = big[: big.numel() // 4]
        all_reduce(small, 5)
        reduce_small = all_reduce(small, 50)
        reduce_mid = all_reduce(mid, 5)
        if rank == 0:
            queue.put((backend, big.numel() * 4 / max(one_way - latency, 1e-9) / 1e9, latency,
                       mid.numel() * 4 / max(reduce_mid - reduce_small, 1e-9) / 1e9, reduce_small / 2))
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # the parent reports it as a user-facing failure
        if rank == 0:
            queue.put(f"{type(exc).__name__}: {exc}")


def _measure_disk(directory: str, mib: int) -> DiskProfile:
    """Write then read `mib` MiB sequentially in 4 MiB blocks."""
    block = 4 << 20
    blocks = max(1, mib * (1 << 20) // block)
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(4096) * (block // 4096))
    fd, path = tempfile.mkstemp(prefix="heteroflow-profile-", dir=directory)
    os.close(fd)
    direct = hasattr(os, "O_DIRECT")
    try:
        try:
            write_s = _disk_pass(path, buf, blocks, write=True, direct=direct)
            read_s = _disk_pass(path, buf, blocks, write=False, direct=direct)
        except OSError:
            direct = False
            write_s = _disk_pass(path, buf, blocks, write=True, direct=False)
            read_s = _disk_pass(path, buf, blocks, write=False, direct=False)
    finally:
        os.unlink(path)
        buf.close()
    total = blocks * block
    return DiskProfile(path=directory, read_gb_per_s=total / read_s / 1e9, write_gb_per_s=total / write_s / 1e9,
                       direct_io=direct)


def _disk_pass(path: str, buf: mmap.mmap, blocks: int, *, write: bool, direct: bool) -> float:
    flags = (os.O_WRONLY | os.O_TRUNC) if write else os.O_RDONLY
    if direct:
        flags |= os.O_DIRECT
    fd = os.open(path, flags)
    try:
        if not write and not direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        for _ in range(blocks):
            if write:
                os.write(fd, buf)
            else:
                os.readv(fd, [buf])
        if write:
            os.fsync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)
