"""A plan over several nodes: which ranks each node runs, checked before anything starts.

``plan run plan.json --nnodes K --node-rank i --rdzv-endpoint HOST:PORT`` on each of K nodes: node
i runs local ranks 0..P-1 as global ranks i*P .. i*P+P-1, P the plan's GPUs (processes) per node
(``plan.cluster.gpus_per_node``). The layout (``runtime.layout``: tp fastest, then cp, dp, pp)
then puts a tensor-parallel group on consecutive ranks, so on one node whenever P is a multiple
of tp. Node 0 hosts the rendezvous store at HOST:PORT.

torchrun's rendezvous is "static" here, not c10d: c10d's dynamic rendezvous ignores --node-rank
(torch/distributed/run.py warns "node_rank is only used for static rdzv_backend") and numbers the
nodes by their sorted descriptors (hostname_pid_localid, dynamic_rendezvous.py), so which node got
which ranks would follow host names, not the plan. The static one takes --node-rank as the
agent's group rank, and the agent's rank assignment gives group rank g the global ranks g*P + local
rank (elastic/agent/server/api.py, `_assign_worker_ranks`): the plan's placement. Node 0's agent
hosts the TCPStore at the endpoint; the others connect to it within the rendezvous timeout.
"""

from __future__ import annotations

import hashlib
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from planner.errors import BadInput
from planner.plan import Plan
from runtime.layout import coords

DEFAULT_RDZV_TIMEOUT_S = 300.0
"""How long a node waits for the others at the rendezvous (capped by the run's --timeout-s)."""


@dataclass(frozen=True)
class NodeSpec:
    """This node's share of a multi-node run."""

    num_nodes: int
    node_rank: int
    host: str
    port: int
    rdzv_id: str
    nproc_per_node: int
    rdzv_timeout_s: float

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.nproc_per_node

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.nproc_per_node)


def torchrun_node_args(node: NodeSpec) -> list[str]:
    """torchrun's flags for this node's share of a multi-node launch (static rendezvous at node 0)."""
    return [
        "--nnodes", str(node.num_nodes), "--node-rank", str(node.node_rank),
        "--rdzv-backend", "static", "--rdzv-endpoint", node.endpoint, "--rdzv-id", node.rdzv_id,
        "--rdzv-conf", f"timeout={max(1, int(node.rdzv_timeout_s))}",
    ]


def calibration_node(num_nodes: int | None, node_rank: int | None, endpoint: str | None, per_node: int,
                     timeout_s: float) -> NodeSpec | None:
    """`plan calibrate --nnodes K --node-rank I --rdzv-endpoint HOST:PORT`: this node's share of a
    measurement across nodes (per_node processes on each); None without the flags."""
    if num_nodes is None and endpoint is None and node_rank is None:
        return None
    if num_nodes is None or endpoint is None:
        raise BadInput("plan calibrate: --nnodes K, --node-rank I and --rdzv-endpoint HOST:PORT go together")
    if num_nodes < 2:
        raise BadInput(f"plan calibrate: --nnodes {num_nodes}: measuring across nodes needs 2 or more")
    if node_rank is None or not 0 <= node_rank < num_nodes:
        raise BadInput(f"plan calibrate: --node-rank {node_rank} is out of range for --nnodes {num_nodes} (0 to {num_nodes - 1})")
    host, port = parse_endpoint(endpoint)
    return NodeSpec(num_nodes, node_rank, host, port, f"plan-calibrate-{num_nodes}x{per_node}", per_node,
                    min(DEFAULT_RDZV_TIMEOUT_S, timeout_s))


def rdzv_id_for(plan_path: str | Path) -> str:
    """The rendezvous id every node derives alike: from the plan file's bytes."""
    return "plan-" + hashlib.sha256(Path(plan_path).read_bytes()).hexdigest()[:16]


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6addr]:PORT`` too) -> (host, port); BadInput otherwise."""
    host, sep, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadInput(f"plan run: --rdzv-endpoint {text!r} is not HOST:PORT (node 0's address and a free port, e.g. node0:29500)")
    return host, int(port)


def node_spec(
    plan: Plan, plan_path: str | Path, num_nodes: int | None, node_rank: int | None, endpoint: str | None,
    rdzv_id: str | None, timeout_s: float, rdzv_timeout_s: float | None = None,
) -> NodeSpec | None:
    """The flags --nnodes/--node-rank/--rdzv-endpoint/--rdzv-id checked against each other and the
    plan; None for a single-node run (none of them given)."""
    if num_nodes is None and endpoint is None:
        given = [f for f, v in (("--node-rank", node_rank), ("--rdzv-id", rdzv_id), ("--rdzv-timeout-s", rdzv_timeout_s))
                 if v is not None]
        if given:
            flag = given[0]
            raise BadInput(f"plan run: {flag} needs --nnodes K and --rdzv-endpoint HOST:PORT")
        return None
    if num_nodes is None:
        raise BadInput("plan run: --rdzv-endpoint needs --nnodes K (the number of nodes of the run)")
    if endpoint is None:
        raise BadInput(f"plan run: --nnodes {num_nodes} needs --rdzv-endpoint HOST:PORT (node 0's address and a free port)")
    host, port = parse_endpoint(endpoint)
    if node_rank is None:
        if num_nodes > 1:
            raise BadInput(f"plan run: --nnodes {num_nodes} needs --node-rank (0 to {num_nodes - 1}, a different one on each node)")
        node_rank = 0
    if not 0 <= node_rank < num_nodes:
        raise BadInput(f"plan run: --node-rank {node_rank} is out of range for --nnodes {num_nodes} (0 to {num_nodes - 1})")
    cluster = plan.cluster
    per_node = min(cluster.gpus_per_node, cluster.num_gpus)  # as planner.hardware.make_cluster caps it
    if cluster.num_gpus != num_nodes * per_node:
        nodes = cluster.num_gpus // per_node
        raise BadInput(
            f"{plan_path}: the plan is for {cluster.num_gpus} GPUs in {nodes} node{'s' * (nodes != 1)} of {per_node}, "
            f"not --nnodes {num_nodes} x {per_node}: run it with --nnodes {nodes}, or re-plan with "
            f"--gpus-per-node {cluster.num_gpus // num_nodes if cluster.num_gpus % num_nodes == 0 else 'N'}"
        )
    check_tp_within_nodes(plan, plan_path, per_node)
    return NodeSpec(num_nodes, node_rank, host, port, rdzv_id or rdzv_id_for(plan_path), per_node,
                    min(rdzv_timeout_s or DEFAULT_RDZV_TIMEOUT_S, timeout_s))


def check_tp_within_nodes(plan: Plan, plan_path: str | Path, per_node: int) -> None:
    """A tensor-parallel group (tp consecutive ranks) stays on one node: tp divides the per-node
    count. Only a plan whose tp exceeds a node (the planner warned it crosses the network) spans
    nodes, and then whole ones (tp a multiple of the per-node count); BadInput otherwise."""
    tp = plan.parallel.tp
    if tp <= per_node and per_node % tp == 0:
        return
    if tp > per_node and tp % per_node == 0:
        return  # the plan spans nodes with TP, as it was made (planning warned about it)
    raise BadInput(
        f"{plan_path}: parallel.tp {tp} does not divide the {per_node} GPUs of a node: a tensor-parallel group "
        f"would straddle two nodes; re-plan with a tp that divides {per_node}"
    )


def check_rendezvous(spec: NodeSpec) -> None:
    """Before torchrun starts. Node 0: the endpoint's port is free to host the store. The others:
    node 0's store answers within the rendezvous timeout; BadInput naming the endpoint otherwise."""
    try:
        socket.getaddrinfo(spec.host, spec.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise BadInput(f"plan run: --rdzv-endpoint {spec.endpoint}: cannot resolve {spec.host!r} ({exc.strerror})") from None
    if spec.node_rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", spec.port))
            except OSError as exc:
                raise BadInput(f"plan run: node 0 cannot host the rendezvous at {spec.endpoint}: port {spec.port} "
                               f"is taken ({exc.strerror}); pick a free port for every node") from None
        return
    wait_for_endpoint(spec)


def wait_for_endpoint(spec: NodeSpec, poll_s: float = 0.5) -> None:
    """Poll node 0's rendezvous store until it accepts a connection; BadInput past the timeout."""
    deadline = time.monotonic() + spec.rdzv_timeout_s
    last = "no answer"
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((spec.host, spec.port), timeout=max(0.1, min(2.0, left))):
                return
        except OSError as exc:
            last = exc.strerror or type(exc).__name__
        left = deadline - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(poll_s, left))
    raise BadInput(
        f"plan run: node {spec.node_rank}: the rendezvous at {spec.endpoint} did not answer within "
        f"{spec.rdzv_timeout_s:g} s ({last}): is node 0 running `plan run ... --node-rank 0` with this endpoint?"
    )


def node_lines(plan: Plan, per_node: int) -> list[str]:
    """Which ranks, at which (pp, dp, cp, tp) coordinates, each node runs: one line a node."""
    p = plan.parallel
    lines = []
    for node in range(p.world_size // per_node):
        cells = []
        for rank in range(node * per_node, (node + 1) * per_node):
            c = coords(rank, p.dp, p.tp, p.pp, p.cp)
            cells.append(f"{rank} (" + " ".join(
                f"{axis}{idx}" for axis, idx, size in
                (("pp", c.pp_index, p.pp), ("dp", c.dp_index, p.dp), ("cp", c.cp_index, p.cp), ("tp", c.tp_index, p.tp))
                if size > 1) + ")")
        lines.append(f"node {node}: ranks " + ", ".join(cells))
    return lines
