"""The device a plan is priced on: a named GPU (analysis/hardware.yaml) or this machine, its model step
calibrated and the link between its ranks probed."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import io
import math
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from core.dist import set_cpu_threads
from estimator import checkpointing_plan
from training.cli import config_from_argv
from simulation.describe import resolve_flags, simulated_env
from training.lifecycle import Run
from training.run import prepare_run
from orchestration.runner import TERMINATED
from analysis.project import HARDWARE
import analysis.plan.backend_costs as bc
from analysis.plan.candidates import REFERENCE, WARM_S
from analysis.plan.processes import gather_messages, started  # noqa: F401 - started: the calibration's API, as it was


@dataclass
class Link:
    """An alpha-beta link: bus GB/s and latency (microseconds) per ring step; where it came from."""

    gb_s: float
    latency_us: float
    source: str


@dataclass
class Device:
    """What the step-time model knows of the device: a named GPU's datasheet, or this machine measured."""

    name: str
    inside: Link  # between the ranks of a node
    between: Link  # between nodes
    flops_per_s: float | None = None  # peak x MFU (a named GPU)
    micro_step_s: float = 0.0  # calibrated: fixed seconds per micro-step
    sample_s: float = 0.0  # calibrated: seconds per sample of forward and backward
    optimizer_s: float = 0.0  # calibrated: the optimizer step
    recompute: dict = dataclasses.field(default_factory=dict)  # calibrated: {full, selective}: extra share
    pcie_gb_s: float | None = None
    cpu_adam_gparams_s: float = 1.0
    overlap: float = 0.5
    memory_gib: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    # measured: {configuration: its own cost's fit} (analysis/plan/backend_costs.py)
    backend_costs: dict = dataclasses.field(default_factory=dict)


def named_device(name: str, network: str, mfu: float, overlap: float, precision: str) -> Device:
    """A GPU of analysis/hardware.yaml: its datasheet peak for `precision` x MFU and its links."""
    hw = yaml.safe_load(HARDWARE.read_text())
    gpu, net = hw["gpus"][name], hw["networks"][network]
    peak = gpu["fp32_tflops" if precision == "fp32" else "bf16_tflops"] * 1e12
    return Device(name, Link(gpu["nvlink_gb_s"], hw["nvlink_latency_us"], "datasheet (hardware.yaml)"),
                  Link(net["gb_s_per_gpu"], net["latency_us"], f"{network} (hardware.yaml)"), flops_per_s=peak * mfu,
                  pcie_gb_s=gpu["pcie_gb_s"], overlap=overlap, memory_gib=gpu["memory_gib"],
                  notes=[f"compute: {precision} peak {peak / 1e12:g} TFLOP/s x MFU {mfu}", f"overlap {overlap}"])


def calibrate(workload, block_class: str | None, micro_batches: tuple[int, int], device: str, save_ops,
              reps: int = 3, precision: str = "fp32") -> dict:
    """This machine's device, measured on the real model (seed 0) in the run's `precision`: a
    micro-step's forward and backward at two micro-batches (each shape's first call untimed, a GPU
    warmed up on the larger, then the two taking turns, the median of `reps` each) fitted as fixed +
    per-sample seconds; the optimizer's step (AdamW); and what full and selective checkpointing
    of every block add, as a share of the larger micro-batch's time (checkpointing_plan.measured_costs)."""
    dev = torch.device(device)
    model = workload.build(0).to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = {m: tuple(t.to(dev) for t in workload.example(m)) for m in micro_batches}

    def timed(m: int) -> float:
        return checkpointing_plan.seconds_of(dev, lambda: checkpointing_plan.forward_backward(model, *batches[m], precision))

    times: dict[int, list[float]] = {m: [] for m in micro_batches}
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        for m in micro_batches:  # each shape's first call (kernel choice, allocation) is not timed
            timed(m)
        # The first micro-batch timed on a GPU read slow: on an H100, micro-batch 8 at 59.3 ms where the
        # grid's own runs say 43 (8x8 against 32x2, runs/reference/nvidia-h100-80gb-hbm3-plan), which
        # put 26 ms on every micro-step where they say 6.5; on an H200, micro-batch 1 timed first, 19 against
        # 6.5. So a GPU runs the largest for WARM_S first (a GPU from idle raises its clocks under load;
        # the cause is not established), and the points take turns, each rep timing both.
        started = time.perf_counter()
        while dev.type == "cuda" and time.perf_counter() - started < WARM_S:
            timed(max(micro_batches))
        for _ in range(reps):
            for m in micro_batches:
                times[m].append(timed(m))
    seconds = {m: statistics.median(t) for m, t in times.items()}
    step = statistics.median([checkpointing_plan.seconds_of(dev, optimizer.step) for _ in range(reps + 1)][1:])
    small, large = micro_batches
    per_sample = max(0.0, (seconds[large] - seconds[small]) / (large - small))
    fixed = max(0.0, seconds[small] - small * per_sample)
    extra = checkpointing_plan.measured_costs(workload, block_class, large, device, save_ops, ["full", "selective"], 0,
                           precision=precision) or {}
    return {"micro_step_s": fixed, "sample_s": per_sample, "optimizer_s": step,
            "recompute": {k: v / seconds[large] for k, v in extra.items()}, "timed": seconds}


# Of the loop's own step (loop_step_times): 2 warm-up, the last profiled, 29 timed. Until 2026-12-02
# 16 (13 timed, 0.1-0.25 s of the zoo's steps): two processes timing it at once on the 2-core CPU,
# their timed steps overlapping, read the zoo's BERT 12.2 and 18.0 ms, llama 8.6 and 12.6, where
# two 200-step runs pinned one to each core read 15.5-16.7 and 15.0-17.5 (three pairs).
LOOP_STEPS = 32


def loop_step_times(train_argv: list[str], micro: int, steps: int = LOOP_STEPS) -> list[float]:
    """The timed steps of train.py's own loop: the run `train_argv` names at --backend single,
    micro-batch `micro`, one micro-step, trained `steps` steps in this process (with this process's
    CPU threads) into a scratch directory; each timed step's seconds. Besides the forward, backward and the
    optimizer that `calibrate` times, a step draws its batch from the dataset, clips the gradients,
    zeroes them, moves the learning rate and times itself: on the 2-core CPU (2026-11-28, the zoo's
    ViT at micro-batch 8, one thread) train.py's step took 15.0 ms where the calibration's forward,
    backward and optimizer step summed to 6.4 (py-spy of the run: forward 30%, backward 25%, optimizer
    and clipping 31%, the batch 8%), and every plan of cpu-2core-zoo-plan-in-window of docs/results/zoo_accuracy_2026-12-05.md
    predicted its model's steps faster than they ran (+7% to +43%)."""
    handler = signal.getsignal(signal.SIGTERM)  # a run sets its own
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = threads or str(torch.get_num_threads())  # the run keeps this process's share
    try:
        with tempfile.TemporaryDirectory(prefix="calibrate-loop-") as tmp:
            cfg = config_from_argv([*train_argv, "--backend", REFERENCE, "--micro_batch", str(micro), "--grad_accum",
                                    "1", "--steps", str(steps), "--warmup_steps", "2", "--mem_profile_steps", "1",
                                    "--eval_batches", "1", "--runs_dir", tmp, "--run_name", "loop", "--quiet"])
            # a scratch run: none of the user's trackers, checkpoints or resumption
            cfg = dataclasses.replace(cfg, tracker=None, save_dir=None, resume=False)
            setup = prepare_run(cfg, env=simulated_env(1, None, cfg.device))
            run = Run(setup)
            # The run's own lines about how it ended, said after it, unless the plan was stopped: a
            # Ctrl-C (KeyboardInterrupt, passed on) or SIGTERM from the plan stopping its calibration's
            # processes is said once, by the plan, not as this scratch run's failure too.
            said = io.StringIO()
            with contextlib.redirect_stderr(said):
                code = run.execute()
            summary = run.record and run.record.read_summary()
            if TERMINATED not in ((summary and summary.error) or ""):
                sys.stderr.write(said.getvalue())
            if code != 0 or summary is None or summary.status != "ok":
                raise RuntimeError(f"train.py's loop at micro-batch {micro} failed: {summary and summary.error}")
            timed = [line["step_time_s"] for line in run.record.metrics if line.get("timed")]
    finally:
        signal.signal(signal.SIGTERM, handler)
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = threads
    if not timed:
        raise RuntimeError(f"train.py's loop at micro-batch {micro} timed no step")
    return timed


def with_loop(c: dict, train_argv: list[str], micro: int, steps: list[float] | None = None) -> dict:
    """A calibration `c` with the step's own work beyond its micro-steps (optimizer_s) taken from
    train.py's loop at micro-batch `micro` (its timed `steps`, loop_step_times; the median of them):
    what that step took beyond the calibrated micro-step, where it is more than the optimizer's step
    alone. The loop's timed steps are kept (`steps_s`) for calibrate_together."""
    steps = loop_step_times(train_argv, micro) if steps is None else steps
    return _with_loop_step(c, micro, statistics.median(steps), steps_s=list(steps))


def _with_loop_step(c: dict, micro: int, step: float, **loop) -> dict:
    """`c` with the loop's `step` at micro-batch `micro` priced (with_loop's rule), `loop` kept with it."""
    beyond = step - (c["micro_step_s"] + micro * c["sample_s"])
    return {**c, "optimizer_s": max(c["optimizer_s"], beyond),
            "loop": {"micro_batch": micro, "step_s": step, "optimizer_alone_s": c["optimizer_s"], **loop}}


def synchronized_median(steps: list[list[float]]) -> float:
    """The median step of ranks that wait for one another every step, from each rank's steps timed
    apart (`steps`: one list per rank): the median of the slowest of one step drawn from each list
    independently. A synchronized step is as long as its slowest rank's (train.py records the
    slowest rank's seconds; DDP's all-reduce and every sharded gather wait for it), so the ranks'
    own medians, or their mean, read it short: exactly, P(slowest <= t) is the product over the
    ranks of the share of each one's steps <= t, and this is the least t where it reaches one half."""
    lists = [sorted(s) for s in steps if s]
    if not lists:
        raise ValueError("synchronized_median: no steps")
    for t in sorted(set().union(*lists)):
        share = 1.0
        for s in lists:
            share *= bisect.bisect_right(s, t) / len(s)
        if share >= 0.5:
            return t
    return max(s[-1] for s in lists)  # not reached: at the largest t every share is 1


def loop_note(c: dict) -> str:
    """What the calibration's optimizer step holds where train.py's loop was timed (with_loop)."""
    loop = c.get("loop")
    if not loop:
        return ""
    ranks = loop.get("ranks_step_s")
    at_once = (f" in {len(ranks)} processes at once, as ranks that wait for one another (each one's median "
               + ", ".join(f"{r * 1e3:.1f}" for r in ranks) + ")") if ranks else ""
    return (f" (train.py's own step at --backend single, micro-batch {loop['micro_batch']}: "
            f"{loop['step_s'] * 1e3:.1f} ms{at_once}; the optimizer alone {loop['optimizer_alone_s'] * 1e3:.1f} ms, the rest of "
            "that step beyond its micro-step counted with it)")


def calibration_line(c: dict) -> str:
    """The calibrated line as a plan prints it (its assumptions; replay reads it back from a plan
    saved before --json carried `calibration`)."""
    return (f"{c['micro_step_s'] * 1e3:.1f} ms per micro-step + {c['sample_s'] * 1e3:.2f} ms per sample, "
            f"optimizer step {c['optimizer_s'] * 1e3:.1f} ms")


CALIBRATION_LINE = re.compile(r"([\d.]+) ms per micro-step \+ ([\d.]+) ms per sample, optimizer step ([\d.]+) ms")


def calibration_points(micro_batches: list[int], gpu: bool) -> tuple[int, int]:
    """The two micro-batches the calibration times to fit its fixed + per-sample line: the smallest
    and largest compared (from micro-batch 1, the calibration put 19 ms on each micro-step on an H200
    where the candidates' own 8 and 32 say 6.5: runs/reference/nvidia-h200/README.md; from 8, 26 ms on
    an H100, so the first point timed, not micro-batch 1, read slow: see calibrate); on a
    CPU, the smallest but at most an eighth of the largest. The fixed part is the line's intercept,
    2 t(4) - t(8) between 4 and 8, twice the noise of t(4): on this machine (GPT-lite small,
    2026-11-26) it read 238 ms per micro-step where 1 and 8 read none, and the planner ranked every
    8 x 1 candidate above 4 x 2 (benchmarks/plan_regret.py: regret 32%). A CPU's step has no launch
    overhead to speak of; a GPU's repeats within about 1%."""
    large, small = max(micro_batches), min(micro_batches)
    if not gpu:
        small = max(1, min(small, large // 8))
    return (small, large) if small < large else (small, 2 * small)


# The link between local processes, as a training step meets it: on the 2-core CPU one all_reduce of
# 1 KB between two processes took 0.13 to 8 ms (200 calls, 2026-11-28: median 0.25-0.76 ms, mean
# 0.86-1.9 ms, three launches), so a probe of five calls read anything from 291 to 2381 us per ring
# step across the eight plans of cpu-2core-zoo-race-within of docs/results/zoo_accuracy_2026-12-05.md, and one plan priced every
# DDP step of its model 9.5 ms of waiting where its runs left 1.3. Each launch times many calls and
# takes their mean (what a step pays on average); the median of the launches is kept.
LINK_CALLS = (50, 8)  # timed per launch: the small message, the large one
LINK_LAUNCHES = 3


def probe_link(world: int, sizes: tuple[int, int] = (1024, 8 * 2**20), calls: tuple[int, int] = LINK_CALLS,
               launches: int = LINK_LAUNCHES) -> Link:
    """all_reduce timed between `world` local processes (gloo, this machine), `launches` times: a small
    message gives the latency per ring step, a large one the bus bandwidth (each launch's mean over
    its `calls`, the median of the launches)."""
    timed = []
    for _ in range(launches):
        with tempfile.TemporaryDirectory() as tmp:
            ctx = mp.get_context("spawn")
            queue = ctx.SimpleQueue()
            procs = [ctx.Process(target=_probe_rank, args=(r, world, f"{tmp}/store", sizes, calls, queue))
                     for r in range(world)]
            with started(procs):
                for proc in procs:
                    proc.join(120)
            if any(proc.exitcode != 0 for proc in procs):
                raise RuntimeError("the all_reduce probe between local processes failed")
            timed.append(queue.get())
    small_s = statistics.median(t[0] for t in timed)
    large_s = statistics.median(t[1] for t in timed)
    steps = 2 * (world - 1)
    bus = 2 * (world - 1) / world * sizes[1]
    return Link(bus / max(large_s - small_s, 1e-9) / 1e9, small_s / steps * 1e6,
                f"all_reduce timed between {world} local processes (gloo; the mean of {calls[0]} and {calls[1]} "
                f"calls, the median of {launches} launches)")


def _probe_rank(rank: int, world: int, store: str, sizes, calls, queue) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    times = []
    for size, n in zip(sizes, calls):
        t = torch.zeros(size // 4)
        dist.all_reduce(t)  # warm-up
        dist.barrier()
        started = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(t)
        times.append((time.perf_counter() - started) / n)
    if rank == 0:
        queue.put(times)
    dist.destroy_process_group()


def machine_link(world: int, use_shipped: bool = False) -> Link:
    """The link between `world` local processes: probed once per machine (probe_link) and kept with
    the configurations' own costs (backend_costs.cache_path(): their residuals are what the step model
    leaves after pricing the calls on this link, so a plan prices them on the same one), measured
    again when the machine changes. With `use_shipped`, where none is kept, the link shipped with
    the costs for this machine's kind (backend_costs.shipped: the one they were fitted against),
    not kept."""
    key, here = f"link|world={world}", bc.machine()
    entry = bc.load().get(key)
    if not (entry and entry.get("machine") == here):
        ready = bc.shipped().get(key) if use_shipped else None
        if ready:
            return Link(ready["gb_s"], ready["latency_us"], f"{ready['source']}, measured {ready['measured']} on a "
                        f"machine of this kind ({ready['machine']['cpu']}, {ready['machine']['cores']} cores), not "
                        f"here: shipped with its costs ({bc._shown(bc.shipped_path())}; --backend_costs measure probes it)")
        link = probe_link(world)
        entry = {"gb_s": link.gb_s, "latency_us": link.latency_us, "source": link.source, "machine": here,
                 "measured": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
        cache = bc.load()  # read again: another plan may have kept something meanwhile
        cache[key] = entry
        bc.keep(cache)
    return Link(entry["gb_s"], entry["latency_us"], f"{entry['source']}, measured {entry['measured']}, kept in "
                f"{bc.cache_path()}")


def _calibrate_rank(train_argv: list[str], ranks: int, points: tuple[int, int], barrier, queue) -> None:
    """One of `ranks` processes calibrating at once (calibrate_together): its calibration, or its error."""
    try:
        setup = resolve_flags([*train_argv, "--backend", REFERENCE], 1)
        set_cpu_threads(simulated_env(ranks, None, setup.cfg.device))
        barrier.wait(300)  # the model built in each: the timing starts together
        c = calibrate(setup.workload, setup.cfg.block_class, points, str(setup.env.device), setup.cfg.save_ops(),
                      precision=setup.cfg.precision)
        barrier.wait(300)  # and train.py's loop too, its timed steps beside the others'
        queue.put(with_loop(c, train_argv, max(points)))
    except Exception as e:  # the parent names it
        barrier.abort()  # the others waiting for this one stop waiting
        queue.put(f"{type(e).__name__}: {e}")


def calibrate_together(train_argv: list[str], ranks: int, points: tuple[int, int]) -> dict:
    """The calibration as `ranks` ranks of one CPU node meet it: `ranks` processes calibrating at once,
    each with its share of the cores (core/dist.set_cpu_threads), every figure their mean. Alone, one
    process has the memory bandwidth and caches to itself: on the 2-core CPU (2026-11-28, forward and
    backward at micro-batch 8, two launches each, alone then two at once) the zoo's ViT took 4.2 ms
    alone and 5.1 together, GPT-lite 21.5 and 24.1, the mixture of experts 15.2 and 17.9,
    frozen_tied 0.63 and 1.23; and against the grid measured in the same window
    (cpu-2core-zoo-plan-in-window of docs/results/zoo_accuracy_2026-12-05.md) the plans calibrated alone predicted ViT's DDP 8 x 1
    at 12.4 ms a step where it ran 17.4."""
    ctx = mp.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(ranks)
    procs = [ctx.Process(target=_calibrate_rank, args=(train_argv, ranks, points, barrier, queue))
             for _ in range(ranks)]
    with started(procs):
        got = gather_messages(queue, procs, f"the calibration in {ranks} processes")
        for proc in procs:
            proc.join(60)
    # the one that failed first, not the others it stopped waiting (BrokenBarrierError)
    failed = sorted((g for g in got if isinstance(g, str)), key=lambda g: g.startswith("BrokenBarrierError"))
    if failed:
        raise RuntimeError(f"the calibration in {ranks} processes failed: {failed[0]}")
    return together(got)


def together(got: list[dict]) -> dict:
    """The calibrations of processes timed at once (calibrate_together), as one: the micro-step's
    figures their mean; train.py's loop the step of ranks that wait for one another
    (synchronized_median of the processes' timed steps), and the optimizer's share what that step
    takes beyond the mean micro-step (with_loop's rule). Until 2026-12-02 the loop too was the
    processes' mean: on the 2-core CPU (six zoo models, two calibrations each, each followed by a
    DDP run at 8 x 1, nothing else running) DDP's step ran 1.2-9.2 ms beyond that mean (a median
    5.4) and 0.8-9.0 ms beyond the synchronized step (a median 4.5); on GPT-lite, whose two processes
    read 17.3 and 25.6 ms, then 23.1 and 17.1, 8.9 and 8.4 beyond the mean, 4.7 and 4.7 beyond this."""
    mean = statistics.fmean
    c = {"micro_step_s": mean(g["micro_step_s"] for g in got), "sample_s": mean(g["sample_s"] for g in got),
         "optimizer_s": mean(g["loop"]["optimizer_alone_s"] for g in got),
         "recompute": {k: mean(g["recompute"][k] for g in got) for k in got[0]["recompute"]},
         "timed": {m: mean(g["timed"][m] for g in got) for m in got[0]["timed"]}}
    return _with_loop_step(c, got[0]["loop"]["micro_batch"], synchronized_median([g["loop"]["steps_s"] for g in got]),
                           ranks_step_s=[g["loop"]["step_s"] for g in got])


def here_device(train_argv: list[str], world: int, per_node: int, overlap: float,
                micro_batches: list[int], shipped_link: bool = False) -> Device:
    """This machine: compute calibrated on its device (at calibration_points of the `micro_batches`
    compared) with the CPU threads one of `per_node` ranks gets (core/dist.set_cpu_threads), on a CPU
    in as many processes at once as the node runs ranks (calibrate_together), its ranks' link probed
    (or kept; with `shipped_link`, shipped: machine_link)."""
    setup = resolve_flags([*train_argv, "--backend", REFERENCE], 1)
    cfg = setup.cfg
    threads = torch.get_num_threads()
    ranks = min(world, per_node)
    set_cpu_threads(simulated_env(ranks, None, cfg.device))
    together = ranks > 1 and torch.device(setup.env.device).type == "cpu"
    try:
        points = calibration_points(micro_batches, torch.device(setup.env.device).type == "cuda")
        if together:
            c = calibrate_together(train_argv, ranks, points)
        else:
            c = calibrate(setup.workload, cfg.block_class, points, str(setup.env.device), cfg.save_ops(),
                          precision=cfg.precision)
            if torch.device(setup.env.device).type == "cpu":
                c = with_loop(c, train_argv, max(points))
    finally:
        torch.set_num_threads(threads)
        # The verifying runs are other processes on the same GPU: what the calibration's caching allocator
        # keeps (46 GiB for the paper preset at micro-batch 64 on an H100) is missing from theirs, and put
        # out of memory a candidate the budget admits (2026-11-26, runs/reference/nvidia-h100-80gb-hbm3-plan/).
        if torch.cuda.is_initialized():
            gc.collect()
            torch.cuda.empty_cache()
    inside = machine_link(world, shipped_link) if world > 1 else Link(math.inf, 0.0, "one rank: nothing to communicate")
    timed = ", ".join(f"micro-batch {m}: {s * 1e3:.1f} ms" for m, s in c["timed"].items())
    return Device(f"here ({setup.env.device})", inside, inside, micro_step_s=c["micro_step_s"],
                  sample_s=c["sample_s"], optimizer_s=c["optimizer_s"], recompute=c["recompute"], overlap=overlap,
                  notes=[f"compute calibrated on {setup.env.device}"
                         + (f" in {ranks} processes at once (their mean)" if together else "")
                         + f": forward and backward {timed}; "
                         f"{calibration_line(c)}{loop_note(c)}; recompute of every block: "
                         + ", ".join(f"{k} +{v:.0%}" for k, v in c["recompute"].items()),
                         f"link: {inside.source}: {inside.gb_s:.2f} GB/s, {inside.latency_us:.0f} us per ring step",
                         f"overlap {overlap}"])
