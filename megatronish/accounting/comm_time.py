"""The time of the collectives one rank issues (accounting.collectives counts them and their
bytes; this module only times them): latency + bytes / bandwidth over the links the group's
placement in the cluster (accounting.cluster) leaves it, by NCCL's algorithms.

Placement (``Placement``): ranks are numbered tp innermost, then cp, then dp (ep inside it),
then pp, and a node holds `gpus_per_node` consecutive ranks. A group whose members lie `stride`
ranks apart fits in one node when stride x size <= gpus_per_node (its link: the intra-node one;
without an NVSwitch the node's concurrent groups share it); otherwise it has k = gpus_per_node
/ stride members a node (1 when stride >= gpus_per_node) on size / k nodes, and the node's
gpus_per_node / k groups of that kind, which run at once, share its NICs: each gets k NICs'
worth (nics x bandwidth x k / gpus_per_node). A dp group with one rank a node gets that GPU's
NIC; one with eight ranks a node eight NICs. Above a pod (a group spanning more than pod_gpus
ranks) or anywhere across nodes without rail optimization, the oversubscription divides that.
Strides: tp 1, cp t, the data-parallel group (dp x cp ranks, and ep inside it) t, pp t cp dp;
the tied-embedding group (first and last stage) (pp - 1) t cp dp.

Algorithms (NCCL's; the fastest for the size, as NCCL's tuner picks):
- ring: 2 (n - 1) steps (all-reduce) or n - 1 (all-gather, reduce-scatter, broadcast,
  all-to-all), each paying the slowest hop's latency, and ``Collective.sent`` bytes a rank
  (bus-bandwidth factor 2 (n-1)/n or (n-1)/n of the payload) at the bus bandwidth: the smaller
  of the intra-node link x Efficiency.nvlink_fraction and, across nodes, the NICs the placement
  leaves x network_fraction;
- tree (all-reduce across nodes): a reduction up and a broadcast down a double binary tree of
  the nodes and a chain inside each, 2 (log2 nodes x network latency + (k - 1) x intra-node
  latency), sending 2 x payload through the same bandwidth;
- in-network reduction (all-reduce across nodes, with the cluster's SHARP): each byte sent once
  up and received once down, payload at that bandwidth, 2 network latencies and the chain.
A point-to-point send, a ring-attention hop and a hop of a decomposed tp collective are one
step on their link (a GPU's own share of the NICs across nodes).

Plan's memory table also shows how well each cp ring step hides (``ring_ratio``): it sends one
block of k and v, c [2, b, k/t, s/cp, d] for k kv heads, while the rank computes one block of
attention, 4 b (n/t) d s^2 / (2 cp^2) FLOPs (a cp-th of its causal attention; under a sliding
window, of the pairs the window keeps in the layers that slide), here at ASSUMED_MFU of the
peak; the transfer hides when it is the shorter of the two. The ring stays inside a node
(NVLink) while tp x cp <= GPUS_PER_NODE, else it crosses nodes (INTER_NODE_GB_S).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil, log2

from megatronish.accounting.cluster import Cluster
from megatronish.accounting.collectives import Collective
from megatronish.accounting.hardware import GPUS_PER_NODE, INTER_NODE_GB_S
from megatronish.accounting.roofline import Efficiency, attention_flops
from megatronish.config import Config, Derived, attention_window

# ring_ratio's block compute: a rough rate, this fraction of the peak (the step-time model's
# attention time is accounting.layer_time's).
ASSUMED_MFU = 0.40
ONE_STEP = ("p2p", "cp_ring", "tp_ring", "cp_state")


@dataclass(frozen=True)
class Mesh:
    """The parallel degrees of a layout (world = tp cp dp pp)."""

    tp: int
    cp: int
    dp: int
    pp: int

    def stride(self, group: str) -> int:
        """Ranks between neighbours of a group (see module doc)."""
        return {
            "tp": 1,
            "world": 1,
            "cp": self.tp,
            "tp_cp": 1,
            "dp": self.tp,
            "ep": self.tp,
            "pp": self.tp * self.cp * self.dp,
            "embedding": max(1, self.pp - 1) * self.tp * self.cp * self.dp,
        }[group]


@dataclass(frozen=True)
class Placement:
    """Where a group of `size` ranks lies: per_node members a node on `nodes` nodes, and the
    bus bandwidth (bytes/s) its links leave it (see module doc)."""

    per_node: int
    nodes: int
    bandwidth: float

    @property
    def inside(self) -> bool:
        return self.nodes == 1


def placement(
    mesh: Mesh, group: str, size: int, cluster: Cluster, eff: Efficiency, one_step: bool = False
) -> Placement:
    """The Placement of a `group` of `size` ranks (module doc); one_step: a point-to-point
    hop, which crosses nodes on its GPU's own share of the NICs."""
    stride, gpn = mesh.stride(group), cluster.gpus_per_node
    per_node = max(1, min(size, gpn // stride)) if stride < gpn and not one_step else 1
    nodes = 1 if stride * size <= gpn else max(2, ceil(size / per_node))
    intra = cluster.intra_node_gb_s * 1e9 * eff.nvlink_fraction
    if not cluster.nvswitch:
        intra *= per_node / gpn
    if nodes == 1:
        return Placement(per_node, 1, intra)
    network = cluster.nics_per_node * cluster.nic_gb_s * 1e9 * per_node / gpn
    above_pod = cluster.pod_gpus and stride * size > cluster.pod_gpus
    if above_pod or not cluster.rail_optimized:
        network /= cluster.oversubscription
    return Placement(per_node, nodes, min(intra, network * eff.network_fraction))


def inside_node(mesh: Mesh, group: str, size: int, cluster: Cluster) -> bool:
    """Whether a `group` of `size` ranks lies within one node."""
    return mesh.stride(group) * size <= cluster.gpus_per_node


def ring_steps(kind: str, size: int) -> int:
    """Latency-bound steps of one call of the ring algorithm."""
    if kind in ONE_STEP:
        return 1
    return (2 if kind == "all_reduce" else 1) * (size - 1)


def collective_seconds(op: Collective, mesh: Mesh, cluster: Cluster, eff: Efficiency) -> float:
    """Seconds all `op.count` calls of one kind of collective take on this rank's links, by
    the fastest of NCCL's algorithms for it (module doc)."""
    where = placement(mesh, op.group, op.size, cluster, eff, op.kind in ONE_STEP)
    hop = eff.nvlink_latency_s if where.inside else eff.network_latency_s
    ring = op.count * ring_steps(op.kind, op.size) * hop + op.sent / where.bandwidth
    if op.kind != "all_reduce" or where.inside:
        return ring
    chain = (where.per_node - 1) * eff.nvlink_latency_s
    tree_latency = 2 * (ceil(log2(where.nodes)) * eff.network_latency_s + chain)
    tree = op.count * tree_latency + 2 * op.payload * op.count / where.bandwidth
    best = min(ring, tree)
    if cluster.sharp:
        sharp = op.count * 2 * (eff.network_latency_s + chain)
        best = min(best, sharp + op.payload * op.count / where.bandwidth)
    return best


def ring_ratio(cfg: Config, derived: Derived, peak_flops: float, link_gb_s: float) -> float | None:
    """A cp ring step's transfer time over its block compute time, for one layer and
    micro-batch forward (None at cp 1; see module doc); link_gb_s: the NVLink bandwidth of one
    GPU, peak_flops its peak."""
    b, s, cp, tp = cfg.train.micro_batch_size, cfg.train.seq_len, derived.cp, derived.tp
    if cp == 1:
        return None
    width = 2 if cfg.train.bf16_autocast else 4
    kv_dims = derived.head_dim + derived.v_head_dim
    kv_bytes = b * (derived.n_kv_head // tp) * (s // cp) * kv_dims * width
    window = attention_window(cfg.model, cfg.model.n_layer - 1)  # the last layer slides, if any
    heads = cfg.model.n_head // tp
    flops = (
        attention_flops(b, heads, s // cp, s, derived.head_dim, True, window, derived.v_head_dim)
        / cp
    )
    link = link_gb_s if tp * cp <= GPUS_PER_NODE else INTER_NODE_GB_S
    return (kv_bytes / (link * 1e9)) / (flops / (peak_flops * ASSUMED_MFU))
