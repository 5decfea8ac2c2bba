"""Tokenized text (models/text_data.py): a tokenizer trained here with the `tokenizers` library, rows
written as JSON Lines, Parquet and text; packing, padding, the split, the order, the cache, the model's
vocabulary, and the bad input of each, in this process (no network: a Hub name is refused offline)."""

from __future__ import annotations

import json

import pytest
import torch

import models
from core.config import RunConfig
from gptlite.data import BatchLayout, DataError
from gptlite.errors import ConfigError
from models import text_data
from models.spec import TextRequest
from models.workload import IGNORE_INDEX, WithLoss, cross_entropy
from text_fixtures import corpus_rows, write_jsonl, write_parquet, write_tokenizer

ROWS = 400  # the corpus' first paragraphs: a few thousand tokens
TINY_GPT2 = "n_layer=2,n_embd=32,n_head=2"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTLITE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "datasets"


@pytest.fixture()
def jsonl(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", corpus_rows(ROWS))


def rows_of(data, split: str) -> list[list[int]]:
    """A split's samples as stored: each sample's tokens (its inputs and its last target)."""
    return data.splits[split].with_format(None)[:]["ids"]


def load(path, tokenizer_dir, block_size=32, **fields):
    return text_data.load_text_dataset(TextRequest(str(tokenizer_dir), train_file=str(path), quiet=True, **fields),
                                       block_size)


def test_packing_joins_the_rows_tokens_and_cuts_them_into_samples_with_the_next_tokens(
        cache, jsonl, tokenizer_dir, tokenizer):
    T = 32
    data = load(jsonl, tokenizer_dir, T)
    rows = corpus_rows(ROWS)
    cut = ROWS - ROWS * 5 // 100  # the last 5% of the rows validate
    stream = [t for r in rows[:cut] for t in tokenizer(r)["input_ids"]]
    n = (len(stream) - 1) // T
    x, y = data._samples("train", range(n))
    assert len(data.splits["train"]) == n
    assert x.tolist() == [stream[i * T:(i + 1) * T] for i in range(n)]  # run_clm.py's samples
    assert y.tolist() == [stream[i * T + 1:(i + 1) * T + 1] for i in range(n)]  # their next tokens
    assert (y != IGNORE_INDEX).all() and data.describe()["train_tokens"] == n * T
    val_stream = [t for r in rows[cut:] for t in tokenizer(r)["input_ids"]]
    vx, _ = data._samples("val", range(len(data.splits["val"])))
    assert vx.flatten().tolist() == val_stream[:vx.numel()]


def test_padding_keeps_one_row_per_sample_and_the_loss_leaves_the_padding_out(tmp_path, cache, tokenizer_dir,
                                                                               tokenizer):
    T = 16
    rows = ["a", "short row\n", "a row of more words than a sample of sixteen tokens can hold, cut at seventeen\n"] * 20
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    data = load(path, tokenizer_dir, T, pad=True)
    ids = [tokenizer(r)["input_ids"] for r in rows[:57]]  # 60 rows, the last 3 validate
    kept = [i[:T + 1] for i in ids if len(i) >= 2]  # "a" is one token: nothing to predict, left out
    assert len(kept) < len(ids) and len(data.splits["train"]) == len(kept)
    x, y = data._samples("train", range(len(kept)))
    for r, k in enumerate(kept):
        assert x[r, :len(k) - 1].tolist() == k[:-1] and y[r, :len(k) - 1].tolist() == k[1:]
        assert (x[r, len(k) - 1:] == tokenizer.pad_token_id).all() and (y[r, len(k) - 1:] == IGNORE_INDEX).all()
    assert data.describe()["train_tokens"] == sum(len(k) - 1 for k in kept) < x.numel()
    # The loss is the mean over the real targets: what the model says at a padding position counts for nothing.
    logits = torch.randn(*x.shape, len(tokenizer))
    real = y != IGNORE_INDEX
    expected = torch.nn.functional.cross_entropy(logits[real], y[real])
    changed = logits.clone()
    changed[~real] = 1e4 * torch.randn_like(changed[~real])
    assert torch.allclose(cross_entropy(logits, y), expected) and torch.allclose(cross_entropy(changed, y), expected)


class _OneRank:
    """The backend interface accumulate_gradients drives, on a plain module: one rank of a data-parallel
    run whose gradients are averaged over the ranks afterwards (as DDP all-reduces them)."""
    cudagraphs = False

    def __init__(self, model, accum):
        self.model, self.accum = model, accum

    def micro_step(self, sync):
        import contextlib

        return contextlib.nullcontext()

    def forward(self, x, y):
        return self.model(x, y)[1]

    def backward(self, loss):
        (loss / self.accum).backward()


def test_padded_samples_give_every_split_of_the_global_batch_the_same_loss_and_gradients(tmp_path, cache,
                                                                                         tokenizer_dir):
    """Each micro-batch's loss is the mean over its own real targets; weighted by its share of the global
    batch's (BatchLayout.micro_weights), the mean over micro-batches and ranks is the mean over all of
    them, as one process computes it: the same loss and gradients for every world size and accumulation."""
    from gptlite.model import GPTLite, preset
    from training.loop import accumulate_gradients

    rows = [" ".join(["word"] * n) + "\n" for n in (1, 30, 3, 12, 2, 25, 6, 40)] * 8  # lengths far apart
    data = load(write_jsonl(tmp_path / "p.jsonl", rows), tokenizer_dir, 32, pad=True)
    cfg = preset("tiny", vocab_size=len(data.tokenizer), block_size=32, dropout=0.0)
    results = {}
    for world, micro, accum in ((1, 8, 1), (2, 4, 1), (2, 2, 2), (4, 1, 2)):
        losses, grads = [], []
        for rank in range(world):
            torch.manual_seed(0)
            model = GPTLite(cfg)
            layout = BatchLayout(micro, accum, world, rank)
            weights = layout.micro_weights(data, "train", 7, 2)
            assert weights is not None and len(weights) == accum
            losses.append(accumulate_gradients(_OneRank(model, accum), layout.micro_batches(data, "train", 7, 2),
                                               accum, torch.device("cpu"), weights=weights))
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        results[(world, micro, accum)] = (torch.stack(losses).mean(), torch.stack(grads).mean(0))
    one_loss, one_grad = results[(1, 8, 1)]
    x, y = next(BatchLayout(8, 1, 1, 0).micro_batches(data, "train", 7, 2))
    assert (y == IGNORE_INDEX).any()  # padded
    torch.manual_seed(0)
    assert torch.allclose(one_loss, GPTLite(cfg)(x, y)[1].detach(), rtol=1e-6)  # the mean over the real targets
    for key, (loss, grad) in results.items():
        assert torch.allclose(loss, one_loss, rtol=1e-6, atol=0), key
        assert torch.allclose(grad, one_grad, rtol=1e-4, atol=1e-7), key
    # Packed samples all weigh the same: no weights at all.
    packed = load(tmp_path / "p.jsonl", tokenizer_dir, 8)
    assert BatchLayout(2, 2, 2, 0).micro_weights(packed, "train", 7, 2) is None


def test_the_validation_rows_are_the_last_of_the_file_or_the_validation_file(tmp_path, cache, tokenizer_dir):
    rows = corpus_rows(ROWS)
    ten = load(write_jsonl(tmp_path / "a.jsonl", rows), tokenizer_dir, validation_split_percentage=10)
    # The same as a training file of the first 90% of the rows and a validation file of the rest.
    files = load(write_jsonl(tmp_path / "b.jsonl", rows[:360]), tokenizer_dir,
                 validation_file=str(write_jsonl(tmp_path / "c.jsonl", rows[360:])))
    for split in ("train", "val"):
        assert rows_of(ten, split) == rows_of(files, split)
    five = load(tmp_path / "a.jsonl", tokenizer_dir)
    assert len(five.splits["val"]) < len(ten.splits["val"])


def test_json_lines_parquet_and_text_give_the_same_samples(tmp_path, cache, tokenizer_dir):
    rows = [r.replace("\n", " ").rstrip() + "\n" for r in corpus_rows(ROWS)]  # a line each
    jsonl = load(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer_dir)
    parquet = load(write_parquet(tmp_path / "d.parquet", rows, column="body"), tokenizer_dir, text_column_name="body")
    # A text file is a row per line, its newline kept (as run_clm.py reads one).
    text = load(_write(tmp_path / "d.txt", "".join(rows)), tokenizer_dir)
    for other in (parquet, text):
        for split in ("train", "val"):
            assert rows_of(other, split) == rows_of(jsonl, split)


def _write(path, text):
    path.write_text(text)
    return path


def test_every_layout_of_ranks_reads_the_same_global_batch(cache, jsonl, tokenizer_dir):
    data = load(jsonl, tokenizer_dir)
    again = load(jsonl, tokenizer_dir)  # another process would read the cache: the same samples
    one = list(BatchLayout(8, 1, 1, 0).micro_batches(data, "train", 1337, 3))
    x1 = one[0][0]
    for world, accum in ((2, 1), (2, 2), (4, 2)):
        micro = 8 // (world * accum)
        parts = [x for rank in range(world) for x, _ in BatchLayout(micro, accum, world, rank).micro_batches(
            again, "train", 1337, 3)]
        assert torch.equal(torch.cat(parts), x1)
    other_step = next(BatchLayout(8, 1, 1, 0).micro_batches(data, "train", 1337, 4))[0]
    assert not torch.equal(other_step, x1)


@pytest.fixture()
def calls(monkeypatch):
    """How many batches of rows were tokenized and packed (datasets' map calls them; a cached result does not)."""
    counts = {"tokenize": 0, "pack": 0}

    def counted(name, make):
        def factory(*args):
            inner = make(*args)

            def call(rows):
                counts[name] += 1
                return inner(rows)
            return call
        return factory

    monkeypatch.setattr(text_data, "_tokenize", counted("tokenize", text_data._tokenize))
    monkeypatch.setattr(text_data, "_pack", counted("pack", text_data._pack))
    return counts


def test_tokenizing_shows_progress_bars_unless_quiet(cache, jsonl, tokenizer_dir, capsys):
    text_data.load_text_dataset(TextRequest(str(tokenizer_dir), train_file=str(jsonl)), 32)
    said = capsys.readouterr().err
    assert "Tokenizing the training rows" in said and "Packing into samples of 32 tokens" in said
    assert "Generating train split" not in said  # reading a local file is quick: no bar before a refusal
    load(jsonl, tokenizer_dir, block_size=16, overwrite_cache=True)  # quiet (load's default here)
    assert "Tokenizing" not in capsys.readouterr().err


def test_the_second_load_reads_the_cache_instead_of_tokenizing(cache, jsonl, tokenizer_dir, calls):
    first = load(jsonl, tokenizer_dir)
    assert calls["tokenize"] >= 2 and calls["pack"] >= 2  # both splits
    assert all(f["filename"].startswith(str(cache)) for f in first.splits["train"].cache_files)
    made = dict(calls)
    second = load(jsonl, tokenizer_dir)
    assert calls == made  # nothing tokenized or packed again
    assert rows_of(second, "train") == rows_of(first, "train")
    load(jsonl, tokenizer_dir, block_size=16)  # another block size: packed again, not tokenized again
    assert calls["tokenize"] == made["tokenize"] and calls["pack"] > made["pack"]
    load(jsonl, tokenizer_dir, overwrite_cache=True)
    assert calls["tokenize"] > made["tokenize"]


def test_another_tokenizer_or_changed_rows_are_tokenized_anew(tmp_path, cache, jsonl, tokenizer_dir, calls):
    load(jsonl, tokenizer_dir)
    made = calls["tokenize"]
    smaller = write_tokenizer(tmp_path / "small", vocab=280)
    load(jsonl, smaller)
    assert calls["tokenize"] == 2 * made
    write_jsonl(jsonl, corpus_rows(ROWS + 20))
    changed = load(jsonl, tokenizer_dir)
    assert calls["tokenize"] == 3 * made and len(changed.splits["train"]) > 0


def test_an_hf_model_takes_its_vocabulary_from_the_tokenizer(cache, jsonl, tokenizer_dir, tokenizer):
    cfg = RunConfig(model="hf:gpt2", model_args=TINY_GPT2, block_size=32, dropout=0.0,
                    tokenizer_name=str(tokenizer_dir), train_file=str(jsonl), quiet=True)
    w = models.load(cfg.model_request())
    w.check()
    assert w.meta().net.config.vocab_size == len(tokenizer) == w.data.vocab_size == 300
    assert w.description["config"]["vocab_size"] == 300 and w.tokens_per_sample == 32
    x, y = w.example(2)
    assert x.shape == y.shape == (2, 32) and int(x.max()) < 300
    gl = models.load(RunConfig(preset="tiny", tokenizer_name=str(tokenizer_dir), train_file=str(jsonl),
                               quiet=True).model_request())
    assert gl.description["vocab_size"] == 300  # GPT-lite too


# Bad input, in this process: (flags, file rows, what the one line says).
@pytest.mark.parametrize("flags, rows, message", [
    ({"text_column_name": "body"}, ["x y z"] * 40, "has no column 'body' (its columns: text); name the text's column"),
    ({}, [{"content": "x", "id": 1}] * 40, "has no column 'text' (its columns: content, id)"),
    ({}, [{"text": 3}] * 40, "column 'text' is not text (it holds Value('int64'))"),
    ({}, [], "has no rows"),
    ({}, ["one"], "has 1 rows: too few to split 5% off for validation"),
    ({"model_args": TINY_GPT2 + ",vocab_size=100"}, ["x"] * 40,
     "the tokenizer {TOK} has 300 tokens (ids 0..299); model hf:gpt2's embedding has 100 rows"),
    ({"block_size": 2048, "model_args": TINY_GPT2}, ["a few words"] * 40, "no training sample of 2048 tokens"),
], ids=["named column missing", "default column missing", "numbers", "empty file", "one row", "vocab too large",
        "too short"])
def test_bad_text_data_is_one_line(tmp_path, cache, tokenizer_dir, flags, rows, message):
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    cfg = RunConfig(**{"model": "hf:gpt2", "model_args": TINY_GPT2, "tokenizer_name": str(tokenizer_dir),
                       "train_file": str(path), "quiet": True, **flags})
    with pytest.raises((ConfigError, DataError)) as e:
        models.load(cfg.model_request()).check()
    assert message.replace("{TOK}", str(tokenizer_dir)) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("flags, message", [
    ({"train_file": "notes.docx", "tokenizer_name": "t"},
     "train_file: notes.docx has extension .docx; the data files read are .txt"),
    ({"train_file": "a.jsonl", "validation_file": "b", "tokenizer_name": "t"}, "validation_file: b has no extension"),
    ({"train_file": "a.jsonl"}, "train_file: tokenized text needs a tokenizer: --tokenizer_name"),
    ({"train_file": "a.jsonl", "dataset_name": "wikitext"}, "train_file and dataset_name are two sources"),
    ({"train_file": "a.jsonl", "data": "x.txt"}, "data and train_file are two sources"),
    ({"validation_file": "b.jsonl"}, "validation_file needs --train_file"),
    ({"dataset_config_name": "raw"}, "dataset_config_name needs --dataset_name"),
    ({"tokenizer_name": "tok"}, "tokenizer_name tokenizes --train_file or --dataset_name"),
    ({"pad_to_block_size": True}, "pad_to_block_size applies to tokenized text"),
    ({"train_file": "a.jsonl", "validation_split_percentage": 0}, "validation_split_percentage must be between 1"),
    ({"train_file": "a.jsonl", "model": "torchvision:resnet18"}, "train_file: tokenized text is for gptlite and hf:"),
    ({"train_file": "a.jsonl", "model": "examples/my_model.py"},
     "train_file: tokenized text is for gptlite and hf: language models; examples/my_model.py: its get_dataset()"),
])
def test_text_flags_that_cannot_go_together_are_refused_before_anything_is_read(flags, message):
    with pytest.raises(ConfigError) as e:
        RunConfig(**flags)
    assert str(e.value).startswith(message)


def test_a_hub_name_without_a_network_says_to_pass_local_files(cache, jsonl, tokenizer_dir, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match=r"^tokenizer_name: 'gpt2' is not a local directory and the Hugging Face Hub "
                                          r"is out of reach \(HF_HUB_OFFLINE is set\); pass a local path"):
        text_data.load_tokenizer("gpt2")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    with pytest.raises(ConfigError, match=r"^dataset_name: 'wikitext' is not a local directory and the Hugging Face "
                                          r"Hub is out of reach .*; pass local files: --train_file"):
        text_data.load_text_dataset(TextRequest(str(tokenizer_dir), dataset_name="wikitext"), 32)
    for name in ("./nowhere", str(jsonl)):  # a path, not a Hub name: said as a path
        with pytest.raises(ConfigError, match="is not a directory"):
            text_data.load_tokenizer(name)


def test_no_route_to_the_hub_is_said_after_one_request(monkeypatch):
    """Not offline by setting, but no network: one short request (patched here to fail as a missing name
    resolution does) instead of transformers' minute of retries."""
    import huggingface_hub.utils

    asked = []

    class NoRoute:
        def head(self, url, timeout):
            asked.append((url, timeout))
            raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.utils, "get_session", lambda: NoRoute())
    with pytest.raises(ConfigError, match=r"^tokenizer_name: 'no-such-org/no-such-tokenizer' is not a local directory "
                                          r"and the Hugging Face Hub is out of reach \(https://.* cannot be reached: "
                                          r"OSError: \[Errno -2\] Name or service not known\); pass a local path"):
        text_data.load_tokenizer("no-such-org/no-such-tokenizer")
    assert len(asked) == 1 and asked[0][1] <= 5


def test_a_directory_without_a_tokenizer_is_refused_naming_the_flag_that_gave_it(tmp_path, cache, jsonl):
    """A checkpoint directory without tokenizer files (the default tokenizer of --model_name_or_path)."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    request = TextRequest(str(tmp_path / "ckpt"), train_file=str(jsonl), tokenizer_flag="model_name_or_path")
    with pytest.raises(ConfigError, match=r"^model_name_or_path: .*ckpt holds no tokenizer transformers can load .*; "
                                          r"give --tokenizer_name a directory"):
        text_data.load_text_dataset(request, 32)


def test_a_local_dataset_directory_is_a_dataset_name(tmp_path, cache, tokenizer_dir):
    rows = corpus_rows(ROWS)
    write_jsonl(tmp_path / "dir" / "train.jsonl", rows[:360])
    write_jsonl(tmp_path / "dir" / "validation.jsonl", rows[360:])
    by_name = text_data.load_text_dataset(TextRequest(str(tokenizer_dir), dataset_name=str(tmp_path / "dir"),
                                                      quiet=True), 32)
    by_files = load(tmp_path / "dir" / "train.jsonl", tokenizer_dir,
                    validation_file=str(tmp_path / "dir" / "validation.jsonl"))
    for split in ("train", "val"):
        assert rows_of(by_name, split) == rows_of(by_files, split)


def test_the_default_loss_reads_the_logits_of_a_model_output(tmp_path):
    """A model file around from_pretrained returns a ModelOutput: the default loss is cross-entropy on
    its `.logits`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    net = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=8)).eval()
    x, y = torch.randint(0, 50, (2, 2, 8), generator=torch.Generator().manual_seed(0))
    out, loss = WithLoss(net)(x, y)
    assert torch.allclose(loss, cross_entropy(net(x).logits, y))
    net.save_pretrained(tmp_path / "ckpt")
    model_file = tmp_path / "finetune.py"
    model_file.write_text(
        "import torch\nfrom transformers import AutoModelForCausalLM\n"
        f"def get_model():\n    return AutoModelForCausalLM.from_pretrained({str(tmp_path / 'ckpt')!r})\n"
        "def get_dataset():\n    g = torch.Generator().manual_seed(0)\n"
        "    ids = torch.randint(0, 50, (40, 9), generator=g)\n"
        "    return [{'input_ids': r[:-1], 'labels': r[1:]} for r in ids]\n")
    w = models.load(RunConfig(model=str(model_file)).model_request())
    w.check()
    x, y = w.example(2)
    model = w.build(0).eval()
    assert torch.allclose(model(x, y)[1], cross_entropy(model.net(x).logits, y))


# ------------------------------------------------------------------ the real launch (tests/support/launches.py "text-ddp")
def _launch_config(run) -> RunConfig:
    """The launch's flags as train.py read them, with the launch's directory for {DIR}."""
    from launches import LAUNCHES
    from training.cli import parse_args

    directory = run.dir.parent
    return parse_args([a.replace("{DIR}", str(directory)) for a in LAUNCHES["text-ddp"].args])


@pytest.mark.distributed
def test_a_ddp_run_on_a_json_lines_file_records_the_tokenized_data(launches, request):
    run = launches.get("text-ddp", request)
    data, model = run.config["data"], run.config["model"]
    assert data["source"] == str(run.dir.parent / "train.jsonl")
    assert data["tokenizer"] == str(run.dir.parent / "tokenizer")
    assert data["vocab_size"] == model["config"]["vocab_size"] == 300 and data["layout"] == "packed"
    assert data["train_samples"] > 0 and data["train_tokens"] == 32 * data["train_samples"]
    assert run.config["world_size"] == 2 and len(run.losses) == 3 and run.summary["val_loss"] > 0
    # The tokenized data is in the run's cache (GPTLITE_CACHE): one file per split and step (tokenized,
    # packed), written by one rank and read by the other (datasets' own log lines, DATASETS_VERBOSITY=info).
    assert len(list((run.dir.parent / "cache" / "datasets").rglob("cache-*.arrow"))) == 4
    said = run.proc.stderr
    assert said.count("Caching processed dataset at") == 4 and said.count("Loading cached processed dataset") == 4, said


@pytest.mark.distributed
def test_the_ranks_first_step_loss_is_the_models_loss_on_the_drawn_samples(launches, request, monkeypatch):
    """Step 0's loss, averaged over the 2 ranks, is the model's loss (built from the seed, as each rank
    builds it) on the 8 samples the sampler draws for step 0, computed here in one piece: the ranks read
    the right samples of the tokenized file, and the model has the tokenizer's vocabulary."""
    run = launches.get("text-ddp", request)
    cfg = _launch_config(run)
    monkeypatch.setenv("GPTLITE_CACHE", str(run.dir.parent / "cache"))
    w = models.load(cfg.model_request())
    x, y = next(BatchLayout(8, 1, 1, 0).micro_batches(w.data, "train", cfg.seed, 0))
    with torch.no_grad():
        loss = w.build(cfg.seed).eval()(x, y)[1].item()
    assert abs(run.losses[0] - loss) <= 1e-5 * loss, (run.losses[0], loss)


# ------------------------------------------------------------------ bad input as processes
PROCESS_CASES = {
    "column missing": ({"text_column_name": "body"}, "has no column 'body' (its columns: text)"),
    "empty file": ({"rows": []}, "has no rows (an empty file)"),
    "vocab too large": ({"model_args": TINY_GPT2 + ",vocab_size=100"}, "has 300 tokens (ids 0..299); model hf:gpt2's "
                                                                         "embedding has 100 rows"),
    "hub tokenizer offline": ({"tokenizer_name": "gpt2"}, "tokenizer_name: 'gpt2' is not a local directory and the "
                                                          "Hugging Face Hub is out of reach (HF_HUB_OFFLINE is set); "
                                                          "pass a local path"),
    "unsupported extension": ({"train_file": "notes.docx"}, "train_file: notes.docx has extension .docx"),
}


def _process_case(tmp_path, tokenizer_dir, name):
    flags, message = PROCESS_CASES[name]
    flags = dict(flags)
    path = write_jsonl(tmp_path / "t.jsonl", flags.pop("rows", ["some words of text\n"] * 40))
    args = {"model": "hf:gpt2", "model_args": TINY_GPT2, "block_size": "16", "tokenizer_name": str(tokenizer_dir),
            "train_file": str(path), "runs_dir": str(tmp_path / "runs"), "steps": "1", **flags}
    return [t for k, v in args.items() for t in (f"--{k}", v)], message


@pytest.mark.launch
@pytest.mark.parametrize("name", list(PROCESS_CASES))
def test_bad_text_data_is_one_line_under_python(tmp_path, tokenizer_dir, name):
    import subprocess
    import sys

    from conftest import REPO, TRAIN, base_env

    args, message = _process_case(tmp_path, tokenizer_dir, name)
    env = {**base_env(), "GPTLITE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(TRAIN), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=180)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("train.py: error: ") and message in lines[0], lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr and not (tmp_path / "runs").exists()


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(PROCESS_CASES))
def test_bad_text_data_is_said_once_under_torchrun(tmp_path, tokenizer_dir, name):
    import subprocess

    from conftest import REPO, base_env, launch_command

    args, message = _process_case(tmp_path, tokenizer_dir, name)
    env = {**base_env(), "GPTLITE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([*launch_command("torchrun", 2), *args, "--backend", "ddp"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0 and proc.stderr.count(message) == 1, proc.stderr
    ours = [line for line in proc.stderr.splitlines()
            if line.strip().startswith(f'File "{REPO}') and f"{REPO}/.venv" not in line]
    assert not ours and not (tmp_path / "runs").exists(), proc.stderr
