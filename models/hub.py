"""The Hugging Face libraries, as the model loaders reach them: transformers and datasets each imported
in one place (here: only the runs that use them pay their seconds of import), transformers quiet, and
whether the Hub can be reached before anything asks it (hf:, --model_name_or_path, the text data).
Their submodules are reached through the module these return (`import_transformers().AutoConfig`),
or imported after it. huggingface_hub, too, is imported where the Hub is asked (its HTTP clients: 0.2 s)."""

from __future__ import annotations

import os

from gptlite.errors import ConfigError, one_line


def import_transformers():
    """transformers, imported, quiet on every rank; ConfigError in one line where it is not installed."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("model hf:...: transformers is not installed (pip install transformers; `make setup` "
                          "installs it)") from None
    transformers.logging.set_verbosity_error()  # no advice about generation or weights loading per rank
    return transformers


def import_datasets():
    """datasets, imported; ConfigError in one line where it is not installed."""
    try:
        import datasets
    except ImportError:
        raise ConfigError("train_file / dataset_name: the datasets library is not installed (pip install datasets; "
                          "`make setup` installs it)") from None
    return datasets


def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached (offline mode, no route), or None: one request with a
    short timeout, where transformers, datasets and huggingface_hub retry for a minute before they give
    up. Offline mode as huggingface_hub read it at import, or as the environment says now."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    try:
        from huggingface_hub.utils import get_session

        get_session().head(constants.ENDPOINT, timeout=5)
    except Exception as e:  # noqa: BLE001 - no name resolution, no route, refused, timed out
        return f"{constants.ENDPOINT} cannot be reached: {one_line(e)}"
    return None
