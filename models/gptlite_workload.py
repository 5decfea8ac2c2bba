"""GPT-lite as a workload: the article's model on character data (--data, or the embedded corpus), or on
tokenized text (--train_file / --dataset_name, models/text_data.py) with its tokenizer's vocabulary."""

from __future__ import annotations

from gptlite.data import CharDataset
from gptlite.errors import ConfigError
from gptlite.model import GPTLite, meta_model
from models.spec import ModelRequest
from models.text_data import load_text_dataset
from models.workload import Workload


GPTLITE_TAKES = ("model_args apply to hf:, torchvision: and file models; GPT-lite takes --preset, --n_layer, "
                 "--n_embd, --n_head, --block_size and --dropout")


def load(request: ModelRequest) -> Workload:
    if request.args:
        raise ConfigError(GPTLITE_TAKES)
    block_size = request.gptlite_config(None).block_size
    if request.text is not None:  # --train_file / --dataset_name: its tokenizer's vocabulary
        data = load_text_dataset(request.text, block_size)
    else:
        data = CharDataset.load(request.data, block_size)
    cfg = request.gptlite_config(data.vocab_size)
    # The record's model section is GPT-lite's config as before, named: old records (without
    # `name`) read as GPT-lite.
    return Workload("gptlite", {"name": "gptlite", **cfg.to_dict()}, data, lambda: GPTLite(cfg),
                    tokens_per_sample=cfg.block_size, flops_formula=cfg.flops_per_token * cfg.block_size,
                    _meta=meta_model(cfg))
