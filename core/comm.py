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
    from torch._C._profiler import _TensorMetadata

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
    from torch._C._profiler import _EventType

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
    groups of the whole world; in_groups gives them for the backend's groups."""
    out: dict[str, dict] = {}
    for e in _outermost_ops(events, spans, KINDS):
        kind = KINDS[e.name]
        whole, shard = message_parts(kind, list(e.typed[1].inputs))
        entry = out.setdefault(kind, {"calls": 0, "whole_bytes": 0, "shard_bytes": 0})
        entry["calls"] += 1
        entry["whole_bytes"] += whole
        entry["shard_bytes"] += shard
    return in_groups(out, {}, world_size)


COPIES = ("aten::copy_",)  # every device-to-device copy (.to(), pinned copies, non_blocking) ends in it


def transfers(events, spans: list[tuple[int, int]]) -> dict:
    """The host<->device copies of the step (aten::copy_ whose two tensors sit on different device
    types): bytes to the device, bytes to the host, and copies. ZeRO-Offload, ZeRO-Infinity and
    FSDP's CPU offload move gradients and parameters this way; on a CPU-only run host and device
    are one, so there is nothing to count."""
    from torch._C._profiler import _TensorMetadata

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
    """Per kind: calls, message bytes and bus bytes for the group the kind runs in (the profiler
    records no group, so the backend says: HYBRID_SHARD's gathers run in a node, its all-reduce
    across nodes); kinds the backend does not name run over the whole world."""
    out = {}
    for kind, v in measured.items():
        group = groups.get(kind, world_size)
        size = v["whole_bytes"] + v["shard_bytes"] * group
        out[kind] = {"calls": v["calls"], "bytes": size, "bus_bytes": size * bus_factor(kind, group),
                     "whole_bytes": v["whole_bytes"], "shard_bytes": v["shard_bytes"]}
    return out


def theory(formula: str, terms: dict[str, tuple[float, float, int]], world_size: int) -> dict:
    """The expected collectives of one step, as the record keeps them beside the measurement.

    `terms`: kind -> (elements per message, bytes per element, ranks in its group); the bus bytes
    of each kind follow the same ring accounting as the measurement.
    """
    by_kind = {kind: {"bytes": n * b, "bus_bytes": n * b * bus_factor(kind, group), "group_size": group}
               for kind, (n, b, group) in terms.items() if n}
    return {"formula": formula, "world_size": world_size, "by_kind": by_kind,
            "bytes": sum(v["bytes"] for v in by_kind.values()),
            "bus_bytes": sum(v["bus_bytes"] for v in by_kind.values())}
