"""The benchmark's peers: PyTorch's SDPA, ONNX Runtime and OpenVINO, and the check
each one passes before it is timed.

Every peer is optional and runs on manyheads' thread count.  Its output is
compared with manyheads' on the same inputs first (``check``); a peer that
differs by more than ``CHECK_ATOL`` is reported and not timed.

ONNX Runtime and OpenVINO are built in memory for one head count and head
size, their worker threads told not to spin-wait, and fed their inputs in their
own preferred layout, prepared before any timing.  A builder returns a
:class:`PeerCall`: ``run`` is the call that is timed, ``result`` makes one call
and returns its output in manyheads' layout (B, H, L, D).

* ONNX Runtime: one ``com.microsoft`` ``GroupQueryAttention`` node (the
  contrib op its LLM exports use).  Prefill: Q, K, V as (B, T, H·D), causal.
  Decode: one new query, key and value as (B, 1, H·D) and a (B, H, L, D)
  key/value cache bound as both the past input and the present output, so the
  op appends in place, as a generation loop runs it.
* OpenVINO: opset-13 ``ScaledDotProductAttention`` with a dynamic sequence
  axis, compiled for the CPU plugin with ``f32`` inference precision (on CPUs
  with bfloat16 the plugin would otherwise compute in bfloat16).  Prefill: a
  plain causal model over (B, H, T, D); the plugin lowers it to its own
  attention subgraph.  Decode: the stateful key/value-cache form that LLM
  exports have (ReadValue → Gather by beam index → Concat → SDPA, Assign),
  which the CPU plugin fuses into its single-token attention node; the cache
  is stored as ``f32``.  That cache grows by one token per call, so the timed
  calls start a little below L keys and end a little above it.

Nothing is written to disk.  None of the peers is a dependency of manyheads;
``pip install '.[bench]'`` in a source checkout installs all three.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from benchmarks.results import Checks

#: the peers built here: benchmark name -> (importable module, label in tables)
PEERS: dict[str, tuple[str, str]] = {
    "onnxruntime": ("onnxruntime", "ONNX Runtime GQA"),
    "openvino": ("openvino", "OpenVINO SDPA"),
}
#: every peer the benchmark knows, in table order
PEER_NAMES = ("torch", *PEERS)
LABELS = {"torch": "torch SDPA", **{name: v[1] for name, v in PEERS.items()}}
SHORT = {"torch": "torch", "onnxruntime": "ORT", "openvino": "OpenVINO"}
#: largest |peer - manyheads| accepted before a peer is timed, by dtype
CHECK_ATOL = {"float32": 1e-4, "float64": 1e-9}


@dataclass
class PeerCall:
    """One peer, built for one shape: the timed call and a checked call."""

    run: Callable[[], Any]
    result: Callable[[], np.ndarray]
    path: str  # what the peer runs, for the record (op, fused node or subgraph)
    keep: tuple[Any, ...] = field(default=(), repr=False)  # buffers the peer reads in place


def _module(name: str) -> Any:
    return importlib.import_module(name)


def version(name: str) -> str | None:
    """Installed version of a peer's package, or None when it does not import."""
    try:
        mod = _module(PEERS[name][0])
        if name == "onnxruntime":
            _module("onnx")  # the model is built with onnx's helper API
    except ImportError:
        return None
    v = str(getattr(mod, "__version__", "?"))
    if name == "openvino":
        v = v.split("-")[0]
    return v


def torch_module() -> Any:
    """The torch module, or None when it is not installed (or blocked in this process)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def torch_loaded() -> bool:
    """True when this process has imported torch (``sys.modules['torch'] = None`` is not)."""
    return sys.modules.get("torch") is not None


def versions(names: Sequence[str] = PEER_NAMES) -> dict[str, str | None]:
    """Installed version of each named peer (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in names:
        if name == "torch":
            torch = torch_module()
            out[name] = None if torch is None else str(torch.__version__)
        else:
            out[name] = version(name)
    return out


def missing_note(name: str) -> str:
    """One line saying that a peer is skipped and how to include it."""
    if name == "torch":
        pkgs, label = "torch", "PyTorch"
    else:
        pkgs = "onnxruntime and onnx" if name == "onnxruntime" else PEERS[name][0]
        label = PEERS[name][1]
    return (f"note: {pkgs} not installed, so {label} is skipped "
            "(pip install '.[bench]' in the source checkout to include it)")


# ----------------------------------------------------------------------------- the check


def check(name: str, out: Any, ref: np.ndarray, dtype: str, checks: Checks) -> bool:
    """Record ``name``'s largest difference from manyheads' output; True when it is small."""
    diff = float(np.max(np.abs(np.asarray(out, dtype=np.float64) - ref)))
    checks.max_abs_diff[name] = diff
    if not diff <= CHECK_ATOL[dtype]:  # NaN fails too
        checks.notes[name] = (f"differs from manyheads by {diff:.1e} "
                              f"(more than {CHECK_ATOL[dtype]:.0e}); not timed")
        sys.stderr.write(f"\nwarning: {LABELS[name]} {checks.notes[name]}\n")
        return False
    return True


def add_peer(name: str, build: Callable[[], PeerCall], ref: np.ndarray, dtype: str,
             fns: dict[str, Callable[[], Any]], checks: Checks) -> None:
    """Build one ONNX Runtime / OpenVINO peer, check it, and add it to ``fns`` if it agrees."""
    if dtype != "float32":
        checks.notes[name] = "float32 only here"
        return
    try:
        call = build()
        out = call.result()
    except Exception as exc:  # a peer that cannot run this shape is reported, not fatal
        checks.notes[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        sys.stderr.write(f"\nwarning: {LABELS[name]} {checks.notes[name]}\n")
        return
    checks.paths[name] = call.path
    if check(name, out, ref, dtype, checks):
        fns[name] = call.run


# ----------------------------------------------------------------------------- ONNX Runtime

_ort_sessions: dict[tuple[Any, ...], Any] = {}


def _ort_session(B: int, H: int, D: int, threads: int, with_cache: bool) -> Any:
    """A GroupQueryAttention session for (B, H, D), float32, dynamic lengths (cached)."""
    key = (B, H, D, threads, with_cache)
    if key in _ort_sessions:
        return _ort_sessions[key]
    ort, onnx = _module("onnxruntime"), _module("onnx")
    helper, TP = onnx.helper, onnx.TensorProto
    hidden = H * D
    inputs = [helper.make_tensor_value_info(n, TP.FLOAT, [B, "new", hidden])
              for n in ("query", "key", "value")]
    names = ["query", "key", "value"]
    if with_cache:
        inputs += [helper.make_tensor_value_info(n, TP.FLOAT, [B, H, "cache", D])
                   for n in ("past_key", "past_value")]
        names += ["past_key", "past_value"]
    else:
        names += ["", ""]  # optional inputs left out
    inputs += [helper.make_tensor_value_info("seqlens_k", TP.INT32, [B]),
               helper.make_tensor_value_info("total_sequence_length", TP.INT32, [])]
    names += ["seqlens_k", "total_sequence_length"]
    outputs = [helper.make_tensor_value_info("output", TP.FLOAT, [B, "new", hidden])]
    if with_cache:
        outputs += [helper.make_tensor_value_info(n, TP.FLOAT, [B, H, "cache", D])
                    for n in ("present_key", "present_value")]
    node = helper.make_node("GroupQueryAttention", names, [o.name for o in outputs],
                            domain="com.microsoft", num_heads=H, kv_num_heads=H)
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
    _ort_sessions[key] = sess
    return sess


def _rows(x: np.ndarray) -> np.ndarray:
    """(B, H, L, D) -> (B, L, H·D), contiguous: the layout GroupQueryAttention reads."""
    B, H, L, D = x.shape
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(B, L, H * D))


def _heads(x: np.ndarray, H: int) -> np.ndarray:
    """(B, L, H·D) -> (B, H, L, D)."""
    B, L, HD = x.shape
    out: np.ndarray = x.reshape(B, L, H, HD // H).transpose(0, 2, 1, 3)
    return out


def _ort_prefill(q: np.ndarray, k: np.ndarray, v: np.ndarray, threads: int) -> PeerCall:
    B, H, T, D = q.shape
    sess = _ort_session(B, H, D, threads, with_cache=False)
    feeds = {"query": _rows(q), "key": _rows(k), "value": _rows(v),
             "seqlens_k": np.full(B, T - 1, np.int32),
             "total_sequence_length": np.array(T, np.int32)}
    binding = sess.io_binding()
    for name, arr in feeds.items():
        binding.bind_cpu_input(name, arr)
    binding.bind_output("output", "cpu")

    def run() -> None:
        sess.run_with_iobinding(binding)

    def result() -> np.ndarray:
        run()
        return _heads(binding.copy_outputs_to_cpu()[0], H)

    return PeerCall(run, result, "GroupQueryAttention, CPU execution provider",
                    keep=tuple(feeds.values()))


def _ort_decode(q: np.ndarray, k: np.ndarray, v: np.ndarray, threads: int) -> PeerCall:
    ort = _module("onnxruntime")
    B, H, _, D = q.shape
    L = k.shape[2]
    sess = _ort_session(B, H, D, threads, with_cache=True)
    # the cache holds L positions; the last one is written by the op from the new token
    cache_k, cache_v = k.copy(), v.copy()
    cache_k[:, :, -1] = 0
    cache_v[:, :, -1] = 0
    past_k = ort.OrtValue.ortvalue_from_numpy(cache_k)
    past_v = ort.OrtValue.ortvalue_from_numpy(cache_v)
    feeds = {"query": _rows(q), "key": _rows(k[:, :, -1:]), "value": _rows(v[:, :, -1:]),
             "seqlens_k": np.full(B, L - 1, np.int32),
             "total_sequence_length": np.array(L, np.int32)}
    binding = sess.io_binding()
    for name, arr in feeds.items():
        binding.bind_cpu_input(name, arr)
    binding.bind_ortvalue_input("past_key", past_k)
    binding.bind_ortvalue_input("past_value", past_v)
    binding.bind_output("output", "cpu")
    binding.bind_ortvalue_output("present_key", past_k)  # same buffer: appended in place
    binding.bind_ortvalue_output("present_value", past_v)

    def run() -> None:
        sess.run_with_iobinding(binding)

    def result() -> np.ndarray:
        run()
        return _heads(binding.copy_outputs_to_cpu()[0], H)

    return PeerCall(run, result, "GroupQueryAttention with a shared past/present cache, "
                                 "CPU execution provider",
                    keep=(*feeds.values(), past_k, past_v))


# ----------------------------------------------------------------------------- OpenVINO

_ov_compiled: dict[tuple[Any, ...], Any] = {}


def _ov_config(threads: int) -> dict[str, Any]:
    return {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}


def _ov_layers(compiled: Any) -> list[str]:
    """The CPU plugin's layer types in the compiled model, in execution order."""
    out = []
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        out.append(str(info["layerType"].astype(str)) if "layerType" in info
                   else op.get_type_name())
    return out


def _ov_path(compiled: Any) -> str:
    layers = [x for x in _ov_layers(compiled)
              if x not in ("Input", "Output", "Const", "Parameter", "Result")]
    return "CPU plugin layers: " + " ".join(layers)


def _ov_compile(B: int, H: int, D: int, threads: int, stateful: bool) -> Any:
    """Compiled opset-13 SDPA for (B, H, ·, D), float32, sequence axis dynamic (cached)."""
    key = (B, H, D, threads, stateful)
    if key in _ov_compiled:
        return _ov_compiled[key]
    ov = _module("openvino")
    ops = _module("openvino.opset13")
    seq = ov.PartialShape([B, H, -1, D])
    q, k, v = (ops.parameter(seq, ov.Type.f32, name=n) for n in ("query", "key", "value"))
    if not stateful:
        attn = ops.scaled_dot_product_attention(q, k, v, causal=True)
        model = ov.Model([attn.output(0)], [q, k, v], "sdpa_prefill")
    else:
        util = _module("openvino.op.util")
        beam = ops.parameter(ov.PartialShape([-1]), ov.Type.i32, name="beam_idx")
        batch = ops.gather(ops.shape_of(beam), ops.constant(np.array([0], np.int64)),
                           ops.constant(np.int64(0)))
        empty = ops.broadcast(ops.constant(np.float32(0)),
                              ops.concat([batch, ops.constant(np.array([H, 0, D], np.int64))], 0))
        assigns, full = [], []
        for name, new in (("past_key", k), ("past_value", v)):
            info = util.VariableInfo()
            info.data_shape = ov.PartialShape([-1, H, -1, D])
            info.data_type = ov.Type.f32
            info.variable_id = name
            var = util.Variable(info)
            past = ops.gather(ops.read_value(empty, var), beam, ops.constant(np.int64(0)))
            cat = ops.concat([past, new], axis=2)
            assigns.append(ops.assign(cat, var))
            full.append(cat)
        # causal: the new query sits at the end of the keys, so it sees all of them
        attn = ops.scaled_dot_product_attention(q, full[0], full[1], causal=True)
        model = ov.Model([attn.output(0)], assigns, [q, k, v, beam], "sdpa_decode")
    compiled = ov.Core().compile_model(model, "CPU", _ov_config(threads))
    _ov_compiled[key] = compiled
    return compiled


def _ov_prefill(q: np.ndarray, k: np.ndarray, v: np.ndarray, threads: int) -> PeerCall:
    ov = _module("openvino")
    B, H, _, D = q.shape
    compiled = _ov_compile(B, H, D, threads, stateful=False)
    req = compiled.create_infer_request()
    for i, arr in enumerate((q, k, v)):
        req.set_input_tensor(i, ov.Tensor(arr, shared_memory=True))

    def run() -> None:
        req.infer()

    def result() -> np.ndarray:
        run()
        return np.array(req.get_output_tensor(0).data, copy=True)

    return PeerCall(run, result, _ov_path(compiled), keep=(q, k, v))


def _ov_decode(q: np.ndarray, k: np.ndarray, v: np.ndarray, threads: int,
               calls: int) -> PeerCall:
    ov = _module("openvino")
    B, H, _, D = q.shape
    L = k.shape[2]
    compiled = _ov_compile(B, H, D, threads, stateful=True)
    req = compiled.create_infer_request()
    new_k, new_v = np.ascontiguousarray(k[:, :, -1:]), np.ascontiguousarray(v[:, :, -1:])
    beam = np.zeros(B, np.int32)
    held = (q, new_k, new_v, beam)
    for i, arr in enumerate(held):
        req.set_input_tensor(i, ov.Tensor(arr, shared_memory=True))

    def fill(n_past: int) -> None:
        """Reset the cache to the first ``n_past`` keys and values."""
        req.reset_state()
        for state in req.query_state():
            src = k if state.name == "past_key" else v
            state.state = ov.Tensor(np.ascontiguousarray(src[:, :, :n_past]))

    def run() -> None:
        req.infer()

    def result() -> np.ndarray:
        # exactly L keys: L-1 cached, the new one appended by the call
        fill(L - 1)
        req.infer()
        out = np.array(req.get_output_tensor(0).data, copy=True)
        # then start the timed calls so that their cache lengths centre on L
        fill(max(1, L - 1 - calls // 2))
        return out

    return PeerCall(run, result, _ov_path(compiled), keep=held)


# ----------------------------------------------------------------------------- entry points

def prefill(name: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, threads: int) -> PeerCall:
    """Causal self-attention over (B, H, T, D) float32 arrays by peer ``name``."""
    if name == "onnxruntime":
        return _ort_prefill(q, k, v, threads)
    if name == "openvino":
        return _ov_prefill(q, k, v, threads)
    raise ValueError(f"unknown peer {name!r}; expected one of {', '.join(PEERS)}")


def decode(name: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, threads: int,
           calls: int = 0) -> PeerCall:
    """One query (B, H, 1, D) against L keys and values (B, H, L, D) by peer ``name``.

    The last key and value are the new token's: the peer appends them to a cache
    holding the first L-1, as a generation step does.  ``calls`` is how many
    times ``run`` will be called (OpenVINO's cache grows by one per call).
    """
    if name == "onnxruntime":
        return _ort_decode(q, k, v, threads)
    if name == "openvino":
        return _ov_decode(q, k, v, threads, calls)
    raise ValueError(f"unknown peer {name!r}; expected one of {', '.join(PEERS)}")
