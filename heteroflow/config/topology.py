"""`NodeTopology`: how the devices of one node are linked to each other (NVLink, HCCS, Infinity Fabric).

A device type's `topology` (`cluster.device_types.NAME.topology`, or the catalog's default) says which device
pairs of a node share direct links, and how many: a matrix of link counts, one row per device, each link
`link_gb_per_s` per direction. Pairs with no link reach each other through the host (the device's PCIe
link). Without a topology every device reaches every other at the type's `intra_node_gb_per_s`, as through a
switch (NVSwitch). Two spellings in YAML:

```yaml
topology: {link_gb_per_s: 30, full_mesh: 4, devices: 8}   # devices 0-3 and 4-7 each a full mesh, one link a pair
topology: {link_gb_per_s: 25, links: [[0, 1, 1, 2, 2, 0, 0, 0], ...]}   # link counts per pair (symmetric)
```

A node of that device type may have at most as many devices as the topology describes (its first `count`).
"""

from __future__ import annotations

from dataclasses import dataclass

from heteroflow.config import limits
from heteroflow.config.reader import Section, type_name

MAX_TOPOLOGY_DEVICES = 64


@dataclass(frozen=True, slots=True)
class NodeTopology:
    """Link counts between the devices of one node (see the module docstring)."""

    link_gb_per_s: float
    """One link's bandwidth per direction, GB/s."""
    links: tuple[tuple[int, ...], ...]
    """links[i][j]: direct links between devices i and j (symmetric, 0 on the diagonal)."""

    @property
    def num_devices(self) -> int:
        """Devices the topology describes."""
        return len(self.links)

    def to_dict(self) -> dict:
        """Plain data in the YAML's `links` spelling."""
        return {"link_gb_per_s": self.link_gb_per_s, "links": [list(row) for row in self.links]}


def full_mesh(num_devices: int, group: int, link_gb_per_s: float) -> NodeTopology:
    """`num_devices` devices in consecutive groups of `group`, each group a full mesh of one link per pair."""
    return NodeTopology(link_gb_per_s=link_gb_per_s,
                        links=tuple(tuple(int(i != j and i // group == j // group) for j in range(num_devices))
                                    for i in range(num_devices)))


def parse_topology(sec: Section) -> NodeTopology | None:
    """A `topology:` mapping (either spelling); None when it has problems (each recorded with its path)."""
    link = sec.number("link_gb_per_s", limit=limits.NETWORK_GB_PER_S)
    mesh = sec.integer("full_mesh", None, minimum=1, maximum=MAX_TOPOLOGY_DEVICES)
    devices = sec.integer("devices", None, minimum=2, maximum=MAX_TOPOLOGY_DEVICES) if mesh is not None else None
    raw = sec.sequence("links", None)
    sec.finish()
    if (mesh is None) == (raw is None) and sec.valid:
        sec.problems.add(sec.path, "give exactly one of full_mesh (devices per full-mesh group) and links "
                                   "(a matrix of link counts)")
        return None
    if link is None:
        return None
    if mesh is not None:
        devices = devices or mesh
        if devices % mesh:
            sec.problems.add(sec.at("devices"), f"{devices} devices do not split into full-mesh groups of {mesh}")
            return None
        return full_mesh(devices, mesh, link)
    rows = _link_rows(raw or [], sec)
    return None if rows is None else NodeTopology(link_gb_per_s=link, links=rows)


def _link_rows(raw: list, sec: Section) -> tuple[tuple[int, ...], ...] | None:
    path, n = sec.at("links"), len(raw)
    if not 2 <= n <= MAX_TOPOLOGY_DEVICES:
        sec.problems.add(path, f"{n} rows; a topology describes 2 to {MAX_TOPOLOGY_DEVICES} devices")
        return None
    rows = []
    for i, row in enumerate(raw):
        if not isinstance(row, list) or len(row) != n or not all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 64 for v in row):
            sec.problems.add(f"{path}[{i}]", f"expected {n} link counts (integers 0 to 64), got "
                                             f"{type_name(row)} {row!r}")
            return None
        rows.append(tuple(row))
    for i in range(n):
        if rows[i][i]:
            sec.problems.add(f"{path}[{i}][{i}]", "a device has no link to itself: 0 on the diagonal")
            return None
        for j in range(i):
            if rows[i][j] != rows[j][i]:
                sec.problems.add(f"{path}[{i}][{j}]", f"{rows[i][j]} links, but [{j}][{i}] says {rows[j][i]}; "
                                                      "links go both ways (a symmetric matrix)")
                return None
    return tuple(rows)
