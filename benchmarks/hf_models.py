"""Whole Hugging Face models at real shapes, random weights: attn_implementation="manyheads"
against the backend transformers would otherwise use.

* SmolLM2-135M's shape (Llama: 30 layers, d=576, 9 query heads on 3 key/value
  heads of 64, MLP 1536, vocabulary 49152): prefill at T = 512, 2048 and 4096,
  and one decode step at a context of 4096, against ``"sdpa"``;
* Gemma-2-2B's shape cut to 4 layers (d=2304, 8 query heads on 4 of 256, MLP
  9216, soft cap 50, a sliding window of 4096 on every other layer,
  vocabulary 256000): prefill at T = 4096, against ``"eager"`` (transformers
  refuses ``"sdpa"`` for Gemma 2: its soft-capped attention runs eagerly).

One model per shape, in float32; its attention implementation is switched
between calls (``set_attn_implementation``), so every backend runs the same
weights.  Each backend is wrapped in a timer registered through transformers'
``AttentionInterface`` under a name of its own (with the backend's own mask
builder), so the time spent inside the attention function is measured the
same way for all of them, inside the whole forward that is timed around it.
A prefill is one forward over T tokens keeping only the last position's
logits, as ``generate`` does; a decode step is one token against a dynamic
cache of the given context, cropped back after each step.  The backends' last
logits are compared before anything is timed.  Needs torch and transformers
(``pip install '.[test]'``).
"""
from __future__ import annotations

import inspect
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from benchmarks import peers
from benchmarks.results import HFModelRow, HFModelsResult

#: the two shapes: (label, config class, settings, baseline backend)
SMOLLM2 = ("SmolLM2-135M", "LlamaConfig", dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True), "sdpa")
GEMMA2 = ("Gemma-2-2B, 4 of 26 layers", "Gemma2Config", dict(
    vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=4096,
    attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256,
    max_position_embeddings=8192), "eager")


@dataclass
class _Timed:
    """A backend wrapped in a timer: its name in the interfaces, and the seconds spent
    inside attention since the last reset."""

    name: str
    seconds: float = 0.0


def _register_timed(transformers: Any, model: Any, base: str) -> _Timed:
    """Register ``timed_<base>``: the backend ``base`` (``eager``: the model's own eager
    function) inside a timer, with ``base``'s mask builder."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base == "eager":
        layer_module = sys.modules[type(model.model.layers[0].self_attn).__module__]
        fn = layer_module.eager_attention_forward
    else:
        fn = ALL_ATTENTION_FUNCTIONS[base]
    timed = _Timed(f"timed_{base}")

    def attention(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timed.seconds += time.perf_counter() - t0

    transformers.AttentionInterface.register(timed.name, attention)
    transformers.AttentionMaskInterface.register(timed.name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return timed


def _measure(calls: dict[str, tuple[_Timed, Callable[[], Any]]], rounds: int
             ) -> dict[str, tuple[float, float]]:
    """(median seconds per call, median seconds inside attention) of each call, in
    alternating rounds after one untimed call each."""
    seen: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
    for _, fn in calls.values():
        fn()
    for _ in range(rounds):
        for name, (timed, fn) in calls.items():
            timed.seconds = 0.0
            t0 = time.perf_counter()
            fn()
            seen[name].append((time.perf_counter() - t0, timed.seconds))
    return {name: (float(np.median([w for w, _ in s])), float(np.median([a for _, a in s])))
            for name, s in seen.items()}


def _model(transformers: Any, torch: Any, shape: tuple[str, str, dict[str, Any], str]) -> Any:
    _, config_class, settings, _ = shape
    config = getattr(transformers, config_class)(**settings)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32).eval()


def _cache_keyword(transformers: Any) -> str:
    """The models' cache argument: ``cache`` in recent releases, ``past_key_values`` before."""
    params = inspect.signature(transformers.LlamaForCausalLM.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _prefill_rows(transformers: Any, torch: Any, shape: tuple[str, str, dict[str, Any], str],
                  Ts: tuple[int, ...], decode_at: int | None, rounds: int,
                  step: Callable[[str], None]) -> list[HFModelRow]:
    label, _, _, base = shape
    model = _model(transformers, torch, shape)
    backends = {"manyheads": _register_timed(transformers, model, "manyheads"),
                base: _register_timed(transformers, model, base)}
    vocab = model.config.vocab_size
    rows = []

    def forward(name: str, ids: Any, **kw: Any) -> Any:
        model.set_attn_implementation(backends[name].name)
        with torch.inference_mode():
            return model(ids, logits_to_keep=1, **kw).logits

    for T in Ts:
        ids = torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(T))
        diff = (forward("manyheads", ids) - forward(base, ids)).abs().max().item()
        times = _measure({n: (backends[n], lambda n=n: forward(n, ids)) for n in backends},
                         rounds)
        rows.append(HFModelRow(model=label, phase="prefill", tokens=T, baseline=base,
                               manyheads_s=times["manyheads"][0], baseline_s=times[base][0],
                               manyheads_attention_s=times["manyheads"][1],
                               baseline_attention_s=times[base][1], max_abs_diff=diff))
        step(f"{label} prefill T={T}")
    if decode_at is not None:
        keyword = _cache_keyword(transformers)
        ids = torch.randint(0, vocab, (1, decode_at + 1),
                            generator=torch.Generator().manual_seed(decode_at))
        cache = transformers.DynamicCache(config=model.config)
        forward("manyheads", ids[:, :decode_at], **{keyword: cache, "use_cache": True})
        last = ids[:, decode_at:]

        def decode(name: str) -> Any:
            logits = forward(name, last, **{keyword: cache, "use_cache": True})
            cache.crop(-1)  # back to the context: the next step is the same step
            return logits

        diff = (decode("manyheads") - decode(base)).abs().max().item()
        times = _measure({n: (backends[n], lambda n=n: decode(n)) for n in backends},
                         max(rounds, 15))
        rows.append(HFModelRow(model=label, phase="decode", tokens=decode_at, baseline=base,
                               manyheads_s=times["manyheads"][0], baseline_s=times[base][0],
                               manyheads_attention_s=times["manyheads"][1],
                               baseline_attention_s=times[base][1], max_abs_diff=diff))
        step(f"{label} decode at {decode_at}")
    del model
    return rows


def steps(quick: bool) -> int:
    """How many progress steps :func:`hf_models_section` reports."""
    return 4 if quick else 5


def hf_models_section(threads: int, quick: bool, step: Callable[[str], None]
                      ) -> HFModelsResult:
    """Both shapes (``quick``: SmolLM2 at T = 512 and 2048, decode at 2048, Gemma 2 at
    T = 2048); a result with a note and no rows when torch or transformers is missing."""
    torch = peers.torch_module()
    try:
        import transformers
    except ImportError:
        transformers = None
    if torch is None or transformers is None:
        for _ in range(steps(quick)):
            step("Hugging Face models: not measured")
        return HFModelsResult(threads=threads, note="needs torch and transformers: "
                              "pip install '.[test]'")
    import manyheads.transformers as mhtf

    mhtf.register()
    torch.set_num_threads(threads)
    rounds = 3
    Ts = (512, 2048) if quick else (512, 2048, 4096)
    rows = _prefill_rows(transformers, torch, SMOLLM2, Ts, Ts[-1], rounds, step)
    rows += _prefill_rows(transformers, torch, GEMMA2, (Ts[-1],), None, rounds, step)
    return HFModelsResult(threads=threads, transformers=transformers.__version__, rows=rows)
