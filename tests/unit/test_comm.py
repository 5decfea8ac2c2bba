"""Communication volume: the collectives of a step, measured for every backend, against theory."""

import pytest

from analysis import load_runs
from conftest import REPO
from core.comm import bus_factor, theory

# Where a backend's own code departs from the textbook accounting, by design (the ratio of
# measured to theoretical bus bytes, and why):
EXPLAINED = {
    # DeepSpeed 0.19's ZeRO-1/2 all-reduce each gradient bucket (stage_1_and_2.average_tensor:
    # use_multi_rank_bucket_allreduce, default true) where the ZeRO paper reduce-scatters: 2 Psi
    # of all-reduce plus Psi of all-gather against the paper's Psi + Psi.
    "deepspeed.z1": 1.5, "deepspeed.z2": 1.5, "deepspeed.z2_offload": 1.5,
    # ZeRO-3 with stage3_max_live_parameters and stage3_max_reuse_distance at 1e9 (the shipped
    # configs) keeps what forward gathered until backward uses it: gathered once, not twice.
    "deepspeed.z3": 2 / 3, "deepspeed.z3_infinity": 2 / 3, "deepspeed.zeropp": 2 / 3,
}


def test_ring_accounting():
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_gather", 4) == 0.75
    assert bus_factor("broadcast", 8) == 1.0 and bus_factor("all_reduce", 1) == 0.0
    expected = theory("x", {"all_gather": (100, 2, 4), "all_reduce": (10, 4, 1)}, 4)
    assert expected["bus_bytes"] == 150.0 and expected["by_kind"]["all_reduce"]["bus_bytes"] == 0.0


@pytest.mark.distributed
def test_every_backend_records_its_collectives_and_they_agree_with_theory(launches, request):
    runs = load_runs(launches.get("matrix", request))
    assert len(runs) == 30 and (runs["status"] == "ok").all()
    bad = []
    for _, run in runs.iterrows():
        if run["world_size"] == 1:
            assert run["comm.bus_bytes"] == 0 and run["comm.theory.bus_bytes"] == 0
            continue
        ratio = run["comm.measured_over_theory"]
        expected = EXPLAINED.get(run["label"], 1.0)
        if abs(ratio / expected - 1) > 0.05:
            bad.append(f"{run['run_name']}: measured/theory {ratio:.3f}, expected {expected:.3f}")
        assert run["comm.collectives.all_gather.calls"] > 0 or run["comm.collectives.all_reduce.calls"] > 0
    assert not bad, "\n".join(bad)
    ddp = runs[(runs["label"] == "ddp") & (runs["ckpt"] == "none")].iloc[0]
    n_params = ddp["n_params"]
    assert ddp["comm.collectives.all_reduce.bytes"] == 4 * n_params  # the fp32 gradients, once a step
    # An all-gather's message is its whole output, also where the profiler sees only the shard
    # (FSDP1 calls c10d::allgather_ with a list of output lists): SHARD_GRAD_OP gathers P once.
    sgo = runs[(runs["label"] == "fsdp.shard_grad_op") & (runs["ckpt"] == "none")].iloc[0]
    assert sgo["comm.collectives.all_gather.bytes"] == 4 * n_params
    fsdp2 = runs[(runs["label"] == "fsdp2.fsdp2_no_reshard") & (runs["ckpt"] == "none")].iloc[0]
    assert fsdp2["comm.collectives.all_gather.bytes"] >= 4 * n_params  # FSDP2 pads each shard


def test_host_device_copies_are_counted_by_direction_and_same_device_copies_are_not():
    """core.comm.transfers on a real profile; the meta device stands in for an accelerator (on a
    CPU-only machine the offloading backends' copies stay on one device and count 0)."""
    import torch
    from torch.profiler._utils import traverse_dfs

    from core.comm import transfers

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.empty(7).copy_(torch.ones(7))  # before the span: left out
        with torch.profiler.record_function("span"):
            torch.empty(1000, device="meta").copy_(torch.ones(1000))  # 4000 bytes to the "device"
            torch.ones(256, dtype=torch.bfloat16).to("meta")  # 512 more, through .to()
            torch.empty(10).copy_(torch.ones(10))  # host to host: not a transfer
    events = list(traverse_dfs(prof.profiler.kineto_results.experimental_event_tree()))
    span = next(e for e in events if e.name == "span")
    result = transfers(events, [(span.start_time_ns, span.end_time_ns)])
    assert result == {"to_device_bytes": 4512, "to_host_bytes": 0, "copies": 2}


def test_a_profiled_step_writes_its_op_table_where_GPTLITE_PROFILE_TABLE_says(tmp_path, monkeypatch):
    import torch

    from core.memory_profile import ProfiledWindow

    table = tmp_path / "step.profile.txt"
    a = torch.randn(64, 64)
    with ProfiledWindow(torch.device("cpu")):
        a @ a
    assert not table.exists()  # unset: no table
    monkeypatch.setenv("GPTLITE_PROFILE_TABLE", str(table))
    with ProfiledWindow(torch.device("cpu")):
        a @ a
    text = table.read_text()
    assert "aten::mm" in text and "Self CPU" in text


def test_a_block_a_collective_held_ends_at_its_last_use_when_nobody_saw_it_freed():
    """The profiler records frees only on threads that carry its state. gloo's worker thread, dropping
    a finished collective, can free that collective's tensors last, unrecorded (core.memory_profile:
    identical FSDP2 runs' peaks lay 1.4x apart). Here a Python thread, which carries no profiler
    state, frees them: the block handed to the all-reduce ends at its last use, before anything
    allocated after; a block no collective touched, freed alike, stays counted to the window's end,
    or to where its address is handed out again (nothing else says when it went)."""
    import threading

    import torch
    import torch.distributed as dist
    from torch._C._profiler import _EventType
    from torch.profiler._utils import traverse_dfs

    from core.memory_profile import ProfiledWindow

    n = 4096  # floats: 16 KiB
    held = []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # in this process
    try:
        with ProfiledWindow(torch.device("cpu")) as window:
            sent = torch.ones(n)
            dist.all_reduce(sent)
            sent.sum()  # its last use
            other = torch.ones(n // 2)
            other.sum()
            ptrs = {"sent": sent.data_ptr(), "other": other.data_ptr()}
            held += [sent, other]
            del sent, other
            freer = threading.Thread(target=held.clear)
            freer.start()
            freer.join()
            late = torch.zeros(2 * n)  # allocated after both were freed
            late.sum()
            del late
        events = list(traverse_dfs(window.profiler.profiler.kineto_results.experimental_event_tree()))
        blocks = window._blocks(events, _EventType)
    finally:
        dist.destroy_process_group()

    def block(ptr, size):
        return next(b for b in blocks if b.ptr == ptr and b.size == size and b.start != float("-inf"))

    sent, other = block(ptrs["sent"], 4 * n), block(ptrs["other"], 2 * n)
    late = next(b for b in blocks if b.size == 8 * n and b.start > other.start)
    assert sent.collective and sent.end < late.start
    reused_at = min((b.start for b in blocks if b.ptr == other.ptr and b.start > other.start), default=float("inf"))
    assert not other.collective and other.end == reused_at


WORLD2 = REPO / "runs" / "reference" / "cpu-2core-zoo-world2"  # the zoo's world2 grids (a compact folder)
FROZEN = WORLD2 / "frozen_tied"


def test_a_frozen_layers_gradients_are_not_in_the_theory_its_gathers_are():
    """benchmarks/zoo/frozen_tied (its first block frozen: 8192 of its 18432 parameters) measured under
    gloo at world 2, every configuration of the committed grid: the gradients reduced (DDP's and
    ZeRO-1/2's all-reduce, FSDP's and ZeRO-3's reduce-scatter) and ZeRO-1/2's gathered shards carry
    the trainable parameters alone, as comm_theory counts them with `trainable`; FSDP and ZeRO-3
    gather every parameter. Counted on all 18432, DDP's all-reduce was priced 1.8 times what it moved
    (73728 bytes against 40960) and, cut into its buckets, two calls where it made one."""
    from analysis import compact
    from benchmarks.zoo import ZOO
    from simulation.describe import resolve_flags

    grid = [g for g in compact.read_json(FROZEN / "grid.json") if g["status"] == "ok"]
    assert len(grid) == 48
    seen = set()
    for g in grid:
        setup = resolve_flags([*ZOO["frozen_tied"].flags, *g["flags"]], 2, 2)
        assert (setup.n_params, setup.workload.n_trainable) == (18432, 10240)
        theory = setup.resolved.build(setup.env).comm_theory(setup.n_params, setup.workload.n_trainable)["by_kind"]
        measured = {k: v["bytes"] for k, v in
                    compact.read_json(FROZEN / "grid" / g["name"] / "summary.json")["comm"]["collectives"].items()}
        backend = g["name"].split("-")[0]
        reduced = "all_reduce" if backend in ("ddp", "z1", "z2") else "reduce_scatter"  # DeepSpeed 0.19's ZeRO-1/2 all-reduce
        expected = theory.get("reduce_scatter", theory.get("all_reduce"))["bytes"]
        assert measured[reduced] == pytest.approx(expected, abs=16), g["name"]  # + a flag or a norm's few bytes
        if backend in ("z1", "z2"):
            assert measured["all_gather"] == theory["all_gather"]["bytes"] == 4 * 10240, g["name"]
        if backend in ("full_shard", "fsdp2", "z3"):
            # every parameter gathered: FSDP1 its root unit once, ZeRO-3 once a micro-step (its reuse distance)
            assert measured["all_gather"] >= 4 * 18432 * (1 if backend == "z3" else 1.5), g["name"]
        seen.add(backend)
    assert seen == {"ddp", "full_shard", "fsdp2", "z1", "z2", "z3"}


def test_ddp_broadcasts_the_models_buffers_every_step_as_the_theory_prices_it():
    """DistributedDataParallel broadcasts the model's buffers from rank 0 before each step's first
    forward (broadcast_buffers, on by default), one call per dtype: measured under gloo at world 2 on
    the committed zoo grid, cnn_bn's BatchNorm statistics (float32) and counts (int64) two calls,
    llama's rotary table and bert's position ids one, models without buffers none; FSDP2 and ZeRO none.
    Priced without them, cnn_bn's DDP 8 x 1 waited 1.9 ms a step for one all-reduce where it made three
    calls of ~0.9 ms latency each, and was predicted 95% too fast."""
    from analysis import compact
    from analysis.project import price_comm
    from benchmarks.zoo import ZOO
    from simulation.describe import resolve_flags

    seen = {}
    for model in ("cnn_bn", "llama", "bert", "gptlite", "gru_lm"):
        for run in ("ddp-mb8x1-none-r0", "ddp-mb4x2-none-r0", "z2-mb8x1-none-r0", "fsdp2-mb8x1-none-r0"):
            record = WORLD2 / model / "grid" / run
            if not compact.is_dir(record):  # the GRU has no repeated block: no FSDP2
                continue
            g = compact.read_json(record / "config.json")
            grid = {x["name"]: x["flags"] for x in compact.read_json(WORLD2 / model / "grid.json")}
            setup = resolve_flags([*ZOO[model].flags, *grid[run]], 2, 2)
            assert g["world_size"] == 2
            traffic, _, _ = price_comm(setup, 2, 2, (1.0, 1000.0), (1.0, 1000.0), 25.0)
            measured = compact.read_json(record / "summary.json")["comm"]["collectives"].get("broadcast")
            priced = traffic.get("broadcast")
            if measured is None:
                assert priced is None, (model, run)
                continue
            assert priced is not None and priced[2] == measured["calls"], (model, run)
            assert priced[1] == pytest.approx(measured["bus_bytes"]), (model, run)
            schedule = setup.resolved.build(setup.env).comm_schedule(setup.workload.param_sizes,
                                                                     setup.workload.buffer_bytes)
            assert schedule["broadcast"][1] == 1.0  # before the forward: all of it waits
            seen[model] = measured["calls"]
    assert seen == {"cnn_bn": 2, "llama": 1, "bert": 1}
