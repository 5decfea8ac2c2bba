"""Zoo model: a speech encoder trained with CTC (benchmarks/zoo/__init__.py), as a user's model file.

    python train.py --model benchmarks/zoo/speech_ctc.py

wav2vec 2.0's shape at toy size: its convolutional feature extractor over the raw waveform (a strided
1-D convolution with GroupNorm, then six more that halve the frame rate each: 320 samples a frame,
its kernels and strides, narrower), a projection into
the encoder's width, pre-LayerNorm transformer blocks (bidirectional attention), and a linear head
to the characters, trained with torch's CTC loss against a label sequence shorter than the frames.
Most of what forward keeps lies in the feature extractor, outside the repeated blocks: its first
convolution's output runs at 64 times the encoder's frame rate.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

SAMPLES = 16000  # waveform samples per utterance (a second at 16 kHz)
VOCAB = 32  # CTC's blank (0) and 31 characters
LABELS = 10  # characters per utterance
# The feature extractor's convolutions, wav2vec 2.0's: (kernel, stride). 16000 samples -> 3199 -> 1599 -> 799
# -> 399 -> 199 -> 99 -> 49 frames.
CONVS = ((10, 5), (3, 2), (3, 2), (3, 2), (3, 2), (2, 2), (2, 2))


class FeatureExtractor(nn.Module):
    """The waveform to frames: convolutions with GELU, the first normalised over time (GroupNorm with
    one group per channel, as wav2vec 2.0's base model)."""

    def __init__(self, channels: int):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv1d(1 if i == 0 else channels, channels, k, stride=s, bias=False)
                                   for i, (k, s) in enumerate(CONVS))
        self.norm = nn.GroupNorm(channels, channels)

    def forward(self, wave):
        x = F.gelu(self.norm(self.convs[0](wave.unsqueeze(1))))
        for conv in self.convs[1:]:
            x = F.gelu(conv(x))
        return x.transpose(1, 2)  # (batch, frames, channels)


class EncoderBlock(nn.Module):
    """The repeated block: pre-LayerNorm self-attention over every frame, and a GELU MLP."""

    def __init__(self, width: int, heads: int, ff: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, ff), nn.Linear(ff, width)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, C)
        x = x + self.out(attended)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class SpeechCTC(nn.Module):
    def __init__(self, channels: int = 32, width: int = 64, layers: int = 4, heads: int = 4, ff: int = 128):
        super().__init__()
        self.features = FeatureExtractor(channels)
        self.feature_norm = nn.LayerNorm(channels)
        self.project = nn.Linear(channels, width)
        self.blocks = nn.ModuleList(EncoderBlock(width, heads, ff) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, wave):
        x = self.project(self.feature_norm(self.features(wave)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))  # (batch, frames, VOCAB) logits


class Utterances(torch.utils.data.Dataset):
    """Utterance i drawn from its own generator (every rank reads the same data): a label sequence
    and a waveform of a tone per label, with noise."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        labels = torch.randint(1, VOCAB, (LABELS,), generator=g)
        t = torch.arange(SAMPLES // LABELS, dtype=torch.float32)
        wave = torch.cat([torch.sin(t * 0.02 * int(c)) for c in labels]) + 0.1 * torch.randn(SAMPLES, generator=g)
        return wave, labels


def get_model(channels: int = 32, width: int = 64, layers: int = 4, heads: int = 4, ff: int = 128):
    return SpeechCTC(channels, width, layers, heads, ff)


def get_dataset():
    return Utterances(2000), Utterances(200)


def loss_fn(output, target):
    """CTC over every frame against the whole label sequence (each utterance's lengths the same)."""
    log_probs = output.float().log_softmax(-1).transpose(0, 1)  # (frames, batch, VOCAB), as CTC takes it
    frames, batch = log_probs.shape[:2]
    return F.ctc_loss(log_probs, target, torch.full((batch,), frames, dtype=torch.long),
                      torch.full((batch,), target.shape[1], dtype=torch.long), zero_infinity=True)
