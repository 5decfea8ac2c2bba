"""Data: the generated corpus, deterministic global batches and their split across ranks."""

import hashlib
import math
import subprocess
import sys
from collections import Counter

import pytest
import torch

from gptlite import corpus
from gptlite.data import BatchLayout, CharDataset, DataError, read_text


@pytest.fixture(scope="module")
def data():
    return CharDataset.load(None, block_size=32)


@pytest.mark.launch
def test_default_corpus_size_alphabet_and_determinism_across_processes():
    text = corpus.generate()
    assert 0.9e6 <= len(text) <= 1.2e6
    assert set(text) == set(corpus.ALPHABET) and len(corpus.ALPHABET) == 65
    digest = hashlib.sha256(text.encode()).hexdigest()
    other = subprocess.run(
        [sys.executable, "-c", "import hashlib; from gptlite import corpus; "
         "print(hashlib.sha256(corpus.generate().encode()).hexdigest())"],
        capture_output=True, text=True, check=True)
    assert other.stdout.strip() == digest


def test_default_corpus_has_learnable_structure():
    # The next character given the previous one is far from uniform: a bigram model
    # alone beats the uniform ln(65) = 4.17 nats by a wide margin.
    text = corpus.generate()
    pairs = Counter(zip(text, text[1:]))
    firsts = Counter(text[:-1])
    n = len(text) - 1
    conditional_entropy = -sum(c / n * math.log(c / firsts[a]) for (a, _), c in pairs.items())
    assert conditional_entropy < 0.7 * math.log(65)


def test_targets_are_inputs_shifted_by_one(data):
    x, y = data.batch("train", seed=0, step=0, global_index=0, size=4, global_batch=4)
    assert x.shape == y.shape == (4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_batches_are_a_pure_function_of_seed_split_and_step(data):
    again = CharDataset.load(None, block_size=32)
    first = data.batch("train", 1, 7, 0, 8, 8)
    assert all(torch.equal(a, b) for a, b in zip(first, again.batch("train", 1, 7, 0, 8, 8)))
    for other in (data.batch("train", 1, 8, 0, 8, 8), data.batch("train", 2, 7, 0, 8, 8),
                  data.batch("val", 1, 7, 0, 8, 8)):
        assert not torch.equal(first[0], other[0])


def _global_batch(data, micro, accum, world, step=3):
    """Concatenate every rank's micro-batches, rank by rank: the global batch as the ranks see it."""
    per_rank = []
    for rank in range(world):
        layout = BatchLayout(micro, accum, world, rank)
        per_rank.append(torch.cat([x for x, _ in layout.micro_batches(data, "train", 0, step)]))
    return per_rank


def test_every_world_size_and_accumulation_sees_the_same_global_batch(data):
    reference = torch.cat(_global_batch(data, micro=12, accum=1, world=1))
    for micro, accum, world in [(6, 2, 1), (3, 2, 2), (6, 1, 2), (1, 3, 4), (2, 1, 6)]:
        assert torch.equal(torch.cat(_global_batch(data, micro, accum, world)), reference), (micro, accum, world)


def test_ranks_get_disjoint_slices(data):
    ranks = [BatchLayout(micro_batch=2, grad_accum=3, world_size=4, rank=r) for r in range(4)]
    owned = [{layout.micro_start(m) + i for m in range(3) for i in range(2)} for layout in ranks]
    assert sum(len(s) for s in owned) == 24
    assert set().union(*owned) == set(range(24))
    slices = _global_batch(data, micro=2, accum=3, world=4)
    assert len({s.numpy().tobytes() for s in slices}) == 4


def test_split_is_90_10(data):
    n_train, n_val = len(data.splits["train"]), len(data.splits["val"])
    assert n_train / (n_train + n_val) == pytest.approx(0.9, abs=1e-5)


@pytest.mark.parametrize("content, reason", [
    (None, "file not found"),
    (b"", "file is empty"),
    (b"\xff\xfe\xfa not utf-8", "not UTF-8"),
    (b"short text", "too short for block_size"),
])
def test_unusable_data_files_get_clear_errors(tmp_path, content, reason):
    path = tmp_path / "input.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError, match=reason) as e:
        CharDataset.load(str(path), block_size=64)
    assert "--data" in str(e.value) and "\n" not in str(e.value)


def test_any_utf8_file_trains_with_its_own_vocabulary(tmp_path):
    path = tmp_path / "input.txt"
    path.write_text("héllo wörld, ünïcode! " * 200, encoding="utf-8")
    data = CharDataset.load(str(path), block_size=16)
    assert data.vocab_size == len(set(read_text(str(path))[0]))
    x, _ = data.batch("val", 0, 0, 0, 2, 2)
    assert int(x.max()) < data.vocab_size


def test_the_corpus_cache_serves_only_intact_text_of_this_generator(tmp_path, monkeypatch):
    """The cached corpus is the generated text byte for byte; a damaged file is made again; an
    unwritable cache costs nothing but the generation."""
    truth = corpus._generate(corpus.DEFAULT_SIZE, corpus.DEFAULT_SEED)
    monkeypatch.setenv("GPTLITE_CACHE", str(tmp_path / "cache"))
    corpus.generate.cache_clear()
    assert corpus.generate() == truth
    (cached,) = (tmp_path / "cache").glob("corpus-*.txt")
    cached.write_text(truth.replace("ACT", "XYZ", 1))  # same name, other bytes
    corpus.generate.cache_clear()
    assert corpus.generate() == truth
    assert cached.read_text() == truth  # made again under the name its bytes match
    monkeypatch.setenv("GPTLITE_CACHE", "/proc/gptlite-cache")  # cannot be created
    corpus.generate.cache_clear()
    assert corpus.generate() == truth
    corpus.generate.cache_clear()


def test_encoding_maps_each_character_to_its_index_in_the_vocabulary():
    from gptlite.data import CharTokenizer

    text = "héllo wörld, ünïcode! \n" * 50 + "€𝄞"
    tokenizer = CharTokenizer.from_text(text)
    ids = tokenizer.encode(text)
    assert ids.dtype.name == "uint8"
    assert [tokenizer.chars[i] for i in ids] == list(text)
    assert tokenizer.decode(ids) == text
    with pytest.raises(KeyError):
        tokenizer.encode("hello ß")  # not in the vocabulary
