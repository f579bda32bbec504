"""The time of the collectives one rank issues (accounting.collectives counts them and their
bytes; this module only times them): latency + bytes / bandwidth over the link the group's
placement gives it.

Placement: ranks are numbered tp innermost, then cp, then dp (ep inside it), then pp, and a
node holds `gpus_per_node` consecutive ranks. A group whose members lie `stride` ranks apart
fits in one node when stride x size <= gpus_per_node, and then uses NVLink; otherwise its ring
crosses nodes and runs at the network bandwidth per GPU (every GPU has its own NIC, so NCCL's
rings run one per NIC). Strides: tp 1, cp t, the data-parallel group (dp x cp ranks, and ep
inside it) t, pp t cp dp; the tied-embedding group (first and last stage) (pp - 1) t cp dp.

A ring collective of n ranks takes 2 (n - 1) steps (all-reduce) or n - 1 (all-gather,
reduce-scatter, broadcast, all-to-all), each paying the link's latency, and sends
``Collective.sent`` bytes a rank (2 (n-1)/n or (n-1)/n of the payload) at the bus bandwidth,
the link's times Efficiency.nvlink_fraction or network_fraction. A point-to-point send, a
ring-attention hop and a hop of a decomposed tp collective are one step.

Plan's memory table also shows how well each cp ring step hides (``ring_ratio``): it sends one
block of k and v, c [2, b, k/t, s/cp, d] for k kv heads, while the rank computes one block of
attention, 4 b (n/t) d s^2 / (2 cp^2) FLOPs (a cp-th of its causal attention; under a sliding
window, of the pairs the window keeps in the layers that slide), here at ASSUMED_MFU of the
peak; the transfer hides when it is the shorter of the two. The ring stays inside a node
(NVLink) while tp x cp <= GPUS_PER_NODE, else it crosses nodes (INTER_NODE_GB_S).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatronish.accounting.collectives import Collective
from megatronish.accounting.hardware import GPUS_PER_NODE, INTER_NODE_GB_S, Device
from megatronish.accounting.roofline import Efficiency, attention_flops
from megatronish.config import Config, Derived, attention_window

# ring_ratio's block compute: a rough rate, this fraction of the peak (the step-time model's
# attention time is accounting.layer_time's).
ASSUMED_MFU = 0.40


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


def inside_node(mesh: Mesh, group: str, size: int, device: Device) -> bool:
    """Whether a `group` of `size` ranks lies within one node."""
    return mesh.stride(group) * size <= device.gpus_per_node


def link(mesh: Mesh, group: str, size: int, device: Device, eff: Efficiency) -> tuple[float, float]:
    """(bus bandwidth bytes/s, latency s per ring step) of a group of `size` ranks."""
    if inside_node(mesh, group, size, device):
        return device.nvlink_gb_s * 1e9 * eff.nvlink_fraction, eff.nvlink_latency_s
    return device.network_gb_s * 1e9 * eff.network_fraction, eff.network_latency_s


def ring_steps(kind: str, size: int) -> int:
    """Latency-bound steps of one call."""
    if kind in ("p2p", "cp_ring", "tp_ring"):
        return 1
    return (2 if kind == "all_reduce" else 1) * (size - 1)


def collective_seconds(op: Collective, mesh: Mesh, device: Device, eff: Efficiency) -> float:
    """Seconds all `op.count` calls of one kind of collective take on this rank's links."""
    bandwidth, latency = link(mesh, op.group, op.size, device, eff)
    return op.count * ring_steps(op.kind, op.size) * latency + op.sent / bandwidth


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
    flops = attention_flops(b, heads, s // cp, s, derived.head_dim, True, window) / cp
    link = link_gb_s if tp * cp <= GPUS_PER_NODE else INTER_NODE_GB_S
    return (kv_bytes / (link * 1e9)) / (flops / (peak_flops * ASSUMED_MFU))
