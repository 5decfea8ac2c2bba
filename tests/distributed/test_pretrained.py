"""A transformers checkpoint trained from its weights (--model_name_or_path) under every backend.

One GPT-2 of 8 blocks with tied embeddings (tests/support/launches.py: pretrained_checkpoint, written with
save_pretrained), one launch per backend (PRETRAINED_BACKENDS: 10 steps in the parity settings):
- the first step's loss is the one transformers computes itself on the same batch, from the
  checkpoint (within 1e-5, fp32): the weights were loaded, and the loss is transformers' loss;
- every 2-rank backend matches the one process for 10 steps (the suite's tolerances: 1e-5 torch,
  1e-4 DeepSpeed, as tests/distributed/test_model_parity.py);
- ZeRO-3 and FSDP2 load it without a whole copy per rank: each rank's loading peak (the record's
  checkpoint_load: torch-allocated bytes live in the loading window) is at most the share it holds
  plus one block's parameters, where DDP's, which loads it whole, is the whole model;
- every backend's checkpoint exports as a transformers checkpoint that from_pretrained reloads with
  the trained logits exactly;
- the memory estimate is within 10% of the measured peak (single, DDP, FSDP2, ZeRO-3);
- bad input about the model: one line, exit 2, nothing recorded.
"""

from __future__ import annotations

import pytest
import torch

from conftest import REPO, assert_losses_close, base_env, check_refused, launch_command, tool_in_process
from launches import PRETRAINED_BACKENDS, REFERENCE_STEPS, pretrained_checkpoint
from pretrained_checkpoint import POSITIONS, write_checkpoint

BACKENDS = list(PRETRAINED_BACKENDS)
REFERENCE = "pretrained-single"
TWO_RANKS = BACKENDS[1:]
BLOCK_SIZE = 32


def _workload(checkpoint):
    import models
    from core.config import RunConfig

    cfg = RunConfig(model_name_or_path=str(checkpoint), block_size=BLOCK_SIZE, dropout=0.0)
    return cfg, models.load(cfg.model_request())


def transformers_loss(checkpoint) -> float:
    """transformers' own loss of `checkpoint` on step 0's global batch (8 samples) as the runs draw it:
    the model's loss function, given the next tokens as its shifted labels."""
    import transformers

    cfg, workload = _workload(checkpoint)
    net = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    x, y = workload.data.batch("train", cfg.seed, 0, 0, 8, 8)
    with torch.no_grad():
        return net(input_ids=x, labels=y, shift_labels=y.contiguous()).loss.item()


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
def test_first_step_loss_is_transformers_own(launches, request, backend):
    run = launches.get(backend, request)
    checkpoint = pretrained_checkpoint(launches.root)
    assert run.config["model"]["name"] == "pretrained" and run.config["model"]["checkpoint"] == str(checkpoint)
    assert run.summary["world_size"] == (1 if backend == REFERENCE else 2)
    expected = transformers_loss(checkpoint)
    assert abs(run.losses[0] - expected) <= 1e-5, f"{backend}: first-step loss {run.losses[0]} != transformers' {expected}"


@pytest.mark.distributed
@pytest.mark.parametrize("backend", TWO_RANKS)
def test_every_backend_matches_one_process_for_10_steps(launches, request, backend):
    run, reference = launches.get(backend, request), launches.get(REFERENCE, request)
    rtol = 1e-4 if PRETRAINED_BACKENDS[backend][0] == "deepspeed" else 1e-5
    assert_losses_close(run.losses, reference.losses, REFERENCE_STEPS, rtol=rtol)
    assert run.summary["val_loss"] == pytest.approx(reference.summary["val_loss"], rel=rtol)


def _model_bytes(checkpoint) -> tuple[int, int]:
    """(the whole model's parameter bytes in fp32, counted once where tied; one block's)."""
    _, workload = _workload(checkpoint)
    meta = workload.meta()
    whole = sum(p.numel() for p in meta.parameters()) * 4
    block = sum(p.numel() for p in meta.net.transformer.h[0].parameters()) * 4
    return whole, block


@pytest.mark.distributed
def test_zero3_and_fsdp2_load_without_a_whole_copy_per_rank(launches, request):
    whole, block = _model_bytes(pretrained_checkpoint(launches.root))
    assert len(launches.get("pretrained-fsdp2", request).config["model"]["tied"]) == 1  # lm_head, stored once
    # The measure sees a whole copy where one is made: DDP loads the model whole on every rank.
    for rank in launches.get("pretrained-ddp", request).config["checkpoint_load"]["ranks"]:
        assert rank["peak_bytes"] >= whole, rank
    for name in ("pretrained-fsdp2", "pretrained-z3"):
        loading = launches.get(name, request).config["checkpoint_load"]
        assert len(loading["ranks"]) == 2
        for r, rank in enumerate(loading["ranks"]):
            held = rank["held_parameter_bytes"]
            assert held < 0.6 * whole, f"{name} rank {r} holds {held} of {whole} bytes: not a share"
            assert rank["peak_bytes"] <= held + block, (
                f"{name} rank {r}: loading peak {rank['peak_bytes']} > its share {held} + one block {block} "
                f"(the whole model: {whole})")


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_export_reloads_with_from_pretrained_and_gives_the_trained_logits(launches, request, tmp_path, backend):
    import transformers

    from training.export import checkpoint_dir, consolidated_state_dict, export

    run = launches.get(backend, request)
    save_dir = run.config["run"]["save_dir"]
    out = tmp_path / "exported"
    export(save_dir, out)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    # The trained weights as the suite's own model holds them (consolidated from the backend's checkpoint).
    state, meta = consolidated_state_dict(checkpoint_dir(save_dir))
    assert meta["step"] == REFERENCE_STEPS - 1
    cfg, workload = _workload(pretrained_checkpoint(launches.root))
    trained = workload.structure()
    trained.load_state_dict(state)
    trained.eval()
    x, y = workload.data.batch("val", cfg.seed, 0, 0, 8, 8)
    with torch.no_grad():
        expected = trained(x)[0]
        got = reloaded(input_ids=x).logits
        loss = reloaded(input_ids=x, labels=y, shift_labels=y.contiguous()).loss.item()
    assert torch.equal(got, expected), f"{backend}: logits differ by {(got - expected).abs().max()}"
    # And the validation loss the run recorded after its last step (the backend's own forward).
    assert loss == pytest.approx(run.summary["val_loss"], rel=1e-5)
    # The tokenizer the checkpoint came with, beside the weights.
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tokenizer("to be or not")["input_ids"] == \
        transformers.AutoTokenizer.from_pretrained(str(pretrained_checkpoint(launches.root)))("to be or not")["input_ids"]


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["pretrained-single", "pretrained-ddp", "pretrained-fsdp2", "pretrained-z3"])
def test_estimate_is_within_10_percent_of_the_measured_peak(launches, request, backend):
    from estimator.estimate import estimate_from_record

    run = launches.get(backend, request)
    estimate, measured = estimate_from_record(run.config).total_bytes, run.summary["mem_peak_bytes"]
    assert abs(estimate / measured - 1) <= 0.10, f"{backend}: estimate {estimate} against measured {measured}"


# ------------------------------------------------------------------ bad input about the model
@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "gpt2", "gpt2", n_layer=1, width=32)


def _bad(tmp_path, small_checkpoint, case: str):
    not_a_checkpoint = tmp_path / "notes"
    not_a_checkpoint.mkdir()
    (not_a_checkpoint / "README.md").write_text("not weights\n")
    no_weights = tmp_path / "config-only"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((small_checkpoint / "config.json").read_text())
    a_file = small_checkpoint / "config.json"
    text = tmp_path / "letters.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX!\n" * 100)
    return {
        "a directory that is not a checkpoint": (["--model_name_or_path", str(not_a_checkpoint)],
                                                 "is not a transformers checkpoint: it has no config.json"),
        "a file": (["--model_name_or_path", str(a_file)], "is a file, not a checkpoint directory"),
        "a path that does not exist": (["--model_name_or_path", str(tmp_path / "nowhere")], "does not exist"),
        "a config without weights": (["--model_name_or_path", str(no_weights)], "has no safetensors weights"),
        "a hub name without a network": (["--model_name_or_path", "some-org/some-model"],
                                         "the hub cannot give it (HF_HUB_OFFLINE is set): pass a local path"),
        "a block size beyond the positions": (["--model_name_or_path", str(small_checkpoint), "--block_size",
                                               str(2 * POSITIONS)],
                                              f"block_size: {2 * POSITIONS} is longer than the model's positions "
                                              f"(n_positions {POSITIONS}"),
        "another --model beside it": (["--model_name_or_path", str(small_checkpoint), "--model", "hf:gpt2"],
                                      "model_name_or_path and --model hf:gpt2 exclude each other"),
        "model_args beside it": (["--model_name_or_path", str(small_checkpoint), "--model_args", "n_layer=2"],
                                 "model_args: a checkpoint's settings are its config.json's"),
        "text with more symbols than the embedding": (
            ["--model_name_or_path", str(write_checkpoint(tmp_path / "vocab32", "gpt2", 1, 32, vocab_size=32,
                                                          tokenizer=False)), "--data", str(text)],
            f"the data's vocabulary ({len(set(text.read_text()))} symbols) is larger than the model's embedding "
            "(32 in"),
    }[case]


BAD = ["a directory that is not a checkpoint", "a file", "a path that does not exist", "a config without weights",
       "a hub name without a network", "a block size beyond the positions", "another --model beside it",
       "model_args beside it", "text with more symbols than the embedding"]


@pytest.mark.parametrize("case", BAD)
def test_bad_model_input_is_one_line_and_records_nothing(tmp_path, monkeypatch, small_checkpoint, case):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache: the name is not there
    args, message = _bad(tmp_path, small_checkpoint, case)
    runs = tmp_path / "runs"
    check_refused(tool_in_process("train", [*args, "--steps", "1", "--runs_dir", str(runs)]), "train.py", message, runs)


@pytest.mark.distributed
def test_a_hub_name_without_a_network_is_said_once_under_torchrun(tmp_path):
    """Two ranks, as test_bad_input's torchrun cases: said once, no traceback of the suite's, nothing recorded."""
    import subprocess

    runs = tmp_path / "runs"
    env = {**base_env(), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([*launch_command("torchrun", 2), "--model_name_or_path", "some-org/some-model", "--backend",
                           "ddp", "--steps", "1", "--runs_dir", str(runs)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode != 0
    assert proc.stderr.count("pass a local path") == 1, proc.stderr
    ours = [line for line in proc.stderr.splitlines()
            if line.strip().startswith(f'File "{REPO}') and f"{REPO}/.venv" not in line]
    assert not ours, "\n".join(ours)
    assert not list(runs.rglob("summary.json"))


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["pretrained-z3"])
def test_a_resumed_run_from_a_checkpoint_continues_exactly(launches, tmp_path, backend):
    """ZeRO-3 (loaded under zero.Init, then its own checkpoint loaded over it): 6 steps saving after step 4,
    then resumed from that checkpoint into the same record: the resumed step repeats the first run's."""
    from conftest import train
    from launches import PRETRAINED_ARGS

    launcher, flags = PRETRAINED_BACKENDS[backend]
    given = dict(zip(PRETRAINED_ARGS[::2], PRETRAINED_ARGS[1::2]))  # flag -> value (every flag takes one)
    given.update({"--model_name_or_path": str(pretrained_checkpoint(launches.root)), "--steps": "6",
                  "--save_dir": str(tmp_path / "save"), "--save_every": "5"})
    args = [*(item for pair in given.items() for item in pair), *flags]
    first = train(tmp_path / "runs", "resume", *args, launcher=launcher, timeout=900).check_ok()
    uninterrupted = first.losses
    resumed = train(tmp_path / "runs", "resume", *args, "--resume", launcher=launcher, timeout=900).check_ok()
    assert resumed.config["start_step"] == 5 and resumed.config["resumed_from"].endswith("step_00000004")
    assert resumed.losses == uninterrupted


def test_the_report_tells_two_checkpoints_apart():
    from analysis.runs import model_key

    rows = [{"model": "pretrained", "config.run.model_name_or_path": path, "config.run.dropout": 0.0}
            for path in ("./gpt2-a", "./gpt2-b")]
    keys = [model_key(row) for row in rows]
    assert keys[0] != keys[1] and "./gpt2-a" in keys[0]


def test_a_bf16_checkpoint_trains_from_fp32_master_weights(tmp_path):
    """The weights load in fp32 whatever the checkpoint stores (what every backend keeps as master
    weights, and what the estimator counts); the record says the checkpoint's own dtype."""
    from safetensors.torch import load_file

    checkpoint = write_checkpoint(tmp_path / "llama-bf16", "llama", n_layer=1, width=32, dtype="bfloat16")
    cfg, workload = _workload(checkpoint)
    assert workload.description["checkpoint_dtype"] == "bf16"
    model = workload.build(cfg.seed)
    stored = load_file(str(checkpoint / "model.safetensors"))
    assert {name for name, _ in model.net.named_parameters()} == set(stored)
    for name, p in model.net.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, stored[name].float()), name


def test_a_hub_name_in_the_local_cache_loads_offline(tmp_path, monkeypatch):
    """The hub path is the same code with a name: a checkpoint laid out as huggingface_hub caches a
    download (models--org--name/snapshots/REV, refs/main) is found by name with HF_HUB_OFFLINE set."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny-org--tiny-gpt2" / "snapshots" / "0123abcd"
    write_checkpoint(snapshot, "gpt2", n_layer=1, width=32)
    (cache / "models--tiny-org--tiny-gpt2" / "refs").mkdir()
    (cache / "models--tiny-org--tiny-gpt2" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg, workload = _workload("tiny-org/tiny-gpt2")
    assert workload.description["checkpoint"] == str(snapshot)
    assert workload.description["model_name_or_path"] == "tiny-org/tiny-gpt2"
    assert workload.n_params > 0


def test_a_checkpoint_sharded_over_several_files_loads_whole(tmp_path):
    """save_pretrained's shards (model.safetensors.index.json and several files) give the same weights."""
    import transformers

    one = write_checkpoint(tmp_path / "one", "gpt2", n_layer=2, width=32)
    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(str(one)).save_pretrained(sharded, max_shard_size="20KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    (cfg, a), (_, b) = _workload(one), _workload(sharded)
    assert len(set(b.pretrained.checkpoint.files.values())) > 1
    for (name, p), (_, q) in zip(a.build(cfg.seed).named_parameters(), b.build(cfg.seed).named_parameters()):
        assert torch.equal(p, q), name


def test_the_estimator_counts_the_checkpoints_vocabulary_and_its_tied_embeddings_once(tmp_path):
    """The data's characters (65 or fewer) are not the model's vocabulary: the checkpoint's embedding
    (pretrained_checkpoint.VOCAB rows) is counted, and once although the LM head shares it."""
    from estimator.traced_model import traced_for_run
    from pretrained_checkpoint import VOCAB

    checkpoint = write_checkpoint(tmp_path / "gpt2", "gpt2", n_layer=2, width=32)
    cfg, workload = _workload(checkpoint)
    assert workload.data.vocab_size < VOCAB
    counts = traced_for_run(cfg.to_dict()).counts
    net = workload.meta().net
    assert net.lm_head.weight is net.transformer.wte.weight and net.transformer.wte.weight.shape[0] == VOCAB
    assert counts.total == sum(p.numel() for p in net.parameters())  # each parameter once
    assert counts.total == workload.n_params
    assert sum(counts.per_block) + counts.root == counts.total


def test_a_checkpoint_on_a_json_lines_file_reads_it_with_its_own_tokenizer(tmp_path, monkeypatch):
    """--model_name_or_path with --train_file and no --tokenizer_name: the rows are tokenized with the
    checkpoint's tokenizer, and the first batch's loss is transformers' own on those tokens."""
    import transformers

    import models
    from core.config import RunConfig
    from text_fixtures import corpus_rows, write_jsonl

    monkeypatch.setenv("GPTLITE_CACHE", str(tmp_path / "cache"))
    checkpoint = write_checkpoint(tmp_path / "gpt2", "gpt2", n_layer=1, width=32)
    rows = write_jsonl(tmp_path / "train.jsonl", corpus_rows(400))
    cfg = RunConfig(model_name_or_path=str(checkpoint), train_file=str(rows), block_size=BLOCK_SIZE, dropout=0.0)
    workload = models.load(cfg.model_request())
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    assert workload.description["tokenizer"] == str(checkpoint)
    x, y = workload.data.batch("train", cfg.seed, 0, 0, 8, 8)
    assert workload.data.vocab_size == len(tokenizer) and x.shape == (8, BLOCK_SIZE)
    assert workload.data.describe()["tokenizer"] == str(checkpoint)
    net = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = net(input_ids=x, labels=y, shift_labels=y.contiguous()).loss.item()
        got = workload.build(cfg.seed).eval()(x, y)[1].item()
    assert abs(got - expected) <= 1e-5 * expected, (got, expected)


def test_a_tokenizer_larger_than_the_checkpoints_embedding_is_refused(tmp_path, monkeypatch):
    from text_fixtures import corpus_rows, write_jsonl, write_tokenizer

    monkeypatch.setenv("GPTLITE_CACHE", str(tmp_path / "cache"))
    checkpoint = write_checkpoint(tmp_path / "gpt2", "gpt2", n_layer=1, width=32)  # vocabulary 96
    tokenizer = write_tokenizer(tmp_path / "tok")  # 300 tokens and more
    rows = write_jsonl(tmp_path / "train.jsonl", corpus_rows(100))
    runs = tmp_path / "runs"
    check_refused(tool_in_process("train", ["--model_name_or_path", str(checkpoint), "--tokenizer_name", str(tokenizer),
                                         "--train_file", str(rows), "--steps", "1", "--runs_dir", str(runs)]),
                   "train.py", "tokenizer_name: the tokenizer", runs)
