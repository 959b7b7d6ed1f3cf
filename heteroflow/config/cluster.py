"""`ClusterSpec` and `NodeSpec`: the machines a job may use."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Mapping

from heteroflow.config import limits
from heteroflow.config.catalog import ALIASES, CATALOG
from heteroflow.config.chip_names import device_type_hint
from heteroflow.config.device import VENDORS, DeviceSpec
from heteroflow.config.reader import REQUIRED, Problems, Section, type_name
from heteroflow.config.topology import parse_topology

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RESERVED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HETEROFLOW_NODE",
                "HETEROFLOW_NODE_RANKS", "HETEROFLOW_VISIBLE_DEVICES", "HETEROFLOW_STOP_FILE")
"""Set by the launcher for each worker; a job may not set them."""
RESERVED_ENV_PREFIXES = ("TORCHELASTIC_",)
MAX_ENV_ENTRY_BYTES = 131_072 - 1
"""The longest `NAME=VALUE` entry a process environment holds on Linux (MAX_ARG_STRLEN, with its NUL)."""
MAX_NODE_ENV_BYTES = 1 << 20
"""The declared variables of one node's workers, all entries together: half of Linux's usual ARG_MAX (2 MiB,
shared with the command line and the environment the agent already has)."""
MAX_HOST_CHARS = 253
"""The longest DNS name."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeSpec:
    """One machine: `count` devices of one type."""

    name: str
    """Unique node name; plans refer to devices as `NAME` or `NAME:i-j`."""
    device: str
    """Device type name (catalog entry or `cluster.device_types` key)."""
    count: int
    """Devices on this node."""
    host: str | None = None
    """Address of the node, for multi-node launch."""
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    """Environment variables for this node's worker processes (overrides cluster and device type `env`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceRef:
    """One device of the cluster: local index `index` on node `node`."""

    node: str
    index: int

    def __str__(self) -> str:
        return f"{self.node}:{self.index}"


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """Nodes, their device types and the network between nodes."""

    nodes: tuple[NodeSpec, ...]
    """Nodes in declaration order; device order follows it."""
    device_types: dict[str, DeviceSpec] = field(hash=False)
    """Every device type a node uses, plus any declared in `cluster.device_types`."""
    inter_node_gb_per_s: float = 25.0
    """Per-node network bandwidth between nodes, GB/s."""
    profile: str | None = None
    """Path of a `heteroflow profile` file whose measurements replace catalog figures."""
    calibration: str | None = None
    """Path of a `heteroflow calibrate` file whose factors scale the cost model's rates (relative to the job)."""
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    """Environment variables for every worker process of the cluster (`cluster.env`)."""
    device_type_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict, hash=False)
    """Per device type variables (`cluster.device_types.NAME.env`), over `env`."""

    def node_env(self, name: str) -> dict[str, str]:
        """The variables for node `name`'s workers: cluster, then device type, then node (most specific wins)."""
        node = self.node(name)
        return {**self.env, **self.device_type_env.get(node.device, {}), **node.env}

    def node(self, name: str) -> NodeSpec:
        """The node called `name` (which must exist)."""
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def device_type_of(self, node_name: str) -> DeviceSpec:
        """The `DeviceSpec` of the devices on node `node_name`."""
        return self.device_types[self.node(node_name).device]

    @property
    def num_devices(self) -> int:
        """Devices in the whole cluster."""
        return sum(n.count for n in self.nodes)

    def devices(self) -> list[DeviceRef]:
        """Every device, node by node."""
        return [DeviceRef(node=n.name, index=i) for n in self.nodes for i in range(n.count)]

    def vendors(self) -> list[str]:
        """Distinct vendors, in node order."""
        seen: list[str] = []
        for n in self.nodes:
            vendor = self.device_types[n.device].vendor
            if vendor not in seen:
                seen.append(vendor)
        return seen

    def to_dict(self) -> dict:
        """Plain data in the job YAML's schema (custom types written out in full)."""
        custom = {k: {f: v for f, v in d.to_dict().items() if f != "name"}
                  for k, d in self.device_types.items() if CATALOG.get(k) != d}
        for k, env in self.device_type_env.items():
            if env:
                custom.setdefault(k, {})["env"] = dict(env)
        out: dict = {"inter_node_gb_per_s": self.inter_node_gb_per_s}
        if self.env:
            out["env"] = dict(self.env)
        if custom:
            out["device_types"] = custom
        if self.profile:
            out["profile"] = self.profile
        if self.calibration:
            out["calibration"] = self.calibration
        out["nodes"] = [{k: v for k, v in (("name", n.name), ("device", n.device), ("count", n.count),
                                           ("host", n.host), ("env", dict(n.env) or None)) if v is not None}
                        for n in self.nodes]
        return out


_DEVICE_NUMBER_LIMITS = {"memory_gib": limits.MEMORY_GIB, "tflops_bf16": limits.TFLOPS, "tflops_fp16": limits.TFLOPS,
                         "tflops_fp32": limits.TFLOPS, "hbm_gb_per_s": limits.MEMORY_GB_PER_S,
                         "intra_node_gb_per_s": limits.NETWORK_GB_PER_S, "host_link_gb_per_s": limits.NETWORK_GB_PER_S}
_DEVICE_NUMBER_FIELDS = tuple(_DEVICE_NUMBER_LIMITS)


def _parse_device_type(name: str, sec: Section, base: DeviceSpec | None) -> DeviceSpec | None:
    """A custom type, or an override of catalog entry `base`."""
    vendor = sec.string("vendor", base.vendor if base else REQUIRED, choices=VENDORS)
    values = {}
    for f in _DEVICE_NUMBER_FIELDS:
        required = base is None and f in ("memory_gib", "intra_node_gb_per_s")
        default = REQUIRED if required else (getattr(base, f) if base else DeviceSpec.__dataclass_fields__[f].default)
        values[f] = sec.number(f, default, limit=_DEVICE_NUMBER_LIMITS[f])
    source = sec.string("source", None)
    topology_sec = sec.mapping("topology", None)
    topology = parse_topology(topology_sec) if topology_sec is not None else (base.topology if base else None)
    sec.finish()
    if base is None and all(values[f] is None for f in ("tflops_bf16", "tflops_fp16", "tflops_fp32")):
        sec.problems.add(sec.path, "a custom device type needs at least one of tflops_bf16, tflops_fp16, "
                         "tflops_fp32")
        return None
    if vendor is None or values["memory_gib"] is None or values["intra_node_gb_per_s"] is None:
        return None
    source = source or ("cluster.device_types override of " + base.source if base else "cluster.device_types")
    if base is not None:
        return replace(base, vendor=vendor, source=source, topology=topology, **values)
    return DeviceSpec(name=name, vendor=vendor, source=source, topology=topology, **values)


def parse_env(sec: Section, key: str = "env") -> dict[str, str] | None:
    """An `env:` mapping of variable names to values (strings or numbers, written as strings); None when
    absent or wrong (each problem recorded with its path)."""
    raw = sec.raw(key, None)
    if raw is None:
        return None
    path = sec.at(key)
    if not isinstance(raw, dict):
        sec.problems.add(path, f"expected a mapping of variable names to values, got {type_name(raw)}")
        return None
    env: dict[str, str] = {}
    for name, value in raw.items():
        where = f"{path}.{name}"
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            sec.problems.add(where, f"{name!r} is not an environment variable name (letters, digits, _; "
                             "not starting with a digit)")
        elif name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES):
            sec.problems.add(where, f"{name} is set by the launcher for each worker; remove it")
        elif isinstance(value, bool) or not isinstance(value, (str, int, float)):
            hint = "; quote it ('true', '1')" if isinstance(value, bool) else ""
            sec.problems.add(where, f"expected a string or a number, got {type_name(value)} {value!r}{hint}")
        elif (problem := env_entry_problem(name, str(value))) is not None:
            sec.problems.add(where, problem)
        else:
            env[name] = str(value)
    return env


def env_entry_problem(name: str, value: str) -> str | None:
    """Why no process environment can hold `NAME=VALUE`, or None."""
    if "\0" in value:
        return "the value holds a NUL byte (\\0), which no process environment can hold; remove it"
    try:
        size = len(name.encode()) + 1 + len(value.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:
        return "the value holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape), which is not text; remove it"
    if size > MAX_ENV_ENTRY_BYTES:
        return (f"NAME=VALUE is {size:,} bytes; a process environment entry holds at most {MAX_ENV_ENTRY_BYTES:,} "
                "(Linux MAX_ARG_STRLEN): put long values in a file and pass its path")
    return None


def text_problem(text: str, what: str, *, max_chars: int, more: str = "") -> str | None:
    """Why `text` cannot be a node name or host (NUL or control characters, too long, `more` characters), or
    None. Both reach the workers' environment, log paths and sockets."""
    bad = sorted({c for c in text if ord(c) < 32 or ord(c) == 127 or c in more})
    if bad:
        shown = ", ".join(repr(c) for c in bad)
        return f"{what} {text!r} holds {shown}; use letters, digits, '.', '-' and '_'"
    if len(text) > max_chars:
        return f"{what} is {len(text)} characters long; at most {max_chars}"
    return None


def _node_env_problems(cluster_env: dict[str, str], type_env: dict[str, dict[str, str]], nodes: list[NodeSpec],
                       sec: Section) -> None:
    """Each node's declared variables together (cluster, device type, node) fit in a process environment."""
    for i, node in enumerate(nodes):
        merged = {**cluster_env, **type_env.get(node.device, {}), **node.env}
        size = sum(len(k.encode()) + len(v.encode("utf-8", "surrogateescape")) + 2 for k, v in merged.items())
        if size > MAX_NODE_ENV_BYTES:
            sec.problems.add(f"{sec.at('nodes')}[{i}].env", f"the variables node {node.name!r} gets (cluster, device "
                             f"type and node env) take {size:,} bytes; at most {MAX_NODE_ENV_BYTES:,} fit beside the "
                             "launcher's: put long values in files")


def parse_cluster(data: object, problems: Problems, path: str = "cluster") -> ClusterSpec | None:
    """Build a `ClusterSpec` from the job's `cluster:` section, resolving device types."""
    sec = Section(data, path, problems)
    inter = sec.number("inter_node_gb_per_s", 25.0, limit=limits.NETWORK_GB_PER_S)
    profile = sec.string("profile", None)
    calibration = sec.string("calibration", None)
    cluster_env = parse_env(sec) or {}
    types: dict[str, DeviceSpec] = {}
    type_env: dict[str, dict[str, str]] = {}
    custom = sec.mapping("device_types", None)
    if custom is not None:
        for name in list(custom.data):
            entry = custom.mapping(str(name))
            if entry is None:
                continue
            env = parse_env(entry)
            base = CATALOG.get(str(name))
            if set(entry.data) <= {"env"}:  # only variables: the catalog entry itself, unchanged
                canonical = str(name) if base else ALIASES.get(str(name).lower(), str(name).lower())
                if canonical not in CATALOG:
                    problems.add(entry.path, f"unknown device type {str(name)!r}: an entry with only `env` must "
                                 "name a catalog device type" + device_type_hint(str(name), CATALOG, ALIASES))
                else:
                    types[canonical] = CATALOG[canonical]
                    type_env[canonical] = env or {}
                continue
            if env:
                type_env[str(name)] = env
            spec = _parse_device_type(str(name), entry, base)
            if spec is not None:
                types[str(name)] = spec
        custom.finish()
    known = {**CATALOG, **types}
    nodes: list[NodeSpec] = []
    raw_nodes = sec.sequence("nodes")
    seen_names: dict[str, int] = {}
    for i, raw in enumerate(raw_nodes or []):
        node_sec = Section(raw, f"{sec.at('nodes')}[{i}]", problems)
        name = node_sec.string("name")
        device = node_sec.string("device")
        count = node_sec.integer("count", limit=limits.DEVICES_PER_NODE)
        host = node_sec.string("host", None)
        if host is not None and (problem := text_problem(host, "host", max_chars=MAX_HOST_CHARS, more=" /")):
            problems.add(node_sec.at("host"), problem)
            host = None
        node_env = parse_env(node_sec) or {}
        node_sec.finish()
        if name is not None:
            if name in seen_names:
                problems.add(node_sec.at("name"), f"duplicate node name {name!r} (also cluster.nodes"
                             f"[{seen_names[name]}]); node names must be unique")
                name = None
            elif ":" in name or not name.strip():
                problems.add(node_sec.at("name"), f"node name {name!r} must be non-empty without ':'")
                name = None
            elif (problem := text_problem(name, "node name", max_chars=255, more="/\\")) is not None \
                    or name in (".", ".."):
                problems.add(node_sec.at("name"), problem or f"node name {name!r} is a directory name; rename it")
                name = None
            else:
                seen_names[name] = i
        if device is not None and device not in known:
            # Catalog names are case-insensitive and have aliases (`ascend-910b`); store the canonical name.
            canonical = ALIASES.get(device.lower(), device.lower())
            device = canonical if canonical in CATALOG else device
        if device is not None and device not in known:
            problems.add(node_sec.at("device"), f"unknown device type {device!r}" + device_type_hint(device, known, ALIASES)
                         + "; declare it under cluster.device_types or run `heteroflow devices --catalog`")
            device = None
        topology = known[device].topology if device is not None else None
        if topology is not None and count is not None and count > topology.num_devices:
            problems.add(node_sec.at("count"), f"{count} devices, but the topology of {device!r} describes "
                         f"{topology.num_devices}; describe the node's links under cluster.device_types.{device}"
                         ".topology")
            count = None
        if None not in (name, device, count):
            nodes.append(NodeSpec(name=name, device=device, count=count, host=host, env=node_env))
            types.setdefault(device, known[device])
    if raw_nodes is not None and not raw_nodes:
        problems.add(sec.at("nodes"), "a cluster needs at least one node")
    elif raw_nodes is not None and len(raw_nodes) > limits.MAX_NODES:
        problems.add(sec.at("nodes"), f"{len(raw_nodes)} nodes; a cluster may have at most {limits.MAX_NODES}")
    sec.finish()
    _node_env_problems(cluster_env, type_env, nodes, sec)
    if not sec.valid or inter is None or not nodes:
        return None
    return ClusterSpec(nodes=tuple(nodes), device_types=types, inter_node_gb_per_s=inter, profile=profile,
                       calibration=calibration,
                       env=cluster_env, device_type_env=type_env)
