"""The inference section: what a generation loop does, against PyTorch and Hugging Face.

* a tiny SDPA call (12 heads × 1 query × 16 keys), as inference code calls it;
* one fused layer's decode step against torch's layer written the same way;
* a GPT-2-small-shaped model's greedy generation against Hugging Face's
  ``generate``, tokens compared;
* the layer step and manyheads' generation again in a subprocess that never
  imports torch, and the layer step in one with ``OPENBLAS_NUM_THREADS=1``.

Every result is checked (outputs, tokens) before or as it is timed.  This
process sets no environment variable; the subprocesses get theirs at start.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Callable

import numpy as np

import manyheads as mh
from benchmarks import peers
from benchmarks.results import (Checks, ChildRun, ChildStatus, GenerationRun, GPT2Shape,
                                InferenceResult, LayerShape, LayerStep, TimedBlock, TinySDPA,
                                TinyShape, from_dict)
from benchmarks.timing import adaptive_compare, compare, load_average

LAYER_SHAPE = LayerShape()
GPT2_SHAPE = GPT2Shape()
TINY_SHAPE = TinyShape()
#: the folder holding the ``benchmarks`` package (a subprocess imports it from there)
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_sdpa_case(threads: int, with_torch: bool) -> TinySDPA:
    """One SDPA call of 12 heads x 1 query x 16 keys (D=64): median microseconds per call.

    torch is called as inference code calls it (no autograd context per call:
    the tensors need no gradient), so neither side pays for more than the call.
    """
    s = TINY_SHAPE
    rng = np.random.default_rng(16)
    q = rng.standard_normal((1, s.heads, s.queries, s.D)).astype(np.float32)
    k, v = (rng.standard_normal((1, s.heads, s.keys, s.D)).astype(np.float32)
            for _ in range(2))
    fns: dict[str, Callable[[], Any]] = {
        "manyheads": lambda: mh.scaled_dot_product_attention(q, k, v, num_threads=threads)}
    ref = np.asarray(fns["manyheads"](), dtype=np.float64)
    checks = Checks()
    torch = peers.torch_module() if with_torch else None
    if torch is not None:
        torch.set_num_threads(threads)
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        fns["torch"] = lambda: sdpa(tq, tk, tv)
        if not peers.check("torch", fns["torch"]().numpy(), ref, "float32", checks):
            del fns["torch"]
    res = compare(fns, rounds=20, per_round=200, warmup=50)
    return TinySDPA(manyheads_us=1e6 * res["manyheads"],
                    torch_us=1e6 * res["torch"] if "torch" in res else None, checks=checks)


def layer_decode_case(threads: int, with_torch: bool) -> LayerStep:
    """One fused layer's decode step against torch's layer written the same way (µs).

    manyheads: ``MultiHeadAttention(768, 12 heads, qkv_bias=True)`` called on one
    new token with a KV cache holding 1024 tokens, rolled back to 1024 by
    ``cache.truncate`` after each call.  torch: a qkv ``F.linear``, the new key
    and value written into a preallocated buffer of 1024 + 1 positions, SDPA
    over it, an output ``F.linear``; same weights, same thread count, outputs
    compared before timing.
    """
    d, H, L = LAYER_SHAPE.d, LAYER_SHAPE.heads, LAYER_SHAPE.cached
    D = d // H
    layer = mh.MultiHeadAttention(d, d, L + 1, 0.0, H, qkv_bias=True, seed=0)
    assert layer.b_qkv is not None  # qkv_bias=True
    rng = np.random.default_rng(5)
    prompt = rng.standard_normal((1, L, d)).astype(np.float32)
    x = rng.standard_normal((1, 1, d)).astype(np.float32)
    cache = layer.new_cache(1, L + 1)
    layer(prompt, cache=cache, num_threads=threads)  # the 1024 cached tokens

    def run_manyheads() -> np.ndarray:
        y: np.ndarray = layer(x, cache=cache, num_threads=threads)
        cache.truncate(L)
        return y

    fns: dict[str, Callable[[], Any]] = {"manyheads": run_manyheads}
    ref = np.asarray(run_manyheads(), dtype=np.float64)
    checks = Checks()
    torch = peers.torch_module() if with_torch else None
    if torch is not None:
        torch.set_num_threads(threads)
        F = torch.nn.functional
        w_qkv = torch.from_numpy(np.ascontiguousarray(layer.W_qkv.T))
        b_qkv = torch.from_numpy(layer.b_qkv.copy())
        w_out = torch.from_numpy(np.ascontiguousarray(layer.W_out.T))
        b_out = torch.from_numpy(layer.b_out.copy())
        keys, values = torch.zeros(1, H, L + 1, D), torch.zeros(1, H, L + 1, D)

        def heads(t: Any, n: int) -> Any:
            return t.view(1, n, H, D).transpose(1, 2)

        with torch.inference_mode():  # torch's own prefill fills its buffer
            _, pk, pv = F.linear(torch.from_numpy(prompt), w_qkv, b_qkv).split(d, dim=-1)
            keys[:, :, :L], values[:, :, :L] = heads(pk, L), heads(pv, L)
        tx = torch.from_numpy(x)

        def run_torch() -> Any:
            with torch.inference_mode():
                q, k, v = F.linear(tx, w_qkv, b_qkv).split(d, dim=-1)
                keys[:, :, L:] = heads(k, 1)
                values[:, :, L:] = heads(v, 1)
                ctx = F.scaled_dot_product_attention(heads(q, 1), keys, values)
                return F.linear(ctx.transpose(1, 2).reshape(1, 1, d), w_out, b_out)

        if peers.check("torch", run_torch().numpy(), ref, "float32", checks):
            fns["torch"] = run_torch
    res = adaptive_compare(fns)
    return LayerStep(manyheads_us=1e6 * res["manyheads"],
                     torch_us=1e6 * res["torch"] if "torch" in res else None,
                     checks=checks, torch_in_process=peers.torch_loaded())


def merge_blocks(blocks: list[LayerStep]) -> LayerStep:
    """One row from blocks measured apart: each time the mean of the blocks' medians."""
    merged = Checks()
    for b in blocks:
        for name, diff in b.checks.max_abs_diff.items():
            merged.max_abs_diff[name] = max(diff, merged.max_abs_diff.get(name, 0.0))
        merged.notes.update(b.checks.notes)
    torch_us = [b.torch_us for b in blocks if b.torch_us is not None]
    return LayerStep(
        manyheads_us=float(np.mean([b.manyheads_us for b in blocks])),
        torch_us=float(np.mean(torch_us)) if len(torch_us) == len(blocks) else None,
        torch_in_process=blocks[-1].torch_in_process, checks=merged,
        blocks=[TimedBlock(b.manyheads_us, b.torch_us) for b in blocks])


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        return None
    return transformers


def gpt2_checkpoint(folder: str) -> Any:
    """A seeded random GPT-2-small-shaped Hugging Face model, saved to ``folder`` (safetensors).

    Returns the model (eval mode).  Needs torch and transformers.
    """
    import torch

    transformers = _transformers()
    s = GPT2_SHAPE
    cfg = transformers.GPT2Config(n_layer=s.n_layer, n_embd=s.n_embd, n_head=s.n_head,
                                  vocab_size=s.vocab_size, n_positions=s.n_positions)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    logging = transformers.utils.logging
    progress_on = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # no "Writing model shards" line inside the bench's own
    try:
        model.save_pretrained(folder)
    finally:
        if progress_on:
            logging.enable_progress_bar()
    return model


def gpt2_runner(folder: str) -> tuple[Callable[[list[int], int], list[int]], str]:
    """manyheads' GPT-2 for a checkpoint folder: (generate(prompt, n) -> tokens, how it loaded).

    ``manyheads.models.from_pretrained``; torch is not imported.
    """
    from manyheads import models

    model = models.from_pretrained(folder)

    def generate(prompt: list[int], n: int) -> list[int]:
        return [int(t) for t in np.asarray(model.generate(np.array([prompt]), n))[0]]

    return generate, "manyheads.models.from_pretrained"


def gpt2_prompt() -> list[int]:
    """The seeded 200-token prompt."""
    rng = np.random.default_rng(200)
    return [int(t) for t in rng.integers(0, GPT2_SHAPE.vocab_size, GPT2_SHAPE.prompt)]


def generation_case(folder: str, threads: int, rounds: int, hf_model: Any = None
                    ) -> GenerationRun:
    """Greedy generation of 32 tokens after a 200-token prompt: whole-call seconds (medians).

    manyheads' runner always; Hugging Face ``generate(do_sample=False)`` on torch
    when ``hf_model`` is given, interleaved with it.  Tokens from both are kept.
    """
    n = GPT2_SHAPE.new_tokens
    prompt = gpt2_prompt()
    generate, loader = gpt2_runner(folder)
    torch_in_process = peers.torch_loaded()
    tokens: dict[str, list[int]] = {}

    def run_manyheads() -> None:
        tokens["manyheads"] = generate(prompt, n)

    fns: dict[str, Callable[[], Any]] = {"manyheads": run_manyheads}
    if hf_model is not None:
        import torch

        transformers = _transformers()
        torch.set_num_threads(threads)
        ids = torch.tensor([prompt])
        # eos_token_id=None: always n tokens, as manyheads' runner makes them
        gen_cfg = transformers.GenerationConfig(max_new_tokens=n, do_sample=False,
                                                eos_token_id=None, pad_token_id=0)

        def run_hf() -> None:
            with torch.inference_mode():
                res = hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                        generation_config=gen_cfg)
            tokens["hf"] = [int(t) for t in res[0, len(prompt):]]

        fns["hf"] = run_hf
    # the runner's calls use the default thread count: set it for the run, then put
    # back what was chosen before (None: OpenMP's default)
    chosen = mh.show_config(mode="dicts")["num_threads_set"]
    mh.set_num_threads(threads)
    try:
        res = compare(fns, rounds=rounds, per_round=1, warmup=1)
    finally:
        mh.set_num_threads(chosen)
    out = GenerationRun(loader=loader, rounds=rounds, torch_in_process=torch_in_process,
                        manyheads_s=res["manyheads"], manyheads_tokens_per_s=n / res["manyheads"],
                        manyheads_tokens=tokens["manyheads"])
    if "hf" in res:
        out.hf_s, out.hf_tokens_per_s = res["hf"], n / res["hf"]
        out.hf_tokens = tokens["hf"]
        out.identical = tokens["hf"] == tokens["manyheads"]
    return out


# ----------------------------------------------------------------------------- subprocesses

_CHILD_SCRIPT = r"""
import json, sys
root, mode, folder, threads, rounds, path = sys.argv[1:7]
if mode == "no-torch":
    sys.modules["torch"] = None  # any import of torch now fails: this process never has it
sys.path.insert(0, root)
from benchmarks import inference
res = inference.child_run(mode, folder or None, int(threads), int(rounds))
with open(path, "w") as fh:
    fh.write(inference.child_json(res))
"""

#: the subprocesses of the inference section: mode -> extra environment
CHILD_MODES: dict[str, dict[str, str]] = {"no-torch": {},
                                          "openblas1": {"OPENBLAS_NUM_THREADS": "1"}}


def child_run(mode: str, folder: str | None, threads: int, rounds: int) -> ChildRun:
    """What one subprocess of the inference section measures (see ``CHILD_MODES``).

    ``no-torch``: manyheads' layer decode step and (with a checkpoint folder)
    its generation, in a process where torch cannot be imported.
    ``openblas1``: the layer decode step exactly as the main run measures it
    (torch too, when installed), under ``OPENBLAS_NUM_THREADS=1``.
    """
    with_torch = mode != "no-torch" and peers.torch_module() is not None
    out = ChildRun(mode=mode, env={k: os.environ.get(k) for k in CHILD_MODES.get(mode, {})},
                   layer=layer_decode_case(threads, with_torch))
    if mode == "no-torch" and folder:
        out.generation = generation_case(folder, threads, rounds)
    out.torch_in_process = peers.torch_loaded()
    out.config = mh.show_config(mode="dicts")
    return out


def child_json(res: ChildRun) -> str:
    return json.dumps(dataclasses.asdict(res))


def run_child(mode: str, folder: str | None, threads: int, rounds: int,
              timeout: float = 1800) -> ChildRun:
    """Run ``child_run`` in a fresh interpreter; its results, or one with ``error`` set."""
    env = dict(os.environ, **CHILD_MODES[mode])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "child.json")
        try:
            res = subprocess.run([sys.executable, "-c", _CHILD_SCRIPT, SOURCE_ROOT, mode,
                                  folder or "", str(threads), str(rounds), path],
                                 capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return ChildRun(mode=mode, error=f"timed out after {timeout:.0f} s")
        if res.returncode != 0 or not os.path.exists(path):
            lines = [x for x in res.stderr.strip().splitlines() if x.strip()]
            return ChildRun(mode=mode, error=(lines[-1] if lines else
                                              f"exit code {res.returncode}")[:300])
        with open(path) as fh:
            return from_dict(ChildRun, json.load(fh))


def inference_section(threads: int, with_torch: bool, quick: bool = False,
                      step: Callable[[str], None] = lambda label: None) -> InferenceResult:
    """The inference benchmarks: tiny SDPA, layer decode step, GPT-2 generation, processes.

    The layer decode step and manyheads' generation also run in a subprocess
    that never imports torch; the layer decode step once more in a subprocess
    with ``OPENBLAS_NUM_THREADS=1``, between two measurements of it here (this
    process's figure is their mean).  This process sets no environment variable.
    """
    rounds = 3 if quick else 5
    res = InferenceResult(threads=threads, generation_rounds=rounds, layer_shape=LayerShape(),
                          gpt2_shape=GPT2Shape(), tiny_shape=TinyShape(),
                          load_start=load_average())
    res.tiny_sdpa = tiny_sdpa_case(threads, with_torch)
    step("SDPA 12 heads x 1 query x 16 keys")
    # this process's layer step is measured before and after the OPENBLAS_NUM_THREADS=1
    # subprocess, so a change in the machine's load between them shows and averages out
    first = layer_decode_case(threads, with_torch)
    ob1 = run_child("openblas1", None, threads, rounds)
    second = layer_decode_case(threads, with_torch)
    res.layer_decode["main"] = merge_blocks([first, second])
    if ob1.layer is not None:
        res.layer_decode["openblas1"] = ob1.layer
    res.children["openblas1"] = ChildStatus(ob1.error, ob1.torch_in_process, ob1.env)
    step("layer decode step, cache 1024; again under OPENBLAS_NUM_THREADS=1")
    transformers = _transformers() if with_torch else None
    with tempfile.TemporaryDirectory() as folder:
        if transformers is None:
            res.generation_note = ("torch and transformers are needed to make the model and "
                                   "run Hugging Face's generate; not measured")
            step("GPT-2 generation (skipped)")
        else:
            hf_model = gpt2_checkpoint(folder)
            res.generation["main"] = generation_case(folder, threads, rounds, hf_model)
            res.transformers = str(transformers.__version__)
            del hf_model
            step("GPT-2 generation, 200 + 32 tokens")
        child = run_child("no-torch", folder if "main" in res.generation else None, threads,
                          rounds)
        step("subprocess without torch")
    if child.layer is not None:
        res.layer_decode["no_torch"] = child.layer
    if child.generation is not None:
        res.generation["no_torch"] = child.generation
    res.children["no-torch"] = ChildStatus(child.error, child.torch_in_process)
    res.load_end = load_average()
    return res
