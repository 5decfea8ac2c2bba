"""A tokenizer and text datasets written where a test asks, without a network: a byte-level BPE
trained with the `tokenizers` library on the embedded corpus and saved as transformers saves one
(PreTrainedTokenizerFast.save_pretrained), and rows of that corpus as JSON Lines, Parquet and text."""

from __future__ import annotations

import json
from pathlib import Path

from gptlite import corpus

VOCAB = 300  # the BPE's size before its special tokens


def corpus_rows(n: int | None = None) -> list[str]:
    """The embedded corpus' paragraphs (blank-line separated), in order: rows of a few hundred characters."""
    rows = [p.strip() + "\n" for p in corpus.generate().split("\n\n") if p.strip()]
    return rows if n is None else rows[:n]


def write_tokenizer(directory: Path, vocab: int = VOCAB) -> Path:
    """A byte-level BPE of `vocab` tokens plus <|endoftext|> (its BOS, EOS and pad), saved in `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_rows(), trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                      pad_token="<|endoftext|>")
    directory.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(directory))
    return directory


def write_jsonl(path: Path, rows: list, column: str = "text") -> Path:
    """`rows` as JSON Lines: each a {column: row} object (a dict row is written as it is)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r if isinstance(r, dict) else {column: r}) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[str], column: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({column: rows, "id": list(range(len(rows)))}), str(path))
    return path


def prepare_launch(directory: Path) -> None:
    """What the text launch (tests/support/launches.py "text-ddp") reads: {DIR}/tokenizer and {DIR}/train.jsonl."""
    write_tokenizer(directory / "tokenizer")
    write_jsonl(directory / "train.jsonl", corpus_rows())
