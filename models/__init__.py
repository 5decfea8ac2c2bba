"""The model a run trains and the data it trains on: GPT-lite (the default), a Hugging Face
transformers model built from its config (`hf:<model_type>`), a torchvision model
(`torchvision:<name>`, where torchvision imports), or the user's own file or module with the
article's `get_model()` and `get_dataset()`.

Whatever the source, a run gets a `Workload` (models/workload.py): a module whose
`forward(x, y)` returns `(output, loss)` (GPT-lite's own contract; other models are wrapped in
`WithLoss`), built the same from the seed on every rank, and a data source whose global batch of
a step is a pure function of (seed, step). Backends see nothing else of the model.
"""

from __future__ import annotations

from gptlite.errors import ConfigError
from models import gptlite_workload, hf, pretrained, user, vision
from models.spec import ModelRequest, check_name, model_label, parse_model_args  # noqa: F401
from models.workload import Workload  # noqa: F401

# Each kind's loader: it imports its own libraries (transformers, datasets, torchvision) when it loads.
LOADERS = {"gptlite": gptlite_workload.load, "hf": hf.load, "pretrained": pretrained.load,
           "torchvision": vision.load_torchvision}


def load(request: ModelRequest) -> Workload:
    """The workload `request` names. Raises ConfigError/DataError with a one-line reason."""
    workload = LOADERS.get(request.kind, user.load)(request)
    if request.block_size_given and workload.tokens_per_sample is None:
        raise ConfigError(f"block_size: {request.name} takes no context length (its samples are not token windows: "
                          "--block_size applies to GPT-lite and hf: language models); drop it")
    return workload
