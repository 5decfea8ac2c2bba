"""Tiny transformers checkpoints written with save_pretrained, for the tests of --model_name_or_path
(no network: the hub is never asked). `python tests/support/pretrained_checkpoint.py DIR [gpt2|llama] [N_LAYER]`."""

from __future__ import annotations

import sys
from pathlib import Path

VOCAB = 96  # >= any character corpus the tests train on (the embedded one, tiny-shakespeare's 65)
POSITIONS = 64


def config_for(arch: str = "gpt2", n_layer: int = 2, width: int = 64, **more):
    import transformers

    more.setdefault("vocab_size", VOCAB)

    if arch == "gpt2":
        return transformers.GPT2Config(n_positions=POSITIONS, n_embd=width, n_layer=n_layer,
                                       n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       bos_token_id=None, eos_token_id=None, **more)
    if arch == "llama":
        return transformers.LlamaConfig(max_position_embeddings=POSITIONS, hidden_size=width,
                                        intermediate_size=2 * width, num_hidden_layers=n_layer, num_attention_heads=4,
                                        num_key_value_heads=2, tie_word_embeddings=False, bos_token_id=None,
                                        eos_token_id=None, pad_token_id=None, **more)
    raise ValueError(arch)


def write_checkpoint(directory: Path, arch: str = "gpt2", n_layer: int = 2, width: int = 64, seed: int = 0,
                     dtype: str = "float32", tokenizer: bool = True, **more) -> Path:
    """A randomly initialised causal LM of `arch` saved as a checkpoint directory (config.json and
    model.safetensors), its weights from `seed`, with a tokenizer (write_tokenizer) unless not."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config_for(arch, n_layer, width, **more))
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(directory)
    if tokenizer:
        write_tokenizer(directory)
    return Path(directory)


def write_tokenizer(directory: Path, vocab_size: int = 80) -> None:
    """A byte-pair tokenizer trained here with the tokenizers library (a few lines of text), saved as
    transformers saves one (tokenizer.json, tokenizer_config.json)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    text = ["to be or not to be, that is the question", "whether tis nobler in the mind to suffer",
            "the slings and arrows of outrageous fortune"]
    tokenizer.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[UNK]"]))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(directory)


if __name__ == "__main__":
    write_checkpoint(Path(sys.argv[1]), *(sys.argv[2:3] or ["gpt2"]), *(int(a) for a in sys.argv[3:4]))
