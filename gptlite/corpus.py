"""The embedded default corpus: a play-like text the project generates itself, deterministically.

It stands in for tiny-shakespeare when no `--data` file is given, so the suite runs with no
download. It uses the same 65-symbol alphabet as tiny-shakespeare (newline, space, `!$&',-.3:;?`
and both cases of a-z), so the `paper` preset has the article's exact parameter count on it. Its
structure is learnable at several scales (syllables within words, word-to-word transitions,
speaker headers, line and speech layout), so a character model's loss falls well below the
uniform ln(65) = 4.17 nats.

A self-contained splitmix64 generator (not `random` or numpy, whose streams may change between
versions) keeps the text byte-identical on every Python and platform.

Generating it costs each process about a second and a half on a 2-core machine, and every rank of
every run needs it, so the text is kept in $GPTLITE_CACHE (default ~/.cache/gptlite) once made,
under a name that carries the generator's own source hash and the text's sha256: a changed
generator makes a new file, and a file whose bytes do not match its name is made again.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import os
import tempfile
from pathlib import Path

ALPHABET = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
DEFAULT_SIZE = 1_000_000
DEFAULT_SEED = 1606  # First Folio

_MASK = (1 << 64) - 1
_ONSETS = ["b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "qu", "r", "s", "t",
           "v", "w", "x", "y", "z", "th", "sh", "ch", "st", "br", "gr", "pl", "tr", ""]
_VOWELS = ["a", "e", "i", "o", "u", "ea", "ou", "ai", "oo", "y"]
_CODAS = ["", "", "", "n", "r", "s", "t", "d", "ll", "ng", "th", "st", "x", "ck"]
_LINE_ENDS = [",", ",", ",", ".", ".", ";", ":", "!", "?", ""]
_ROMAN = ["I", "II", "III", "IV", "V"]


class _SplitMix64:
    def __init__(self, seed: int):
        self.state = seed & _MASK

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n

    def chance(self, p: float) -> bool:
        return self.next() < p * 2.0**64

    def pick(self, seq):
        return seq[self.below(len(seq))]


class _Zipf:
    """Draws index i with probability proportional to 1 / (i + 1)^s."""

    def __init__(self, n: int, s: float = 1.1):
        self.cumulative = list(itertools.accumulate(1.0 / (i + 1) ** s for i in range(n)))

    def draw(self, rng: _SplitMix64) -> int:
        return bisect.bisect_right(self.cumulative, rng.next() / 2.0**64 * self.cumulative[-1])


def _word(rng: _SplitMix64, syllables: int) -> str:
    return "".join(rng.pick(_ONSETS) + rng.pick(_VOWELS) + rng.pick(_CODAS) for _ in range(syllables))


def _lexicon(rng: _SplitMix64, size: int) -> list[str]:
    words: list[str] = []
    seen: set[str] = set()
    # One word starting with each letter first, so every capital letter occurs at line starts.
    for letter in "abcdefghijklmnopqrstuvwxyz":
        word = letter + rng.pick(_VOWELS) + rng.pick(_CODAS)
        words.append(word)
        seen.add(word)
    while len(words) < size:
        # Short words are the frequent ones (the lexicon is drawn Zipf-first).
        word = _word(rng, 1 + min(2, len(words) // 300 + rng.below(2)))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


@functools.lru_cache(maxsize=4)
def generate(size: int = DEFAULT_SIZE, seed: int = DEFAULT_SEED) -> str:
    """A play of about `size` characters (it stops at the first speech boundary past `size`), from
    the disk cache where it is there and intact, else made (and cached where the cache is writable)."""
    key = f"corpus-{hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]}-{size}-{seed}"
    directory = Path(os.environ.get("GPTLITE_CACHE") or Path.home() / ".cache" / "gptlite")
    for path in sorted(directory.glob(f"{key}-*.txt")):
        try:
            raw = path.read_bytes()
        except OSError:
            continue
        if hashlib.sha256(raw).hexdigest() == path.stem.rsplit("-", 1)[1]:
            return raw.decode()
    text = _generate(size, seed)
    raw = text.encode()
    try:  # best effort: a read-only or full cache only costs the next process the generation
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{key}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, directory / f"{key}-{hashlib.sha256(raw).hexdigest()}.txt")
    except OSError:
        pass
    return text


def _generate(size: int, seed: int) -> str:
    rng = _SplitMix64(seed)
    lexicon = _lexicon(rng, 1500)
    zipf = _Zipf(len(lexicon))
    # Each word prefers a few successors: structure a model can learn beyond word frequencies.
    successors = [[zipf.draw(rng) for _ in range(6)] for _ in lexicon]
    speakers = sorted({_word(rng, 2).upper() for _ in range(40)})
    speaker_zipf = _Zipf(len(speakers), s=0.8)

    parts: list[str] = []
    length = 0
    act = scene = 0
    word = zipf.draw(rng)
    while length < size:
        if length == 0 or rng.chance(0.02):
            act, scene = (act + 1, 1) if scene >= 4 or length == 0 else (act, scene + 1)
            header = f"ACT {_ROMAN[(act - 1) % 5]}. SCENE {_ROMAN[scene - 1]}.\n\n"
            entering = " and ".join(speakers[speaker_zipf.draw(rng)] for _ in range(2))
            parts.append(header + f"Enter {entering}.\n\n")
        lines = []
        for _ in range(1 + rng.below(4)):
            n_words = 4 + rng.below(7)
            line_words = []
            for _ in range(n_words):
                word = rng.pick(successors[word]) if rng.chance(0.7) else zipf.draw(rng)
                line_words.append(lexicon[word])
            if rng.chance(0.08):
                line_words.insert(rng.below(n_words), rng.pick(["&c", "3", "$", "o'", "-"]))
            line = " ".join(line_words)
            lines.append(line[0].upper() + line[1:] + rng.pick(_LINE_ENDS))
        speech = f"{speakers[speaker_zipf.draw(rng)]}:\n" + "\n".join(lines) + "\n\n"
        parts.append(speech)
        length += len(speech)
    text = "".join(parts)
    assert set(text) <= set(ALPHABET), sorted(set(text) - set(ALPHABET))
    return text
