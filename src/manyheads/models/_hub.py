"""Hugging Face Hub ids (``org/name``) as checkpoint folders.

A folder that exists always wins.  Otherwise an ``org/name`` is looked up with
``huggingface_hub`` (an optional package, imported only here and only then): first in
the local Hugging Face cache (``HF_HUB_CACHE``, no network), else downloaded into it,
only the files :func:`~manyheads.models.from_pretrained` and the command line read
(:data:`HUB_FILES`).  ``HF_HUB_OFFLINE=1`` keeps it to the cache.
"""
from __future__ import annotations

import importlib
import os
import re
from typing import Any

__all__ = ["HUB_FILES", "resolve_checkpoint"]

#: What is fetched of a Hub repository: the config, the safetensors weights (one file or
#: shards and their index), the tokenizer, its config (chat template, special tokens),
#: a separate chat template file, and the generation config.
HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def _import_hub(repo_id: str) -> Any:
    try:
        return importlib.import_module("huggingface_hub")
    except ImportError as exc:
        raise ImportError(
            f"there is no folder {repo_id!r}; reading it as a Hugging Face Hub id needs the "
            "'huggingface_hub' package: pip install 'manyheads[hub]' (or pip install "
            f"huggingface_hub). Or download the folder first: hf download {repo_id} "
            f"--local-dir DIR, and give DIR instead") from exc


def resolve_checkpoint(path: str | os.PathLike[str], revision: str | None = None) -> str:
    """The checkpoint folder of ``path``: the folder itself when it exists, else the
    Hub repository ``org/name``'s snapshot in the Hugging Face cache (downloaded there
    if it is not yet).

    ``revision`` (a branch, tag or commit hash; default ``main``) applies to Hub ids.
    FileNotFoundError for a missing folder that is no ``org/name``; ImportError without
    ``huggingface_hub``; OSError when the repository is neither cached nor reachable.
    """
    folder = os.fspath(path)
    if os.path.isdir(folder) or not _HUB_ID.fullmatch(folder):
        if revision is not None and not os.path.isdir(folder):
            raise FileNotFoundError(f"no checkpoint folder at {folder!r} (and it is no "
                                    "Hub id org/name for the revision to apply to)")
        return folder
    hub = _import_hub(folder)
    try:
        local: str = hub.snapshot_download(folder, revision=revision, allow_patterns=HUB_FILES,
                                           local_files_only=True)
        return local
    except OSError:  # not (or not completely) in the cache
        pass
    try:
        fetched: str = hub.snapshot_download(folder, revision=revision,
                                             allow_patterns=HUB_FILES)
    except OSError as exc:
        raise OSError(f"no checkpoint folder at {folder!r}, and the Hugging Face Hub "
                      f"repository {folder!r}"
                      f"{'' if revision is None else f' (revision {revision!r})'} is neither "
                      f"in the local cache nor downloadable: {exc}") from exc
    return fetched
