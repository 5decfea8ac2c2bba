"""Zoo model: a recurrent language model, a GRU (benchmarks/zoo/__init__.py), as a user's model file.

    python train.py --model benchmarks/zoo/gru_lm.py

Token embedding, one GRU layer, a linear head to the vocabulary, on sequences of a fixed random
"language" (each token a function of the one before), predicting the next token.
"""

import torch
import torch.nn as nn

VOCAB, SEQ = 64, 16


class GRULM(nn.Module):
    def __init__(self, embed: int = 32, hidden: int = 64):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, embed)
        self.gru = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, x):
        out, _ = self.gru(self.embed(x))
        return self.head(out).flatten(0, 1)  # (batch x SEQ, VOCAB): the loss against the flattened targets


class Sequences(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        tokens = [int(torch.randint(VOCAB, (1,), generator=g))]
        for _ in range(SEQ):
            tokens.append((tokens[-1] * 7 + 3) % VOCAB)
        t = torch.tensor(tokens)
        return t[:-1], t[1:]


def get_model(embed: int = 32, hidden: int = 64):
    return GRULM(embed, hidden)


def get_dataset():
    return Sequences(2000), Sequences(200)


def loss_fn(output, target):
    return nn.functional.cross_entropy(output, target.flatten())
