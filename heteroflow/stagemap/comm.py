"""Communication times: collectives inside a stage and the boundary transfer between two stages.

Assumptions (documented, used everywhere):
- Ring algorithms: all-reduce moves 2(n-1)/n of the buffer per rank, all-gather and reduce-scatter
  (n-1)/n; each of the 2(n-1) or (n-1) steps pays the link latency.
- TP collectives run on the node's intra-node link and are not overlapped with compute (Megatron default);
  with a profile that measured all-reduces, collectives inside a node use those figures instead.
- A DP group inside one node uses the intra-node link; one that spans nodes is a ring through the nodes'
  NICs, which the tp * cp concurrent DP rings of the stage share.
- An all-to-all (a MoE layer's token dispatch and combine inside the stage's ep group) sends each rank's bytes for
  the other ep ranks directly, one exchange per peer. Inside a node it runs on the intra-node link; an ep group
  spanning nodes sends the share bound for other nodes through the NIC, which the node's ranks share.
- The boundary transfer moves one micro-batch's hidden states (micro_batch_size x seq x hidden) forward and
  the same amount of gradient backward, both in the dtype of the stage that sends the hidden states (the
  earlier one; `estimate.boundary_times`). Its time depends only on the hardware of the two stages, never on
  their layouts: the remap spreads the bytes over every device pair (inside a node), over the NICs of the
  nodes involved (between nodes), or, between vendors, through host memory: device to host on the
  sender, the network, host to device on the receiver, one hop after the other (store and forward).
- The receiving stage pays the transfer (it waits for it before computing); sends are asynchronous.
- An embedding tied across the first and last stage has its gradient summed once per step by every rank of
  both stages (`runtime.stage`, each rank the whole fp32 vocab x hidden gradient): a ring all-reduce over the
  nodes' network. When both stages are of one accelerator vendor it runs on their backend, device to device;
  otherwise on gloo over TCP (on one node its loopback, priced no faster), with each rank's device-to-host and
  host-to-device copy on accelerators. Over the local link when emulated.
"""

from __future__ import annotations

from heteroflow.stagemap.hardware import HOST_STAGE_LATENCY_S, DeviceModel, Hardware


def all_reduce_s(num_bytes: float, n: int, gb_per_s: float, latency_s: float) -> float:
    """Ring all-reduce of `num_bytes` per rank over `n` ranks."""
    if n <= 1 or num_bytes <= 0:
        return 0.0
    return 2.0 * (n - 1) / n * num_bytes / (gb_per_s * 1e9) + 2 * (n - 1) * latency_s


def all_gather_s(num_bytes: float, n: int, gb_per_s: float, latency_s: float) -> float:
    """Ring all-gather (or reduce-scatter) of a `num_bytes` full buffer over `n` ranks."""
    if n <= 1 or num_bytes <= 0:
        return 0.0
    return (n - 1) / n * num_bytes / (gb_per_s * 1e9) + (n - 1) * latency_s


def dp_link(device: DeviceModel, hardware: Hardware, *, single_node: bool, tp: int, cp: int) -> tuple[float, float]:
    """(GB/s, latency) of one DP ring of a stage (bandwidth scaled by the calibration's `dp_comm`)."""
    if single_node or hardware.emulate:
        gb_per_s, latency_s = device.collective_link()
        return gb_per_s * device.dp_comm_efficiency, latency_s
    gb_per_s = min(device.intra_node_gb_per_s, hardware.inter_node_gb_per_s / (tp * cp))
    return gb_per_s * device.dp_comm_efficiency, hardware.inter_latency_s


def all_to_all_s(num_bytes: float, n: int, gb_per_s: float, latency_s: float) -> float:
    """All-to-all over `n` ranks in which each rank sends `num_bytes` in all to the others."""
    if n <= 1 or num_bytes <= 0:
        return 0.0
    return num_bytes / (gb_per_s * 1e9) + (n - 1) * latency_s


def ep_alltoall_s(num_bytes: float, device: DeviceModel, hardware: Hardware, *, ep: int, etp: int,
                  node_count: int, single_node: bool) -> float:
    """One all-to-all of a stage's ep group, `num_bytes` sent per rank (spread evenly over the other ep ranks).
    The group's ranks are etp apart (`ParallelLayout.expert_dp` folding), so it spans etp * ep consecutive ranks:
    inside one node when that fits in a node (`node_count` devices) or the stage has one node; otherwise the
    bytes for peers on other nodes cross the NIC, which all `node_count` ranks of a node share."""
    if ep <= 1 or num_bytes <= 0:
        return 0.0
    intra_gb_per_s, intra_latency_s = device.tp_link()
    if single_node or hardware.emulate or etp * ep <= node_count:
        return all_to_all_s(num_bytes, ep, intra_gb_per_s, intra_latency_s)
    peers_on_node = node_count // etp - 1
    off_node = num_bytes * (ep - 1 - peers_on_node) / (ep - 1)
    nic_gb_per_s = hardware.inter_node_gb_per_s / node_count
    return ((num_bytes - off_node) / (intra_gb_per_s * 1e9) + off_node / (nic_gb_per_s * 1e9)
            + peers_on_node * intra_latency_s + (ep - 1 - peers_on_node) * hardware.inter_latency_s)


def boundary_s(num_bytes: float, hardware: Hardware, *, sender: DeviceModel, receiver: DeviceModel,
               sender_devices: int, receiver_devices: int, sender_nodes: frozenset[str],
               receiver_nodes: frozenset[str]) -> float:
    """One-way transfer of `num_bytes` from one stage to the next."""
    if hardware.emulate:
        return num_bytes / (sender.intra_node_gb_per_s * 1e9) + sender.intra_latency_s
    if len(sender_nodes) == 1 and sender_nodes == receiver_nodes:
        pairs = min(sender_devices, receiver_devices)
        return num_bytes / (sender.intra_node_gb_per_s * 1e9 * pairs) + sender.intra_latency_s
    nics = min(len(sender_nodes), len(receiver_nodes))
    network = num_bytes / (hardware.inter_node_gb_per_s * 1e9 * nics) + hardware.inter_latency_s
    if sender.vendor == receiver.vendor:
        return network
    d2h = num_bytes / (sender.host_link_gb_per_s * 1e9 * sender_devices) + HOST_STAGE_LATENCY_S
    h2d = num_bytes / (receiver.host_link_gb_per_s * 1e9 * receiver_devices) + HOST_STAGE_LATENCY_S
    return d2h + network + h2d


def tied_sync_s(num_bytes: float, hardware: Hardware, *, first: DeviceModel, last: DeviceModel, ranks: int) -> float:
    """The all-reduce of `num_bytes` (each rank's whole tied-embedding gradient) over the `ranks` ranks of the
    first and the last stage (see the module docstring)."""
    if ranks <= 1 or num_bytes <= 0:
        return 0.0
    if hardware.emulate:
        return all_reduce_s(num_bytes, ranks, *first.collective_link())
    if first.vendor == last.vendor and first.vendor != "cpu":  # the vendor's group: no host copies
        return all_reduce_s(num_bytes, ranks, hardware.inter_node_gb_per_s, hardware.inter_latency_s)
    copies = 2 * max(num_bytes / (d.host_link_gb_per_s * 1e9) + HOST_STAGE_LATENCY_S for d in (first, last))
    return copies + all_reduce_s(num_bytes, ranks, hardware.inter_node_gb_per_s, hardware.inter_latency_s)
