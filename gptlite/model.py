"""GPT-lite: the character-level GPT-2-small-like model of the "Distributed GPT model" article.

Faithful to the article's architecture: token and learned position embeddings, `n_layer`
pre-LayerNorm blocks (multi-head causal self-attention, then a ReLU feed-forward, both residual),
a final LayerNorm and an `lm_head` without bias.

Two deliberate differences from the article's code, neither of which changes the parameter count
or the function computed:
- the per-head key/query/value Linears are fused into one Linear per role covering all heads
  (the same weights, laid out side by side), because twelve tiny matmuls per role are slow;
- there is no `tril` mask buffer per head: at block_size 2048 those buffers alone would cost
  12 x 12 x 2048^2 floats (2.3 GiB). The causal mask is built per forward, once per block.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptlite.errors import ConfigError

ATTENTION_IMPLS = ("naive", "sdpa")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 65
    block_size: int = 256
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    dropout: float = 0.0
    # "naive" materialises the B x H x T x T scores as the article does (its memory profile);
    # "sdpa" uses torch's fused scaled_dot_product_attention. Both compute the same function.
    attention: str = "naive"

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_embd", "n_head"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer (got {value!r})")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"n_embd must be divisible by n_head (got n_embd={self.n_embd}, n_head={self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1) (got {self.dropout!r})")
        if self.attention not in ATTENTION_IMPLS:
            raise ConfigError(
                f"attention must be one of {', '.join(ATTENTION_IMPLS)} (got {self.attention!r})"
            )

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_params(self) -> int:
        """Parameters of GPTLite(self), by formula (tests check it against the built model): per
        block two LayerNorms (4C), q, k, v (3C^2), proj (C^2 + C), the feed-forward (8C^2 + 5C);
        token and position embeddings, the final LayerNorm and lm_head (no bias)."""
        C = self.n_embd
        return self.n_layer * (12 * C * C + 10 * C) + 2 * self.vocab_size * C + self.block_size * C + 2 * C

    @property
    def flops_per_token(self) -> float:
        """Model FLOPs per token of one forward and backward (PaLM's accounting, core/flops.py): 6 x the
        parameters that take part in matmuls (all but the two embedding tables, which are lookups),
        plus attention's 12 x n_layer x n_embd x T (QK^T and AV, causal masking not subtracted)."""
        matmul_params = self.n_params - (self.vocab_size + self.block_size) * self.n_embd
        return 6 * matmul_params + 12 * self.n_layer * self.n_embd * self.block_size

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


# `paper` is the article's model: 86,701,056 parameters (0.323 GiB in fp32) with the 65-symbol
# tiny-shakespeare vocabulary. `small` and `tiny` keep its shape but fit a 2-core CPU.
PRESETS: dict[str, GPTConfig] = {
    "paper": GPTConfig(block_size=2048, n_layer=12, n_embd=768, n_head=12, dropout=0.1),
    "small": GPTConfig(block_size=256, n_layer=6, n_embd=192, n_head=6, dropout=0.1),
    "tiny": GPTConfig(block_size=64, n_layer=4, n_embd=64, n_head=4, dropout=0.1),
}


def preset(name: str, **overrides) -> GPTConfig:
    """The named preset with `overrides` applied (None values are ignored)."""
    if name not in PRESETS:
        raise ConfigError(f"preset must be one of {', '.join(PRESETS)} (got {name!r})")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.attention = cfg.attention
        self.dropout_p = cfg.dropout
        self.key = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.query = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.value = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, C) -> (B, H, T, hs)
        q, k, v = (
            lin(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            for lin in (self.query, self.key, self.value)
        )
        if self.attention == "sdpa":
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout_p if self.training else 0.0, is_causal=True
            )
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu_(1)
            scores = scores.masked_fill(future, float("-inf"))
            weights = self.attn_dropout(F.softmax(scores, dim=-1))
            out = weights @ v
        out = out.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.proj(out))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.ReLU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    """One transformer block: the unit that sharding wrappers and activation checkpointing target."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.sa = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.ffwd = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.sa(self.ln1(x))
        return x + self.ffwd(self.ln2(x))


class GPTLite(nn.Module):
    def __init__(self, cfg: GPTConfig, init_weights: bool = True):
        # init_weights=False: for counting and shapes on the meta device, where initialising costs
        # torch's reference-op machinery (about 1 s of imports) for nothing.
        super().__init__()
        self.config = cfg
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.position_embedding = nn.Embedding(cfg.block_size, cfg.n_embd)
        # A ModuleList (not the article's nn.Sequential) so wrappers can replace block i in place
        # and the forward loop below stays the same whatever wraps each block.
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if init_weights:
            self.apply(_init_weights)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits (B, T, vocab) and, given targets, the mean cross-entropy loss."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.token_embedding(idx) + self.position_embedding(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss


def _init_weights(module: nn.Module) -> None:
    # GPT-2's initialisation, as in the article's tutorial code.
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# Random fills on the meta device go through torch's reference implementations, whose first call
# imports torch._dynamo (about 2 s of every process's start-up): a meta tensor has no values to fill.
_INIT_FILLS = frozenset(getattr(torch.Tensor, n) for n in ("normal_", "uniform_", "fill_", "zero_", "exponential_"))


class _SkipMetaInit(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init" or func in _INIT_FILLS:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta():
    """Build modules on the meta device (structure and shapes, no memory) without running their
    initialisation, which has nothing to fill there."""
    with torch.device("meta"), _SkipMetaInit():
        yield


def meta_model(cfg: GPTConfig) -> GPTLite:
    """The model's structure without memory or initialisation: for counting parameters."""
    with on_meta():
        return GPTLite(cfg, init_weights=False)


def build_model(cfg: GPTConfig, seed: int) -> GPTLite:
    """The model with weights that depend on `seed` alone: every rank and backend starts equal."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPTLite(cfg)
