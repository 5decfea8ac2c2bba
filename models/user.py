"""The user's own model: a Python file (`--model path/to/my_model.py`) or an importable module
(`--model mypackage.my_model`) with the article's two functions, and optionally a loss:

    get_model(**model_args) -> torch.nn.Module      # called with --model_args, under the run's seed
    get_dataset() -> Dataset | (train, val)          # map-style: len(ds), ds[i] -> a sample (models/sampling.py:
                                                     # (input, target), {input_ids, labels}, {pixel_values, labels})
    loss_fn(output, target) -> scalar tensor         # optional; default: cross-entropy on the logits (the
                                                     # output, or its .logits: a transformers ModelOutput)

One dataset is split 90/10 into training and validation, as the text is. The model's forward
takes the batched inputs and returns the output that `loss_fn` reads.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import types
import typing
from pathlib import Path

import torch
import torch.nn as nn

from gptlite.errors import ConfigError, one_line
from models.sampling import SampledDataset
from models.spec import ModelRequest
from models.workload import Workload, WithLoss


def user_call(what: str, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`: the user's code, whose failure is bad input said in one line (ConfigError).
    SystemExit too: a model file that calls sys.exit() (or exit()) must not end train.py quietly
    with the file's exit code; only Ctrl-C (KeyboardInterrupt) goes through."""
    try:
        return fn(*args, **kwargs)
    except ConfigError:
        raise
    except SystemExit as e:
        raise ConfigError(f"model: {what} called sys.exit({e.code!r})") from None
    except Exception as e:  # noqa: BLE001 - the user's code: say where it failed, in one line
        raise ConfigError(f"model: {what} failed: {one_line(e)}") from None


def import_user_module(name: str):
    if name.endswith(".py"):
        path = Path(name)
        if not path.is_file():
            raise ConfigError(f"model: file not found: {name}")
        # As `python file.py` would: the file's own directory first on the path, so that it can
        # import the modules beside it (kept there: get_model() may import them later too).
        directory = str(path.resolve().parent)
        if directory not in sys.path:
            sys.path.insert(0, directory)
        module_name = f"user_model_{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path.resolve())
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
        user_call(f"importing {name}", spec.loader.exec_module, module)
        return module

    def find():
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and name.startswith(e.name):
                raise ConfigError(f"model must be gptlite, hf:<model_type>, torchvision:<name>, a .py file or an "
                                  f"importable module (no module named {name!r})") from None
            raise

    return user_call(f"importing {name}", find)


# The annotations check_arg_types understands: what each accepts from --model_args' YAML values.
_SIMPLE = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}
_NAMES = {int: "an int", float: "a float", bool: "a bool (true or false)", str: "a string"}


def check_arg_types(get_model, args: dict, name: str) -> None:
    """Each --model_args value against get_model's annotation for it, where the annotation is one this
    can read (int, float, bool, str, X | None, list[X], tuple[X, ...]): a value of another type is
    refused naming the key and the type (ConfigError), not passed on to fail inside the user's code or,
    worse, to be used (a string "1e3" where a float is meant: YAML reads 1e3 as a string)."""
    parameters = inspect.signature(get_model).parameters
    for key, value in args.items():
        annotation = _annotation(get_model, parameters[key]) if key in parameters else None
        expected = _expected(annotation)
        if expected is None or _fits(value, annotation):
            continue
        hint = " (YAML reads 1e3 as a string: write 1.0e+3 or 1000.0)" if isinstance(value, str) and _number(value) \
            else ""
        raise ConfigError(f"model_args: {key} must be {expected} ({name}'s get_model() annotates it "
                          f"{_spelled(annotation)}), got {type(value).__name__} {value!r}{hint}")


def _annotation(fn, parameter: inspect.Parameter):
    """The parameter's annotation, evaluated where it is a string (`from __future__ import annotations`);
    None where it cannot be (it names something the file does not define)."""
    annotation = parameter.annotation
    if isinstance(annotation, str):
        try:
            return eval(annotation, getattr(fn, "__globals__", {}))  # noqa: S307 - the user's own file, already run
        except Exception:  # noqa: BLE001
            return None
    return annotation


def _parts(annotation):
    """(origin, arguments) of an annotation: `int | None` -> (Union, (int, NoneType))."""
    return typing.get_origin(annotation), typing.get_args(annotation)


def _expected(annotation) -> str | None:
    """What `annotation` asks for in words, or None for an annotation this does not check."""
    if annotation in _SIMPLE:
        return _NAMES[annotation]
    origin, inner = _parts(annotation)
    if origin in (typing.Union, types.UnionType):
        words = [_expected(a) for a in inner if a is not type(None)]
        if None in words:
            return None
        return " or ".join(words + (["null"] if type(None) in inner else []))
    if (origin is list and len(inner) == 1) or (origin is tuple and len(inner) == 2 and inner[1] is Ellipsis):
        return f"a list of {inner[0].__name__}" if inner[0] in _SIMPLE else None
    return None


def _fits(value, annotation) -> bool:
    if annotation in _SIMPLE:
        return isinstance(value, _SIMPLE[annotation]) and not (annotation is not bool and isinstance(value, bool))
    origin, inner = _parts(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(value is None if a is type(None) else _fits(value, a) for a in inner)
    if origin in (list, tuple):  # YAML gives lists for both
        return isinstance(value, list) and all(_fits(v, inner[0]) for v in value)
    return True


def _number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _spelled(annotation) -> str:
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def load(request: ModelRequest) -> Workload:
    module = import_user_module(request.name)
    for function in ("get_model", "get_dataset"):
        if not callable(getattr(module, function, None)):
            raise ConfigError(f"model: {request.name} defines no {function}() (a model file needs get_model() and "
                              "get_dataset(); see docs/models.md, 'Your own model')")
    if request.dropout is not None:
        raise ConfigError("dropout applies to gptlite and hf: models; give your model's its own argument in "
                          "--model_args")
    if request.data is not None:
        raise ConfigError(f"data: {request.name}'s get_dataset() provides the data; --data applies to gptlite, "
                          "hf: and torchvision: models")
    try:
        inspect.signature(module.get_model).bind(**request.args)
    except TypeError as e:
        raise ConfigError(f"model_args: {request.name}'s get_model() does not take them ({e})") from None
    check_arg_types(module.get_model, request.args, request.name)
    dataset = user_call(f"{request.name}: get_dataset()", module.get_dataset)
    train, val = dataset if isinstance(dataset, tuple) and len(dataset) == 2 else (dataset, None)
    data = SampledDataset(train, val, f"{request.name}: get_dataset()")
    loss = getattr(module, "loss_fn", None)
    if loss is not None and not callable(loss):
        raise ConfigError(f"model: {request.name}: loss_fn must be a function (output, target) -> scalar tensor "
                          f"(got {type(loss).__name__})")
    args = dict(request.args)

    def make():
        if torch.get_default_device().type == "meta":
            # The model's structure (Workload.meta): a get_model() that cannot run on the meta device
            # (from_pretrained refuses it: it loads weights) is built for real instead, so its failure
            # here is not the user's error.
            try:
                net = module.get_model(**args)
            except SystemExit as e:
                raise ConfigError(f"model: {request.name}: get_model() called sys.exit({e.code!r})") from None
        else:
            net = user_call(f"{request.name}: get_model()", module.get_model, **args)
        if not isinstance(net, nn.Module):
            raise ConfigError(f"model: {request.name}: get_model() must return a torch.nn.Module (got "
                              f"{type(net).__name__})")
        return WithLoss(net, loss=loss)

    return Workload(request.name, {"name": request.name, "args": args,
                                   "loss": "loss_fn" if loss is not None else "cross_entropy"}, data, make)
