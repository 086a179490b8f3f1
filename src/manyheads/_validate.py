"""Argument checks shared by every public entry point.

One rule for which exception a mistake raises: a value of the wrong **type**
(a float where an int is needed, a string where a number is needed, an
unsupported dtype) raises ``TypeError``; a value of the right type that is out
of range or has the wrong shape raises ``ValueError``.  Every message names
the argument and says what was expected.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
FLOAT_DTYPES_TEXT = "float32 or float64"


def check_int(value: Any, name: str, minimum: int | None = None) -> int:
    """``value`` as an int; TypeError unless it is an integer (bools are not), ValueError below ``minimum``."""
    if type(value) is not int and (isinstance(value, bool)
                                   or not isinstance(value, numbers.Integral)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    result = int(value)
    if minimum is not None and result < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {result}")
    return result


def check_optional_int(value: Any, name: str, minimum: int | None = None) -> int | None:
    return None if value is None else check_int(value, name, minimum)


def check_real(value: Any, name: str, *, low: float | None = None, high: float | None = None,
               finite: bool = True) -> float:
    """``value`` as a float; TypeError unless it is a real number, ValueError outside [low, high]."""
    if type(value) is not float and (isinstance(value, bool)
                                     or not isinstance(value, numbers.Real)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    result = float(value)
    if finite and not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {result}")
    if (low is not None and result < low) or (high is not None and result > high):
        raise ValueError(f"{name} must be in [{low}, {high}], got {result}")
    return result


def check_optional_real(value: Any, name: str) -> float | None:
    return None if value is None else check_real(value, name)


def check_factor(value: float | None, name: str, dtype: Any) -> float | None:
    """A checked scale, soft cap or ALiBi slope (None passes) within the range the
    kernels take for attention in ``dtype``: they multiply it by log2(e) in the
    scores' type, so float32 attention takes magnitudes up to about 2.36e38."""
    limit = FACTOR_MAX[np.dtype(dtype) == np.float64]
    if value is not None and abs(value) > limit:
        kind = "float64" if np.dtype(dtype) == np.float64 else "float32"
        raise ValueError(f"{name} must be at most {limit:.4g} in magnitude for {kind} "
                         f"attention (its scores are computed in {kind}), got {value:g}")
    return value


#: the largest magnitude check_factor lets through, for float32 (False) and float64 (True)
FACTOR_MAX = {False: float(np.finfo(np.float32).max) / math.log2(math.e),
              True: float(np.finfo(np.float64).max) / math.log2(math.e)}


def check_bool(value: Any, name: str) -> bool:
    if value is False or value is True:  # the usual case, checked first (hot path)
        return value
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def check_dropout(value: Any, name: str = "dropout_p") -> float:
    """A dropout probability in [0, 1]."""
    if type(value) is float and 0.0 <= value <= 1.0:  # the usual case (hot path)
        return value
    return check_real(value, name, low=0.0, high=1.0)


def seed_value(seed: Any, name: str = "seed") -> int:
    """A 64-bit dropout seed from None (fresh entropy), an int or a numpy Generator."""
    if seed is None:
        return int(np.random.default_rng().integers(0, 2**63))
    if isinstance(seed, np.random.Generator):
        return int(seed.integers(0, 2**63))
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{name} must be None, an int or a numpy Generator, "
                        f"got {type(seed).__name__}")
    return int(seed) & (2**64 - 1)


def rng_from_seed(seed: Any, name: str = "seed") -> np.random.Generator:
    """A Generator: ``seed`` itself if it is one, else ``default_rng(seed)`` (None or an int)."""
    if isinstance(seed, np.random.Generator):
        return seed
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise TypeError(f"{name} must be None, an int or a numpy Generator, "
                        f"got {type(seed).__name__}")
    return np.random.default_rng(None if seed is None else int(seed))


def check_float_dtype(dtype: Any, name: str = "dtype") -> np.dtype:
    """float32 or float64 as a numpy dtype; TypeError for anything else."""
    try:
        dt: np.dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be {FLOAT_DTYPES_TEXT}, got {dtype!r}") from None
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be {FLOAT_DTYPES_TEXT}, got {dt}")
    return dt


ATTENTION_DTYPES_TEXT = "float32, float64, float16 or ml_dtypes.bfloat16"
_DTYPE_NAMES: dict[np.dtype, str] = {}


def dtype_name(dt: np.dtype) -> str:
    """``dt.name``, remembered: NumPy builds the name anew on every access (about a
    microsecond), and ml_dtypes' bfloat16 is recognised by it without importing ml_dtypes."""
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = str(dt.name)
    return name


def is_half(dt: np.dtype) -> bool:
    """float16 or ml_dtypes' bfloat16, in the machine's byte order."""
    return dtype_name(dt) in ("float16", "bfloat16") and dt.isnative


def check_byte_order(dt: np.dtype, name: str) -> None:
    """TypeError for a float dtype the kernels take but in the other byte order (the
    message says how to convert it)."""
    if not dt.isnative and dtype_name(dt) in ("float32", "float64", "float16", "bfloat16"):
        raise TypeError(f"{name} has dtype {dt.str}, not in the machine's byte order; "
                        f"convert it with {name}.astype({name}.dtype.newbyteorder('='))")


def as_attention_array(x: Any, name: str) -> np.ndarray:
    """``x`` as a float32/float64/float16/bfloat16 array (integer array-likes become
    float64); TypeError naming the supported dtypes otherwise."""
    if isinstance(x, np.ndarray) and (x.dtype in FLOAT_DTYPES or is_half(x.dtype)):
        return x
    if not isinstance(x, np.ndarray) and x is not None:
        try:
            arr = np.asarray(x)
        except Exception:  # pragma: no cover - depends on foreign objects
            arr = None
        if arr is not None and is_half(arr.dtype):  # a list of float16 values, a tensor
            return arr
    try:
        return as_float_array(x, name)
    except TypeError as exc:
        raise TypeError(str(exc).replace(FLOAT_DTYPES_TEXT, ATTENTION_DTYPES_TEXT)) from None


def as_float_array(x: Any, name: str) -> np.ndarray:
    """``x`` as a float32/float64 array (integer array-likes become float64); TypeError otherwise."""
    if isinstance(x, np.ndarray):
        arr = x
    else:
        if x is None:
            raise TypeError(f"{name} must be an array of {FLOAT_DTYPES_TEXT}, got None")
        try:
            arr = np.asarray(x)
        except Exception as exc:  # pragma: no cover - depends on foreign objects
            raise TypeError(f"{name} must be array-like, got {type(x).__name__}") from exc
        if arr.dtype.kind in "iu":
            arr = arr.astype(np.float64)
    if arr.dtype not in FLOAT_DTYPES:
        check_byte_order(arr.dtype, name)
        raise TypeError(f"{name} has dtype {arr.dtype}; supported dtypes are {FLOAT_DTYPES_TEXT}")
    return arr


# The score transforms and extra output of one call (see _core.attention): soft cap (or
# None), sinks (or None), ALiBi slopes (or None), and whether to return the log-sum-exp.
ScoreFeatures = tuple["float | None", "np.ndarray | None", "np.ndarray | None", bool]


def check_score_features(q: np.ndarray, softcap: Any, sinks: Any, alibi_slopes: Any,
                         return_lse: Any) -> ScoreFeatures | None:
    """The soft cap, sinks, ALiBi slopes and log-sum-exp flag of a call, checked
    against the queries q (..., Hq, L, E); None when the call uses none of them."""
    lse = check_bool(return_lse, "return_lse")
    if softcap is None and sinks is None and alibi_slopes is None and not lse:
        return None
    heads = q.shape[-3] if q.ndim >= 3 else 1
    cap = None
    if softcap is not None:
        cap = check_real(softcap, "softcap")
        if cap <= 0:
            raise ValueError(f"softcap must be positive, got {cap}")
        check_factor(cap, "softcap", q.dtype)
    sink_logits = None
    if sinks is not None:
        sink_logits = as_float_array(sinks, "sinks")
        if sink_logits.shape != (heads,):
            raise ValueError(f"sinks must have shape ({heads},): one logit per query head, "
                             f"got {sink_logits.shape}")
    slopes = None
    if alibi_slopes is not None:
        slopes = as_float_array(alibi_slopes, "alibi_slopes")
        batch = q.shape[-4] if q.ndim >= 4 else None
        if slopes.ndim not in (1, 2) or slopes.shape[-1] != heads or (
                slopes.ndim == 2 and (batch is None or slopes.shape[0] not in (1, batch))):
            want = f"({heads},)" + (f" or ({batch}, {heads})" if batch is not None else "")
            raise ValueError(f"alibi_slopes must have shape {want}: one slope per query head"
                             f"{' (and batch)' if batch is not None else ''}, "
                             f"got {slopes.shape}")
        if slopes.size:
            check_factor(float(np.abs(slopes).max()), "alibi_slopes", q.dtype)
    return cap, sink_logits, slopes, lse
