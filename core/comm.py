"""The collective communication of one training step, measured the same way for every backend.

Every collective a backend issues (DDP's reducer, FSDP1, FSDP2, DeepSpeed: all through
torch.distributed) passes through one of c10d's dispatcher ops (`c10d::allreduce_`,
`c10d::_allgather_base_`, `c10d::_reduce_scatter_base_`, ...), which torch.profiler records with
the shapes and dtypes of their tensors. So the profiled step (core/memory_profile.py) gives, per
kind of collective, the number of calls and the bytes of the logical messages, whatever the
process-group backend: gloo on CPU sends the same messages as nccl on GPUs (how each implements
them, e.g. gloo's reduce-scatter as an all-reduce underneath, is below this level).

Message size follows nccl-tests: an all-reduce's tensor, an all-gather's whole output, a
reduce-scatter's whole input. Bus bytes, what the usual ring algorithm moves through each rank's
link, are the message times 2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and
all-to-all, and 1 for broadcast and point-to-point (nccl-tests' busbw accounting).
"""

from __future__ import annotations

import torch.distributed as dist
from torch._C._profiler import _EventType, _TensorMetadata
from torch.distributed import distributed_c10d as c10d

# c10d dispatcher op -> kind of collective
KINDS = {
    "c10d::allreduce_": "all_reduce", "c10d::allreduce_coalesced_": "all_reduce",
    "c10d::_allgather_base_": "all_gather", "c10d::allgather_": "all_gather",
    "c10d::allgather_coalesced_": "all_gather", "c10d::allgather_into_tensor_coalesced_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter", "c10d::reduce_scatter_": "reduce_scatter",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d::broadcast_": "broadcast", "c10d::reduce_": "reduce", "c10d::gather_": "gather", "c10d::scatter_": "scatter",
    "c10d::alltoall_": "all_to_all", "c10d::alltoall_base_": "all_to_all",
    "c10d::send": "send_recv", "c10d::recv_": "send_recv", "c10d::recv_any_source_": "send_recv",
    "c10d::barrier": "barrier",
}
GATHERING = ("all_gather", "reduce_scatter")  # the message is the larger side: n shards


def bus_factor(kind: str, n: int) -> float:
    if n <= 1 or kind == "barrier":
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def _tensor_bytes(value) -> int:
    """Bytes of the tensors in one op input (a tensor, or a list, possibly nested)."""
    if isinstance(value, _TensorMetadata):
        n = 1
        for s in value.sizes:
            n *= s
        return n * value.dtype.itemsize
    if isinstance(value, list):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def message_parts(kind: str, inputs: list) -> tuple[int, int]:
    """The logical message of one c10d op, from its recorded inputs (output and input tensors), as
    (bytes seen whole, bytes of a shard seen alone): exactly one of them is nonzero.

    An all-gather's message is its whole output, n shards; a reduce-scatter's its whole input: the
    larger side. The profiler records some outputs without their tensors (c10d::allgather_'s
    list of lists, FSDP1's gathers); there only the shard is seen, and the whole is n shards for
    the size n of the group the op runs in, which the profiler does not record (in_groups)."""
    sides = [_tensor_bytes(v) for v in inputs[:2]]
    if kind in GATHERING:
        whole = max(sides, default=0)
        shard = min((b for b in sides if b), default=0)
        return (whole, 0) if whole > shard else (0, shard)
    return (sides[0] if sides else 0), 0


def _outermost_ops(events, spans: list[tuple[int, int]], names) -> list:
    """The profiler's op events named in `names` that start inside `spans` (the step's phases, so
    the harness's own small exchanges between steps are left out) and sit inside no other of them
    (a coalesced collective's parts, a copy inside a copy)."""
    found = []
    for e in events:
        if e.name not in names or e.typed[0] != _EventType.TorchOp:
            continue
        if not any(start <= e.start_time_ns <= end for start, end in spans):
            continue
        parent = e.parent
        while parent is not None and parent.name not in names:
            parent = parent.parent
        if parent is None:
            found.append(e)
    return found


def collectives(events, spans: list[tuple[int, int]], world_size: int) -> dict:
    """Per kind, the calls and bytes of the c10d ops of the step. Bytes and bus bytes are for
    groups of the whole world; in_groups gives them for the backend's groups. Where a gathering op
    shows both its sides, its group's size is their ratio (n shards make the whole): `by_group`
    keeps those calls and their whole bytes by group size, so one kind run in two groups (FSDP2's gather after
    a partial reshard, ZeRO++'s secondary partition) is priced in each."""
    out: dict[str, dict] = {}
    for e in _outermost_ops(events, spans, KINDS):
        kind = KINDS[e.name]
        inputs = list(e.typed[1].inputs)
        whole, shard = message_parts(kind, inputs)
        entry = out.setdefault(kind, {"calls": 0, "whole_bytes": 0, "shard_bytes": 0, "by_group": {}})
        entry["calls"] += 1
        entry["whole_bytes"] += whole
        entry["shard_bytes"] += shard
        if kind in GATHERING and whole:
            sides = sorted(_tensor_bytes(v) for v in inputs[:2])
            if sides[0] and sides[1] % sides[0] == 0:
                seen = entry["by_group"].setdefault(str(sides[1] // sides[0]), {"calls": 0, "bytes": 0})  # JSON keys
                seen["calls"] += 1
                seen["bytes"] += whole
    return in_groups(out, {}, world_size)


COPIES = ("aten::copy_",)  # every device-to-device copy (.to(), pinned copies, non_blocking) ends in it


def transfers(events, spans: list[tuple[int, int]]) -> dict:
    """The host<->device copies of the step (aten::copy_ whose two tensors sit on different device
    types): bytes to the device, bytes to the host, and copies. ZeRO-Offload, ZeRO-Infinity and
    FSDP's CPU offload move gradients and parameters this way; on a CPU-only run host and device
    are one, so there is nothing to count."""
    out = {"to_device_bytes": 0, "to_host_bytes": 0, "copies": 0}
    for e in _outermost_ops(events, spans, COPIES):
        dst, src = (list(e.typed[1].inputs) + [None, None])[:2]
        if not (isinstance(dst, _TensorMetadata) and isinstance(src, _TensorMetadata)):
            continue
        if dst.device.type == src.device.type:
            continue
        out["to_host_bytes" if dst.device.type == "cpu" else "to_device_bytes"] += _tensor_bytes(dst)
        out["copies"] += 1
    return out


def totals(per_kind: dict) -> tuple[int, float]:
    return sum(v["bytes"] for v in per_kind.values()), sum(v["bus_bytes"] for v in per_kind.values())


def in_groups(measured: dict, groups: dict[str, int], world_size: int) -> dict:
    """Per kind: calls, message bytes and bus bytes for the group the kind runs in: the group its
    calls' two sides show (by_group), else the one the backend names (the profiler records no group:
    HYBRID_SHARD's gathers run in a node, its all-reduce across nodes); kinds the backend does not
    name run over the whole world."""
    out = {}
    for kind, v in measured.items():
        group = groups.get(kind, world_size)
        seen = v.get("by_group") or {}
        size = v["whole_bytes"] + v["shard_bytes"] * group
        rest = size - sum(b["bytes"] for b in seen.values())
        bus = rest * bus_factor(kind, group) + sum(b["bytes"] * bus_factor(kind, int(g)) for g, b in seen.items())
        out[kind] = {"calls": v["calls"], "bytes": size, "bus_bytes": bus,
                     "whole_bytes": v["whole_bytes"], "shard_bytes": v["shard_bytes"], "by_group": seen}
    return out


def process_groups() -> dict[str, tuple[tuple[int, ...], int]]:
    """{a process group's name: (the global ranks in it, collectives it has issued)} for every group
    of this rank that torch.distributed knows: c10d numbers each group's collectives (its sequence
    number), so two readings around a step count the step's calls per group, which the profiler
    cannot tell apart. (Several groups may hold the same ranks: DeepSpeed's copies of the world,
    a device mesh's dimensions.)"""
    if not dist.is_initialized():
        return {}
    out = {}
    for pg, ranks in list(c10d._world.pg_group_ranks.items()):
        try:
            out[c10d._world.pg_names.get(pg, str(id(pg)))] = (tuple(sorted(ranks)), pg._get_sequence_number_for_group())
        except (RuntimeError, AttributeError, NotImplementedError):  # a backend that keeps no count (fake)
            continue
    return out


def by_link(measured: dict, groups: dict | None, theory: dict) -> dict | None:
    """The step's traffic by link: inside a node and between nodes (summary.json's comm.links).

    Calls per link are measured (each group's count, `groups`: [(ranks, calls)], over its ranks' nodes);
    bytes per link are each measured kind's, on the link the theory puts that kind's group (the
    profiler records no group); `calls_beyond_placement` says how many calls each link counted
    beyond the kinds so placed, which checks the placement against the run."""
    per_node = theory.get("ranks_per_node")
    if not per_node or groups is None:
        return None
    links = {link: {"calls": 0, "bytes": 0, "bus_bytes": 0.0, "kind_calls": 0, "theory_bus_bytes": 0.0}
             for link in ("intra_node", "inter_node")}
    for ranks, calls in groups:
        if len(ranks) > 1 and calls:
            links["inter_node" if len({r // per_node for r in ranks}) > 1 else "intra_node"]["calls"] += calls
    placed: dict[str, dict[int, bool]] = {}  # kind -> {group size: spans nodes}
    for kind, term in theory["by_kind"].items():
        placed.setdefault(base_kind(kind), {}).setdefault(term["group_size"], bool(term["spans_nodes"]))
        links["inter_node" if term["spans_nodes"] else "intra_node"]["theory_bus_bytes"] += term["bus_bytes"]
    world = theory["world_size"]
    unplaced = []
    for kind, v in measured.items():
        if kind == "barrier":
            continue
        where = placed.get(kind) or {world: spans_nodes(world, 1, world, per_node)}  # unnamed: the world's
        # Bytes whose calls showed their group (by_group) go where the theory puts a group of that
        # size; the rest where it puts the kind, if it puts it in one place.
        seen = v.get("by_group") or {}
        parts = [(where.get(int(g)), b["bytes"], b["calls"], int(g)) for g, b in seen.items()]
        rest = v["bytes"] - sum(p[1] for p in parts)
        calls = v["calls"] - sum(p[2] for p in parts)
        if rest > 0 or calls > 0:
            one = next(iter(where.values())) if len(set(where.values())) == 1 else None
            parts.append((one, rest, calls, None))
        if any(crosses is None for crosses, *_ in parts):
            unplaced.append(kind)
            continue
        for crosses, b, n, g in parts:
            link = links["inter_node" if crosses else "intra_node"]
            link["bytes"] += b
            link["bus_bytes"] += b * bus_factor(kind, g or next(s for s, c in where.items() if c == crosses))
            link["kind_calls"] += n
    # Calls a link counted beyond those of the kinds placed on it (negative: fewer): where the
    # placement is right, a few small ones the theory leaves out (a gradient norm's all-reduce).
    beyond = {name: link["calls"] - link["kind_calls"] for name, link in links.items()}
    return {**links, "ranks_per_node": per_node, "unplaced_kinds": unplaced, "calls_beyond_placement": beyond}


def base_kind(kind: str) -> str:
    """The c10d kind of a theory's term: "all_gather:post_forward" is an all_gather in a group of its own."""
    return kind.split(":")[0]


def spans_nodes(group: int, stride: int, world: int, per_node: int | None) -> bool | None:
    """Whether some group of `group` ranks `stride` apart (consecutive: 1), as a mesh lays them out over
    `world` ranks, reaches beyond one node of `per_node` consecutive ranks (torchrun's and Slurm's
    numbering); None where the nodes are unknown."""
    if per_node is None:
        return None
    for base in range(0, world, group * stride):
        for first in range(base, base + stride):
            if first // per_node != (first + (group - 1) * stride) // per_node:
                return True
    return False


def theory(formula: str, terms: dict[str, tuple], world_size: int, per_node: int | None = None) -> dict:
    """The expected collectives of one step, as the record keeps them beside the measurement.

    `terms`: kind -> (elements per message, bytes per element, ranks in its group[, stride]); the bus
    bytes of each kind follow the same ring accounting as the measurement. `stride`: how far apart a
    group's ranks are (1, the default: consecutive ranks, a shard group; a replica group of HSDP takes
    one rank of each shard group). A kind may be named "kind:label" where one c10d kind runs in two
    groups (FSDP2's backward gather in its post-forward group). With `per_node`, each term says whether
    its group spans nodes, and `inter_node_bus_bytes` sums those that do: what crosses the slow link.
    """
    by_kind = {}
    for kind, (n, b, group, *rest) in terms.items():
        if not n:
            continue
        stride = rest[0] if rest else 1
        by_kind[kind] = {"bytes": n * b, "bus_bytes": n * b * bus_factor(base_kind(kind), group), "group_size": group,
                         "stride": stride, "spans_nodes": spans_nodes(group, stride, world_size, per_node)}
    out = {"formula": formula, "world_size": world_size, "by_kind": by_kind,
           "bytes": sum(v["bytes"] for v in by_kind.values()),
           "bus_bytes": sum(v["bus_bytes"] for v in by_kind.values())}
    if per_node is not None:
        out["ranks_per_node"] = per_node
        out["inter_node_bus_bytes"] = sum(v["bus_bytes"] for v in by_kind.values() if v["spans_nodes"])
    return out
