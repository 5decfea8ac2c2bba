"""Hugging Face transformers models built from their config: random weights, no download.

`hf:<model_type>` (a transformers model type: gpt2, llama, mistral, resnet, vit, ...) becomes
`AutoConfig.for_model(<model_type>, **settings)` and then, by what transformers registers for the
type, a causal LM trained on the character data or the tokenized --train_file / --dataset_name
(models/text_data.py; vocabulary and context length from the data or tokenizer and --block_size) or
an image classifier trained on CIFAR-10-shaped images (models/vision.py).
--model_args sets config fields (checked against the type's own settings); --dropout sets every
dropout probability of the config. The loss is computed here, from the logits, exactly as for
GPT-lite (the targets are already the next tokens, so the model's own shifted loss is not used).
"""

from __future__ import annotations

import re
from unittest import mock

from gptlite.data import CharDataset
from gptlite.errors import ConfigError, one_line
from models.hub import import_transformers as _import
from models.spec import ModelRequest
from models.text_data import check_vocab, load_text_dataset, load_tokenizer
from models.vision import image_data
from models.workload import Workload, WithLoss


def task_of(model_type: str) -> str:
    """"causal_lm" or "image_classification": what this suite trains a model type for."""
    modeling_auto = _import().models.auto.modeling_auto
    if model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "causal_lm"
    if model_type in modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES:
        return "image_classification"
    raise ConfigError(f"model hf:{model_type}: transformers has no causal language model or image classifier for "
                      "this type (e.g. hf:gpt2, hf:llama, hf:mistral, hf:resnet, hf:vit)")


def _dropout_fields(config) -> list[str]:
    return [k for k, v in config.to_dict().items()
            if isinstance(v, float) and (k.endswith("dropout") or k.endswith("pdrop") or k.endswith("dropout_prob")
                                         or k.endswith("drop_rate"))]


def build_config(request: ModelRequest, task: str, vocab_size: int | None):
    transformers = _import()
    model_type = request.name.split(":", 1)[1]
    default = transformers.AutoConfig.for_model(model_type)
    known = set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
    unknown = sorted(set(request.args) - known)
    if unknown:
        some = ", ".join(sorted(k for k in default.to_dict() if not k.startswith("_"))[:25])
        raise ConfigError(f"model_args: hf:{model_type} has no setting {', '.join(unknown)} (its settings include "
                          f"{some}, ...)")
    _check_sizes(default, request.args, model_type)
    for key in sorted(set(request.args) & set(AUX_LOSS_SETTINGS)):
        if request.args[key]:
            raise ConfigError(f"model_args: {key}={request.args[key]!r}: hf:{model_type}'s router loss is part of the "
                              "model's own loss, which the harness does not train (it trains cross-entropy on the "
                              "logits, so the router's auxiliary loss would be dropped): leave it unset")
    settings = {}
    if task == "causal_lm":
        # is_decoder: encoder types that can be decoders (BERT and its family) apply a causal mask only
        # with it; decoder-only types ignore it. Workload.check probes that the model is causal.
        settings.update(vocab_size=vocab_size, max_position_embeddings=request.seq_len, is_decoder=True)
        # A character vocabulary has no room for the type's default special tokens (GPT-2's 50256).
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(default, name, None) is not None:
                settings[name] = None
        # A context length in model_args stands (it was overwritten by --block_size's): it must hold a sample.
        alias = getattr(default, "attribute_map", {}).get("max_position_embeddings", "max_position_embeddings")
        for key in {"max_position_embeddings", alias} & set(request.args):
            value = request.args[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < request.seq_len:
                raise ConfigError(f"model_args: {key}={value!r} is shorter than a sample ({request.seq_len} tokens: "
                                  f"--block_size, or the preset's); give --block_size {value} or a {key} of at least "
                                  f"{request.seq_len}")
            settings.pop("max_position_embeddings", None)
    else:
        settings.update(num_labels=10)
        for name, value in (("image_size", 32), ("num_channels", 3)):
            if hasattr(default, name):
                settings[name] = value
    if request.dropout is not None:
        settings.update({k: request.dropout for k in _dropout_fields(default)})
    settings.update(request.args)
    try:
        return transformers.AutoConfig.for_model(model_type, **settings)
    except Exception as e:  # noqa: BLE001 - the config's own validation (ValueError, TypeError, huggingface_hub's)
        raise ConfigError(f"model_args: hf:{model_type}: {one_line(e)}") from None


# Settings that add loss terms of the model's own (mixture-of-experts routers: Mixtral, Qwen-MoE, Switch):
# the harness trains cross-entropy on the logits alone.
AUX_LOSS_SETTINGS = ("output_router_logits", "router_aux_loss_coef", "router_z_loss_coef")

# A setting that counts or sizes something (layers, heads, widths, experts): at least 1 where the type's
# default is. transformers builds a GPT-2 of n_layer=-1 without a complaint: no blocks at all.
_SIZE_NAME = re.compile(r"^(num_|n_)|(_size|_dim|_layers|_heads)$")


def _check_sizes(default, args: dict, model_type: str) -> None:
    aliases = getattr(default, "attribute_map", {})
    for key, value in args.items():
        name = aliases.get(key, key)
        given = getattr(default, name, None)
        if not (_SIZE_NAME.search(name) or _SIZE_NAME.search(key)) or isinstance(given, bool) \
                or not isinstance(given, int) or given < 1:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"model_args: {key}={value!r}: hf:{model_type}'s {name} is a count or a size, an integer "
                              f">= 1 (its default: {given})")


def _causal_lm_logits(net, x):
    return net(input_ids=x, use_cache=False).logits


def _classifier_logits(net, x):
    return net(pixel_values=x).logits


def load(request: ModelRequest) -> Workload:
    transformers = _import()
    model_type = request.name.split(":", 1)[1]
    if model_type not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        raise ConfigError(f"model hf:{model_type}: not a transformers model type (e.g. gpt2, llama, mistral, resnet, "
                          "vit)")
    task = task_of(model_type)
    if task == "causal_lm":
        if request.text is None:
            data = CharDataset.load(request.data, request.seq_len)
            config = build_config(request, task, data.vocab_size)
        else:  # the tokenizer's vocabulary, checked against the model's before anything is tokenized
            text = request.text
            tokenizer = load_tokenizer(text.tokenizer, text.tokenizer_flag)
            config = build_config(request, task, len(tokenizer))
            if getattr(config, "vocab_size", None) is not None:
                check_vocab(len(tokenizer), config.vocab_size, request.name, text.tokenizer, text.tokenizer_flag)
            data = load_text_dataset(request.text, request.seq_len, tokenizer)
        auto, call, tokens = transformers.AutoModelForCausalLM, _causal_lm_logits, request.seq_len
    else:
        if request.text is not None:
            raise ConfigError(f"model {request.name}: an image classifier; --train_file and --dataset_name are "
                              "tokenized text, for language models")
        data = image_data(request.data, request.trust_data)
        config = build_config(request, task, None)
        auto, call, tokens = transformers.AutoModelForImageClassification, _classifier_logits, None

    def make():
        return WithLoss(auto.from_config(config), call)

    description = {"name": request.name, "task": task, "args": request.args, "config": config.to_diff_dict()}
    return Workload(request.name, description, data, make, tokens_per_sample=tokens,
                    fake_patches=(_one_sequence_per_row,) if task == "causal_lm" else (), causal=task == "causal_lm")


def _one_sequence_per_row():
    """On fake tensors, transformers cannot read the position ids to see that no row packs several
    sequences, so it builds a full causal mask, and SDPA with a mask takes its math path (which keeps
    the B x H x T x T weights) where real training passes is_causal. Our batches never pack
    sequences: say so, as real tensors would."""
    return mock.patch.object(_import().masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
