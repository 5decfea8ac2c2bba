"""The hybrid family (sharded within a node, replicated or re-gathered across nodes) at 4 ranks as 2
torchrun nodes of 2 (tests/support/launches.py HYBRID): FSDP2 on a 2-D mesh (HSDP), FSDP2 resharding to a
node after forward, FSDP1 HYBRID_SHARD and _HYBRID_SHARD_ZERO2, ZeRO++'s hpZ; each against the
one-process reference, resumed, its communication per link against its theory, its memory against
the estimate; and the shapes that cannot run, refused in one line."""

import json
import subprocess
import sys
import uuid

import pytest

from conftest import PARITY_ARGS, REPO, TRAIN, assert_losses_close, base_env, in_process
from gptlite.errors import ConfigError
from launches import HYBRID, NODES_SAVE_AFTER, NODES_STEPS, committed_reference

NAMES = list(HYBRID)


def _nodes(launches, request, name):
    return launches.get(f"{name}-2x2", request)


# ------------------------------------------------------------------ real launches: 2 nodes x 2 ranks
@pytest.mark.distributed
@pytest.mark.parametrize("name", NAMES)
def test_each_hybrid_configuration_trains_like_one_process(launches, request, name):
    run = _nodes(launches, request, name).first
    assert run.summary["world_size"] == 4 and run.config["ranks_per_node"] == 2
    assert_losses_close(run.losses, committed_reference()["losses"][:NODES_STEPS], NODES_STEPS, 1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("name", NAMES)
def test_each_hybrid_configuration_resumes_exactly(launches, request, name):
    made = _nodes(launches, request, name)
    resumed = made.resumed
    assert resumed.config["start_step"] == NODES_SAVE_AFTER + 1
    assert [m["step"] for m in resumed.metrics] == list(range(NODES_STEPS))
    # On CPU in fp32 the resumed steps repeat the uninterrupted ones bit for bit.
    assert resumed.losses == made.first.losses


@pytest.mark.distributed
@pytest.mark.parametrize("name", NAMES)
def test_each_hybrid_configuration_communicates_per_link_as_its_theory_says(launches, request, name):
    """Bytes within 5% of the theory (the suite's tolerance, tests/unit/test_comm.py), and on each link:
    the calls each process group counted (c10d's sequence numbers) fall on the links the theory puts
    their kinds, but for at most one small all-reduce (the gradient norm's, which no theory counts)."""
    comm = _nodes(launches, request, name).first.summary["comm"]
    theory = comm["theory"]
    assert comm["measured_over_theory"] == pytest.approx(1.0, rel=0.05), theory["formula"]
    links = comm["links"]
    assert links["ranks_per_node"] == 2 and not links["unplaced_kinds"]
    assert all(abs(v) <= 1 for v in links["calls_beyond_placement"].values()), links
    for link in ("intra_node", "inter_node"):
        assert links[link]["calls"] > 0, link  # both links carry something in every one of them
        assert links[link]["bus_bytes"] == pytest.approx(links[link]["theory_bus_bytes"], rel=0.05), link
    assert theory["inter_node_bus_bytes"] == pytest.approx(links["inter_node"]["theory_bus_bytes"])


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["fsdp2_hsdp", "hybrid_shard", "hybrid_shard_zero2"])
def test_hsdp_sends_only_the_gradient_all_reduce_between_nodes(launches, request, name):
    """HSDP's bar: between nodes, the all-reduce of each rank's shard of the gradients and nothing
    else; every all-gather and reduce-scatter ran in a group of the 2 ranks of one node (their two
    sides show the group) and every call between nodes ran in the replica groups."""
    run = _nodes(launches, request, name).first
    comm, n_params = run.summary["comm"], run.config["n_params"]
    shard = 4 * n_params / 2  # fp32 gradients, one node's shard of them
    assert comm["links"]["inter_node"]["bytes"] == pytest.approx(shard, rel=0.01)
    assert comm["collectives"]["all_reduce"]["bytes"] == pytest.approx(shard, rel=0.01)
    for kind in ("all_gather", "reduce_scatter"):
        seen = comm["collectives"][kind]["by_group"]
        assert set(seen) <= {"2"}, seen  # FSDP1 records its gathers without their output: none seen
    between = [g for g in comm["groups"] if len({r // 2 for r in g["ranks"]}) > 1]
    assert 0 < sum(g["calls"] for g in between) <= comm["collectives"]["all_reduce"]["calls"]
    assert sum(g["calls"] for g in between if g["ranks"] == [0, 1, 2, 3]) == 0  # nothing over the whole world


@pytest.mark.distributed
@pytest.mark.parametrize("name", NAMES)
def test_the_estimate_is_within_10_percent_of_each_measured_peak(launches, request, name):
    from estimator.estimate import estimate_from_record

    run = _nodes(launches, request, name).first
    peak = run.summary["mem_peak_bytes"]
    estimate = estimate_from_record(run.config).total_bytes
    assert abs(estimate / peak - 1) <= 0.10, f"estimate {estimate} against measured {peak}"


@pytest.mark.distributed
def test_a_hybrid_checkpoint_exports_the_plain_model(launches, request, tmp_path):
    import torch

    from gptlite.model import build_model, preset
    from training import export

    kept = _nodes(launches, request, "fsdp2_hsdp").checkpoint
    proc = in_process(export.main, [str(kept), "--out", str(tmp_path / "out")])
    assert proc.returncode == 0, proc.stderr
    exported = torch.load(tmp_path / "out" / "model.pt")
    reference = build_model(preset("tiny", vocab_size=65, dropout=0.0), 0).state_dict()
    assert exported["step"] == NODES_SAVE_AFTER and set(exported["model"]) == set(reference)
    for key, value in exported["model"].items():
        assert value.shape == reference[key].shape and torch.isfinite(value).all()


# ------------------------------------------------------------------ bad shapes, one line each
def _estimate(tmp_path, text: str, world: int, per_node: int, suffix=".yaml"):
    from analysis import estimate_cli

    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    flag = "--fsdp_config" if suffix == ".yaml" else "--deepspeed_config"
    return in_process(estimate_cli.main, ["--world", str(world), "--gpus_per_node", str(per_node), "--preset", "tiny",
                                          flag, str(path)])


FSDP2 = "backend: fsdp2\n"
BAD_SHAPES = [
    (FSDP2 + "mesh:\n  shard: 3\n", 4, 2, "mesh.shard 3 must divide the world size 4"),
    (FSDP2 + "mesh:\n  replicate: 3\n  shard: 2\n", 4, 2, "mesh.replicate 3 x mesh.shard 2 must equal the world size 4"),
    (FSDP2 + "mesh:\n  shard: 4\n", 8, 2, "mesh.shard 4 spans nodes of 2 ranks, and mesh.within_node asks"),
    (FSDP2 + "mesh:\n  shard: 3\n", 12, 4, "mesh.shard 3 spans nodes of 4 ranks"),  # 3 does not tile a node of 4
    (FSDP2 + "reshard_after_forward: 3\n", 4, 2, "reshard_after_forward 3 (3 ranks) must divide the shard group of 4"),
    (FSDP2 + "mesh:\n  shard: 2\nreshard_after_forward: node\n", 8, 4,
     "reshard_after_forward node (4 ranks) must divide the shard group of 2"),
    (FSDP2 + "mesh:\n  shard: many\n", 4, 2, "mesh.shard must be an integer >= 1 or node (got 'many')"),
    ("sharding_strategy: _HYBRID_SHARD_ZERO2\nhybrid_shard_size: 4\n", 8, 2,
     "hybrid_shard_size 4 spans nodes of 2 ranks, and shard_within_node asks"),
    ("sharding_strategy: HYBRID_SHARD\nhybrid_shard_size: 3\n", 4, 2, "hybrid_shard_size 3 must be >= 2 and divide"),
    ("sharding_strategy: FULL_SHARD\nmesh:\n  shard: 2\n", 4, 2, "mesh: backend fsdp (FSDP1) takes no device mesh"),
]


@pytest.mark.parametrize("text, world, per_node, message", BAD_SHAPES, ids=[c[3][:40] for c in BAD_SHAPES])
def test_a_mesh_that_cannot_run_is_refused_in_one_line(tmp_path, text, world, per_node, message):
    proc = _estimate(tmp_path, text, world, per_node)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert message in lines[0] and "Traceback" not in proc.stderr, lines[0]


def test_a_mesh_the_shard_group_may_span_nodes_where_the_file_allows_it(tmp_path):
    proc = _estimate(tmp_path, FSDP2 + "mesh:\n  shard: 4\n  within_node: false\n", 8, 2)
    assert proc.returncode == 0, proc.stderr


def test_a_mesh_on_deepspeed_is_refused_in_one_line(tmp_path):
    config = json.loads((REPO / "ds_configs" / "z3.json").read_text())
    proc = _estimate(tmp_path, json.dumps({**config, "mesh": {"shard": 2}}), 4, 2, suffix=".json")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "mesh: DeepSpeed takes no device mesh" in proc.stderr


def test_mics_is_refused_with_the_reason_where_deepspeed_has_removed_it(tmp_path):
    """DeepSpeed 0.19.8 removed MiCS (mics_shard_size): a MiCS file is refused before any rank
    trains, in one line saying so; ZeRO++'s hpZ (ds_configs/zeropp_hpz.json) is what runs instead."""
    from backends import deepspeed_config

    config = json.loads((REPO / "ds_configs" / "z3.json").read_text())
    config["zero_optimization"]["mics_shard_size"] = 2
    path = tmp_path / "mics.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="mics_shard_size.*no longer supported"):
        deepspeed_config.validate(str(path), deepspeed_config.read(str(path)))
    proc = _estimate(tmp_path, json.dumps(config), 4, 2, suffix=".json")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.distributed
def test_a_shard_group_spanning_nodes_is_refused_under_two_node_launchers(tmp_path):
    """2 torchrun nodes of 1 rank, HSDP's shard group of 2 asked inside a node: every rank refuses
    before training, the reason said once, nothing recorded."""
    from core.ports import free_port

    config = tmp_path / "c.yaml"
    config.write_text(FSDP2 + "mesh:\n  shard: 2\n")
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
         "--nproc_per_node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
         str(TRAIN), "--runs_dir", str(tmp_path / "runs"), *PARITY_ARGS, "--steps", "2", "--fsdp_config", str(config)],
        cwd=REPO, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    outputs = [node.communicate(timeout=240) for node in nodes]
    assert all(n.returncode != 0 for n in nodes)
    # Node 0's launcher prints its rank's error file; node 1's may lose the rendezvous store with it
    # (torch's own agent then says so) before it prints its own.
    said = outputs[0][1] + outputs[1][1]
    assert 1 <= said.count("mesh.shard 2 spans nodes of 1 ranks, and mesh.within_node asks") <= 2, said[-3000:]
    ours = [line for line in said.splitlines()
            if line.strip().startswith(f'File "{REPO}') and f"{REPO}/.venv" not in line]
    assert not ours, "\n".join(ours)  # no traceback from the suite's code
    assert not list((tmp_path / "runs").rglob("summary.json"))


# ------------------------------------------------------------------ theory, in process
def _theory(flags: list[str], world: int, per_node: int) -> dict:
    from simulation.describe import resolve_flags

    setup = resolve_flags(["--preset", "tiny", *flags], world, per_node)
    return setup.resolved.build(setup.env).comm_theory(setup.n_params, setup.workload.n_trainable), setup.n_params


@pytest.mark.parametrize("config", ["fsdp_configs/fsdp2_hsdp.yaml", "fsdp_configs/hybrid_shard.yaml",
                                    "fsdp_configs/hybrid_shard_zero2.yaml"])
def test_hsdp_theory_puts_only_the_sharded_all_reduce_between_nodes(config):
    theory, n_params = _theory(["--fsdp_config", config], 64, 8)
    crossing = {k: v for k, v in theory["by_kind"].items() if v["spans_nodes"]}
    assert list(crossing) == ["all_reduce"]
    assert crossing["all_reduce"]["bytes"] == 4 * n_params / 8 and crossing["all_reduce"]["group_size"] == 8
    full, _ = _theory(["--fsdp_config", "fsdp_configs/full_shard.yaml"], 64, 8)
    assert theory["inter_node_bus_bytes"] < full["inter_node_bus_bytes"] / 10


def test_reshard_to_a_node_moves_backwards_gather_inside_it():
    theory, n_params = _theory(["--fsdp_config", "fsdp_configs/fsdp2_reshard_node.yaml"], 16, 8)
    kinds = theory["by_kind"]
    assert kinds["all_gather"]["spans_nodes"] and not kinds["all_gather:post_forward"]["spans_nodes"]
    assert kinds["all_gather:post_forward"]["group_size"] == 8 and kinds["all_gather"]["group_size"] == 16


def test_group_placement_over_nodes():
    from core.comm import spans_nodes

    assert not spans_nodes(8, 1, 64, 8) and spans_nodes(16, 1, 64, 8)  # a node's ranks; two nodes'
    assert spans_nodes(8, 8, 64, 8) and spans_nodes(2, 2, 4, 2)  # replica groups, one rank per shard group
    assert not spans_nodes(2, 1, 4, 2) and spans_nodes(3, 1, 6, 4)  # 3 does not tile a node of 4
    assert spans_nodes(4, 1, 4, None) is None


# ------------------------------------------------------------------ projection and planner
# The stated cluster: H100-SXM nodes of 8 GPUs, NVLink inside a node (450 GB/s, 3 us), InfiniBand NDR
# between nodes (50 GB/s per GPU, 5 us): analysis/hardware.yaml's datasheet figures.
CLUSTER = ("H100-SXM", "infiniband-ndr", 8)
RUN = ["--preset", "small", "--precision", "bf16", "--micro_batch", "8", "--grad_accum", "1"]


def test_the_planner_considers_the_hybrid_family_only_where_the_world_spans_nodes():
    from analysis.plan.candidates import configurations

    hybrid = {"fsdp_configs/fsdp2_hsdp.yaml", "fsdp_configs/fsdp2_reshard_node.yaml",
              "fsdp_configs/hybrid_shard.yaml", "fsdp_configs/hybrid_shard_zero2.yaml"}
    assert hybrid <= set(configurations(64, 8)) and hybrid <= set(configurations(16, 8))
    assert not hybrid & set(configurations(8, 8))


def test_at_64_gpus_the_planner_picks_the_hybrid_the_projection_says_is_fastest():
    """On the stated cluster at W = 64 (8 nodes), the projection ranks a hybrid configuration first:
    FULL_SHARD's gathers and reduce-scatter cross InfiniBand, HSDP's stay on NVLink and only the
    all-reduce of a node's shard of the gradients crosses. The planner, pricing the same way, picks
    the configuration the projection puts first."""
    import yaml

    from analysis.plan import main as plan_main
    from analysis.project import HARDWARE, Assumptions, configurations, node_hybrid, project

    gpu_name, network, per_node = CLUSTER
    hw = yaml.safe_load(HARDWARE.read_text())
    gpu, net = {**hw["gpus"][gpu_name], "gpus_per_node": per_node}, hw["networks"][network]
    rows = {c: project(c, RUN, 64, gpu, net, hw["nvlink_latency_us"], Assumptions()) for c in configurations()}
    fastest = max(rows, key=lambda c: rows[c]["samples/s"])
    assert node_hybrid(fastest), {c: round(r["samples/s"]) for c, r in rows.items()}
    full = rows["fsdp_configs/full_shard.yaml"]
    assert rows[fastest]["inter-node GiB/step"] < full["inter-node GiB/step"] / 4
    proc = in_process(plan_main, ["--world", "64", "--gpu", gpu_name, "--network", network, "--gpus_per_node",
                                  str(per_node), "--mem_budget_gb", "80", "--global_batch", "512", "--ckpt", "none",
                                  "--micro_batches", "8", "--json", "--preset", "small", "--precision", "bf16"])
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    picked = out["candidates"][0]["config"]
    assert node_hybrid(picked) and rows[picked]["samples/s"] == pytest.approx(rows[fastest]["samples/s"])
