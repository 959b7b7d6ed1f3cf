"""Find the devices on this machine and match them to catalog entries.

torch is imported inside functions so `import heteroflow.devices` stays cheap. torch_npu is imported
only here (and only through `import_torch_npu`), and any failure of it counts as "no Ascend": a CPU
torch with a mismatched torch_npu installed must still probe, plan and emulate.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import re
from dataclasses import dataclass
from types import ModuleType

from heteroflow.config.catalog import CATALOG

log = logging.getLogger(__name__)

_GIB = 2**30
# A name match whose memory is this far off the catalog's is a different card (an H100 NVL sold as
# 'H100', a 64 GB 910B4 variant): better unmatched than planned with the wrong capacity.
_MEMORY_TOLERANCE = 0.25


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalDevice:
    """One device found on this machine, as its runtime reports it."""

    vendor: str
    """One of `heteroflow.config.device.VENDORS`."""
    index: int
    """Local index within its runtime (`cuda:3` -> 3)."""
    name: str
    """Device name as reported (`NVIDIA A100-SXM4-80GB`, `Ascend910B2`, the CPU model)."""
    memory_gib: float
    """Device memory in GiB (host RAM for the CPU)."""
    catalog_name: str | None
    """The matching catalog entry, or None when the name is not recognised."""
    torch_device: str
    """torch device string: `cuda:0` (also ROCm), `npu:0` or `cpu`."""

    def to_dict(self) -> dict:
        """Plain data for JSON output."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def probe_local_devices() -> list[LocalDevice]:
    """Accelerators found here (CUDA or ROCm, then Ascend), followed by the CPU, which is always present.

    An accelerator no catalog entry matches keeps `catalog_name=None` (never the nearest entry: a wrong match
    plans with wrong rates and memory) and is logged once as a warning naming it and how to declare it.
    """
    found = [*_probe_cuda_like(), *_probe_ascend(), _probe_cpu()]
    for device in found:
        if device.catalog_name is None:
            _warn_unmatched(device.torch_device, device.name, round(device.memory_gib, 1))
    return found


@functools.cache  # once per device and process: probing is repeated
def _warn_unmatched(torch_device: str, name: str, memory_gib: float) -> None:
    log.warning("%s: %r (%.1f GiB) matches no chip in the catalog; describe it under cluster.device_types in the "
                "job YAML (a new name with vendor, memory_gib and peak rates; `heteroflow devices --catalog` lists "
                "the fields) and pass that name to `heteroflow profile --device-type`", torch_device, name, memory_gib)


def import_torch_npu() -> ModuleType | None:
    """torch_npu if it imports cleanly, else None (a broken install is logged, never raised)."""
    try:
        import torch_npu  # noqa: F401  (registers the 'npu' device and torch.npu)
    except ModuleNotFoundError:
        return None
    except Exception as exc:  # a torch_npu built for another torch raises all sorts of errors
        log.warning("torch_npu is installed but does not import (%s: %s); ignoring Ascend devices",
                    type(exc).__name__, exc)
        return None
    return torch_npu


def is_hygon_name(name: str) -> bool:
    """Whether a ROCm device name is a Hygon DCU rather than an AMD GPU."""
    upper = name.upper()
    return any(tag in upper for tag in ("DCU", "Z100", "K100", "BW"))


def match_catalog_name(vendor: str, name: str, memory_gib: float | None = None) -> str | None:
    """The catalog entry a reported device name most likely is, or None.

    Heuristic: a model token in the name (`A100`, `MI300X`, `910B2`, `K100_AI`), with the memory size
    choosing between variants (A100 40 vs 80 GB) and rejecting matches whose memory is far off.
    """
    if vendor == "cpu":
        return "cpu"
    token = re.sub(r"[^A-Z0-9]", "", name.upper())  # 'Ascend 910B-2' and 'Ascend910B2' alike
    matcher = {"nvidia": _match_nvidia, "amd": _match_amd, "hygon": _match_hygon,
               "ascend": _match_ascend}.get(vendor)
    found = matcher(name.upper(), token, memory_gib) if matcher else None
    if found is None or memory_gib is None:
        return found
    expected = CATALOG[found].memory_gib
    if abs(memory_gib - expected) > _MEMORY_TOLERANCE * expected:
        return None
    return found


def _has(model: str, upper_name: str) -> bool:
    """`model` appears as its own token: 'H20' in 'NVIDIA H20' but not in 'NVIDIA H200'."""
    return re.search(rf"(?<![A-Z0-9]){model}(?![A-Z0-9])", upper_name) is not None


def _match_nvidia(upper: str, _token: str, memory_gib: float | None) -> str | None:
    # Names as torch reports them: 'NVIDIA H100 80GB HBM3' (SXM), 'NVIDIA H100 PCIe', 'NVIDIA H100 NVL',
    # 'NVIDIA H200', 'NVIDIA H200 NVL', 'NVIDIA B200'. Token matches, so 'H20' is not 'H200' nor 'B200' 'GB200'.
    large = memory_gib is None or memory_gib >= 60
    nvl = _has("NVL", upper)
    if _has("A100", upper):
        return "nvidia-a100-80g" if large else "nvidia-a100-40g"
    if _has("A800", upper):
        return "nvidia-a800-80g"
    if _has("H100", upper):
        return "nvidia-h100-nvl" if nvl else "nvidia-h100-pcie" if "PCIE" in upper else "nvidia-h100-sxm"
    if _has("H200", upper):
        return "nvidia-h200-nvl" if nvl else "nvidia-h200"
    if _has("B200", upper):
        return "nvidia-b200"
    if _has("H800", upper):
        return "nvidia-h800"
    if _has("H20", upper):
        return "nvidia-h20"
    if _has("V100", upper):
        return "nvidia-v100-32g"
    return None


def _match_amd(upper: str, _token: str, _memory_gib: float | None) -> str | None:
    if _has("MI250X", upper):
        return "amd-mi250x"
    if _has("MI300X", upper):
        return "amd-mi300x"
    return None


def _match_hygon(_upper: str, token: str, _memory_gib: float | None) -> str | None:
    if "BW1000" in token:
        return "hygon-bw1000"
    if "K100AI" in token:  # before plain K100: 'K100_AI' is a different chip
        return "hygon-k100-ai"
    if re.search(r"K100(?![0-9A-Z])", token):
        return "hygon-k100"
    if re.search(r"Z100(?![0-9A-Z])", token):
        return "hygon-z100"
    return None


def _match_ascend(_upper: str, token: str, _memory_gib: float | None) -> str | None:
    # The 910C's dies report their SoC version ('Ascend910_9392', 'Ascend910_9381': the A3 training parts);
    # other 910_93xx bins are left unmatched rather than priced as these.
    if re.search(r"910C(?![0-9A-Z])", token) or re.search(r"91093[89][12](?![0-9])", token):
        return "ascend-910c"
    variant = re.search(r"910B([1-4])", token)
    if variant:
        return f"ascend-910b{variant.group(1)}"
    if re.search(r"910(PRO|PREMIUM)?A", token):
        return "ascend-910a"
    return None


def _probe_cuda_like() -> list[LocalDevice]:
    """NVIDIA under CUDA, or AMD / Hygon under ROCm (which torch also calls `cuda`)."""
    import torch

    if not torch.cuda.is_available():
        return []
    rocm = getattr(torch.version, "hip", None) is not None
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        name = str(props.name)
        if rocm:
            vendor = "hygon" if is_hygon_name(name) else "amd"
        else:
            vendor = "nvidia"
        memory_gib = props.total_memory / _GIB
        found.append(LocalDevice(vendor=vendor, index=index, name=name, memory_gib=memory_gib,
                                 catalog_name=match_catalog_name(vendor, name, memory_gib),
                                 torch_device=f"cuda:{index}"))
    return found


def _probe_ascend() -> list[LocalDevice]:
    """Ascend NPUs through torch_npu; nothing when torch_npu is absent, broken or sees no device."""
    if import_torch_npu() is None:
        return []
    import torch

    try:
        npu = torch.npu
        if not npu.is_available():
            return []
        found = []
        for index in range(npu.device_count()):
            name = str(npu.get_device_name(index))
            memory_gib = npu.get_device_properties(index).total_memory / _GIB
            found.append(LocalDevice(vendor="ascend", index=index, name=name, memory_gib=memory_gib,
                                     catalog_name=match_catalog_name("ascend", name, memory_gib),
                                     torch_device=f"npu:{index}"))
        return found
    except Exception as exc:  # a driver/CANN mismatch surfaces only here; probing must go on
        log.warning("torch_npu imported but querying NPUs failed (%s: %s); ignoring Ascend devices",
                    type(exc).__name__, exc)
        return []


def _probe_cpu() -> LocalDevice:
    """The host CPU: model name and total RAM."""
    return LocalDevice(vendor="cpu", index=0, name=_cpu_model_name(), memory_gib=_host_memory_bytes() / _GIB,
                       catalog_name="cpu", torch_device="cpu")


def _cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux
    return platform.processor() or platform.machine() or "unknown CPU"


def _host_memory_bytes() -> int:
    try:
        import psutil
    except ImportError:  # psutil is a dependency, but a bare interpreter should still probe
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(psutil.virtual_memory().total)
