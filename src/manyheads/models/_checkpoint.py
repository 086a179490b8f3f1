"""Reading a checkpoint folder: ``config.json`` and ``*.safetensors`` (one file or shards).

Nothing here knows an architecture.  :class:`Checkpoint` reads the safetensors
format itself (a JSON header, then each tensor's bytes): float32 arrays by tensor
name, and projection weights in the precision asked for, read a slice of rows at a
time through the file (not a memory map, whose pages would stay resident); bfloat16
tensors need ``ml_dtypes`` (imported only when such a tensor is met) because
NumPy has no bfloat16 of its own.  The optional packages are imported lazily,
so ``import manyheads`` never needs them; a missing one is an ImportError that
names the ``models`` extra.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Callable

import numpy as np

from .. import _formats, weights
from ..weights import Int8Weight, WeightArena, convert_weight, join_columns

__all__ = ["TensorSource", "Checkpoint", "ArrayTensors", "read_config", "config_int", "config_float",
           "require_package", "WEIGHT_DTYPES"]

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


WEIGHT_DTYPES = weights.WEIGHT_DTYPES + ("auto",)  # and "auto": the tensor's own
# bytes of a weight read, converted and placed at a time (whole rows, at least 16): the
# conversion's temporaries stay small, and so does what the allocator keeps of them
_READ_BYTES = 1 << 18
# safetensors dtype codes of float tensors -> NumPy dtypes (and those ml_dtypes provides)
_NUMPY_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}
_ML_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
# bytes per element of every safetensors dtype code, to check each entry's byte range
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
               "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1,
               "BOOL": 1}


# MXFP4 (OCP microscaling): 4-bit e2m1 codes (sign, two exponent bits, one mantissa bit)
# and one power of two 2^(e - 127) a block of 32 values, as gpt-oss stores its experts
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
# each byte's two values, the low nibble's first (one lookup a byte: 3x less time than
# a lookup a nibble and interleaving them)
_FP4_PAIRS = np.stack([FP4_VALUES[np.arange(256) & 0x0F], FP4_VALUES[np.arange(256) >> 4]],
                      axis=1)


def mxfp4_values(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 rows as float32: ``blocks`` (..., G, 16) uint8, two codes a byte (the low
    nibble first), ``scales`` (..., G) uint8 exponents; the result is (..., G * 32)."""
    out: np.ndarray = _FP4_PAIRS[blocks].reshape(blocks.shape[:-1] + (32,))
    np.ldexp(out, scales.astype(np.int32)[..., None] - 127, out=out)
    return out.reshape(blocks.shape[:-2] + (-1,))


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class TensorSource:
    """Named weights: norms, biases and positions as float32 arrays (:meth:`get`), and
    projections and embeddings stored as ``weight_dtype`` says (:meth:`linear`)."""

    origin = "weights"
    # storage of projections: float32, bfloat16, float16, int8 (per output column
    # scales), or auto (the tensor's own float precision)
    weight_dtype = "float32"
    # where projections are placed (see WeightArena); None: arrays of their own
    arena: WeightArena | None = None

    def __contains__(self, name: object) -> bool:
        raise NotImplementedError

    def _read(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def _shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._read(name).shape)

    def _rows(self, name: str, start: int, stop: int,
              buf: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, stop) of tensor ``name`` in its stored float dtype (read into the
        start of ``buf``, when given and the rows are read from a file)."""
        return self._read(name)[start:stop]

    def _byte_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a uint8 tensor (MXFP4's blocks and scales)."""
        return np.asarray(self._read(name)[start:stop]).astype(np.uint8)

    def _check_shape(self, name: str, want: tuple[int, ...]) -> None:
        if name not in self:
            raise ValueError(f"{self.origin} has no tensor {name!r}")
        if self._shape(name) != want:
            raise ValueError(f"tensor {name!r} has shape {self._shape(name)}, the config "
                             f"implies {want}")

    def experts(self, name: str, n: int, d_in: int, d_out: int,
                columns: np.ndarray | None = None) -> list[Any]:
        """The n weights for ``x @ W``, each (d_in, d_out), of stacked experts, stored as
        :attr:`weight_dtype` (``auto``: the tensor's own precision; bfloat16 for MXFP4,
        which holds its values exactly), one expert read at a time.  The tensor is
        ``name`` (n, d_in, d_out) of floats, or MXFP4: ``name_blocks`` (n, d_out,
        d_in / 32, 16) and ``name_scales`` (n, d_out, d_in / 32) (:func:`mxfp4_values`).
        ``columns`` reorders each expert's columns."""
        blocks, scales = name + "_blocks", name + "_scales"
        mx = name not in self and blocks in self
        if mx:
            if d_in % 32:
                raise ValueError(f"MXFP4 tensor {blocks!r}: {d_in} inputs are not whole "
                                 "blocks of 32")
            self._check_shape(blocks, (n, d_out, d_in // 32, 16))
            self._check_shape(scales, (n, d_out, d_in // 32))
        else:
            self._check_shape(name, (n, d_in, d_out))
        out = []
        for e in range(n):
            if mx:
                w = mxfp4_values(self._byte_rows(blocks, e, e + 1)[0],
                                 self._byte_rows(scales, e, e + 1)[0]).T
                own = "bfloat16"
            else:
                w = self._rows(name, e, e + 1)[0]
                own = w.dtype.name
            target = self.weight_dtype
            if target == "auto":
                target = own if own in WEIGHT_DTYPES else "float32"
            if columns is not None:
                w = w[:, columns]
            weights.check_storable(w, target, f"expert {e} of {name!r}")
            stored = convert_weight(np.ascontiguousarray(w), target)
            out.append(stored if self.arena is None else join_columns([stored], self.arena))
        return out

    def same_tensor(self, a: str, b: str) -> bool:
        """Whether tensors ``a`` and ``b`` (both present) hold the same values, read a few
        thousand rows at a time."""
        shape = self._shape(a)
        if self._shape(b) != shape:
            return False
        if not shape:
            return bool(np.array_equal(self._read(a), self._read(b)))
        first = self._rows(a, 0, min(1, shape[0]))
        rows = max(1, _READ_BYTES // max(1, first.nbytes))
        for start in range(0, shape[0], rows):
            stop = min(start + rows, shape[0])
            if not np.array_equal(self._rows(a, start, stop), self._rows(b, start, stop)):
                return False
        return True

    def tied_head(self, tie: bool, embed: str, head: str = "lm_head.weight") -> bool:
        """Whether the LM head is the token embedding ``embed``: as transformers ties them,
        when the config says so (``tie``) and the checkpoint holds no ``head`` of other
        values (a stored head that differs is kept, as transformers keeps it)."""
        return tie and (head not in self or self.same_tensor(embed, head))

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Tensor ``name`` as a float32 array; ValueError if absent or of another shape."""
        if name not in self:
            raise ValueError(f"{self.origin} has no tensor {name!r}")
        out = self._read(name)
        if shape is not None and out.shape != shape:
            raise ValueError(f"tensor {name!r} has shape {out.shape}, the config implies {shape}")
        return np.asarray(out, dtype=np.float32)

    def linear(self, name: str, d_in: int, d_out: int, transposed: bool = True,
               part: bool = False) -> Any:
        """A weight for ``x @ W``, (d_in, d_out), stored as :attr:`weight_dtype`: a
        contiguous ndarray or an :class:`~manyheads.weights.Int8Weight`.  The tensor is
        a PyTorch ``nn.Linear`` weight (d_out, d_in), or with ``transposed`` False
        already (d_in, d_out) (GPT-2's Conv1D).  It is read a few thousand rows at a
        time, converted and placed (in :attr:`arena` unless it is a ``part`` of a
        weight joined later), so loading holds little beyond the result."""
        if name not in self:
            raise ValueError(f"{self.origin} has no tensor {name!r}")
        stored = self._shape(name)
        want = (d_out, d_in) if transposed else (d_in, d_out)
        if stored != want:
            raise ValueError(f"tensor {name!r} has shape {stored}, the config implies {want}")
        first = self._rows(name, 0, min(1, want[0]))
        target = self.weight_dtype
        if target == "auto":
            target = first.dtype.name if first.dtype.name in WEIGHT_DTYPES else "float32"
        if not transposed:  # rows are input features: whole columns need the whole tensor
            return convert_weight(self._rows(name, 0, d_in), target)
        arena = None if part else self.arena
        if target == "int8":  # per output column scales: a column is a row of the tensor
            blocked = weights._blocked_empty(d_in, d_out, arena)  # in the kernels' order
            scales = np.empty((1, d_out), np.float32)
        else:
            dtype = _formats.FORMATS[target].dtype
            out = np.empty((d_in, d_out), dtype) if arena is None else \
                arena.empty((d_in, d_out), dtype)
        # whole blocks of the int8 order's columns at a time, read into one buffer
        rows = max(16, _READ_BYTES // max(1, d_in * first.dtype.itemsize)) // 16 * 16
        buf = np.empty((min(rows, d_out), d_in), first.dtype)
        for start in range(0, d_out, rows):
            cols = slice(start, min(start + rows, d_out))
            block = self._rows(name, cols.start, cols.stop, buf).T
            weights.check_storable(block, target, f"tensor {name!r}")
            if target == "int8":
                values, scales[:, cols] = weights._quantized(block, max(d_in, 1))
                weights._place_columns(blocked, start, values)
            else:
                out[:, cols] = block
        if target == "int8":
            return Int8Weight._from_blocked(blocked, (d_in, d_out), scales, max(d_in, 1))
        return out


class ArrayTensors(TensorSource):
    """Weights already in memory: a mapping of names to arrays (e.g. a state dict)."""

    origin = "the state dict"

    def __init__(self, arrays: dict[str, np.ndarray], weight_dtype: str = "float32") -> None:
        self.arrays = arrays
        self.weight_dtype = weight_dtype

    def __contains__(self, name: object) -> bool:
        return name in self.arrays

    def _read(self, name: str) -> np.ndarray:
        arr = np.asarray(self.arrays[name])
        return arr if arr.dtype.kind == "f" else arr.astype(np.float32)


class Checkpoint(TensorSource):
    """The tensors of a checkpoint folder, read on demand (see :class:`TensorSource`).

    Finds ``model.safetensors``, or the shards listed by
    ``model.safetensors.index.json``, or else every ``*.safetensors`` file of
    the folder.  Use as a context manager (the files are closed at exit).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.folder = os.fspath(path)
        self.origin = f"checkpoint {self.folder!r}"
        self._files: dict[str, Any] = {}
        self._tensors: dict[str, tuple[str, str, tuple[int, ...], int]] = {}
        try:
            for name in self._shard_names():
                self._open_shard(name)
        except BaseException:
            self.close()
            raise
        if not self._tensors:
            raise FileNotFoundError(f"no tensors in the safetensors files of {self.folder!r}")

    def _open_shard(self, name: str) -> None:
        """Read the header of shard ``name`` (an 8-byte little-endian length, then a JSON
        object of tensor name -> dtype, shape and byte range after the header) and keep
        the file open for reads of tensors and their rows.  Reads go through the file,
        not a memory map, so loading holds only the tensors in their final format."""
        f = open(os.path.join(self.folder, name), "rb")
        self._files[name] = f
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if not 2 <= n <= size - 8:
            raise ValueError(f"malformed safetensors file {name!r} in {self.folder!r}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"malformed safetensors header in {name!r}: {exc}") from None
        if not isinstance(header, dict):
            raise ValueError(f"malformed safetensors header in {name!r}")
        for key, info in header.items():
            if key == "__metadata__":
                continue
            try:
                dtype, dims, offsets = info["dtype"], info["shape"], info["data_offsets"]
            except (KeyError, TypeError):
                raise ValueError(f"malformed safetensors entry {key!r} in {name!r}") from None
            if not (isinstance(dtype, str) and isinstance(dims, list)
                    and all(_is_count(d) for d in dims) and isinstance(offsets, list)
                    and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
                raise ValueError(f"malformed safetensors entry {key!r} in {name!r}")
            begin, end = offsets
            if begin > end or 8 + n + end > size:
                raise ValueError(f"tensor {key!r} lies outside the file {name!r}")
            width = _ITEM_BYTES.get(dtype)
            if width is not None and end - begin != math.prod(dims) * width:
                raise ValueError(f"malformed safetensors entry {key!r} in {name!r}: "
                                 f"{end - begin} bytes for shape {dims} of {dtype}")
            self._tensors[key] = (name, dtype, tuple(dims), 8 + n + begin)

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
        files = os.listdir(self.folder)
        names = sorted(n for n in files if n.endswith(".safetensors"))
        if not names:
            torch_files = sorted(n for n in files if n.endswith((".bin", ".pt", ".pth")))
            raise FileNotFoundError(
                f"{self.folder!r} has no *.safetensors file" + (
                    f": its weights are PyTorch files ({', '.join(torch_files)}), which this "
                    "loader does not read (safetensors only)" if torch_files else
                    " (no weights: this loader reads model.safetensors, or the shards of "
                    f"{INDEX_FILE})"))
        return names

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def keys(self) -> list[str]:
        return sorted(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def _dtype(self, name: str) -> np.dtype:
        code = self._tensors[name][1]
        if code in _NUMPY_DTYPES:
            return np.dtype(_NUMPY_DTYPES[code])
        if code in _ML_DTYPES:
            # NumPy alone has no such dtype; ml_dtypes provides it
            ml = require_package("ml_dtypes", "reading a bfloat16 or float8 checkpoint")
            found: np.dtype = np.dtype(getattr(ml, _ML_DTYPES[code]))
            return found
        raise ValueError(f"tensor {name!r} has dtype {code}; expected floating point "
                         "weights (quantised checkpoints are not supported)")

    def _shape(self, name: str) -> tuple[int, ...]:
        return self._tensors[name][2]

    def _byte_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        if self._tensors[name][1] != "U8":
            raise ValueError(f"tensor {name!r} has dtype {self._tensors[name][1]}; MXFP4 "
                             "blocks and scales are U8")
        return self._read_rows(name, start, stop, np.dtype(np.uint8))

    def _read(self, name: str) -> np.ndarray:
        shape = self._shape(name)
        return self._rows(name, 0, shape[0] if shape else 1).reshape(shape)

    def _rows(self, name: str, start: int, stop: int,
              buf: np.ndarray | None = None) -> np.ndarray:
        return self._read_rows(name, start, stop, self._dtype(name), buf)

    def _read_rows(self, name: str, start: int, stop: int, dtype: np.dtype,
                   buf: np.ndarray | None = None) -> np.ndarray:
        shard, _, shape, offset = self._tensors[name]
        row = int(np.prod(shape[1:], dtype=np.int64)) if shape else 1
        n = max(stop - start, 0)
        if buf is not None and buf.dtype == dtype and buf.shape[1:] == tuple(shape[1:]) \
                and buf.shape[0] >= n and buf.flags.c_contiguous:
            out = buf[:n]
        else:
            out = np.empty((n,) + tuple(shape[1:]), dtype)
        f = self._files[shard]
        f.seek(offset + start * row * dtype.itemsize)
        if f.readinto(out.reshape(-1).view(np.uint8)) != out.nbytes:
            raise ValueError(f"tensor {name!r} is cut short in {shard!r}")
        return out
