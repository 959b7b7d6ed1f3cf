"""The chip catalog: published dense peaks of the accelerators heteroflow plans for.

Pure data, no torch: the planner runs on a laptop. Conventions, so entries compare fairly:
- rates are dense (no 2:4 sparsity), per device as torch sees one (an MI250X GCD, not the OAM);
- `tflops_fp32` is the non-tensor-core (vector) rate; None means unsupported or not published;
- link bandwidths are per direction: half of the bidirectional figure vendors put on slides
  (NVLink 600 GB/s on an A100 is 300 GB/s each way); `intra_node_gb_per_s` is what one device can
  push to its peers in total, `host_link_gb_per_s` its PCIe (or host fabric) link.
Vendors that publish little (Hygon, Huawei for the 910B variants) are marked "approximate, public
reports" in `source`; a cluster YAML can override any field under `cluster.device_types`.
"""

from __future__ import annotations

from heteroflow.config.device import DeviceSpec
from heteroflow.config.topology import NodeTopology, full_mesh
from heteroflow.config.chip_names import device_type_hint
from heteroflow.errors import UserError

# PCIe per direction, x16: Gen3 ~16, Gen4 ~32, Gen5 ~64 GB/s.
_PCIE3, _PCIE4, _PCIE5 = 16.0, 32.0, 64.0
_APPROX = "approximate, public reports"

DGX1_HYBRID_CUBE_MESH = NodeTopology(link_gb_per_s=25.0, links=(
    (0, 1, 1, 2, 2, 0, 0, 0), (1, 0, 2, 1, 0, 2, 0, 0), (1, 2, 0, 2, 0, 0, 1, 0), (2, 1, 2, 0, 0, 0, 0, 1),
    (2, 0, 0, 0, 0, 1, 1, 2), (0, 2, 0, 0, 1, 0, 2, 1), (0, 0, 1, 0, 1, 2, 0, 2), (0, 0, 0, 1, 2, 1, 2, 0)))
"""NVIDIA DGX-1 with V100 (`nvidia-smi topo -m`: NV1 / NV2 between pairs, SYS where no NVLink): six NVLink2 links
of 25 GB/s per direction per GPU, each GPU linked to the three others of its quad and to one GPU of the other."""

_HCCS_910B = "HCCS 392 GB/s bidirectional, 8-chip full mesh (7 links of 28 GB/s each way)"
_MESH_910B = full_mesh(8, 8, 28.0)

_SPECS = (
    # NVIDIA. 80 GB before 40 GB so a did-you-mean for 'a100' offers the common card first.
    DeviceSpec(name="nvidia-a100-80g", vendor="nvidia", memory_gib=80,
               tflops_bf16=312, tflops_fp16=312, tflops_fp32=19.5,
               hbm_gb_per_s=2039, intra_node_gb_per_s=300, host_link_gb_per_s=_PCIE4,
               source="NVIDIA A100 datasheet (SXM4 80GB); NVLink3 600 GB/s bidirectional"),
    DeviceSpec(name="nvidia-a100-40g", vendor="nvidia", memory_gib=40,
               tflops_bf16=312, tflops_fp16=312, tflops_fp32=19.5,
               hbm_gb_per_s=1555, intra_node_gb_per_s=300, host_link_gb_per_s=_PCIE4,
               source="NVIDIA A100 datasheet (SXM4 40GB); NVLink3 600 GB/s bidirectional"),
    DeviceSpec(name="nvidia-a800-80g", vendor="nvidia", memory_gib=80,
               tflops_bf16=312, tflops_fp16=312, tflops_fp32=19.5,
               hbm_gb_per_s=2039, intra_node_gb_per_s=200, host_link_gb_per_s=_PCIE4,
               source="NVIDIA A800 datasheet (SXM4 80GB); NVLink 400 GB/s bidirectional"),
    DeviceSpec(name="nvidia-h100-sxm", vendor="nvidia", memory_gib=80,
               tflops_bf16=989, tflops_fp16=989, tflops_fp32=67,
               hbm_gb_per_s=3350, intra_node_gb_per_s=450, host_link_gb_per_s=_PCIE5,
               source="NVIDIA H100 datasheet (SXM5; 1979 TFLOP/s is with sparsity); "
                      "NVLink4 900 GB/s bidirectional"),
    DeviceSpec(name="nvidia-h100-pcie", vendor="nvidia", memory_gib=80,
               tflops_bf16=756, tflops_fp16=756, tflops_fp32=51,
               hbm_gb_per_s=2000, intra_node_gb_per_s=300, host_link_gb_per_s=_PCIE5,
               source="NVIDIA H100 datasheet (PCIe 80GB HBM2e; 1513 TFLOP/s is with sparsity); "
                      "NVLink bridge 600 GB/s bidirectional between pairs, PCIe Gen5 otherwise"),
    DeviceSpec(name="nvidia-h100-nvl", vendor="nvidia", memory_gib=94,
               tflops_bf16=835, tflops_fp16=835, tflops_fp32=60,
               hbm_gb_per_s=3900, intra_node_gb_per_s=300, host_link_gb_per_s=_PCIE5,
               source="NVIDIA H100 NVL datasheet (94 GB HBM3; 1671 TFLOP/s is with sparsity); "
                      "NVLink bridge 600 GB/s bidirectional between pairs, PCIe Gen5 otherwise"),
    DeviceSpec(name="nvidia-h200", vendor="nvidia", memory_gib=141,
               tflops_bf16=989, tflops_fp16=989, tflops_fp32=67,
               hbm_gb_per_s=4800, intra_node_gb_per_s=450, host_link_gb_per_s=_PCIE5,
               source="NVIDIA H200 datasheet (SXM, 141 GB HBM3e; 1979 TFLOP/s is with sparsity); "
                      "NVLink4 900 GB/s bidirectional"),
    DeviceSpec(name="nvidia-h200-nvl", vendor="nvidia", memory_gib=141,
               tflops_bf16=835, tflops_fp16=835, tflops_fp32=60,
               hbm_gb_per_s=4800, intra_node_gb_per_s=450, host_link_gb_per_s=_PCIE5,
               source="NVIDIA H200 datasheet (NVL, PCIe card, 141 GB HBM3e; 1671 TFLOP/s is with sparsity); "
                      "2- or 4-way NVLink bridge 900 GB/s bidirectional"),
    DeviceSpec(name="nvidia-b200", vendor="nvidia", memory_gib=180,
               tflops_bf16=2250, tflops_fp16=2250, tflops_fp32=75,
               hbm_gb_per_s=8000, intra_node_gb_per_s=900, host_link_gb_per_s=_PCIE5,
               source="NVIDIA HGX B200 datasheet per GPU (8 GPUs: 36 PFLOP/s bf16 with sparsity, 600 TFLOP/s "
                      "fp32, 1.44 TB HBM3e at 64 TB/s); NVLink5 1.8 TB/s bidirectional"),
    DeviceSpec(name="nvidia-h800", vendor="nvidia", memory_gib=80,
               tflops_bf16=989, tflops_fp16=989, tflops_fp32=67,
               hbm_gb_per_s=3350, intra_node_gb_per_s=200, host_link_gb_per_s=_PCIE5,
               source="NVIDIA H800 datasheet (SXM5); NVLink 400 GB/s bidirectional"),
    DeviceSpec(name="nvidia-h20", vendor="nvidia", memory_gib=96,
               tflops_bf16=148, tflops_fp16=148, tflops_fp32=44,
               hbm_gb_per_s=4000, intra_node_gb_per_s=450, host_link_gb_per_s=_PCIE5,
               source="NVIDIA H20 datasheet (96 GB HBM3); NVLink4 900 GB/s bidirectional"),
    DeviceSpec(name="nvidia-v100-32g", vendor="nvidia", memory_gib=32,
               tflops_bf16=None, tflops_fp16=125, tflops_fp32=15.7,
               hbm_gb_per_s=900, intra_node_gb_per_s=150, host_link_gb_per_s=_PCIE3,
               source="NVIDIA V100 datasheet (SXM2 32GB; fp16 tensor cores, no bf16); "
                      "NVLink2 300 GB/s bidirectional; DGX-1 hybrid cube mesh",
               topology=DGX1_HYBRID_CUBE_MESH),
    # AMD.
    DeviceSpec(name="amd-mi250x", vendor="amd", memory_gib=64,
               tflops_bf16=191.5, tflops_fp16=191.5, tflops_fp32=23.95,
               hbm_gb_per_s=1638, intra_node_gb_per_s=100, host_link_gb_per_s=_PCIE4,
               source="AMD Instinct MI250X datasheet, one GCD as torch sees it: half the OAM's "
                      "128 GB, 383 TFLOP/s bf16/fp16, 47.9 fp32 vector, 3.2 TB/s HBM; "
                      "xGMI to peers ~50-200 GB/s per direction by pair, 100 taken"),
    DeviceSpec(name="amd-mi300x", vendor="amd", memory_gib=192,
               tflops_bf16=1307.4, tflops_fp16=1307.4, tflops_fp32=163.4,
               hbm_gb_per_s=5300, intra_node_gb_per_s=448, host_link_gb_per_s=_PCIE5,
               source="AMD Instinct MI300X datasheet; 7 Infinity Fabric links x 64 GB/s per direction, "
                      "8-GPU full mesh",
               topology=full_mesh(8, 8, 64.0)),
    # Hygon DCU (ROCm-compatible DTK stack).
    DeviceSpec(name="hygon-z100", vendor="hygon", memory_gib=32,
               tflops_bf16=None, tflops_fp16=24.5, tflops_fp32=12.2,
               hbm_gb_per_s=1024, intra_node_gb_per_s=_PCIE4, host_link_gb_per_s=_PCIE4,
               source=f"{_APPROX}: Vega20-class (gfx906) DCU, no matrix cores, no bf16 units; "
                      "peers over PCIe Gen4"),
    DeviceSpec(name="hygon-k100", vendor="hygon", memory_gib=64,
               tflops_bf16=None, tflops_fp16=100, tflops_fp32=24.5,
               hbm_gb_per_s=896, intra_node_gb_per_s=50, host_link_gb_per_s=_PCIE4,
               source=f"{_APPROX}: vendor table lists no bf16; HBM bandwidth as the K100_AI"),
    DeviceSpec(name="hygon-k100-ai", vendor="hygon", memory_gib=64,
               tflops_bf16=196, tflops_fp16=196, tflops_fp32=49,
               hbm_gb_per_s=896, intra_node_gb_per_s=50, host_link_gb_per_s=_PCIE4,
               source=f"{_APPROX}: vendor spec table (K100_AI, 64 GB, 896 GB/s)"),
    DeviceSpec(name="hygon-bw1000", vendor="hygon", memory_gib=64,
               tflops_bf16=480, tflops_fp16=480, tflops_fp32=60,
               hbm_gb_per_s=1600, intra_node_gb_per_s=100, host_link_gb_per_s=_PCIE4,
               source=f"{_APPROX}: 64 GB, 480 TFLOP/s bf16, 1.6 TB/s, ~100 GB/s intra-node"),
    # Huawei Ascend (torch_npu, HCCL). fp32 rates are not published for the cube units.
    DeviceSpec(name="ascend-910a", vendor="ascend", memory_gib=32,
               tflops_bf16=None, tflops_fp16=256, tflops_fp32=None,
               hbm_gb_per_s=1200, intra_node_gb_per_s=90, host_link_gb_per_s=_PCIE4,
               source="Huawei Ascend 910 (Hot Chips 2019): 256 TFLOP/s fp16 only, no bf16; "
                      "3 HCCS links x 30 GB/s inside a 4-chip mesh (two meshes a node, PCIe between them)",
               topology=full_mesh(8, 4, 30.0)),
    DeviceSpec(name="ascend-910b1", vendor="ascend", memory_gib=64,
               tflops_bf16=379, tflops_fp16=379, tflops_fp32=None,
               hbm_gb_per_s=1600, intra_node_gb_per_s=196, host_link_gb_per_s=_PCIE5,
               source=f"{_APPROX}: 64 GB HBM2e; {_HCCS_910B}", topology=_MESH_910B),
    DeviceSpec(name="ascend-910b2", vendor="ascend", memory_gib=64,
               tflops_bf16=354, tflops_fp16=354, tflops_fp32=None,
               hbm_gb_per_s=1600, intra_node_gb_per_s=196, host_link_gb_per_s=_PCIE5,
               source=f"{_APPROX}: 64 GB HBM2e; {_HCCS_910B}", topology=_MESH_910B),
    DeviceSpec(name="ascend-910b3", vendor="ascend", memory_gib=64,
               tflops_bf16=313, tflops_fp16=313, tflops_fp32=None,
               hbm_gb_per_s=1600, intra_node_gb_per_s=196, host_link_gb_per_s=_PCIE5,
               source=f"{_APPROX}: 64 GB HBM2e; {_HCCS_910B}", topology=_MESH_910B),
    DeviceSpec(name="ascend-910b4", vendor="ascend", memory_gib=32,
               tflops_bf16=280, tflops_fp16=280, tflops_fp32=None,
               hbm_gb_per_s=800, intra_node_gb_per_s=196, host_link_gb_per_s=_PCIE5,
               source=f"{_APPROX}: 32 GB HBM2e; {_HCCS_910B}", topology=_MESH_910B),
    # The 910C is two 910B-class dies in one package; torch_npu shows each die as a device
    # (`Ascend910_9392`), so an entry is one die: half the package's 752 TFLOP/s, 128 GB and 3.2 TB/s.
    DeviceSpec(name="ascend-910c", vendor="ascend", memory_gib=64,
               tflops_bf16=376, tflops_fp16=376, tflops_fp32=None,
               hbm_gb_per_s=1600, intra_node_gb_per_s=196, host_link_gb_per_s=_PCIE5,
               source=f"{_APPROX}: one die of the dual-die package (Huawei, 'Serving Large Language Models on "
                      "Huawei CloudMatrix384', 2025: 752 TFLOP/s bf16 dense, 128 GB, 3.2 TB/s and 392 GB/s "
                      "unidirectional UB per package)"),
    # The CPU "device" every emulated rank runs on. Measured, not published: torch 2.13 CPU build,
    # 2 threads per rank, 2048-4096 square matmuls; memory copy for HBM and host link; gloo
    # send/recv between two local processes for intra-node. memory_gib is a per-rank budget.
    DeviceSpec(name="cpu", vendor="cpu", memory_gib=8,
               tflops_bf16=0.13, tflops_fp16=0.23, tflops_fp32=0.25,
               hbm_gb_per_s=11, intra_node_gb_per_s=1.5, host_link_gb_per_s=11,
               source="measured on the 2-core dev machine (Xeon, AVX512-BF16, no AMX; torch 2.13 "
                      "CPU, 2 threads): matmul, memory copy, gloo send/recv over loopback"),
)

CATALOG: dict[str, DeviceSpec] = {spec.name: spec for spec in _SPECS}
"""Every known chip by catalog name, in display order."""

ALIASES: dict[str, str] = {
    # Generic names people write; each points at the variant the generic name usually means.
    "ascend-910b": "ascend-910b3",  # the 64 GB / ~313 TFLOP/s part quoted as "the 910B"
    "ascend-910": "ascend-910a",
    "nvidia-h100": "nvidia-h100-sxm",
    "nvidia-h200-sxm": "nvidia-h200",
    "hygon-k100_ai": "hygon-k100-ai",
}
"""Other spellings `lookup` accepts, mapped to catalog names."""


def catalog_names() -> list[str]:
    """Catalog names in display order."""
    return list(CATALOG)


def lookup(name: str) -> DeviceSpec:
    """The catalog entry for `name` (case-insensitive; aliases such as `ascend-910b` allowed).

    Raises `UserError` naming the closest entries when `name` is unknown.
    """
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key in CATALOG:
        return CATALOG[key]
    hint = device_type_hint(name, CATALOG, ALIASES)
    raise UserError(
        f"unknown chip {name!r}{hint}; `heteroflow devices --catalog` lists the known chips, "
        "or describe it under cluster.device_types"
    )
