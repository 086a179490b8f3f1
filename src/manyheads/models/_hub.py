"""Hugging Face Hub ids (``org/name``) as checkpoint folders.

A folder that exists always wins.  Otherwise an ``org/name`` is looked up with
``huggingface_hub`` (an optional package, imported only here and only then): first in
the local Hugging Face cache (``HF_HUB_CACHE``, no network), else downloaded into it,
only the files :func:`~manyheads.models.from_pretrained` and the command line read
(:data:`HUB_FILES`).  A cached snapshot without the weights (what reading only the
config or the tokenizer with transformers leaves) counts as not cached.
``HF_HUB_OFFLINE=1`` keeps it to the cache.
"""
from __future__ import annotations

import importlib
import json
import os
import re
from typing import Any

from ._checkpoint import INDEX_FILE

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


def _has_weights(folder: str) -> bool:
    """Whether ``folder`` holds safetensors weights: every shard its index lists, or
    else some ``*.safetensors`` file (a malformed index counts as weights, for the
    loader to report)."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                shards = set(json.load(f)["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return True
        return all(isinstance(n, str) and os.path.isfile(os.path.join(folder, n))
                   for n in shards)
    # (a cached file is a link to a blob: isfile follows it, a broken one is no file)
    return any(n.endswith(".safetensors") and os.path.isfile(os.path.join(folder, n))
               for n in os.listdir(folder))


def resolve_checkpoint(path: str | os.PathLike[str], revision: str | None = None) -> str:
    """The checkpoint folder of ``path``: the folder itself when it exists, else the
    Hub repository ``org/name``'s snapshot in the Hugging Face cache (downloaded there
    if it is not yet).

    ``revision`` (a branch, tag or commit hash; default ``main``) applies to Hub ids.
    FileNotFoundError for a missing folder that is no ``org/name``; ImportError without
    ``huggingface_hub``; OSError when the repository is neither cached nor reachable,
    or when neither the cache nor the download gives safetensors weights.
    """
    folder = os.fspath(path)
    if os.path.isdir(folder) or not _HUB_ID.fullmatch(folder):
        if revision is not None and not os.path.isdir(folder):
            raise FileNotFoundError(f"no checkpoint folder at {folder!r} (and it is no "
                                    "Hub id org/name for the revision to apply to)")
        return folder
    hub = _import_hub(folder)
    repo = f"{folder!r}{'' if revision is None else f' (revision {revision!r})'}"
    try:
        local: str = hub.snapshot_download(folder, revision=revision, allow_patterns=HUB_FILES,
                                           local_files_only=True)
        if _has_weights(local):
            return local
    except OSError:  # not in the cache
        pass
    try:
        fetched: str = hub.snapshot_download(folder, revision=revision,
                                             allow_patterns=HUB_FILES)
    except OSError as exc:
        raise OSError(f"no checkpoint folder at {folder!r}, and the Hugging Face Hub "
                      f"repository {repo} is neither in the local cache nor downloadable: "
                      f"{exc}") from exc
    if not _has_weights(fetched):
        # offline (or without a network), huggingface_hub gives the cached snapshot back
        held = ", ".join(sorted(os.listdir(fetched))) or "nothing"
        raise OSError(f"the Hugging Face Hub repository {repo} gave no safetensors weights: "
                      f"its snapshot {fetched!r} holds {held}. Either they could not be "
                      "downloaded (HF_HUB_OFFLINE=1, or no network: the cache holds only "
                      f"what was read before; fetch them with hf download {folder}), or "
                      "the repository has no *.safetensors files (this loader does not read "
                      "PyTorch .bin files)")
    return fetched
