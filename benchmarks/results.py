"""What the benchmark measured, as typed records, and their JSON form.

One dataclass per kind of row or section.  Times carry their unit in the
field name (``_ms``, ``_us``, ``_s``); a contender that was not measured
(not installed, not selected, or refused by the check before timing) is
None.  ``to_json`` writes a result with ``dataclasses.asdict``; ``from_json``
reads it back into the same classes, so a report can be made again from a
saved ``results.json``.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any

# ----------------------------------------------------------------------------- attention


@dataclass
class Checks:
    """What was checked before timing: each contender's largest |x − manyheads| on the
    same inputs, why a contender was not timed, and what each peer ran."""

    max_abs_diff: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)


@dataclass
class PrefillRow:
    """Causal attention over (B=1, H=12, T, D) inputs: milliseconds per call (medians)."""

    T: int
    D: int
    dtype: str
    threads: int
    manyheads_ms: float
    flops: float  # the useful work, 2·B·H·T²·D
    sgemm_gflops: float  # the SGEMM rate measured right before this row
    torch_ms: float | None = None
    oracle_ms: float | None = None
    peers_ms: dict[str, float | None] = field(default_factory=dict)  # ONNX Runtime, OpenVINO
    checks: Checks = field(default_factory=Checks)


@dataclass
class ThreadScaling:
    """The same call on one thread and on every thread, interleaved (ms)."""

    T: int
    threads: int
    one_thread_ms: float
    all_threads_ms: float


@dataclass
class PeakMemory:
    """Peak RSS growth of one call beyond its inputs and output (None: not measurable here)."""

    T: int
    extra_mib: float | None


@dataclass
class ModuleResult:
    """Whole-module time at the book's shape (B=8, T=1024, d=768, 12 heads), ms."""

    fused_ms: float
    stacked_ms: float
    oracle_ms: float
    torch_ms: float | None = None


@dataclass
class Bandwidth:
    """Memory read rate of NumPy reductions over 1 GiB, GB/s."""

    max_gbs: float
    sum_gbs: float

    @property
    def best(self) -> float:
        return max(self.max_gbs, self.sum_gbs)


@dataclass
class DecodeRow:
    """One query against L keys (B=1, H=12, D=64): microseconds per call."""

    L: int
    bytes_f32: int  # the float32 keys and values read
    float32_us: float
    float16_us: float  # float32 query, float16 keys and values
    torch_us: float | None = None
    peers_us: dict[str, float] = field(default_factory=dict)  # the peers that were timed
    checks: Checks = field(default_factory=Checks)


@dataclass
class CacheFormatRow:
    """A fused layer's decode step through a cache of L tokens in each storage format."""

    L: int
    bytes_per_token: dict[str, float]  # format -> the cache's bytes per token
    step_us: dict[str, float]  # format -> microseconds per step
    skipped: list[str] = field(default_factory=list)  # formats not run (ml_dtypes missing)
    torch_sdpa_f32_us: float | None = None
    # format -> microseconds per step with the last-level cache evicted before each call
    # (as in a deep model, where the other layers' caches pass through it between steps)
    cold_step_us: dict[str, float] = field(default_factory=dict)
    # format -> microseconds per step of layers stepped in turn, each with its own cache
    # (enough of them that each finds its cache out of the last-level cache), as in a deep
    # model's decode: the cache cold, the code path warm
    deep_step_us: dict[str, float] = field(default_factory=dict)


@dataclass
class GroupedQueryDecode:
    """Hq query heads on Hkv kv heads against the kv heads repeated to Hq (µs)."""

    L: int
    heads: int
    kv_heads: int
    max_abs_diff: float
    grouped_us: float
    repeated_us: float


@dataclass
class HalfPrefill:
    """Causal prefill with float32, float16 and bfloat16 inputs (ms)."""

    T: int
    ms: dict[str, float]  # input type -> milliseconds per call
    avx512_bf16: bool | None  # does the CPU list AVX512-BF16 (None: cannot tell)
    path: str  # the kernel path that ran


# ----------------------------------------------------------------------------- inference


@dataclass
class LayerShape:
    """The layer decode step: model width, heads, tokens held by the KV cache."""

    d: int = 768
    heads: int = 12
    cached: int = 1024


@dataclass
class GPT2Shape:
    """The GPT-2-small-shaped model and the generation that is timed."""

    n_layer: int = 12
    n_embd: int = 768
    n_head: int = 12
    vocab_size: int = 50257
    n_positions: int = 1024
    prompt: int = 200
    new_tokens: int = 32


@dataclass
class TinyShape:
    """The tiny SDPA call: heads, queries, keys, head size."""

    heads: int = 12
    queries: int = 1
    keys: int = 16
    D: int = 64


@dataclass
class TinySDPA:
    manyheads_us: float
    torch_us: float | None = None
    checks: Checks = field(default_factory=Checks)


@dataclass
class TimedBlock:
    """One of the separate measurements a row's figure is the mean of (µs)."""

    manyheads_us: float
    torch_us: float | None = None


@dataclass
class LayerStep:
    """One fused layer's decode step and torch's layer written the same way (µs)."""

    manyheads_us: float
    torch_in_process: bool  # torch imported in the process that measured this
    torch_us: float | None = None
    checks: Checks = field(default_factory=Checks)
    blocks: list[TimedBlock] = field(default_factory=list)  # when measured more than once


@dataclass
class GenerationRun:
    """Greedy generation after the prompt: whole-call seconds (medians) and the tokens."""

    loader: str
    rounds: int
    torch_in_process: bool
    manyheads_s: float
    manyheads_tokens_per_s: float
    manyheads_tokens: list[int]
    hf_s: float | None = None
    hf_tokens_per_s: float | None = None
    hf_tokens: list[int] | None = None
    identical: bool | None = None  # Hugging Face's tokens against manyheads'


@dataclass
class ChildRun:
    """What one subprocess of the inference section measured, or why it failed."""

    mode: str
    error: str | None = None
    env: dict[str, str | None] = field(default_factory=dict)
    torch_in_process: bool | None = None
    layer: LayerStep | None = None
    generation: GenerationRun | None = None
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class ChildStatus:
    """How a subprocess went, kept with the results."""

    error: str | None = None
    torch_in_process: bool | None = None
    env: dict[str, str | None] = field(default_factory=dict)


@dataclass
class InferenceResult:
    """The inference section.  Rows are keyed by process: ``main`` (this process),
    ``openblas1`` and ``no_torch`` (the subprocesses); a missing key was not measured."""

    threads: int
    generation_rounds: int
    layer_shape: LayerShape
    gpt2_shape: GPT2Shape
    tiny_shape: TinyShape
    load_start: float | None = None
    load_end: float | None = None
    tiny_sdpa: TinySDPA | None = None
    layer_decode: dict[str, LayerStep] = field(default_factory=dict)
    generation: dict[str, GenerationRun] = field(default_factory=dict)
    generation_note: str | None = None  # why generation was not measured
    transformers: str | None = None  # its version, when Hugging Face ran
    children: dict[str, ChildStatus] = field(default_factory=dict)  # by subprocess mode


# ----------------------------------------------------------------------------- Hugging Face models


@dataclass
class HFModelRow:
    """One whole-model call, manyheads' backend against transformers' (seconds, medians):
    the forward, and the time inside the attention function during it."""

    model: str
    phase: str  # "prefill" (a forward over `tokens` tokens) or "decode" (one token)
    tokens: int  # prefill: the tokens in the forward; decode: the context
    baseline: str  # "sdpa" or "eager"
    manyheads_s: float
    baseline_s: float
    manyheads_attention_s: float
    baseline_attention_s: float
    max_abs_diff: float  # the last position's logits, manyheads against the baseline


@dataclass
class HFModelsResult:
    """The Hugging Face models section (no rows and a note when it could not run)."""

    threads: int
    transformers: str | None = None
    note: str | None = None
    rows: list[HFModelRow] = field(default_factory=list)


# ----------------------------------------------------------------------------- the whole run


@dataclass
class Claim:
    """One claim a user can check, with its measured ratio (None: not measured)."""

    key: str
    text: str
    threshold: float
    ratio: float | None
    met: bool | None
    identical: bool | None = None  # generation only: were the tokens identical


@dataclass
class BenchResult:
    """One run of the benchmark.  A section that did not run leaves its fields None."""

    config: dict[str, Any]  # manyheads.show_config(mode="dicts")
    threads: int
    cpu_count: int | None
    sections: list[str]
    peers: dict[str, str | None]  # every selected peer's version (None: not installed)
    numpy_blas: dict[str, str]
    load_start: float | None = None
    load_end: float | None = None
    sgemm_gflops: float | None = None
    prefill: list[PrefillRow] | None = None
    thread_scaling: ThreadScaling | None = None
    peak_memory: PeakMemory | None = None
    module: ModuleResult | None = None
    bandwidth: Bandwidth | None = None
    decode: list[DecodeRow] | None = None
    cache_formats: list[CacheFormatRow] | None = None
    gqa: GroupedQueryDecode | None = None
    half_prefill: HalfPrefill | None = None
    inference: InferenceResult | None = None
    hf_models: HFModelsResult | None = None
    claims: list[Claim] = field(default_factory=list)


# ----------------------------------------------------------------------------- JSON


def _plain(obj: object) -> object:
    """JSON for what json cannot write itself (a NumPy scalar that slipped through)."""
    item = getattr(obj, "item", None)
    return item() if callable(item) else str(obj)


def to_json(result: Any) -> str:
    """The JSON text of a result dataclass (indented)."""
    return json.dumps(dataclasses.asdict(result), indent=2, default=_plain)


T = typing.TypeVar("T")


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """A ``cls`` dataclass from the dict ``dataclasses.asdict`` made of one (keys it does
    not know are ignored; missing ones take their defaults)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    kwargs = {f.name: _build(hints[f.name], data[f.name])
              for f in dataclasses.fields(cls) if f.name in data}
    return cls(**kwargs)


def _build(tp: Any, value: Any) -> Any:
    """``value`` (from JSON) as type ``tp``: dataclasses, optionals, lists and dicts of them."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _build(inner[0], value) if len(inner) == 1 else value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_dict(tp, value)
    if origin is list:
        (item,) = typing.get_args(tp)
        return [_build(item, v) for v in value]
    if origin is dict:
        _, item = typing.get_args(tp)
        return {k: _build(item, v) for k, v in value.items()}
    if tp is float:
        return float(value)
    return value


def from_json(text: str) -> BenchResult:
    """A :class:`BenchResult` from the text ``to_json`` wrote."""
    return from_dict(BenchResult, json.loads(text))
