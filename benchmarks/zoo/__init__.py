"""The model zoo the predictions are validated on (issue 40): nine models of different shapes, at
sizes that run on a 2-core CPU, each as train.py's flags, with its FLOPs per sample counted by hand.

    from benchmarks.zoo import ZOO
    ZOO["llama"].flags      # train.py's flags for the model
    ZOO["llama"].hand(v)    # FLOPs of one sample's forward and backward, by hand (v: the data's vocabulary)

The hand counts follow the accounting core/flops.py counts with (PaLM's): two FLOPs per
multiply-add of every matmul, convolution and attention product (QK^T and AV over the whole
sequence, the causal mask not subtracted), nothing for elementwise work, norms or lookups. Backward
costs two products per forward one (the input's gradient and the weight's), one where either is not
needed: the first convolution's input (an image) needs no gradient; a frozen layer's weights get
none. No model here is tuned on alone (tests/unit/test_zoo.py holds every one to its count).

Measured (2026-11-27, torch 2.13.0+cpu, `tests/unit/test_zoo.py`): gptlite,
bert, cnn_bn, gru_lm and frozen_tied count exactly their hand counts; llama, vit and mixtral count
1.4%, 1.6% and 0.9% more, speech_ctc (added later, measured alike) 1.1% more. Those four run
attention through the CPU flash kernel, whose backward
recomputes QK^T: torch's formula for it (flop_counter.sdpa_backward_flop_count, which core/flops.py
uses for the CPU kernel as torch does for the others) counts five products where the hand count,
as PaLM's accounting, counts four. The difference is exactly half of the forward attention's FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import models
from training.cli import config_from_argv

HERE = Path(__file__).resolve().parent
T = 32  # --block_size of the text models: tokens per sample


@dataclass(frozen=True)
class Model:
    name: str
    shape: str  # what kind of model, for the tables
    flags: tuple[str, ...]  # train.py's
    hand: Callable[[int], float]  # FLOPs per sample, forward and backward, given the data's vocabulary


def _args(**kw) -> str:
    return ",".join(f"{k}={v}" for k, v in kw.items())


def _decoder(name: str, model_type: str, L: int, d: int, heads: int, ff: int, gated: bool) -> Model:
    """A transformers decoder: per layer q, k, v, o (d x d each), the MLP (gated: three d x ff, else
    two) and attention's two T x d products; the LM head d x vocab."""
    mlp = (3 if gated else 2) * d * ff
    return Model(name, f"transformers decoder ({model_type})",
                 ("--model", f"hf:{model_type}", "--block_size", str(T), "--model_args",
                  _args(num_hidden_layers=L, hidden_size=d, num_attention_heads=heads, num_key_value_heads=heads,
                        intermediate_size=ff)),
                 lambda v: 6 * T * (L * (4 * d * d + mlp + 2 * T * d) + d * v))


def _bert(L=2, d=64, heads=4, ff=128) -> Model:
    """BERT as a language model (bidirectional attention): its layers as a decoder's with a two-matrix
    MLP, and the LM head's transform (d x d) before the decoder (d x vocab); no pooler."""
    return Model("bert", "transformers encoder (bert)",
                 ("--model", "hf:bert", "--block_size", str(T), "--model_args",
                  _args(num_hidden_layers=L, hidden_size=d, num_attention_heads=heads, intermediate_size=ff)),
                 lambda v: 6 * T * (L * (4 * d * d + 2 * d * ff + 2 * T * d) + d * d + d * v))


def _vit(L=2, d=32, heads=2, ff=64, patch=8) -> Model:
    """ViT on 3x32x32 images: the patch embedding (a convolution whose input, the image, needs no
    gradient), S = patches + 1 tokens through the layers, the classifier on the first token alone."""
    patches = (32 // patch) ** 2
    S = patches + 1
    embed = patches * 3 * patch * patch * d
    return Model("vit", "vision transformer (vit)",
                 ("--model", "hf:vit", "--model_args",
                  _args(num_hidden_layers=L, hidden_size=d, num_attention_heads=heads, intermediate_size=ff,
                        patch_size=patch)),
                 lambda v: 4 * embed + 6 * (S * L * (4 * d * d + 2 * d * ff + 2 * S * d) + 10 * d))


def _mixtral(L=2, d=64, heads=4, ff=128, experts=4, k=2) -> Model:
    """A mixture of experts: per layer attention as a decoder's, the router (d x experts) and the k
    experts each token is routed to (three d x ff each)."""
    return Model("mixtral", f"mixture of experts, top-{k} of {experts} (mixtral)",
                 ("--model", "hf:mixtral", "--block_size", str(T), "--model_args",
                  _args(num_hidden_layers=L, hidden_size=d, num_attention_heads=heads, num_key_value_heads=heads,
                        intermediate_size=ff, num_local_experts=experts, num_experts_per_tok=k)),
                 lambda v: 6 * T * (L * (4 * d * d + 2 * T * d + d * experts + k * 3 * d * ff) + d * v))


def _cnn(width=16) -> Model:
    """benchmarks/zoo/cnn_bn.py on 3x16x16: 3x3 convolutions 3 -> w (16x16 out; the image needs no
    gradient), w -> 2w (stride 2, 8x8), 2w -> 2w (8x8), the classifier 2w x 10."""
    first = 3 * width * 9 * 16 * 16
    rest = width * 2 * width * 9 * 8 * 8 + 2 * width * 2 * width * 9 * 8 * 8 + 2 * width * 10
    return Model("cnn_bn", "CNN with BatchNorm (a model file)",
                 ("--model", str(HERE / "cnn_bn.py"), "--model_args", _args(width=width)),
                 lambda v: 4 * first + 6 * rest)


def _gru(embed=32, hidden=64, seq=16, vocab=64) -> Model:
    """benchmarks/zoo/gru_lm.py: per token the GRU's three gates (input embed x 3h and hidden h x 3h)
    and the head h x vocab; the first step's hidden state (zeros) needs no gradient."""
    return Model("gru_lm", "recurrent network, a GRU (a model file)",
                 ("--model", str(HERE / "gru_lm.py"), "--model_args", _args(embed=embed, hidden=hidden)),
                 lambda v: 6 * seq * (3 * hidden * embed + 3 * hidden * hidden + hidden * vocab)
                 - 2 * 3 * hidden * hidden)


def _frozen_tied(width=32, seq=16, vocab=64) -> Model:
    """benchmarks/zoo/frozen_tied.py: two blocks of d x 4d and 4d x d, the first frozen (its input's
    gradient, not its weights'), the output layer the embedding's transpose (d x vocab, trained)."""
    block = 8 * width * width
    return Model("frozen_tied", "frozen and tied parameters (a model file)",
                 ("--model", str(HERE / "frozen_tied.py"), "--model_args", _args(width=width)),
                 lambda v: seq * (4 * block + 6 * block + 6 * width * vocab))


def _speech_ctc(channels=32, d=64, L=4, heads=4, ff=128) -> Model:
    """benchmarks/zoo/speech_ctc.py: the feature extractor's convolutions over 16000 samples (the
    first, 1 -> channels, kernel 10, 3199 frames out, on the waveform: no input gradient; six more,
    channels x channels x kernel 3 at 1599, 799, 399, 199 frames and kernel 2 at 99, 49), the
    projection channels x d, per layer q, k, v, the output (d x d each), the MLP (d x ff, ff x d) and
    attention's two T x d products over T = 49 frames, the head d x 32 characters; CTC multiplies
    nothing."""
    T = 49
    first = 3199 * channels * 10
    rest = ((1599 + 799 + 399 + 199) * 3 + (99 + 49) * 2) * channels * channels
    return Model("speech_ctc", "speech encoder, convolutional front end and CTC (a model file)",
                 ("--model", str(HERE / "speech_ctc.py"), "--model_args",
                  _args(channels=channels, width=d, layers=L, heads=heads, ff=ff)),
                 lambda v: 4 * first + 6 * rest + 6 * T * (channels * d + L * (4 * d * d + 2 * d * ff + 2 * T * d)
                                                           + d * 32))


def _gptlite(L=4, d=64) -> Model:
    """GPT-lite's tiny preset (n_layer 4, n_embd 64) at T: per layer q, k, v and the projection (d x d
    each), the MLP (d x 4d, 4d x d) and attention's two T x d products; the head d x vocab."""
    return Model("gptlite", "GPT-lite (the article's model)", ("--preset", "tiny", "--block_size", str(T)),
                 lambda v: 6 * T * (L * (12 * d * d + 2 * T * d) + d * v))


ZOO: dict[str, Model] = {m.name: m for m in (
    _gptlite(),
    _decoder("llama", "llama", L=2, d=64, heads=4, ff=128, gated=True),
    _bert(),
    _vit(),
    _cnn(),
    _mixtral(),
    _gru(),
    _frozen_tied(),
    _speech_ctc(),
)}


def workload(model: Model):
    """The zoo model's workload (models.Workload), resolved from its flags as train.py resolves them."""
    return models.load(config_from_argv(list(model.flags)).model_request())
