"""Reading a checkpoint folder: ``config.json`` and ``*.safetensors`` (one file or shards).

Nothing here knows an architecture.  :class:`Checkpoint` opens every shard with
safetensors' NumPy API and hands out float32 arrays by tensor name; bfloat16
tensors need ``ml_dtypes`` (imported only when such a tensor is met) because
NumPy has no bfloat16 of its own.  The optional packages are imported lazily,
so ``import manyheads`` never needs them; a missing one is an ImportError that
names the ``models`` extra.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable

import numpy as np

__all__ = ["TensorSource", "Checkpoint", "ArrayTensors", "read_config", "config_int", "config_float",
           "require_package"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def require_package(name: str, what: str) -> Any:
    """Import ``name`` or raise an ImportError that says how to install it."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"{what} needs the '{name}' package: pip install 'manyheads[models]'"
                          ) from exc


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint folder.

    FileNotFoundError if the folder or its config is missing; ValueError if the
    file is not a JSON object or has no ``model_type``.
    """
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no checkpoint folder at {folder!r}")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"{folder!r} has no config.json")
    cfg = read_json(folder, "config.json")
    if not isinstance(cfg.get("model_type"), str):
        raise ValueError(f"malformed config.json in {folder!r}: no 'model_type' string")
    return cfg


def read_json(folder: str, name: str) -> dict[str, Any]:
    """The JSON object in file ``name`` of ``folder`` ({} if there is no such file);
    ValueError if it is not a JSON object."""
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed {name} in {folder!r}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"malformed {name} in {folder!r}: expected a JSON object, "
                         f"got {type(data).__name__}")
    return data


def _config_value(cfg: dict[str, Any], names: tuple[str, ...], kind: str,
                  check: Callable[[Any], bool], default: Any) -> Any:
    for name in names:
        if name in cfg and cfg[name] is not None:
            value = cfg[name]
            if not check(value):
                raise ValueError(f"malformed config.json: {name!r} must be {kind}, "
                                 f"got {value!r}")
            return value
    if default is None:
        raise ValueError(f"malformed config.json: missing {' or '.join(map(repr, names))}")
    return default


def config_int(cfg: dict[str, Any], *names: str, default: int | None = None,
               minimum: int = 1) -> int:
    """The first of ``names`` present in ``cfg`` as an int >= ``minimum`` (ValueError otherwise)."""
    return int(_config_value(
        cfg, names, f"an integer >= {minimum}",
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= minimum, default))


def config_float(cfg: dict[str, Any], *names: str, default: float | None = None) -> float:
    """The first of ``names`` present in ``cfg`` as a positive finite float."""
    return float(_config_value(
        cfg, names, "a positive number",
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
        and bool(np.isfinite(v)) and v > 0, default))


class TensorSource:
    """Named weights handed out as float32 arrays (what the architectures read from)."""

    origin = "weights"

    def __contains__(self, name: object) -> bool:
        raise NotImplementedError

    def _read(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Tensor ``name`` as a float32 array; ValueError if absent or of another shape."""
        if name not in self:
            raise ValueError(f"{self.origin} has no tensor {name!r}")
        out = self._read(name)
        if shape is not None and out.shape != shape:
            raise ValueError(f"tensor {name!r} has shape {out.shape}, the config implies {shape}")
        return out

    def linear(self, name: str, d_in: int, d_out: int) -> np.ndarray:
        """A PyTorch ``nn.Linear`` weight (d_out, d_in) as a contiguous (d_in, d_out) array."""
        return np.ascontiguousarray(self.get(name, (d_out, d_in)).T)


class ArrayTensors(TensorSource):
    """Weights already in memory: a mapping of names to arrays (e.g. a state dict)."""

    origin = "the state dict"

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays

    def __contains__(self, name: object) -> bool:
        return name in self.arrays

    def _read(self, name: str) -> np.ndarray:
        return np.asarray(self.arrays[name], dtype=np.float32)


class Checkpoint(TensorSource):
    """The tensors of a checkpoint folder, read on demand as float32 NumPy arrays.

    Finds ``model.safetensors``, or the shards listed by
    ``model.safetensors.index.json``, or else every ``*.safetensors`` file of
    the folder.  Use as a context manager (the files are closed at exit).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.folder = os.fspath(path)
        self.origin = f"checkpoint {self.folder!r}"
        st = require_package("safetensors", "reading a checkpoint")
        self._files: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        for name in self._shard_names():
            handle = st.safe_open(os.path.join(self.folder, name), framework="np")
            self._files[name] = handle
            for key in handle.keys():
                self._where[key] = name
        if not self._where:
            raise FileNotFoundError(f"no tensors in the safetensors files of {self.folder!r}")

    def _shard_names(self) -> list[str]:
        index = os.path.join(self.folder, INDEX_FILE)
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                names = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"malformed {INDEX_FILE} in {self.folder!r}: {exc!r}") from None
            missing = [n for n in names if not os.path.isfile(os.path.join(self.folder, n))]
            if missing:
                raise FileNotFoundError(f"{self.folder!r}: shards listed in {INDEX_FILE} are "
                                        f"missing: {', '.join(missing)}")
            return names
        if os.path.isfile(os.path.join(self.folder, SINGLE_FILE)):
            return [SINGLE_FILE]
        names = sorted(n for n in os.listdir(self.folder) if n.endswith(".safetensors"))
        if not names:
            raise FileNotFoundError(f"{self.folder!r} has no *.safetensors file (this loader "
                                    "reads safetensors only, not PyTorch .bin files)")
        return names

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for handle in self._files.values():
            exit_ = getattr(handle, "__exit__", None)
            if exit_ is not None:
                exit_(None, None, None)
        self._files.clear()

    def keys(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def _read(self, name: str) -> np.ndarray:
        handle = self._files[self._where[name]]
        if handle.get_slice(name).get_dtype() in ("BF16", "F8_E4M3", "F8_E5M2"):
            # NumPy alone has no such dtype; ml_dtypes registers it for safetensors
            require_package("ml_dtypes", "reading a bfloat16 or float8 checkpoint")
        arr = handle.get_tensor(name)
        if arr.dtype.kind in "iub":
            raise ValueError(f"tensor {name!r} has dtype {arr.dtype}; expected floating point "
                             "weights (quantised checkpoints are not supported)")
        return np.asarray(arr, dtype=np.float32)
