"""The performance claims a user can check on their own machine, and whether a run meets them.

Each claim is a ratio measured in one run, against a threshold:

* speed claims: the other side's time over manyheads' (above 1: manyheads is
  faster) must reach the threshold;
* the ``OPENBLAS_NUM_THREADS=1`` claim is a ceiling: manyheads' layer step in
  the default run over its time in the subprocess with one OpenBLAS thread
  must stay at or below it (NumPy's BLAS threads must not slow the step);
* the generation claim also needs the generated tokens to be identical.

A claim whose ratio could not be measured (a peer not installed, a subprocess
that failed) is "not measured", neither met nor missed.
"""
from __future__ import annotations

from dataclasses import dataclass

from benchmarks.results import BenchResult, Claim, HFModelRow


@dataclass(frozen=True)
class ClaimSpec:
    key: str
    text: str
    threshold: float
    ceiling: bool = False  # True: the ratio must stay at or below the threshold


#: the claims, in report order
CLAIMS: tuple[ClaimSpec, ...] = (
    ClaimSpec("layer_decode", "layer decode step ≥ 1.5× torch's layer (in a process that "
                              "imported and used torch)", 1.5),
    ClaimSpec("generation", "GPT-2 generation ≥ 1.3× Hugging Face's tokens/s, with identical "
                            "tokens", 1.3),
    ClaimSpec("module_prefill", "module prefill (B=8, T=1024, d=768, 12 heads) ≥ 1.2× torch's "
                                "layer", 1.2),
    ClaimSpec("tiny_sdpa", "tiny SDPA (12 heads × 1 query × 16 keys) ≥ 1.5× torch", 1.5),
    ClaimSpec("int4_cold", "int4 KV cache ≥ 1.5× the int8 cache (decode step, L=16384, "
                           "cache cold)", 1.5),
    ClaimSpec("int4_deep", "int4 KV cache ≥ 1.5× the int8 cache (decode step, L=16384, "
                           "layers stepped in turn, each finding its cache cold)", 1.5),
    ClaimSpec("openblas", "layer decode step within 1.2× of its time in the run with "
                          "OPENBLAS_NUM_THREADS=1", 1.2, ceiling=True),
    ClaimSpec("smollm2_attention", "SmolLM2-135M-shaped model, prefill T=4096: time inside "
                                   "attention ≥ 1.4× \"sdpa\"", 1.4),
    ClaimSpec("smollm2_model", "SmolLM2-135M-shaped model, prefill T=4096: whole forward "
                               "≥ 1.1× \"sdpa\"", 1.1),
    ClaimSpec("smollm2_decode", "SmolLM2-135M-shaped model, decode step at a context of 4096: "
                                "no slower than \"sdpa\"", 1.0),
    ClaimSpec("gemma2_attention", "Gemma-2-shaped model (4 layers), prefill T=4096: time "
                                  "inside attention ≥ 3× \"eager\"", 3.0),
    ClaimSpec("gemma2_model", "Gemma-2-shaped model (4 layers), prefill T=4096: whole forward "
                              "≥ 1.25× \"eager\"", 1.25),
)


def _hf_ratios(r: BenchResult) -> dict[str, tuple[float | None, bool | None]]:
    """The Hugging Face models' claims: baseline time over manyheads' at 4096 tokens."""
    rows = r.hf_models.rows if r.hf_models else []

    def find(model: str, phase: str) -> HFModelRow | None:
        return next((x for x in rows if x.model.startswith(model) and x.phase == phase
                     and x.tokens == 4096), None)

    out: dict[str, tuple[float | None, bool | None]] = {}
    for key, model, phase in (("smollm2", "SmolLM2", "prefill"), ("gemma2", "Gemma-2", "prefill"),
                              ("smollm2_decode", "SmolLM2", "decode")):
        row = find(model, phase)
        if key.endswith("decode"):
            out[key] = (row.baseline_s / row.manyheads_s if row else None, None)
            continue
        out[key + "_attention"] = (row.baseline_attention_s / row.manyheads_attention_s
                                   if row else None, None)
        out[key + "_model"] = (row.baseline_s / row.manyheads_s if row else None, None)
    return out


def _ratios(r: BenchResult) -> dict[str, tuple[float | None, bool | None]]:
    """Each claim's measured ratio (None: not measured) and, for generation, identical tokens."""
    inf = r.inference
    layer = inf.layer_decode if inf else {}
    main, ob1 = layer.get("main"), layer.get("openblas1")
    gen = inf.generation.get("main") if inf else None
    tiny = inf.tiny_sdpa if inf else None
    mod = r.module
    cold = next((row.cold_step_us for row in r.cache_formats or [] if row.L == 16384), {})
    deep = next((row.deep_step_us for row in r.cache_formats or [] if row.L == 16384), {})
    return {
        "layer_decode": (main.torch_us / main.manyheads_us
                         if main and main.torch_us and main.torch_in_process else None, None),
        "generation": (gen.hf_s / gen.manyheads_s if gen and gen.hf_s else None,
                       gen.identical if gen else None),
        "module_prefill": (mod.torch_ms / mod.fused_ms
                           if mod and mod.torch_ms is not None else None, None),
        "tiny_sdpa": (tiny.torch_us / tiny.manyheads_us
                      if tiny and tiny.torch_us is not None else None, None),
        "int4_cold": (cold["int8"] / cold["int4"] if "int8" in cold and "int4" in cold
                      else None, None),
        "int4_deep": (deep["int8"] / deep["int4"] if "int8" in deep and "int4" in deep
                      else None, None),
        "openblas": (main.manyheads_us / ob1.manyheads_us if main and ob1 else None, None),
        **_hf_ratios(r),
    }


def judge(spec: ClaimSpec, ratio: float | None, identical: bool | None = None) -> bool | None:
    """Whether a measured ratio meets ``spec`` (None: not measured)."""
    if ratio is None:
        return None
    if spec.ceiling:
        return ratio <= spec.threshold
    return ratio >= spec.threshold and identical is not False


def evaluate(r: BenchResult) -> list[Claim]:
    """Every claim with its measured ratio and whether this run meets it (one whose section
    did not run is not measured)."""
    ratios = _ratios(r)
    out = []
    for spec in CLAIMS:
        ratio, identical = ratios[spec.key]
        out.append(Claim(key=spec.key, text=spec.text, threshold=spec.threshold, ratio=ratio,
                         met=judge(spec, ratio, identical), identical=identical))
    return out
