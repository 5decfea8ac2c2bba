"""Plan a run: which configuration to train a model with on W ranks under a memory budget per rank.

    python -m analysis.plan --world 2 --gpu here --mem_budget_gb 0.3 --global_batch 16 --preset small
    python -m analysis.plan --world 8 --gpu H100-SXM --mem_budget_gb 40 --global_batch 64 \\
        --preset paper --precision bf16 --attention sdpa

The model is train.py's flags (any model that trains: GPT-lite, hf:, a model file; train.py's names
and defaults). The planner chooses the rest: the backend configuration (ddp and every shipped
fsdp_configs/ and ds_configs/ file, or --configs), micro-batch x accumulation with micro x accumulation
x W = --global_batch, and checkpointing (none, full every k, selective every k: --ckpt). Each candidate
is resolved as train.py resolves it (simulation/describe.py: a refused one is listed with train.py's
reason), its peak per rank estimated (analysis.estimate_cli; over the budget less the estimator's error
band, MARGIN, 15%: dropped, naming the part that breaks it), and its step timed by a
model whose parts are printed:

    compute   --gpu NAME: FLOPs per sample (counted, plus what checkpointing recomputes) x samples per
              rank / (the precision's peak x MFU), as analysis.project;
              --gpu here: calibrated on this machine's device: the model's forward and backward timed
              at two micro-batches (a fixed time per micro-step plus a time per sample), the optimizer
              step timed, and the recompute of full and selective checkpointing timed as a share of a
              micro-step's time
    comm      each backend's collectives by theory (Backend.comm_theory) over alpha-beta links
              (hardware.yaml for a named GPU; --gpu here: all_reduce timed between W local processes),
              cut into the calls the configuration's bucket sizes make (Backend.comm_schedule: each
              call pays the link's latency); with --counted, the calls and bytes counted by running
              the candidate as rank 0 of W under the fake process group (simulation.fake_world)
    wait      the share of comm nothing overlaps (Backend.comm_schedule): DeepSpeed stage 0's all-reduce
              after backward, ZeRO-1/2's gather in the optimizer step and reductions without
              overlap_comm, ZeRO-3's gathers with stage3_prefetch_bucket_size 0, FSDP's backward
              gathers with backward_prefetch null, DDP's last bucket (ready when backward ends); on
              the critical path, never hidden
    offload   host<->device bytes / PCIe and the CPU optimizer's time (a named GPU only)
    own       --gpu here: the configuration's own cost on this machine (its hooks, flattening, engine,
              optimizer, per-call cost), measured by running it on a probe model and taking the rest
              of this model's prediction away: per step + per micro-step + per item per micro-step
              (FSDP's units, else trainable tensors: analysis/plan/backend_costs.py; kept per
              machine, or shipped for this machine's kind, the plan saying which: --backend_costs)
    step      compute + (1 - overlap) x comm + wait + offload + own;  samples/s = global batch / step

--variants DIR adds the variants of the compared configurations that change speed or memory (bucket
sizes, prefetching: variants()), written into DIR as the files their commands name (DDP's are flags).
The answer is ranked by predicted samples/s, with each candidate's exact launch command.
--race runs every configuration's best-ranked candidate a few steps and the faster half again (its runs'
median), until two are left (successive halving): a wrong prediction costs steps, not the pick. Only
the configurations predicted within --race_within (0.6) of the best enter: each one left out saves a
launch, and on the model zoo none left out would have won (0 enters every configuration).
--verify K runs the top K and two further down (here, or as Slurm jobs with --executor slurm;
--verify_rounds R runs each R times, taking turns), refits the step model on them and picks the
fastest measured. --out DIR writes plan.md and plan.png (every
candidate's estimated peak against its predicted samples/s, with the frontier and the budget).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import yaml

from gptlite.data import DataError
from gptlite.errors import ConfigError
from backends import REFERENCE
from core.config import RunConfig
from training.cli import OneLineParser, config_from_argv
from training.preflight import writable_out
from orchestration.slurm import SlurmSettings, add_flags, settings_from
from analysis.project import HARDWARE, add_cost_flags, add_gpu_flag
import analysis.plan.backend_costs as backend_costs
from analysis.plan.backend_costs import QUICK_REPEATS, REPEATS, summary_line
from analysis.plan.candidates import (CHOSEN_FLAGS, CKPT, RUN_OWN_FLAGS, _check_ckpt_within_blocks, _check_config,
                                      candidates, check_ckpt, configurations, write_variants)
from analysis.plan.cost import plan
from analysis.plan.device import Device, here_device, named_device
from analysis.plan.probe import costs_for
from analysis.plan.refit import refit
from analysis.plan.report import outcome, print_json, print_table, print_verified, write_out
from analysis.plan.verify import RACE_LEAST, RACE_WITHIN, SLURM_OWN, entrants, race, verify


def main(argv=None) -> int:
    """The planner's command line. Ctrl-C: one line and exit code 130 (128 + SIGINT, what a shell reports
    for a command Ctrl-C stopped, and what sweep.py returns; 2 says bad input, which this is not),
    with nothing half-written: the verifying run in progress is stopped and recorded failed
    (orchestration/runner.py), the calibration's processes stopped, every file kept so far whole."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("python -m analysis.plan: stopped (Ctrl-C) before the plan was made; nothing written for it "
              "(a verifying run it stopped is recorded failed)", file=sys.stderr)
        return 130


def build_parser(hw: dict) -> OneLineParser:
    """The planner's flags (train.py's model flags pass through: parse_known_args)."""
    p = OneLineParser(prog="python -m analysis.plan", description=__doc__.splitlines()[0], allow_abbrev=False,
                      formatter_class=argparse.RawDescriptionHelpFormatter,
                      usage="python -m analysis.plan --world W --mem_budget_gb M --global_batch B [--gpu GPU|here] "
                            "[--configs C ...] [--variants DIR] [--ckpt P ...] [--verify K | --race] [--top N] [--json] "
                            "[train.py's model flags]",
                      epilog="Every other flag is train.py's, with train.py's names and defaults (the model: --model, "
                             "--preset, --model_args, --block_size, --precision, --attention, ...: python train.py "
                             "--help). What the planner chooses (the backend and its file, --micro_batch, "
                             "--grad_accum, checkpointing) is refused among them.\n\n" + __doc__.split("\n\n", 2)[2])
    p.add_argument("--world", type=int, required=True, help="ranks (GPUs) the run is launched on")
    p.add_argument("--gpus_per_node", type=int, default=None, help="ranks per node (default: the GPU's node, "
                   "hardware.yaml; --gpu here: --world)")
    add_gpu_flag(p, hw)
    add_cost_flags(p, hw)
    p.add_argument("--mem_budget_gb", type=float, required=True, help="memory per rank, GiB (train.py's flag)")
    p.add_argument("--global_batch", type=int, required=True,
                   help="samples per optimizer step, fixed as a recipe fixes it: micro x accumulation x world")
    p.add_argument("--configs", nargs="+", default=None, metavar="CONFIG",
                   help="single, ddp, fsdp, fsdp2, or fsdp_configs/ and ds_configs/ files (default: all shipped)")
    p.add_argument("--variants", default=None, metavar="DIR",
                   help="also plan the variants of the configurations that change speed or memory, written into DIR "
                        "as files the commands name: DDP's buckets a quarter and 4x its 25 MiB (--ddp_bucket_cap_mb: "
                        "flags, no file), DeepSpeed ZeRO-1/2 reduce buckets a quarter and 4x the file's, ZeRO-3 "
                        "without prefetch and with 100x the file's persistence threshold (priced with --counted), "
                        "FSDP FULL_SHARD/HYBRID_SHARD without backward prefetch")
    p.add_argument("--counted", action="store_true",
                   help="price each fitting candidate's real collectives (calls and bytes), counted by running it as rank "
                        "0 of --world under the fake process group (simulation.fake_world: a few seconds each), not the "
                        "theory's bytes cut by the configuration's buckets: "
                        "ZeRO-3's and FSDP's gathers go module by module")
    p.add_argument("--ckpt", nargs="+", default=list(CKPT), metavar="P",
                   help="checkpointing candidates: none, full/K, selective/K (every K-th block)")
    p.add_argument("--micro_batches", type=int, nargs="+", default=None, help="only these micro-batches")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="also write DIR/plan.md (the tables and the pick) and DIR/plan.png (every candidate's estimated "
                        "peak against its predicted samples/s, the frontier, the budget, the verified runs as measured)")
    p.add_argument("--top", type=int, default=10, help="rows of the ranked table shown")
    p.add_argument("--json", action="store_true", help="print one JSON object: candidates (ranked) and pick, "
                   "and with --verify, verified")
    p.add_argument("--verify", type=int, default=0, metavar="K",
                   help="run the top K candidates and two from further down on this machine (--gpu here), as "
                        "ordinary records under --runs_dir, and pick the fastest measured one within the budget")
    p.add_argument("--backend_costs", choices=("auto", "measure", "cached", "off"), default="auto",
                   help="--gpu here: each configuration's own cost on this machine (its hooks, flattening, engine, "
                        "calls; analysis/plan/backend_costs.py), measured on a probe model at world --world and "
                        "kept in $GPTLITE_CACHE/backend_costs.json for the next plan. auto (default): those kept; "
                        "where none are, those shipped for this machine's kind (the same CPU and cores: "
                        "analysis/plan/shipped_costs.json; the plan says which it used); the others measured first, "
                        "each probe run a line (4 runs a configuration, about 45 s each on a 2-core CPU; from "
                        "nothing kept or shipped, the six of a question were measured and predicted in 4.5 minutes, "
                        "with them shipped in 15 s). measure: measured here in full, 12 runs a configuration (about "
                        "2 minutes each on a 2-core CPU), whatever is shipped or kept from auto's 4. "
                        "cached: those kept or shipped, the others "
                        "priced at 0 (saying which). off: none (the configurations' own work unpriced)")
    p.add_argument("--race", action="store_true",
                   help="trust no prediction across configurations: race them on this machine (successive halving). "
                        "Every configuration's best-ranked fitting candidate (of those --race_within admits) runs "
                        "--verify_steps steps, the faster half "
                        "within the budget (the median of each one's runs) runs again, until two are left; the faster "
                        "is the pick. At most a quarter of the grid's runs (RACE_SHARE; at least two): the best-ranked "
                        "entrants alone where more would not fit, and no round that would go over. "
                        "Prints the steps and seconds it ran against the grid's (every fitting candidate as long)")
    p.add_argument("--race_within", type=float, default=RACE_WITHIN, metavar="F",
                   help="--race: enter only the configurations whose best prediction is at least F x the best "
                        f"candidate's (default {RACE_WITHIN}; 0: every configuration; fewer than {RACE_LEAST} entered, "
                        f"the next best-ranked candidates join up to {RACE_LEAST}). On the model zoo no "
                        "configuration predicted below 0.6 of the leader measured within 5%% of the best (at most "
                        "0.85 of it), and "
                        "racing fewer saves a launch per configuration left out (docs/results/zoo_accuracy_2026-12-05.md)")
    p.add_argument("--verify_steps", type=int, default=8, help="steps of each verifying run, and of a race's first "
                   "round (2 warm-up steps and the last, profiled for memory, are not timed)")
    p.add_argument("--verify_rounds", type=int, default=1, metavar="R",
                   help="run each verified candidate R times, taking turns (every candidate once, then again): its "
                        "samples/s is the median of its runs, its spread their range (this machine's speed "
                        "drifts between runs more than within one)")
    p.add_argument("--runs_dir", default="runs/plan", help="where verifying runs are recorded")
    p.add_argument("--timeout_s", type=float, default=900, help="each verifying run's limit")
    # --verify's runs as Slurm jobs (on nodes like this machine: the calibration's); a run's shape
    # is the plan's own (--world, --gpus_per_node).
    add_flags(p, where="the executor's default", skip=SLURM_OWN)
    return p


def check_args(p: OneLineParser, args) -> None:
    """The planner's own flags checked (p.error: one line, exit code 2) before anything runs or is written."""
    if args.world < 1 or args.global_batch < 1:
        p.error("--world and --global_batch must be >= 1")
    if not (math.isfinite(args.mem_budget_gb) and args.mem_budget_gb > 0):
        p.error(f"--mem_budget_gb must be a number of GiB > 0 (got {args.mem_budget_gb:g})")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        p.error(f"--gpus_per_node must be >= 1 (got {args.gpus_per_node})")
    if not 0 < args.mfu <= 1 or not 0 <= args.overlap <= 1:
        p.error("--mfu must be in (0, 1], --overlap in [0, 1]")
    if args.top < 1:
        p.error(f"--top must be >= 1 (got {args.top}): the rows of the ranked table shown")
    if not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
        p.error(f"--timeout_s must be a number of seconds > 0 (got {args.timeout_s:g}): each verifying run's limit")
    for flag, values in (("--configs", args.configs or []), ("--ckpt", args.ckpt), ("--micro_batches", args.micro_batches or [])):
        twice = next((v for v in values if values.count(v) > 1), None)
        if twice is not None:
            p.error(f"{flag}: each at most once ({twice} is given {values.count(twice)} times)")
    for m in args.micro_batches or []:
        if m < 1:
            p.error(f"--micro_batches: each >= 1 (got {m})")
    for c in args.configs or []:
        try:
            _check_config(c)
        except ConfigError as e:
            p.error(str(e))
    if (args.verify or args.race) and args.gpu != "here":
        p.error(f"{'--verify' if args.verify else '--race'} runs the candidates on this machine: it needs --gpu here")
    if not 0.0 <= args.race_within <= 1.0:
        p.error(f"--race_within must lie between 0 and 1 (got {args.race_within:g})")
    if args.verify and args.race:
        p.error("--verify K and --race: one or the other (the race runs every configuration's best-ranked candidate)")
    if args.verify_rounds != 1 and not args.verify:
        p.error("--verify_rounds: it repeats the runs of --verify K; give --verify too")
    if args.verify < 0 or args.verify_steps < 4 or args.verify_rounds < 1:
        p.error("--verify must be >= 0, --verify_rounds >= 1 and --verify_steps >= 4 (2 warm-up steps and the "
                "profiled last one are not timed)")
    if args.gpu == "here" and args.gpus_per_node is not None and args.gpus_per_node < args.world:
        p.error("--gpus_per_node: --gpu here plans on this machine, one node of all --world ranks")
    if args.out or args.verify or args.race:  # before any calibration or run: bad input records nothing
        try:
            if args.out:
                writable_out("--out", args.out)
            if args.verify or args.race:  # where the verifying runs are recorded, after the calibration
                writable_out("--runs_dir", args.runs_dir)
        except ConfigError as e:
            p.error(str(e))


def model_config(train_argv: list[str]) -> RunConfig:
    """The model's RunConfig from train.py's flags, parsed once: what every candidate varies
    (dataclasses.replace). The flags the planner chooses, and one run's own, are refused."""
    given, defaults = config_from_argv(train_argv), config_from_argv([])
    for name in CHOSEN_FLAGS:
        if getattr(given, name) != getattr(defaults, name):
            raise ConfigError(f"--{name}: the planner chooses it (--configs, --micro_batches, --ckpt narrow the choice)")
    for name in RUN_OWN_FLAGS:
        if getattr(given, name) != getattr(defaults, name):
            raise ConfigError(f"--{name}: one run's own, not the model's: every candidate's command would carry it "
                              "(add it to the command you pick)")
    return given


def this_machine(args, train_argv: list[str], per_node: int, configs: list[str], bases: dict,
                 micro_batches: list[int]) -> Device:
    """--gpu here: the device calibrated and its link probed (or kept), each configuration's own costs
    kept, shipped or measured (--backend_costs)."""
    if not args.json:
        print("calibrating this machine (the model's step timed; the link between its ranks probed, or kept) ...",
              file=sys.stderr, flush=True)
    # single's step is the calibration itself: it has no own costs to price (probe.costs_for)
    priced = [c for c in configs if c not in bases and c != REFERENCE]
    speed_before = None
    if args.backend_costs != "off" and priced:  # the machine's speed, read again when the costs are priced
        speed_before = backend_costs.reference_seconds()  # through its module: tests stand in for it there
    # the link the shipped costs were fitted against, where nothing is kept (auto, cached)
    shipped_link = args.backend_costs in ("auto", "cached")
    device = here_device(train_argv, args.world, per_node, args.overlap, micro_batches, shipped_link=shipped_link)
    if args.backend_costs != "off":
        def probe_device(model: list[str], micro_batches: list[int]) -> Device:
            return here_device(model, args.world, per_node, args.overlap, micro_batches, shipped_link=shipped_link)

        found, missing = costs_for(priced, args.world, probe_device,
                                   args.backend_costs in ("auto", "measure"),
                                   progress=lambda line: print(line, file=sys.stderr, flush=True),
                                   speed_before=speed_before, use_shipped=shipped_link,
                                   repeats=QUICK_REPEATS if args.backend_costs == "auto" else REPEATS)
        device.backend_costs = found
        device.notes.append(summary_line(found, missing))
    return device


def measured(args, rows: list[dict], train_argv: list[str], device: Device, slurm) -> tuple[list, dict | None, dict | None]:
    """--verify K or --race: the candidates run here (or as Slurm jobs), the step model refitted on them:
    (verified, refit, race)."""
    if args.verify:
        if not args.json:
            print_table(rows, device, args)
            rounds = f", {args.verify_rounds} rounds" if args.verify_rounds > 1 else ""
            print(f"\nverifying: the top {args.verify} and two further down, {args.verify_steps} steps each"
                  f"{rounds}, into {args.runs_dir}", flush=True)
        verified = verify(rows, args.verify, train_argv, args.world, Path(args.runs_dir).resolve(), args.verify_steps,
                          args.timeout_s, slurm, args.verify_rounds)
        return verified, refit(rows, verified, args.global_batch), None
    if not args.json:
        print_table(rows, device, args)
        entering = entrants(rows, within=args.race_within)
        configs = len({r["config"] for r in entering})
        left = len({r["config"] for r in rows if r.get("fits")}) - configs
        print(f"\nracing: the best-ranked candidate of each of {configs} configurations"
              + (f" ({left} predicted below {args.race_within:g} x the best left out)" if left else "")
              + (f", and the next best-ranked up to {len(entering)} entrants" if len(entering) > configs else "")
              + ", "
              f"{args.verify_steps} steps, the faster half (the median of its runs) again, until two are "
              f"left, into {args.runs_dir}", flush=True)
    raced = race(rows, train_argv, args.world, Path(args.runs_dir).resolve(), args.verify_steps,
                 args.timeout_s, args.mem_budget_gb, slurm, within=args.race_within)
    # each entrant's last run, its samples/s the median of its runs (what the race ranked it by)
    raced["latest"] = {m["command"]: {**m, "measured_samples_per_s": m.get("race_samples_per_s",
                                                                           m["measured_samples_per_s"])}
                       for rnd in raced["rounds"] for m in rnd}
    verified = list(raced["latest"].values())
    return verified, refit(rows, verified, args.global_batch), raced


def _main(argv=None) -> int:
    hw = yaml.safe_load(HARDWARE.read_text())
    p = build_parser(hw)
    args, train_argv = p.parse_known_args(argv)
    check_args(p, args)
    per_node = args.gpus_per_node or (args.world if args.gpu == "here" else hw["gpus"][args.gpu]["gpus_per_node"])
    try:
        given = model_config(train_argv)
        ckpt = tuple(check_ckpt(k) for k in args.ckpt)
        if args.ckpt != list(CKPT):
            _check_ckpt_within_blocks(ckpt, given)
        configs = args.configs or configurations(args.world, per_node)
        asked = candidates(configs, args.world, args.global_batch, ckpt, args.micro_batches)  # the question checked first
        slurm = None
        if (args.verify or args.race) and args.executor == "slurm":  # checked before anything is written or run
            slurm = settings_from(SlurmSettings(), args, skip=SLURM_OWN)
        bases = write_variants(configs, args.variants) if args.variants else {}
        configs = [*configs, *bases]
        if args.gpu == "here":
            device = this_machine(args, train_argv, per_node, configs, bases, sorted({c.micro_batch for c in asked}))
        else:
            device = named_device(args.gpu, args.network, args.mfu, args.overlap, given.precision)
        rows = plan(train_argv, args.world, per_node, args.mem_budget_gb, args.global_batch, device, configs, ckpt,
                    args.micro_batches, progress=not args.json, bases=bases, counted=args.counted, model=given)
        refused = list(dict.fromkeys(r["refused"] for r in rows if "refused" in r))
        if rows and len(refused) == 1 and all("refused" in r for r in rows):  # the question itself is bad input
            raise ConfigError(refused[0])
        if args.counted:
            failed = sorted({r["bytes"] for r in rows if r.get("bytes", "").startswith("theory (")})
            device.notes.append(f"comm: the fitting candidates' collectives counted as rank 0 of {args.world} under "
                                "the fake process group" + (f"; not counted, on the theory's bytes: {'; '.join(failed)}"
                                                             if failed else ""))
        fitting = any(r.get("fits") for r in rows)
        verified, fitted, raced = measured(args, rows, train_argv, device, slurm) if (args.verify or args.race) \
            and fitting else ([], None, None)
    except (ConfigError, DataError) as e:
        p.error(str(e))
    except RuntimeError as e:
        print(f"python -m analysis.plan: {e}", file=sys.stderr)
        return 1
    pick, ties = outcome(rows, verified, raced, args)
    if args.out:
        try:
            write_out(Path(args.out), rows, device, args, verified, fitted, pick, ties,
                      sys.argv[1:] if argv is None else argv, raced)
        except OSError as e:
            p.error(f"--out {args.out}: cannot write there ({e.strerror or e})")
    if args.json:
        print_json(rows, device, args, verified, fitted, pick, ties, raced)
        return 0 if pick else 1
    if (args.verify or args.race) and fitting:
        print_verified(verified, fitted, [r for r in rows if r.get("fits")], pick, ties, raced)
        return 0 if pick else 1
    return print_table(rows, device, args)
