"""A device type's intra-node topology in the cluster YAML: both spellings, the catalog's defaults, the job's
round trip, and every mistake reported as a `path: message` line (exit 2 from `heteroflow validate`)."""

from __future__ import annotations

import yaml

from conftest import problems
from heteroflow.cli import main
from heteroflow.config import parse_job
from heteroflow.config.catalog import CATALOG, DGX1_HYBRID_CUBE_MESH
from heteroflow.config.topology import full_mesh

RING4 = [[0, 1, 0, 1], [1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 1, 0]]


def job(topology, count: int = 4) -> dict:
    return {"cluster": {"device_types": {"my-gpu": {"vendor": "nvidia", "memory_gib": 32, "tflops_bf16": 100,
                                                    "intra_node_gb_per_s": 100, "topology": topology}},
                        "nodes": [{"name": "n0", "device": "my-gpu", "count": count}]},
            "model": {"preset": "tiny-llama"}, "train": {"global_batch_size": 8}}


def test_both_spellings_parse_and_the_job_round_trips():
    ring = parse_job(job({"link_gb_per_s": 50, "links": RING4})).cluster.device_types["my-gpu"].topology
    assert ring.links == tuple(map(tuple, RING4)) and ring.link_gb_per_s == 50 and ring.num_devices == 4
    mesh = parse_job(job({"link_gb_per_s": 30, "full_mesh": 2, "devices": 4})).cluster.device_types["my-gpu"]
    assert mesh.topology == full_mesh(4, 2, 30.0)
    assert mesh.topology.links[0] == (0, 1, 0, 0) and mesh.topology.links[3] == (0, 0, 1, 0)
    again = parse_job(parse_job(job({"link_gb_per_s": 50, "links": RING4})).to_dict())
    assert again.cluster.device_types["my-gpu"].topology == ring


def test_catalog_defaults_and_overrides():
    assert CATALOG["nvidia-v100-32g"].topology == DGX1_HYBRID_CUBE_MESH
    assert CATALOG["ascend-910a"].topology == full_mesh(8, 4, 30.0)  # two 4-chip HCCS meshes, PCIe between
    assert CATALOG["ascend-910b2"].topology == full_mesh(8, 8, 28.0)
    assert CATALOG["nvidia-a100-80g"].topology is None  # NVSwitch: every pair alike
    links = DGX1_HYBRID_CUBE_MESH.links
    assert all(sum(row) == 6 for row in links)  # six NVLinks per V100
    data = {"cluster": {"device_types": {"ascend-910a": {"topology": {"link_gb_per_s": 30, "full_mesh": 8}}},
                        "nodes": [{"name": "n0", "device": "ascend-910a", "count": 8}]},
            "model": {"preset": "tiny-llama"}, "train": {"global_batch_size": 8, "precision": "fp16"}}
    assert parse_job(data).cluster.device_types["ascend-910a"].topology == full_mesh(8, 8, 30.0)


def test_mistakes_name_their_path():
    base = "cluster.device_types.my-gpu.topology"
    assert problems(job({"link_gb_per_s": 50})) == [
        f"{base}: give exactly one of full_mesh (devices per full-mesh group) and links (a matrix of link counts)"]
    assert problems(job({"link_gb_per_s": 50, "links": RING4, "full_mesh": 2}))[0].startswith(f"{base}: give")
    asym = [row[:] for row in RING4]
    asym[2][0] = 2
    assert problems(job({"link_gb_per_s": 50, "links": asym})) == [
        f"{base}.links[2][0]: 2 links, but [0][2] says 0; links go both ways (a symmetric matrix)"]
    diagonal = [row[:] for row in RING4]
    diagonal[1][1] = 1
    assert problems(job({"link_gb_per_s": 50, "links": diagonal})) == [
        f"{base}.links[1][1]: a device has no link to itself: 0 on the diagonal"]
    assert problems(job({"link_gb_per_s": 50, "links": [[0, 1], [1, 0, 0]]})) == [
        f"{base}.links[1]: expected 2 link counts (integers 0 to 64), got a list [1, 0, 0]"]
    assert problems(job({"link_gb_per_s": -1, "full_mesh": 2}))[0].startswith(f"{base}.link_gb_per_s:")
    assert problems(job({"link_gb_per_s": 30, "full_mesh": 3, "devices": 4})) == [
        f"{base}.devices: 4 devices do not split into full-mesh groups of 3"]
    assert problems(job({"link_gb_per_s": 30, "ful_mesh": 2}))[0].startswith(f"{base}.ful_mesh: unknown key")
    assert problems(job({"link_gb_per_s": 50, "links": RING4}, count=8)) == [
        "cluster.nodes[0].count: 8 devices, but the topology of 'my-gpu' describes 4; describe the node's links "
        "under cluster.device_types.my-gpu.topology"]


def test_validate_exits_2_with_the_path(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job({"link_gb_per_s": 50, "links": RING4}, count=8)))
    assert main(["validate", str(path)]) == 2
    assert "\ncluster.nodes[0].count: 8 devices, but the topology" in capsys.readouterr().err
