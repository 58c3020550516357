"""Which link each parallel group's traffic crosses.

Ranks are laid out tensor-parallel first, then context-parallel, then data-parallel, then
pipeline (Megatron-LM's and torchtitan's order, tp fastest): a TP group is `tp` consecutive ranks,
a CP group strides by `tp`, an EP group is `ep` consecutive ranks, tp ranks included (inside a node
first), the dp x cp ranks that hold the same weights (ZeRO's and the gradient
average's group) are `tp`-strided too, pipeline neighbours are `tp * cp * dp` ranks apart. A group
that cannot stay inside one node uses the inter-node network: each of its members in a node
sends through its own port (one NIC per GPU), so the group's bandwidth is the per-GPU figure
times its members per node (hardware.Cluster).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.cost.comm import Affine, Link, all_to_all, ring_step_s
from planner.cost.constants import LINK_EFFICIENCY
from planner.cost.memo import cache_of
from planner.cost.setup import Candidate
from planner.hardware import Cluster


@dataclass(frozen=True)
class Links:
    tp: Link
    dp: Link
    """The group ZeRO shards and gradients are averaged over (dp x cp ranks, or one HSDP shard group)."""
    pp: Link
    tp_spans_nodes: bool
    dp_spans_nodes: bool
    pp_spans_nodes: bool
    dp_replicate: Link | None = None
    """HSDP: a replica group (one rank per shard group, one per node), across nodes."""
    cp: Link | None = None
    """A context-parallel group (cp ranks strided by tp), None without CP."""
    cp_spans_nodes: bool = False
    ep: Link | None = None
    """An expert-parallel group's all-to-all (ep consecutive ranks), None without EP."""
    ep_spans_nodes: bool = False
    expert_dp: Link | None = None
    """The ranks that hold the same experts (dp x cp x tp / ep of them, strided by ep: one in each EP
    group), which average and shard the experts' gradients and state; None without EP."""


def _link(cluster: Cluster, group_size: int, spans: bool, members_per_node: int = 1) -> Link:
    step = 0.0
    if cluster.gpu.origin != "measured":  # NCCL's ring steps (a measured CPU runs gloo)
        step = ring_step_s(group_size, -(-group_size // members_per_node) if spans else 1)
    # the local CPU's gloo figures: measured with that many processes all in one group, every one
    # busy at once; a plan's smaller groups run while all of its processes compete for the cores,
    # so each collective costs what the plan's process count measured (not its own group's size)
    measured = cluster.gpu.collective(cluster.num_gpus) if group_size > 1 else ()
    return Link(cluster.bandwidth_Bps(group_size, spans, members_per_node), cluster.latency_s(group_size, spans), step,
                measured)


def _all_to_all_link(cluster: Cluster, n: int, spans: bool, members_per_node: int) -> Link:
    """An all-to-all over n GPUs, `members_per_node` of them in each node: each GPU sends 1/n of
    its data to every other; the (members - 1) / n inside its node go over the node's links, the
    (n - members) / n to other nodes through its own port (one NIC per GPU, all of them busy at
    once). Expressed as the one bandwidth that moves (n - 1) / n of the data in that time."""
    if not spans:
        return _link(cluster, n, False)
    m = members_per_node
    per_byte = (m - 1) / n / cluster.gpu.intra_node_bandwidth_Bps + (n - m) / n / cluster.gpu.inter_node_bandwidth_Bps
    return Link((n - 1) / n / per_byte, cluster.latency_s(n, True), 0.0)


def remote_nodes_per_token(experts: int, top_k: int, nodes: int, node_limit: int | None = None) -> float:
    """How many nodes other than its own hold at least one of a token's top_k experts, on average:
    the experts spread evenly over `nodes` nodes, the k chosen (distinct) with equal chances among
    those of `node_limit` nodes (all of them when None; at least the nodes k experts need), and
    the token's own node as likely to be one of them as any other."""
    if nodes <= 1 or top_k <= 0:
        return 0.0
    per_node = experts / nodes
    limit = nodes if node_limit is None else min(nodes, max(node_limit, math.ceil(top_k / per_node)))
    pool = limit * per_node
    # chance that one of the `limit` nodes holds none of the k: k draws without replacement
    p_none = 1.0
    for i in range(min(top_k, int(pool))):
        p_none *= max(0.0, (pool - per_node - i) / (pool - i))
    return limit * (1 - p_none) * (nodes - 1) / nodes


def ep_members_per_node(cluster: Cluster, cand: Candidate) -> int:
    """Members of one expert-parallel group in a node (consecutive ranks, as a node's are)."""
    return min(cand.ep, cluster.gpus_per_node)


def deepep_all_to_all(cluster: Cluster, cand: Candidate, experts: int, top_k: int, node_limit: int | None,
                      link: Link) -> Affine:
    """DeepEP's dispatch (or combine) over an expert-parallel group (Training.ep_dispatch): per byte
    of a rank's rows (its tokens x top_k), the seconds to send each token once to every other node
    that holds one of its experts (`remote_nodes_per_token`), through the rank's own network port,
    while the rows that stay in the node, or arrive from the network for another GPU of it, cross
    NVLink at the same time: the longer of the two. A group inside one node is a plain all-to-all."""
    members = ep_members_per_node(cluster, cand)
    if cand.ep <= members or link.measured:  # inside a node, or this cluster's all-to-all measured
        return all_to_all(cand.ep, link)
    nodes = cand.ep // members
    network = remote_nodes_per_token(experts, top_k, nodes, node_limit) / top_k / cluster.gpu.inter_node_bandwidth_Bps
    nvlink = (members - 1) / members / cluster.gpu.intra_node_bandwidth_Bps
    return Affine(link.latency_s * math.ceil(math.log2(cand.ep)), max(network, nvlink) / LINK_EFFICIENCY)


def links(cluster: Cluster, cand: Candidate) -> Links:
    """The links of `cand`'s groups (kept per cluster and layout: the search asks for thousands)."""
    cache = cache_of(cluster)
    key = ("links", cand.tp, cand.pp, cand.dp, cand.cp, cand.ep, cand.dp_replicate)
    if key not in cache:
        cache[key] = _links(cluster, cand)
    return cache[key]


def _links(cluster: Cluster, cand: Candidate) -> Links:
    per_node = cluster.gpus_per_node
    shard, rep = cand.dp_shard, cand.dp_replicate
    tp_spans = cand.tp > per_node
    dp_spans = cand.tp * shard > per_node
    cp_spans = cand.cp > 1 and cand.tp * cand.cp > per_node
    ep_spans = cand.ep > 1 and cand.ep > per_node
    pp_spans = cand.pp > 1 and cand.tp * cand.grad_ranks >= per_node
    # members of one group in a node, whose network ports it uses at once: a TP group fills its
    # nodes; a DP group strides by tp, so a node holds per_node / tp of it (at least one); an
    # HSDP replica group strides by a shard group: one member per node, each of the shard
    # group's ranks on its own port; a CP group strides by tp, as a DP group
    tp_members = min(cand.tp, per_node)
    dp_members = min(shard, max(1, per_node // cand.tp))
    # the experts' replicas stride by a whole EP group (ep consecutive ranks): an EP group that fills
    # a node leaves one of them in each node, each on its own port
    expert_stride, replicas = cand.ep, cand.expert_replicas
    expert_dp = (_link(cluster, replicas, expert_stride * replicas > per_node, min(replicas, max(1, per_node // expert_stride)))
                 if cand.ep > 1 and replicas > 1 else None)
    return Links(
        tp=_link(cluster, cand.tp, tp_spans, tp_members),
        dp=_link(cluster, shard, dp_spans, dp_members),
        pp=_link(cluster, 2, pp_spans),
        tp_spans_nodes=tp_spans,
        dp_spans_nodes=dp_spans,
        pp_spans_nodes=pp_spans,
        dp_replicate=_link(cluster, rep, cand.tp * cand.grad_ranks > per_node) if rep > 1 else None,
        cp=_link(cluster, cand.cp, cp_spans, min(cand.cp, max(1, per_node // cand.tp))) if cand.cp > 1 else None,
        cp_spans_nodes=cp_spans,
        ep=_all_to_all_link(cluster, cand.ep, ep_spans, ep_members_per_node(cluster, cand))
        if cand.ep > 1 else None,
        ep_spans_nodes=ep_spans,
        expert_dp=expert_dp,
    )
