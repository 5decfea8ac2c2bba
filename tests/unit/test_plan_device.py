"""This machine calibrated (analysis/plan/device.py, processes.py): train.py's loop, the synchronized
step, processes timed at once, the micro-batches taking turns, the link probed once and kept."""

import json
import os
import time

import pytest

from analysis import plan

TINY = ["--preset", "tiny"]


def h100():
    return plan.named_device("H100-SXM", "infiniband-ndr", 0.4, 0.5, "fp32")


@pytest.mark.unit
def test_a_ctrl_c_while_the_processes_start_is_not_lost():
    """A Ctrl-C that arrives while the plan starts its processes (each of them started with SIGINT ignored)
    still stops the plan: on a loaded machine the starts take seconds."""
    import signal

    from analysis.plan.device import started

    class SignalledWhileStarting:  # a process whose start is interrupted by the terminal's Ctrl-C
        pid = None

        def start(self):
            os.kill(os.getpid(), signal.SIGINT)

    # Python's own handler, as in a process a terminal started (one started in the background ignores SIGINT)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):  # raised during the starts, or in the body at the latest
            with started([SignalledWhileStarting()]):
                time.sleep(0.5)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_calibrations_step_is_train_pys_own_loop(monkeypatch):
    """On a CPU what a step does beyond its micro-steps (the batch drawn from the dataset, the gradients
    clipped and zeroed, the learning rate moved, the optimizer) is timed in train.py's own loop at
    --backend single, in this process, in a scratch directory: on the zoo's ViT that step took 15.0 ms
    where the calibrated forward, backward and optimizer summed to 6.4. Priced with the optimizer step
    where it is more than the optimizer alone; the process's threads and SIGTERM handler left as they were."""
    import signal

    from analysis.plan import device

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    handler = signal.getsignal(signal.SIGTERM)
    from training import trackers

    started = []
    real = trackers.Trackers

    def recorded(names, *args, **kwargs):
        started.append(names)
        return real(names, *args, **kwargs)

    monkeypatch.setattr(trackers, "Trackers", recorded)
    steps = device.loop_step_times([*TINY, "--tracker", "csv"], 4, steps=5)
    assert len(steps) == 5 - 2 - 1 and min(steps) > 0  # 2 warm-up, the last profiled
    assert started and not any(started), started  # a scratch run: not the user's trackers
    assert "OMP_NUM_THREADS" not in os.environ and signal.getsignal(signal.SIGTERM) is handler
    c = {"micro_step_s": 0.002, "sample_s": 0.001, "optimizer_s": 0.001}
    monkeypatch.setattr(device, "loop_step_times", lambda argv, micro: [0.03, 0.02, 0.01])
    looped = device.with_loop(c, TINY, 8)
    assert looped["optimizer_s"] == pytest.approx(0.02 - 0.002 - 8 * 0.001)  # the loop's median step
    assert looped["loop"] == {"micro_batch": 8, "step_s": 0.02, "optimizer_alone_s": 0.001,
                              "steps_s": [0.03, 0.02, 0.01]}
    assert "train.py's own step at --backend single, micro-batch 8: 20.0 ms;" in device.loop_note(looped)
    monkeypatch.setattr(device, "loop_step_times", lambda argv, micro: [0.005])  # less than the micro-step's
    assert device.with_loop(c, TINY, 8)["optimizer_s"] == 0.001


def test_a_synchronized_step_is_the_median_of_the_slowest_ranks():
    """Ranks that wait for one another every step take the slowest one's time: the median of the
    slowest of one step drawn from each rank's own steps, which every pair (or triple) of steps
    spells out one by one; never below the slowest rank's own median."""
    import itertools
    import random

    from analysis.plan.device import synchronized_median

    assert synchronized_median([[1.0, 2.0]]) == 1.0  # one rank: the lower median of its own steps
    assert synchronized_median([[1.0, 2.0, 3.0], [2.0, 2.0, 2.0]]) == 2.0
    # two ranks each at 10 ms half the time and 20 the other: a synchronized step is 20 three times in four
    assert synchronized_median([[0.01, 0.02], [0.01, 0.02]]) == 0.02
    rng = random.Random(0)
    for ranks in (2, 3):
        steps = [[rng.uniform(0.01, 0.03) for _ in range(rng.randint(3, 9))] for _ in range(ranks)]
        slowest = sorted(max(draw) for draw in itertools.product(*steps))
        got = synchronized_median(steps)
        assert sum(s <= got for s in slowest) >= len(slowest) / 2 > sum(s < got for s in slowest)
        assert got >= max(sorted(s)[(len(s) - 1) // 2] for s in steps)
    with pytest.raises(ValueError):
        synchronized_median([[], []])


def test_processes_timed_at_once_are_one_calibration_whose_loop_is_the_synchronized_step():
    """The micro-step's figures the processes' mean; train.py's loop the step of ranks in step, the
    optimizer's share what it takes beyond the mean micro-step, each process's own median kept and
    named in the plan's note."""
    from analysis.plan import device

    def one(micro_step, steps):
        c = {"micro_step_s": micro_step, "sample_s": 0.001, "optimizer_s": 0.002, "recompute": {"full": 0.5},
             "timed": {1: micro_step + 0.001, 8: micro_step + 0.008}}
        return device.with_loop(c, [], 8, steps)

    got = [one(0.002, [0.010, 0.012, 0.014]), one(0.004, [0.016, 0.018, 0.020])]
    c = device.together(got)
    assert c["micro_step_s"] == pytest.approx(0.003) and c["sample_s"] == pytest.approx(0.001)
    assert c["loop"]["step_s"] == 0.018 and c["loop"]["ranks_step_s"] == [0.012, 0.018]  # the slower one's here
    assert c["optimizer_s"] == pytest.approx(0.018 - 0.003 - 8 * 0.001)
    assert c["timed"] == {1: pytest.approx(0.004), 8: pytest.approx(0.011)} and c["recompute"] == {"full": 0.5}
    assert "18.0 ms in 2 processes at once" in device.loop_note(c) and "12.0, 18.0" in device.loop_note(c)
    # a loop shorter than the micro-steps: the optimizer alone
    fast = device.together([one(0.002, [0.001]), one(0.002, [0.001])])
    assert fast["optimizer_s"] == pytest.approx(0.002)


def test_the_calibration_times_its_two_micro_batches_taking_turns(monkeypatch):
    """Each shape's first call is not timed, then the two micro-batches take turns, so neither is timed
    alone in the machine's first seconds (an H100 timed the first at 59 ms where the runs said 43:
    runs/reference/nvidia-h100-80gb-hbm3-plan)."""
    from estimator import checkpointing_plan as ckpt_plan
    from simulation.describe import resolve_flags

    order, first = [], []
    real = ckpt_plan.forward_backward

    def recorded(model, x, y, precision):
        first.append(x.shape[0] not in order)
        order.append(x.shape[0])
        real(model, x, y, precision)

    def clock(dev, fn):  # each shape's first call "takes" 1000 s, the others 1 ms: no wall clock
        calls = len(first)
        fn()
        return 1000.0 if len(first) > calls and first[-1] else 0.001

    monkeypatch.setattr(ckpt_plan, "forward_backward", recorded)
    monkeypatch.setattr(ckpt_plan, "seconds_of", clock)
    setup = resolve_flags([*TINY, "--backend", "single"], 1)
    c = plan.calibrate(setup.workload, setup.cfg.block_class, (2, 8), "cpu", setup.cfg.save_ops(), reps=1)
    assert order[:4] == [2, 8, 2, 8], order
    assert max(c["timed"].values()) < 1000, c["timed"]  # one timed call each: not the slow first


def test_the_link_is_probed_once_per_machine_and_kept_with_the_backend_costs(tmp_path, monkeypatch):
    """--gpu here prices every call on the link kept in the backend costs' file (their residuals are
    what is left after pricing the probe runs' calls on it): probed the first time (many calls, several
    launches: five calls read 291 to 2381 us per ring step across eight plans on the 2-core CPU), then
    read back, probed again on another machine or world; a probe takes the mean of each launch's calls
    and the median of the launches; the tests' cache (os.devnull) keeps nothing."""
    from analysis.plan import backend_costs as bc
    from analysis.plan import device

    launches = iter([(0.004, 0.020), (0.001, 0.012), (0.002, 0.014)])  # (small, large) seconds per call

    class Queue:
        def get(self):
            return next(launches)

    class Proc:
        exitcode = 0

        def __init__(self, target, args):
            pass

        def start(self):
            pass

        def join(self, timeout):
            pass

    class Context:
        SimpleQueue = Queue
        Process = Proc

    import torch.multiprocessing as mp

    monkeypatch.setattr(mp, "get_context", lambda kind: Context())
    link = device.probe_link(2, sizes=(1024, 8 * 2**20), calls=(50, 8), launches=3)
    # the median launch's: 0.002 s over 2 ring steps; 8 MiB of bus bytes over (0.014 - 0.002) s
    assert link.latency_us == pytest.approx(1000.0) and link.gb_s == pytest.approx(8 * 2**20 / 0.012 / 1e9)

    probed = []

    def fake_probe(world):
        probed.append(world)
        return device.Link(1.5, 700.0 + len(probed), "probed")

    monkeypatch.setattr(device, "probe_link", fake_probe)
    monkeypatch.setenv("GPTLITE_BACKEND_COSTS", str(tmp_path / "backend_costs.json"))
    first = device.machine_link(2)
    assert (first.latency_us, probed) == (701.0, [2]) and str(tmp_path) in first.source
    assert device.machine_link(2).latency_us == 701.0 and probed == [2]  # kept: not probed again
    kept = json.loads((tmp_path / "backend_costs.json").read_text())
    assert kept["link|world=2"]["machine"] == bc.machine() and kept["link|world=2"]["gb_s"] == 1.5
    assert device.machine_link(4).latency_us == 702.0 and probed == [2, 4]
    monkeypatch.setattr(bc, "machine", lambda: {"cpu": "another"})
    assert device.machine_link(2).latency_us == 703.0 and probed == [2, 4, 2]
    monkeypatch.setenv("GPTLITE_BACKEND_COSTS", os.devnull)
    assert device.machine_link(2).latency_us == 704.0 and device.machine_link(2).latency_us == 705.0
    assert os.path.exists(os.devnull) and not os.path.isfile(os.devnull)
