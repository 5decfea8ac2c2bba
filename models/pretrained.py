"""A transformers causal language model trained from its checkpoint's weights: `--model_name_or_path`.

The checkpoint is a directory as `save_pretrained` writes it (config.json and safetensors weights, one
file or an index of shards), given as a path, or a hub name found in the local Hugging Face cache (or
downloaded where the hub is reachable). The model is the type's AutoModelForCausalLM, loaded in fp32
(the master weights every backend trains; mixed precision casts from them), trained with the same
cross-entropy on the logits as `hf:<type>`.

How the weights reach each rank depends on the backend (Backend.build_model):
- single, DDP, FSDP1, ZeRO-0/1/2, accelerate: every rank loads the whole model (`from_pretrained`);
  these backends start from a whole replica anyway.
- FSDP2: the model is built without parameter memory (accelerate's init_empty_weights: parameters on
  the meta device, buffers real), sharded, given empty storage, and each rank reads only its shards
  from the safetensors files (torch.distributed.checkpoint's HuggingFaceStorageReader): `load_fsdp2`.
- ZeRO-3: built under DeepSpeed's zero.Init (transformers' HfDeepSpeedConfig), each rank holding its
  partition; then module by module the module's parameters are gathered, rank 0 copies them from the
  file one tensor at a time, and DeepSpeed re-partitions them: `load_zero3`. (transformers' own ZeRO-3
  path in from_pretrained reads the whole state dict on rank 0 first.)
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from textwrap import shorten

import torch

from gptlite.data import CharDataset, DataError
from gptlite.errors import ConfigError, one_line
from safetensors import safe_open

from models.hf import _dropout_fields, _one_sequence_per_row
from models.hub import hub_unreachable, import_transformers as _transformers
from models.spec import ModelRequest
from models.text_data import check_vocab, load_text_dataset, load_tokenizer
from models.workload import Workload, WithLoss

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# What a hub download fetches: the config, the weights and the tokenizer's files (no other formats).
HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", INDEX, "tokenizer*", "vocab*", "merges.txt",
             "special_tokens_map.json", "*.model"]
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def resolve_checkpoint(name_or_path: str) -> Path:
    """The checkpoint directory `name_or_path` names: a local directory, or a hub name from the local
    cache first (no network), then from the hub; ConfigError in one line where there is none."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"model_name_or_path: {name_or_path} is a file, not a checkpoint directory "
                              "(save_pretrained's output: config.json and model.safetensors)")
        check_files(path, name_or_path)
        return path.resolve()
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1 \
        or not _HUB_NAME.match(name_or_path)
    if looks_local:
        raise ConfigError(f"model_name_or_path: {name_or_path} does not exist (a checkpoint directory, "
                          "save_pretrained's output, or a hub name such as gpt2 or org/model)")
    from huggingface_hub import snapshot_download

    try:  # the local cache first: no network, no wait
        found = Path(snapshot_download(name_or_path, allow_patterns=HUB_FILES, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (huggingface_hub's LocalEntryNotFoundError, or a bad name)
        found = None
    if found is None:
        why = hub_unreachable()
        if why is None:
            try:
                found = Path(snapshot_download(name_or_path, allow_patterns=HUB_FILES, etag_timeout=10))
            except Exception as e:  # noqa: BLE001 - no network, no such repository, no access
                why = one_line(e)
        if found is None:
            raise ConfigError(f"model_name_or_path: {name_or_path!r} is not a local directory and is not in the "
                              f"Hugging Face cache, and the hub cannot give it ({shorten(why, 120, placeholder='...')}): "
                              "pass a local path, a "
                              "checkpoint directory (save_pretrained's output)")
    check_files(found, name_or_path)
    return found


def check_files(path: Path, given: str) -> None:
    if not (path / "config.json").is_file():
        raise ConfigError(f"model_name_or_path: {given} is not a transformers checkpoint: it has no config.json "
                          "(a directory save_pretrained wrote)")
    if not ((path / WEIGHTS).is_file() or (path / INDEX).is_file()):
        others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        also = f" (it has {', '.join(others[:3])}: re-save it with save_pretrained, which writes safetensors)" \
            if others else ""
        raise ConfigError(f"model_name_or_path: {given} has no safetensors weights ({WEIGHTS} or {INDEX}){also}")


@dataclass
class Checkpoint:
    """A checkpoint's weights, read lazily: which file holds each tensor, its shape and dtype."""

    path: Path
    files: dict[str, str] = field(default_factory=dict)  # tensor name -> file name
    shapes: dict[str, tuple] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)  # safetensors' names: F32, BF16, F16
    key_map: dict[str, str] = field(default_factory=dict)  # the model's state-dict name -> the checkpoint's

    @classmethod
    def read(cls, path: Path, given: str) -> "Checkpoint":
        if (path / INDEX).is_file():
            try:
                weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"model_name_or_path: {given}/{INDEX} cannot be read ({one_line(e)})") from None
            names = sorted(set(weight_map.values()))
        else:
            weight_map, names = None, [WEIGHTS]
        ckpt = cls(path)
        for name in names:
            try:
                with safe_open(str(path / name), framework="pt") as f:
                    for key in f.keys():
                        piece = f.get_slice(key)
                        ckpt.files[key], ckpt.shapes[key], ckpt.dtypes[key] = name, tuple(piece.get_shape()), \
                            piece.get_dtype()
            except Exception as e:  # noqa: BLE001 - a missing or damaged file (safetensors' own errors)
                raise ConfigError(f"model_name_or_path: {given}: cannot read {name} ({one_line(e)})") from None
        if not ckpt.files:
            raise ConfigError(f"model_name_or_path: {given}: its weights hold no tensors")
        return ckpt

    @property
    def dtype(self) -> str:
        """The checkpoint's floating-point dtype (the most common one, by elements)."""
        count: dict[str, int] = {}
        for key, d in self.dtypes.items():
            n = 1
            for s in self.shapes[key]:
                n *= s
            count[d] = count.get(d, 0) + n
        return {"F32": "fp32", "BF16": "bf16", "F16": "fp16", "F64": "fp64"}.get(max(count, key=count.get),
                                                                              max(count, key=count.get))

    def match(self, net: torch.nn.Module, prefix: str, given: str) -> None:
        """Pair each of `net`'s (a meta model's) state-dict entries with the checkpoint's tensor; refuse a
        checkpoint that misses one (tied weights aside: one parameter under two names, stored once) or
        has another shape."""
        state = net.state_dict()
        owner = {}
        for name, p in net.named_parameters(remove_duplicate=False):
            owner.setdefault(id(p), []).append(name)
        missing, wrong = [], []
        for key, value in state.items():
            for candidate in (key, f"{prefix}.{key}" if prefix else None,
                              key.removeprefix(f"{prefix}.") if prefix and key.startswith(f"{prefix}.") else None):
                if candidate and candidate in self.files:
                    if tuple(value.shape) != self.shapes[candidate]:
                        wrong.append(f"{key} {list(self.shapes[candidate])} (the model's: {list(value.shape)})")
                    self.key_map[key] = candidate
                    break
        for key, value in state.items():
            if key in self.key_map:
                continue
            twins = owner.get(id(net.get_parameter(key)), []) if _is_parameter(net, key) else []
            if not any(t in self.key_map for t in twins):
                missing.append(key)
        if wrong:
            raise ConfigError(f"model_name_or_path: {given}: {len(wrong)} tensors have another shape than its "
                              f"config.json gives: {', '.join(wrong[:3])}")
        if missing:
            raise ConfigError(f"model_name_or_path: {given}: its weights lack {len(missing)} of the model's "
                              f"{len(state)} tensors ({', '.join(missing[:3])}): not a complete checkpoint of "
                              f"{type(net).__name__}")

    def file_sizes(self) -> set[int]:
        """The sizes of the checkpoint's files: safetensors maps a file whole into memory to read it (an
        allocation of the file's size whose pages are the page cache's, resident only where read)."""
        return {(self.path / name).stat().st_size for name in set(self.files.values())}

    def tensor(self, key: str) -> torch.Tensor:
        with safe_open(str(self.path / self.files[key]), framework="pt") as f:
            return f.get_tensor(key)

    # ------------------------------------------------------------------ sharded loading
    def load_fsdp2(self, net: torch.nn.Module) -> None:
        """Fill an FSDP2-sharded `net` (its parameters DTensors with storage) from the checkpoint, each
        rank reading its own shards: torch.distributed.checkpoint with Hugging Face's safetensors reader."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        state = net.state_dict()
        wanted = {ckpt_key: state[key] for key, ckpt_key in self.key_map.items()}
        dcp.load(wanted, storage_reader=HuggingFaceStorageReader(str(self.path)))

    def load_zero3(self, net: torch.nn.Module, rank: int) -> None:
        """Fill a ZeRO-3-partitioned `net` (built under zero.Init) module by module: its parameters
        gathered (one module's at a time), rank 0 copying each from the file, DeepSpeed re-partitioning
        them on leaving the context. Buffers are whole on every rank: each rank copies its own."""
        import deepspeed

        for module_name, module in net.named_modules():
            def full(name):
                return f"{module_name}.{name}" if module_name else name

            params = [(self.key_map[full(n)], p) for n, p in module.named_parameters(recurse=False)
                      if full(n) in self.key_map]
            for key, p in params:  # one parameter whole at a time
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    if rank == 0:
                        with torch.no_grad():
                            p.data.copy_(self.tensor(key))
            with torch.no_grad():
                for n, b in module.named_buffers(recurse=False):
                    if full(n) in self.key_map:
                        b.copy_(self.tensor(self.key_map[full(n)]))


def has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def save_transformers(state: dict[str, torch.Tensor], description: dict, out: Path) -> list[str]:
    """A run's consolidated state dict (training/export.py: names as the suite's model has them, `net.`
    first) written as a transformers checkpoint in `out` (save_pretrained: config.json, model.safetensors,
    in fp32 as trained), with the tokenizer the run's checkpoint came with; the files written."""
    transformers = _transformers()
    config_dict = dict(description["config"])
    config = transformers.AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    with torch.device("meta"):
        net = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights = {k.removeprefix("net."): v for k, v in state.items()}
    missing, unexpected = net.load_state_dict(weights, strict=False, assign=True)
    missing = [k for k in missing if k not in description.get("tied", [])]
    if missing or unexpected:
        raise ConfigError(f"the checkpoint does not hold {type(net).__name__}'s weights (missing "
                          f"{', '.join(missing[:3]) or 'none'}; unexpected {', '.join(unexpected[:3]) or 'none'})")
    net.tie_weights()  # tied names loaded as two tensors: one parameter again
    before = {p.name for p in out.iterdir()} if out.is_dir() else set()
    net.save_pretrained(out)
    source = description.get("tokenizer")
    if source and Path(source).is_dir():
        transformers.AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return sorted({p.name for p in out.iterdir() if p.is_file()} - before)


def _is_parameter(net, key: str) -> bool:
    try:
        net.get_parameter(key)
        return True
    except AttributeError:
        return False


def _causal_lm_logits(net, x):
    return net(input_ids=x, use_cache=False).logits


@dataclass
class PretrainedModel:
    """What a backend needs to build the model its own way (Backend.build_model)."""

    config: object
    checkpoint: Checkpoint
    auto: object  # transformers.AutoModelForCausalLM

    def full(self) -> torch.nn.Module:
        """The whole model with its weights, on this rank (from_pretrained, fp32)."""
        if os.environ.get("RANK", "0") != "0":  # one progress bar per run, not one per rank
            _transformers().utils.logging.disable_progress_bar()
        net = self.auto.from_pretrained(str(self.checkpoint.path), config=self.config, dtype=torch.float32)
        return WithLoss(net, _causal_lm_logits)

    def structure(self) -> torch.nn.Module:
        """The model without weights (from its config): for the meta device and fake tensors."""
        return WithLoss(self.auto.from_config(self.config, dtype=torch.float32), _causal_lm_logits)

    def empty(self) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        """The model with its parameters on the meta device and its buffers real (rotary tables, which
        no checkpoint holds), and those buffers by name: FSDP2 shards it, gives it empty storage, restores
        the buffers and loads the shards (load_fsdp2)."""
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            model = self.structure()
        # init_empty_weights replaces each parameter it registers, which unties tied embeddings: tie again.
        model.net.tie_weights()
        return model, {name: b.clone() for name, b in model.named_buffers()}

    def zero3(self, ds_config: dict, rank: int) -> torch.nn.Module:
        """The model built under DeepSpeed's zero.Init (each rank its partition), then loaded (load_zero3).
        transformers' contexts for ZeRO-3 (as from_config enters them under HfDeepSpeedConfig) without
        its initialisation pass, which gathers every module to draw weights the checkpoint replaces."""
        import deepspeed
        from transformers.initialization import no_init_weights
        from transformers.integrations.deepspeed import prevent_arange_dtype_change

        with no_init_weights(), prevent_arange_dtype_change(), deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = self.structure()
        model.net.tie_weights()
        self.checkpoint.load_zero3(model.net, rank)
        return model


def load(request: ModelRequest) -> Workload:
    transformers = _transformers()
    given = request.checkpoint
    path = resolve_checkpoint(given)
    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - transformers' own validation of config.json
        raise ConfigError(f"model_name_or_path: {given}/config.json cannot be read by transformers: {one_line(e)}") \
            from None
    if config.model_type not in transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"model_name_or_path: {given} is a {config.model_type} checkpoint, which transformers has no "
                          "causal language model for (e.g. gpt2, llama, mistral, qwen2 checkpoints)")
    if request.args:
        raise ConfigError("model_args: a checkpoint's settings are its config.json's (--model_args applies to "
                          "hf:<type>, torchvision and model files); drop it")
    positions_name = getattr(config, "attribute_map", {}).get("max_position_embeddings", "max_position_embeddings")
    positions = getattr(config, positions_name, None)
    seq_len = request.seq_len
    if positions is not None:
        if request.block_size_given and seq_len > positions:
            raise ConfigError(f"block_size: {seq_len} is longer than the model's positions ({positions_name} "
                              f"{positions} in {given}/config.json); give --block_size {positions} or less")
        seq_len = min(seq_len, positions)
    original = config.to_diff_dict()  # what an export writes back (training/export.py), as the checkpoint had it
    if request.dropout is not None:
        for name in _dropout_fields(config):
            setattr(config, name, request.dropout)
    # Encoder families that can be decoders (BERT's) apply a causal mask only with it; others ignore it.
    config.is_decoder = True
    tokenizer_path = str(path) if has_tokenizer(path) else None
    if request.text is not None:  # --train_file / --dataset_name, tokenized (models/text_data.py)
        text = request.text
        # The checkpoint's own tokenizer by default: from its resolved directory (a hub name's download)
        tokenizer_path = str(path) if text.tokenizer_flag == "model_name_or_path" else text.tokenizer
        tokenizer = load_tokenizer(tokenizer_path, text.tokenizer_flag)
        check_vocab(len(tokenizer), config.vocab_size, request.name, tokenizer_path, text.tokenizer_flag)
        data = load_text_dataset(text, seq_len, tokenizer)
    else:
        data = CharDataset.load(request.data, seq_len)
        if data.vocab_size > config.vocab_size:
            raise DataError(f"model_name_or_path: the data's vocabulary ({data.vocab_size} symbols) is larger than "
                            f"the model's embedding ({config.vocab_size} in {given}/config.json)")
    ckpt = Checkpoint.read(path, given)
    pretrained = PretrainedModel(config, ckpt, transformers.AutoModelForCausalLM)
    with torch.device("meta"):
        structure = pretrained.structure()
    ckpt.match(structure.net, getattr(structure.net, "base_model_prefix", ""), given)
    tied = sorted(set(structure.net.state_dict()) - set(ckpt.key_map))
    description = {"name": request.name, "task": "causal_lm", "model_name_or_path": given, "checkpoint": str(path),
                   "model_type": config.model_type, "architecture": type(structure.net).__name__,
                   "checkpoint_dtype": ckpt.dtype, "vocab_size": config.vocab_size, "positions": positions,
                   "tied": tied, "dropout": request.dropout, "config": original,
                   "tokenizer": tokenizer_path}
    # A causal LM type's logits never read later tokens (not probed: the probe builds the whole
    # model on every rank, which ZeRO-3 and FSDP2 avoid here).
    return Workload(request.name, description, data, pretrained.full, tokens_per_sample=seq_len,
                    fake_patches=(_one_sequence_per_row,), causal=False, structure=pretrained.structure,
                    pretrained=pretrained)
