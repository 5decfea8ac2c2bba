"""The real launches the suite needs: one declarative table, each launch made once per test run
(the first time a test asks for it), and the tests that read it.

A test reads a launch through the `launches` fixture (conftest.py): `launches.get("matrix", request)`.
Only the tests a launch names may read it (`readers`, as "module::test" or "module::fixture"), so the
table says who depends on what; tests/unit/test_launch_table.py holds every reader to a real test or fixture.
A launch that failed fails every test that reads it, with its output.

Kinds:
    train   train.py under a launcher (python, torchrun, deepspeed): a Run (conftest.Run); "{DIR}" in
            its args and env is the launch's own directory (its record is {DIR}/<name>)
    sweep   sweep.py on a spec built from a shipped one: the directory of its records
    probe   tests/support/ckpt_probe.py under torchrun, every group of PROBE_GROUPS in one launch: each rank's
            results ({group label: {case: result}})
    nodes   train.py on 2 "nodes" of 2 ranks: two torchrun node launchers (--nnodes 2, c10d rendezvous on
            127.0.0.1) on this machine, saving a checkpoint after step NODES_SAVE_AFTER; then the same run
            resumed from it into the same record: a Nodes (the first run's record kept aside)

The parity settings (PARITY_ARGS: no dropout, fp32, the learning rate moving the weights from step 0)
make runs of different backends comparable step by step: the reference (one process, micro-batch 8)
and every 2-rank run of global batch 8 (micro-batch 4, or 2 with 2-step accumulation) must have the
same losses within 1e-5. The quick matrix (sweeps/cpu_quick.yaml, what `make demo` runs) is launched
in these settings, so its 30 records serve the parity, memory, communication, estimator, report,
fake-world and Slurm tests at once.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from orchestration.launch import REPO

# Small, fast and exact: no dropout, fp32, a learning rate that moves the weights from step 0.
PARITY_ARGS = ("--preset", "tiny", "--dropout", "0", "--precision", "fp32", "--lr_warmup_steps", "0",
               "--mem_profile_steps", "0", "--warmup_steps", "0", "--eval_batches", "1")
REFERENCE_STEPS = 10  # the reference's steps; 2-rank runs compare their first ones
MATRIX_STEPS = 6  # the quick matrix's steps (the first timed-step warm-up, the last profiled)
QUICK_SPEC = REPO / "sweeps" / "cpu_quick.yaml"
LAUNCH_TIMEOUT_S = 240  # a launch longer than this is hung: fail fast instead of waiting for pytest's timeout
DS_TIMEOUT_S = 900


@dataclass(frozen=True)
class Launch:
    what: str
    kind: str  # train | sweep | probe
    readers: tuple[str, ...]
    launcher: str = "python"
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    timeout: float = LAUNCH_TIMEOUT_S
    real: bool = False  # under the real launcher; else forked (tests/support/forkserver.py)
    prepare: str | None = None  # "module.function" writing what the launch reads into {DIR} first


def _two_ranks(*flags: str, micro: int = 4, accum: int = 1, steps: int = REFERENCE_STEPS) -> tuple[str, ...]:
    return (*PARITY_ARGS, *flags, "--steps", str(steps), "--micro_batch", str(micro), "--grad_accum", str(accum),
            "--mem_profile_steps", "1")


# ------------------------------------------------------------------ the probe's groups
# tests/support/ckpt_probe.py: checkpointing (every k-th block, both torch implementations, torch's offload,
# selective, plans per block, dropout) and prefetch offload, per backend, one launch for them all.
N_LAYER = 4  # the tiny preset
CKPT_BASELINE = "0:torch_nonreentrant:0"
CKPT_CASES = ([CKPT_BASELINE] + [f"{k}:{impl}:0" for impl in ("torch_nonreentrant", "torch_reentrant")
                                 for k in (1, 2, N_LAYER)]
              + ["1:torch_nonreentrant:1", "2:torch_reentrant:1"]
              # --ckpt_policy selective, without dropout and with it: a recompute draws the forward's masks.
              + ["1:torch_nonreentrant:0:selective", "2:torch_nonreentrant:0:selective",
                 "0:torch_nonreentrant:0:full:0.1", "1:torch_nonreentrant:0:full:0.1",
                 "1:torch_nonreentrant:0:selective:0.1"]
              # A plan per block (--ckpt_plan, what --ckpt_policy auto runs), without dropout and with it.
              + ["0:torch_nonreentrant:0:selective+full+none+full",
                 "0:torch_nonreentrant:0:full+none+selective+selective:0.1"])
# The rest of the quick matrix and accelerate: a plan per block leaves losses and gradients unchanged,
# dropout 0.1 too; selective blocks except under ZeRO-3 (plans of none and full there).
PLAN_CASES = ["0:torch_nonreentrant:0", "0:torch_nonreentrant:0:full:0.1",
              "0:torch_nonreentrant:0:selective+full+none+full", "0:torch_nonreentrant:0:full+none+selective+full:0.1"]
ZERO3_PLAN_CASES = ["0:torch_nonreentrant:0", "0:torch_nonreentrant:0:full:0.1",
                    "0:torch_nonreentrant:0:none+full+full+none", "0:torch_nonreentrant:0:full+none+full+full:0.1"]
# Prefetch offload at horizon 2 against the same checkpointing kept in memory; DeepSpeed's own too.
OFFLOAD_CASES = [f"{k}:torch_nonreentrant:{offload}" for k in (1, 2) for offload in ("0", "p2")]
DS_OFFLOAD_CASES = [f"1:torch_reentrant:{offload}" for offload in ("0", "p1")]


def _ds_ckpt_cases(config: str) -> list[str]:
    """DeepSpeed's checkpointing implementations and the torch ones under ZeRO-2 and ZeRO-3
    (DeepSpeed's non_reentrant_checkpoint fails on ZeRO-3), its cpu_checkpointing, selective and plans."""
    impls = (("deepspeed", "deepspeed_nonreentrant", "torch_nonreentrant", "torch_reentrant") if config == "z2"
             else ("deepspeed", "torch_nonreentrant", "torch_reentrant"))
    cases = [CKPT_BASELINE] + [f"{k}:{impl}:0" for impl in impls for k in (1, 2, N_LAYER)]
    cases.append("2:deepspeed:1")  # with --ckpt_offload: DeepSpeed's cpu_checkpointing
    if config == "z2":  # selective is refused under ZeRO-3 (backends/deepspeed_spec.py)
        cases += ["1:torch_nonreentrant:0:selective", "2:torch_nonreentrant:0:selective",
                  "0:torch_nonreentrant:0:full:0.1", "1:torch_nonreentrant:0:selective:0.1",
                  "0:torch_nonreentrant:0:selective+full+none+full:0.1"]
    else:  # a plan of none and full, what --ckpt_policy auto chooses from under ZeRO-3
        cases += ["0:torch_nonreentrant:0:none+full+full+none", "0:torch_nonreentrant:0:full:0.1",
                  "0:torch_nonreentrant:0:full+none+none+full:0.1"]
    return cases


def _union(*lists: list[str]) -> list[str]:
    return list(dict.fromkeys(case for cases in lists for case in cases))


def _group(label: str, backend: str, config: str | None, cases: list[str], **more) -> dict:
    return {"label": label, "backend": backend, "config": config, "cases": cases, **more}


# The torch backends first, then accelerate, then DeepSpeed (whose set-up wraps the process group), ZeRO-3 last.
PROBE_GROUPS = [
    _group("ddp", "ddp", None, _union(CKPT_CASES, OFFLOAD_CASES)),
    _group("fsdp", "fsdp", "fsdp_configs/full_shard.yaml", _union(CKPT_CASES, OFFLOAD_CASES)),
    _group("fsdp2", "fsdp2", "fsdp_configs/fsdp2.yaml", _union(CKPT_CASES, OFFLOAD_CASES)),
    _group("fsdp.shard_grad_op", "fsdp", "fsdp_configs/shard_grad_op.yaml", PLAN_CASES),
    _group("fsdp.no_shard", "fsdp", "fsdp_configs/no_shard.yaml", PLAN_CASES),
    _group("fsdp.hybrid_shard", "fsdp", "fsdp_configs/hybrid_shard.yaml", PLAN_CASES),
    _group("fsdp2.no_reshard", "fsdp2", "fsdp_configs/fsdp2_no_reshard.yaml", PLAN_CASES),
    _group("accelerate", "accelerate", None, PLAN_CASES),
    # ZeRO-2's cases first among DeepSpeed's: after the other DeepSpeed groups in this one process, its
    # selective cases' losses moved beyond 1e-6 from its own baseline (measured 2026-11-27; each ran in a
    # launch of its own before). With frozen embeddings, block 0's input needs no gradient: DeepSpeed's
    # reentrant checkpoint then computed none for the checkpointed blocks (DeepSpeed issues 4274, 4479).
    _group("z2", "deepspeed", "ds_configs/z2.json", _ds_ckpt_cases("z2")),
    _group("z2.frozen", "deepspeed", "ds_configs/z2.json",
           ["0:torch_nonreentrant:0", "1:deepspeed:0", "2:deepspeed:0", "4:deepspeed:0"], freeze_embeddings=True),
    _group("z0", "deepspeed", "ds_configs/z0.json", PLAN_CASES),
    _group("z1", "deepspeed", "ds_configs/z1.json", PLAN_CASES),
    _group("z2_offload", "deepspeed", "ds_configs/z2_offload.json", PLAN_CASES),
    _group("zeropp", "deepspeed", "ds_configs/zeropp.json", ZERO3_PLAN_CASES),
    _group("z3_infinity", "deepspeed", "ds_configs/z3_infinity.json", ZERO3_PLAN_CASES),
    _group("z3", "deepspeed", "ds_configs/z3.json", _union(_ds_ckpt_cases("z3"), OFFLOAD_CASES, DS_OFFLOAD_CASES)),
]


# ------------------------------------------------------------------ 2 nodes x 2 ranks
# The hybrid family (sharded within a node, replicated across nodes) needs more than one node to be
# more than FULL_SHARD: 4 ranks as 2 torchrun nodes of 2, global batch 8 (micro-batch 2), so the first
# NODES_STEPS losses compare with the committed one-process reference.
NODES_STEPS = 6
NODES_SAVE_AFTER = 3  # --save_every 4: one checkpoint, after step 3; the resume trains steps 4 and 5
HYBRID = {"fsdp2_hsdp": ("--fsdp_config", "fsdp_configs/fsdp2_hsdp.yaml"),
          "fsdp2_reshard_node": ("--fsdp_config", "fsdp_configs/fsdp2_reshard_node.yaml"),
          "hybrid_shard": ("--fsdp_config", "fsdp_configs/hybrid_shard.yaml"),
          "hybrid_shard_zero2": ("--fsdp_config", "fsdp_configs/hybrid_shard_zero2.yaml"),
          "zeropp_hpz": ("--deepspeed_config", "ds_configs/zeropp_hpz.json")}
HYBRID_READERS = ("test_hybrid::test_each_hybrid_configuration_trains_like_one_process",
                  "test_hybrid::test_each_hybrid_configuration_resumes_exactly",
                  "test_hybrid::test_each_hybrid_configuration_communicates_per_link_as_its_theory_says",
                  "test_hybrid::test_hsdp_sends_only_the_gradient_all_reduce_between_nodes",
                  "test_hybrid::test_the_estimate_is_within_10_percent_of_each_measured_peak",
                  "test_hybrid::test_a_hybrid_checkpoint_exports_the_plain_model",
                  "test_slurm_two_nodes::test_the_hybrid_family_over_two_slurm_nodes_records_the_losses_of_one_host")


@dataclass
class Nodes:
    first: "object"  # conftest.Run: the uninterrupted run's record, kept aside before the resume
    resumed: "object"  # conftest.Run: the same record after the resume
    checkpoint: Path  # the checkpoint after step NODES_SAVE_AFTER

    @property
    def proc(self):  # what another pytest-xdist worker reads back (Launched._made_elsewhere)
        return self.resumed.proc


def two_nodes(directory: Path, name: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """train.py under two torchrun node launchers of 2 ranks each on this machine: what a user runs on
    each of two nodes, with the rendezvous on this host (tests/distributed/test_multinode.py's way)."""
    import uuid

    from conftest import base_env
    from core.ports import free_port

    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
         "--nproc_per_node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
         str(REPO / "train.py"), "--runs_dir", str(directory), "--run_name", name, "--quiet", *args],
        cwd=REPO, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    outputs = [node.communicate(timeout=timeout) for node in nodes]
    code = next((n.returncode for n in nodes if n.returncode), 0)
    return subprocess.CompletedProcess(["torchrun --nnodes 2", *args], code, outputs[0][0] + outputs[1][0],
                                       outputs[0][1][-4000:] + outputs[1][1][-4000:])


def _nodes_launch(name: str) -> "Launch":
    return Launch(f"{name}: 2 torchrun nodes x 2 ranks, a checkpoint after step {NODES_SAVE_AFTER}, then resumed",
                  "nodes", readers=HYBRID_READERS, launcher="torchrun",
                  args=(*PARITY_ARGS, *HYBRID[name], "--steps", str(NODES_STEPS), "--micro_batch", "2",
                        "--mem_profile_steps", "1", "--save_every", str(NODES_SAVE_AFTER + 1)),
                  timeout=DS_TIMEOUT_S, real=True)


# ------------------------------------------------------------------ the table
TRUST_READERS = ("test_checkpoint_trust::test_a_damaged_checkpoint_is_refused_before_any_rank_starts",
                 "test_checkpoint_trust::test_a_checkpoint_carrying_code_runs_none_of_it")
SAVED = ("--save_every", "2", "--save_dir", "{DIR}/save")
TEXT_ARGS = (*PARITY_ARGS, "--model", "hf:gpt2", "--model_args", "n_layer=2,n_embd=32,n_head=2", "--block_size", "32",
             "--tokenizer_name", "{DIR}/tokenizer", "--train_file", "{DIR}/train.jsonl", "--backend", "ddp",
             "--micro_batch", "4", "--steps", "3")
SAVED_KEY = (("GPTLITE_CHECKPOINT_KEY", "{DIR}/checkpoint.key"),)
# A transformers checkpoint loaded with its weights (--model_name_or_path; tests/distributed/test_pretrained.py): GPT-2 of
# 8 blocks with tied embeddings ({CKPT}: written once per test run, pretrained_checkpoint), 10 steps in the
# parity settings, the last profiled (the estimator's peak), a checkpoint after the last (export).
PRETRAINED_ARGS = ("--model_name_or_path", "{CKPT}", "--block_size", "32", "--dropout", "0", "--precision", "fp32",
                   "--lr_warmup_steps", "0", "--warmup_steps", "0", "--eval_batches", "1", "--steps",
                   str(REFERENCE_STEPS), "--mem_profile_steps", "1", "--save_dir", "{DIR}/save", "--save_every",
                   str(REFERENCE_STEPS))
PRETRAINED_READERS = ("test_pretrained::test_first_step_loss_is_transformers_own",
                      "test_pretrained::test_every_backend_matches_one_process_for_10_steps",
                      "test_pretrained::test_an_export_reloads_with_from_pretrained_and_gives_the_trained_logits",
                      "test_pretrained::test_estimate_is_within_10_percent_of_the_measured_peak")
LOADING_READERS = ("test_pretrained::test_zero3_and_fsdp2_load_without_a_whole_copy_per_rank",)
# (launch name, launcher, flags); the one-process reference first.
PRETRAINED_BACKENDS = {
    "pretrained-single": ("python", ("--backend", "single", "--micro_batch", "8")),
    "pretrained-ddp": ("torchrun", ("--backend", "ddp", "--micro_batch", "4")),
    "pretrained-fsdp": ("torchrun", ("--fsdp_config", "fsdp_configs/full_shard.yaml", "--micro_batch", "4")),
    "pretrained-fsdp2": ("torchrun", ("--fsdp_config", "fsdp_configs/fsdp2.yaml", "--micro_batch", "4")),
    "pretrained-z1": ("deepspeed", ("--deepspeed_config", "ds_configs/z1.json", "--micro_batch", "4")),
    "pretrained-z2": ("deepspeed", ("--deepspeed_config", "ds_configs/z2.json", "--micro_batch", "4")),
    "pretrained-z3": ("deepspeed", ("--deepspeed_config", "ds_configs/z3.json", "--micro_batch", "4")),
    "pretrained-accelerate": ("torchrun", ("--backend", "accelerate", "--micro_batch", "4")),
}


def pretrained_checkpoint(root: Path) -> Path:
    """The checkpoint the pretrained launches load ({CKPT}), written once per test run under `root`."""
    from filelock import FileLock

    from pretrained_checkpoint import write_checkpoint

    path = root / "pretrained-gpt2-8"
    with FileLock(str(root / "pretrained-gpt2-8.lock")):
        if not (path / "model.safetensors").is_file():
            write_checkpoint(path, "gpt2", n_layer=8, width=64)
    return path


LAUNCHES: dict[str, Launch] = {
    "reference": Launch(
        "the one-process reference: micro-batch 8, global batch 8, the last step profiled", "train",
        readers=("test_parity::test_the_reference_reproduces_its_committed_losses",
                 "test_training::test_accumulation_equals_a_larger_micro_batch",
                 "test_fsdp::test_no_shard_holds_everything", "test_fsdp::test_memory_breakdown_is_measured_under_fsdp",
                 "test_compile::test_compiled_run_matches_eager", "test_compile::test_an_eager_run_records_no_compilation",
                 "test_compile::test_a_compile_memory_budget_recomputes_inside_the_compiled_blocks",
                 "test_allocator::test_a_run_records_its_allocator_settings"),
        args=(*PARITY_ARGS, "--steps", str(REFERENCE_STEPS), "--micro_batch", "8", "--mem_profile_steps", "1"),
        real=True),
    "matrix": Launch(
        "sweeps/cpu_quick.yaml in the parity settings: 15 configurations x checkpointing off and every block, "
        "2 ranks, micro-batch 4, through sweep.py", "sweep",
        readers=("test_parity::test_ddp_on_two_processes_matches_single",
                 "test_parity::test_checkpointing_every_block_leaves_every_backends_losses_unchanged",
                 "test_fsdp::fsdp_runs", "test_deepspeed::ds_runs",
                 "test_comm::test_every_backend_records_its_collectives_and_they_agree_with_theory",
                 "test_estimate::test_estimate_against_every_backend_of_the_quick_matrix",
                 "test_fake_world::test_fake_world_at_2_matches_every_real_2_rank_run", "test_analysis::mixed",
                 "test_slurm::test_a_sweep_on_slurm_records_what_the_same_sweep_records_here",
                 "test_slurm_two_nodes::test_runs_over_two_nodes_record_what_one_machine_records"),
        timeout=3600),
    "ddp-2x2": Launch("DDP with 2-step accumulation (no_sync)", "train",
                      readers=("test_parity::test_ddp_on_two_processes_matches_single",
                               "test_ddp_zero1::test_it_trains_as_ddp_does_and_holds_a_shard_of_the_optimizer_state"),
                      launcher="torchrun", args=_two_ranks("--backend", "ddp", micro=2, accum=2), real=True),
    "ddp_zero1-2x2": Launch("DDP with ZeroRedundancyOptimizer, 2-step accumulation", "train",
                            readers=("test_ddp_zero1::test_it_trains_as_ddp_does_and_holds_a_shard_of_the_optimizer_state",),
                            launcher="torchrun", args=_two_ranks("--backend", "ddp_zero1", micro=2, accum=2)),
    "fsdp.shard_grad_op-2x2": Launch("FSDP SHARD_GRAD_OP with accumulation (no_sync)", "train",
                                     readers=("test_fsdp::fsdp_runs",), launcher="torchrun",
                                     args=_two_ranks("--fsdp_config", "fsdp_configs/shard_grad_op.yaml", micro=2, accum=2)),
    "fsdp2.fsdp2-2x2": Launch("FSDP2 with accumulation (requires_gradient_sync)", "train",
                        readers=("test_fsdp::fsdp_runs",), launcher="torchrun",
                        args=_two_ranks("--fsdp_config", "fsdp_configs/fsdp2.yaml", micro=2, accum=2)),
    "fsdp.full_shard_offload": Launch("FSDP with CPU offload (not applied on a CPU, recorded)", "train",
                                      readers=("test_fsdp::fsdp_runs",), launcher="torchrun",
                                      args=_two_ranks("--fsdp_config", "fsdp_configs/full_shard_offload.yaml")),
    "fsdp.full_shard_tuned": Launch("FSDP tuned for speed: forward prefetch, no all-gather limit", "train",
                                    readers=("test_fsdp::fsdp_runs",), launcher="torchrun",
                                    args=_two_ranks("--fsdp_config", "fsdp_configs/full_shard_tuned.yaml")),
    "fsdp2.fsdp2_offload": Launch("FSDP2 with CPU offload", "train", readers=("test_fsdp::fsdp_runs",),
                                  launcher="torchrun", args=_two_ranks("--fsdp_config", "fsdp_configs/fsdp2_offload.yaml")),
    "z2-2x2": Launch("ZeRO-2 with accumulation, the deepspeed launcher", "train", readers=("test_deepspeed::ds_runs",),
                     launcher="deepspeed", args=_two_ranks("--deepspeed_config", "ds_configs/z2.json", micro=2, accum=2),
                     timeout=DS_TIMEOUT_S, real=True),
    "z3_infinity-2x2": Launch("ZeRO-Infinity (CPU) with accumulation, DeepSpeed under torchrun", "train",
                              readers=("test_deepspeed::ds_runs",), launcher="torchrun",
                              args=_two_ranks("--deepspeed_config", "ds_configs/z3_infinity.json", micro=2, accum=2),
                              timeout=DS_TIMEOUT_S),
    # Finished runs with checkpoints after steps 1 and 3 (the latest), signed with a key of their own
    # ({DIR}: the launch's directory), which resumes are tried against, damaged or carrying code.
    "fsdp2-saved": Launch("FSDP2, 2 ranks, checkpoints after steps 1 and 3", "train",
                          readers=TRUST_READERS, launcher="torchrun",
                          args=_two_ranks("--fsdp_config", "fsdp_configs/fsdp2.yaml", *SAVED, micro=2, steps=4),
                          env=SAVED_KEY),
    "z3-saved": Launch("ZeRO-3, 2 ranks, checkpoints after steps 1 and 3", "train", readers=TRUST_READERS,
                       launcher="deepspeed", args=_two_ranks("--deepspeed_config", "ds_configs/z3.json", *SAVED,
                                                             micro=2, steps=4),
                       env=SAVED_KEY, timeout=DS_TIMEOUT_S),
    # A tiny GPT-2 built from its config, on a JSON Lines file with a tokenizer trained for the test
    # (tests/support/text_fixtures.py), its tokenized data cached in {DIR}/cache; datasets says what it caches.
    "text-ddp": Launch("hf:gpt2 on a JSON Lines file and a trained tokenizer, DDP, 2 ranks under torchrun", "train",
                       readers=("test_text_data::test_a_ddp_run_on_a_json_lines_file_records_the_tokenized_data",
                                "test_text_data::test_the_ranks_first_step_loss_is_the_models_loss_on_the_drawn_samples"),
                       launcher="torchrun", args=TEXT_ARGS,
                       env=(("GPTLITE_CACHE", "{DIR}/cache"), ("DATASETS_VERBOSITY", "info")),
                       prepare="text_fixtures.prepare_launch", real=True),
    "probe": Launch("tests/support/ckpt_probe.py: every group of PROBE_GROUPS, 2 ranks", "probe",
                    readers=("test_activation_checkpointing::test_checkpointing_leaves_losses_and_gradients_unchanged",
                             "test_activation_checkpointing::test_printed_model_shows_checkpoint_wrappers_where_chosen",
                             "test_activation_checkpointing::test_a_plan_leaves_losses_and_gradients_unchanged_on_the_rest_of_the_quick_matrix",
                             "test_activation_offload::test_losses_and_gradients_identical_with_offloading",
                             "test_deepspeed::test_checkpointing_leaves_losses_and_gradients_unchanged",
                             "test_deepspeed::test_reentrant_checkpointing_of_a_first_block_whose_input_needs_no_grad"),
                    launcher="torchrun", timeout=1800),
    **{name: Launch(f"a transformers checkpoint loaded and trained: {name.removeprefix('pretrained-')}", "train",
                    readers=PRETRAINED_READERS + (LOADING_READERS if name in ("pretrained-ddp", "pretrained-fsdp2",
                                                                               "pretrained-z3") else ()),
                    launcher=launcher, args=(*PRETRAINED_ARGS, *flags),
                    timeout=DS_TIMEOUT_S if launcher == "deepspeed" else LAUNCH_TIMEOUT_S)
       for name, (launcher, flags) in PRETRAINED_BACKENDS.items()},
    **{f"{name}-2x2": _nodes_launch(name) for name in HYBRID},
}


@dataclass
class Launched:
    """The launches of one test run, each made the first time a test asks for it."""

    root: Path
    done: dict = field(default_factory=dict)

    def get(self, name: str, request):
        launch = LAUNCHES[name]
        reader = reader_of(request)
        assert reader in launch.readers, (f"{reader} reads launch {name!r} but the table does not name it: add it to "
                                          f"LAUNCHES[{name!r}].readers in tests/support/launches.py")
        if name not in self.done:
            self.done[name] = self._once(name, launch)
        if isinstance(self.done[name], BaseException):
            raise self.done[name]
        return self.done[name]

    def _once(self, name: str, launch: Launch):
        """The launch, made once per test run: by this process, or by another pytest-xdist worker of
        the same run (`root` is theirs too), which this one waits for and reads. A launch that failed
        fails every test reading it, in every worker, with its error, without launching again."""
        from filelock import FileLock

        made = self.root / f"{name}.made.json"
        with FileLock(str(self.root / f"{name}.lock")):
            if not made.exists():
                try:
                    result = self._make(name, launch)
                except BaseException as e:  # noqa: BLE001
                    made.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
                    return e
                proc = getattr(result, "proc", None)
                made.write_text(json.dumps({"error": None, "proc": proc and [
                    list(map(str, proc.args)), proc.returncode, proc.stdout, proc.stderr]}))
                return result
        return self._made_elsewhere(name, launch, json.loads(made.read_text()))

    def _made_elsewhere(self, name: str, launch: Launch, made: dict):
        from conftest import Run

        if made["error"]:
            return RuntimeError(f"launch {name!r} (made by another pytest-xdist worker) failed: {made['error']}")
        directory = self.root / name
        if launch.kind == "train":
            return Run(subprocess.CompletedProcess(*made["proc"]), directory / name)
        if launch.kind == "sweep":
            return directory / "runs"
        if launch.kind == "nodes":
            return Nodes(Run(subprocess.CompletedProcess([], 0, "", ""), directory / "first"),
                         Run(subprocess.CompletedProcess(*made["proc"]), directory / name), directory / "kept")
        import torch

        return [torch.load(p) for p in sorted((directory / "out").glob("rank*.pt"))]

    def _make(self, name: str, launch: Launch):
        from conftest import launch as start, train

        directory = self.root / name
        env = {key: value.replace("{DIR}", str(directory)) for key, value in launch.env}
        if launch.prepare is not None:
            module, function = launch.prepare.rsplit(".", 1)
            getattr(importlib.import_module(module), function)(directory)
        if launch.kind == "train":
            args = [arg.replace("{DIR}", str(directory)) for arg in launch.args]
            if "{CKPT}" in args:
                args = [arg.replace("{CKPT}", str(pretrained_checkpoint(self.root))) for arg in args]
            return train(directory, name, *args, launcher=launch.launcher, timeout=launch.timeout,
                         env=env, real=launch.real).check_ok()
        if launch.kind == "sweep":
            path = directory / "spec.yaml"
            directory.mkdir(parents=True)
            path.write_text(matrix_spec(directory / "runs"))
            proc = sweep_forked(path, env)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            return directory / "runs"
        if launch.kind == "nodes":
            import shutil

            from conftest import Run

            save = directory / "save"
            args = [*launch.args, "--save_dir", str(save)]
            first = Run(two_nodes(directory, name, args, launch.timeout), directory / name).check_ok()
            shutil.copytree(first.dir, directory / "first")  # the uninterrupted record, before the resume
            shutil.copytree(save, directory / "kept")  # the checkpoint after step NODES_SAVE_AFTER
            resumed = Run(two_nodes(directory, name, [*args, "--resume"], launch.timeout), directory / name).check_ok()
            return Nodes(Run(first.proc, directory / "first"), resumed, directory / "kept")
        if launch.kind == "probe":
            import torch

            plan = directory / "plan.json"
            directory.mkdir(parents=True)
            plan.write_text(json.dumps(PROBE_GROUPS))
            proc = start(REPO / "tests" / "support" / "ckpt_probe.py", [str(directory / "out"), str(plan)], launch.launcher, 2,
                         timeout=launch.timeout, env=env, real=launch.real)
            assert proc.returncode == 0, proc.stderr[-4000:]
            ranks = [torch.load(p) for p in sorted((directory / "out").glob("rank*.pt"))]
            assert len(ranks) == 2
            return ranks
        raise ValueError(f"launch kind {launch.kind!r}")


def sweep_forked(spec: Path, env: dict, *flags: str) -> subprocess.CompletedProcess:
    """sweep.py's main on `spec`, in this process, its runs launched by the fork launcher
    (conftest.fork_command) instead of torchrun and deepspeed: the sweep's own logic and runner as
    they are, each run's ranks without their start-up (test_sweep.py and the Slurm tests run sweep.py
    itself)."""
    from unittest import mock

    import sweep as sweep_cli
    from conftest import base_env, forked_runs, in_process

    # The environment sweep.py would have been started with (one thread per rank: base_env), which
    # its runner passes on to each run.
    with mock.patch.dict(os.environ, {**base_env(), **env}), forked_runs():
        return in_process(sweep_cli.main, [str(spec), *flags])


def matrix_spec(runs_dir: Path) -> str:
    """sweeps/cpu_quick.yaml in the parity settings, into `runs_dir` (the Slurm test's spec,
    sweeps/cpu_slurm.yaml, has the same settings: its records must equal these)."""
    import yaml

    spec = yaml.safe_load(QUICK_SPEC.read_text())
    spec.update(name="quick_test", steps=MATRIX_STEPS, runs_dir=str(runs_dir))
    spec["matrix"]["micro_batch"] = [4]
    spec["train_args"] = {**spec.get("train_args", {}), **MATRIX_TRAIN_ARGS}
    return yaml.safe_dump(spec)


MATRIX_TRAIN_ARGS = {"warmup_steps": 1, "mem_profile_steps": 1, "eval_batches": 1, "dropout": 0.0,
                     "lr_warmup_steps": 0}


def reader_of(request) -> str:
    """"module::test" for a test, "module::fixture" for a fixture (of module or wider scope)."""
    module = request.module.__name__.rsplit(".", 1)[-1]
    if request.scope == "function":
        return f"{module}::{request.node.originalname}"
    return f"{module}::{request.fixturename}"


# ------------------------------------------------------------------ committed reference losses
# The reference's losses and validation loss, committed (tests/support/reference_losses.json): the parity tests
# compare against them without depending on the reference launch; test_parity.py holds the launch to
# them (exactly, on the machine and torch that wrote them). Regenerate after a change that moves them:
#     .venv/bin/python tests/support/launches.py --write-reference
REFERENCE_FILE = Path(__file__).resolve().parent / "reference_losses.json"
REGENERATE = ".venv/bin/python tests/support/launches.py --write-reference"


def machine() -> dict:
    """What the losses' last bits depend on: the CPU (its kernels: its name, family, model and stepping,
    core.environment.cpu_name; two virtual machines both named "AMD EPYC" round the reference's third
    loss apart, 3.9270265 and 3.9270263) and torch."""
    import platform

    import torch

    from core.environment import cpu_name

    cpu = cpu_name() or platform.processor()
    return {"cpu": cpu, "torch": torch.__version__}


def committed_reference() -> dict:
    return json.loads(REFERENCE_FILE.read_text())


def write_reference() -> None:
    import tempfile

    from conftest import train

    launch = LAUNCHES["reference"]
    with tempfile.TemporaryDirectory() as tmp:
        run = train(Path(tmp), "reference", *launch.args, launcher=launch.launcher, timeout=launch.timeout).check_ok()
        REFERENCE_FILE.write_text(json.dumps({
            "what": launch.what, "command": f"python train.py {' '.join(launch.args)}",
            "regenerate": REGENERATE, "machine": machine(), "losses": run.losses,
            "val_loss": run.summary["val_loss"]}, indent=1) + "\n")
    print(f"wrote {REFERENCE_FILE}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for conftest
    if sys.argv[1:] != ["--write-reference"]:
        sys.exit(f"usage: {REGENERATE}")
    write_reference()
