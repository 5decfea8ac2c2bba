"""Tiny transformers checkpoints written with save_pretrained, for the tests of --model_name_or_path
(no network: the hub is never asked). `python tests/pretrained_checkpoint.py DIR [gpt2|llama] [N_LAYER]`."""

from __future__ import annotations

import sys
from pathlib import Path

VOCAB = 96  # >= any character corpus the tests train on (the embedded one, tiny-shakespeare's 65)
POSITIONS = 64


def config_for(arch: str = "gpt2", n_layer: int = 2, width: int = 64, **more):
    import transformers

    if arch == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=width, n_layer=n_layer,
                                       n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       bos_token_id=None, eos_token_id=None, **more)
    if arch == "llama":
        return transformers.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=POSITIONS, hidden_size=width,
                                        intermediate_size=2 * width, num_hidden_layers=n_layer, num_attention_heads=4,
                                        num_key_value_heads=2, tie_word_embeddings=False, bos_token_id=None,
                                        eos_token_id=None, pad_token_id=None, **more)
    raise ValueError(arch)


def write_checkpoint(directory: Path, arch: str = "gpt2", n_layer: int = 2, width: int = 64, seed: int = 0,
                     dtype: str = "float32", **more) -> Path:
    """A randomly initialised causal LM of `arch` saved as a checkpoint directory (config.json and
    model.safetensors), its weights from `seed`."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_for(arch, n_layer, width, **more))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(directory)
    return Path(directory)


if __name__ == "__main__":
    write_checkpoint(Path(sys.argv[1]), *(sys.argv[2:3] or ["gpt2"]), *(int(a) for a in sys.argv[3:4]))
