"""The repeated block of a model: what FSDP wraps, FSDP2 shards, checkpointing and compilation target.

For any nn.Module, not only GPT-lite: among the model's non-leaf submodules that hold parameters,
the classes with more than one instance are candidates (torch's containers, ModuleList and the
like, left out), and the block is the class whose instances hold the most parameters together
(ties: the more numerous). A transformer's layer class wins over its attention and MLP classes
(which hold less) and over its heads (more numerous, but less); GPT-lite's answer is `Block`, its
n_layer blocks in forward order. A caller can name the class instead (`block_class`).

A model without a repeated class (a single Linear, a small CNN) has no blocks: fine where nothing
needs them (single, ddp, ZeRO without checkpointing), refused in one line where something does
(`needed_by`: FSDP's units, FSDP2's shards, checkpointing, --compile, activation offload).
"""

from __future__ import annotations

import torch.nn as nn

from gptlite.errors import ConfigError

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList, nn.ParameterDict)


def _candidates(model: nn.Module) -> dict[type, list[nn.Module]]:
    found: dict[type, list[nn.Module]] = {}
    for module in model.modules():
        if module is model or isinstance(module, CONTAINERS) or not any(True for _ in module.children()):
            continue
        if any(True for _ in module.parameters()):
            found.setdefault(type(module), []).append(module)
    return found


def find_blocks(model: nn.Module, block_class: str | None = None, needed_by: str | None = None) -> list[nn.Module]:
    """The model's blocks, in the order model.modules() meets them (forward order for a ModuleList);
    [] for a model without a repeated class where nothing needs blocks (`needed_by` None)."""
    found = _candidates(model)
    if block_class is not None:
        named = [modules for cls, modules in found.items() if cls.__name__ == block_class]
        if not named:
            names = ", ".join(sorted({cls.__name__ for cls in found})) or "none"
            raise ConfigError(f"block_class {block_class}: no such module class holding parameters in the model "
                              f"(found: {names})")
        return named[0]
    repeated = {cls: modules for cls, modules in found.items() if len(modules) > 1}
    if not repeated:
        if needed_by is None:
            return []
        raise ConfigError(f"the model ({_name(model)}) has no repeated block (a module class holding parameters, "
                          f"used more than once), which {needed_by} needs; --block_class NAME or run without "
                          "FSDP/checkpointing")

    def weight(cls: type) -> tuple[int, int]:
        modules = repeated[cls]
        return sum(p.numel() for m in modules for p in m.parameters()), len(modules)

    return repeated[max(repeated, key=weight)]


def _name(model: nn.Module) -> str:
    """The model's class, inside the suite's WithLoss wrapper (models/workload.py) where it is one."""
    inner = getattr(model, "net", None)
    return type(inner if isinstance(inner, nn.Module) else model).__name__
