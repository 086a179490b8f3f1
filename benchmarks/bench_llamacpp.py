"""Greedy generation against llama.cpp: the same checkpoint, converted by llama.cpp's own tool.

A SmolLM2-135M-shaped Llama checkpoint (30 layers, d=576, 9 heads, 3 key/value heads,
MLP 1536, vocabulary 49152, tied embeddings) with seeded random weights is written as
safetensors, with a tiny SentencePiece ``tokenizer.model`` beside it so that llama.cpp's
``convert_hf_to_gguf.py`` accepts the folder (the converter pads the tokenizer's few
pieces up to the config's 49152 with unused ``[PAD]`` tokens).  The converter writes it
as GGUF in F32, F16 and Q8_0; manyheads loads the safetensors with ``from_pretrained``
at the matching ``weight_dtype`` (float32, bfloat16 against F16, int8 against Q8_0).

``--family gpt_oss`` takes a gpt-oss-shaped checkpoint instead (gpt-oss-20b at a quarter
of its width and a third of its depth: 8 layers, d=768, 16 heads of 64, 2 key/value
heads, 32 experts of 768 of which 4 a token, sinks, sliding and full layers in turn,
vocabulary 32000) with float experts, and a tiny byte-level BPE ``tokenizer.json``;
llama.cpp's converter would refuse its pre-tokenizer, whose hash it does not know, so
it runs with its answer set to gpt-oss's own (``gpt-4o``).  The prompt is token ids
either way.  Its YaRN rounds its correction range (``truncate``), as llama.cpp always
does, so that both engines compute the same model.  A token reads only its experts'
weights, so the decode bound counts every other weight and top_k / num_experts of the
experts' (the average share).

Every measurement runs in a fresh process, so its peak RSS is the whole process: the
interpreter, the library, loading the weights and generating.  Each process runs the
workload twice and reports the second run (the first warms the caches and thread
pools).  The workload: a 128-token prompt of seeded random token ids (no special
tokens; the same ids on both sides), then 64 greedy tokens, one step at a time with
the engine's KV cache (llama.cpp through llama-cpp-python's ``Llama.eval`` and the
logits of the last position; manyheads through ``model.logits`` with
``model.new_caches``), each token the argmax of the logits.  Prefill tokens/s is the
prompt's tokens over the time to the first token's logits; decode tokens/s counts the
63 tokens after the first over their time.  A 2048-token prompt is timed for float32
and F32 as well.  The engines alternate within each round; the figures are medians of
the rounds and each ratio compares medians of one run.

The decode rates are set beside the rate that memory bandwidth allows: each decoded
token reads every weight once, so bytes of weights per token over the read bandwidth
is an upper bound.  Two read rates are used.  Beside each run: in each round's process,
after the measured runs and their memory figures, one more run's decode between two
readings of 256 MiB (``read_beside``), so that the rate bounds the run it was read
beside (a VM's read rate moves by 1.5-2x within seconds).  And the run's best: measured
as the main benchmark measures it (``benchmarks.cases.read_bandwidth``: two threads,
each reducing half of a 1 GiB array with NumPy) before and after every round, or given
with ``--bandwidth``.

Needs an interpreter with ``llama_cpp`` (llama-cpp-python), ``gguf``, ``sentencepiece``,
``torch`` and ``transformers`` for the llama.cpp side (``--llama-python``, default: this
one) and llama.cpp's converter script (``--convert``); without either it says so and
stops.  docs/guide/llamacpp.md shows how to set that up.

    python benchmarks/bench_llamacpp.py --convert LLAMA_CPP/convert_hf_to_gguf.py \\
        --llama-python VENV/bin/python [--rounds 3] [--layers 30] [--out DIR] \\
        [--bandwidth GBPS] [--out-results benchmarks/results/llamacpp.txt] \\
        [--family gpt_oss]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):
    # run as a script: import the benchmark package from the checkout's root
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

# The worker processes of the llama.cpp side run this file with an interpreter that may
# not have manyheads: nothing of manyheads is imported at module level.

#: (manyheads weight_dtype, GGUF outtype, label) of each precision compared.
PRECISIONS = (("float32", "f32", "float32 / F32"),
              ("bfloat16", "f16", "bfloat16 / F16"),
              ("int8", "q8_0", "int8 / Q8_0"))

#: GGUF token types (llama.cpp's llama_token_type) that a prompt may use.
_NORMAL, _UNUSED = 1, 5

#: gpt-oss-20b (d 2880, 24 layers, 64 heads, 8 kv heads, 32 experts of 2880, 4 a token,
#: vocabulary 201088) at about a quarter of its width (768: whole Q8_0 blocks of 32) and
#: a third of its depth
GPT_OSS_SMALL = dict(vocab_size=32000, hidden_size=768, intermediate_size=768,
                     num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2,
                     head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                     sliding_window=128,
                     # (truncate: llama.cpp's YaRN always rounds its correction range out
                     # to whole dimensions, gpt-oss's own setting false does not: with
                     # it llama.cpp computed a model 1e-3 (relative) off transformers')
                     rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                       beta_slow=1.0, truncate=True,
                                       original_max_position_embeddings=4096))


def _proc_status_mib(key: str) -> float | None:
    """A memory line of /proc/self/status (Linux), MiB; None where there is none."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 2**10
    except OSError:
        pass
    return None


def rss_mib() -> float | None:
    """The resident set of this process now, MiB (None where /proc is missing)."""
    return _proc_status_mib("VmRSS")


def peak_rss_mib() -> float:
    """The peak resident set of this process so far, MiB.

    On Linux, ``VmHWM`` of /proc/self/status: ``ru_maxrss`` of a process started from
    a large one begins at its parent's peak (Linux keeps the high-water mark across
    fork and exec), and the benchmark's own process holds the checkpoint while it
    writes it.  Elsewhere ``ru_maxrss`` (KiB; bytes on macOS).
    """
    peak_mib = _proc_status_mib("VmHWM")
    if peak_mib is not None:
        return peak_mib
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def agreement(a: list[int], b: list[int]) -> tuple[int, int | None]:
    """How many positions of two token lists hold the same token, and the first position
    where they differ (None when they do not)."""
    same = [x == y for x, y in zip(a, b)]
    first = next((i for i, s in enumerate(same) if not s), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    return sum(same), first


def decode_bound(bytes_per_token: float, bandwidth_gbps: float) -> float:
    """Tokens/s that reading ``bytes_per_token`` at ``bandwidth_gbps`` (1e9 bytes/s) allows."""
    return bandwidth_gbps * 1e9 / bytes_per_token


#: bytes read by each read-rate measurement beside a decode run (8x a 32 MiB L3)
BESIDE_BYTES = 256 << 20


def read_rate(buf: np.ndarray, threads: int, repeats: int = 3) -> float:
    """GB/s (1e9 bytes/s) of reading ``buf`` once: ``threads`` threads each take NumPy's
    max of their share (max keeps up with memory where a pairwise sum may not); the best
    of ``repeats`` readings."""
    from benchmarks.timing import split_reduction

    read = split_reduction(buf, threads, np.max)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        read()
        best = min(best, time.perf_counter() - t)
    return buf.nbytes / best / 1e9


def read_beside(run: Any, threads: int) -> tuple[float, float, float]:
    """``run()`` (which returns its seconds) between two read-rate measurements in this
    process: (seconds, GB/s read just before, GB/s just after).

    The memory a VM's two cores can read moves by 1.5-2x within seconds (other tenants,
    the host placing the cores); a rate measured beside the run it bounds is what that
    run could have read.  Each measurement waits 0.1 s first, so that an engine's threads
    that spin after their work are idle.
    """
    buf = np.ones(BESIDE_BYTES // 4, np.float32)
    time.sleep(0.1)
    before = read_rate(buf, threads)
    seconds = float(run())
    time.sleep(0.1)
    return seconds, before, read_rate(buf, threads)


def of_rate_beside(bytes_per_token: float, steps: int, rounds: list[dict[str, Any]]) -> float:
    """The median over ``rounds`` of the weights' read rate in each round's run beside its
    read-rate measurements (``beside``: seconds, GB/s before, GB/s after), as a fraction
    of the mean of those two measurements."""
    fractions = [bytes_per_token * steps / x["beside"][0] / 1e9
                 / ((x["beside"][1] + x["beside"][2]) / 2) for x in rounds]
    return float(np.median(fractions))


# -- worker processes ----------------------------------------------------------------


def _greedy_llama(llm: Any, llama_cpp: Any, prompt: list[int], new: int
                  ) -> tuple[float, float, list[int]]:
    """Prefill seconds, decode seconds and the ``new`` greedy tokens of llama.cpp."""
    n_vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                     shape=(n_vocab,))

    llm.reset()  # the next eval drops the cache from position 0 on
    t0 = time.perf_counter()
    llm.eval(prompt)
    tok = int(np.argmax(last_logits()))
    t1 = time.perf_counter()
    tokens = [tok]
    for _ in range(new - 1):
        llm.eval([tok])
        tok = int(np.argmax(last_logits()))
        tokens.append(tok)
    return t1 - t0, time.perf_counter() - t1, tokens


def _greedy_manyheads(model: Any, prompt: list[int], new: int
                      ) -> tuple[float, float, list[int]]:
    """The same with manyheads' model.logits and its caches."""
    caches = model.new_caches(1, len(prompt) + new)
    ids = np.asarray(prompt, np.int64)[None]
    t0 = time.perf_counter()
    tok = np.argmax(model.logits(ids, caches=caches, last_only=True)[:, -1], -1)[:, None]
    t1 = time.perf_counter()
    tokens = [int(tok[0, 0])]
    for _ in range(new - 1):
        tok = np.argmax(model.logits(tok, caches=caches, last_only=True)[:, -1], -1)[:, None]
        tokens.append(int(tok[0, 0]))
    return t1 - t0, time.perf_counter() - t1, tokens


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """One measurement (or a chore of the llama.cpp side) in this fresh process."""
    task = job["task"]
    if task == "probe":
        import importlib.metadata as md

        import llama_cpp
        versions: dict[str, str | None] = {}
        for name in ("llama_cpp_python", "gguf", "sentencepiece", "torch", "transformers"):
            try:
                versions[name] = md.version(name)
            except md.PackageNotFoundError:
                versions[name] = None
        return {"versions": versions,
                "system": llama_cpp.llama_print_system_info().decode().strip()}
    if task == "tokenizer":
        import io

        import sentencepiece as spm
        buf = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(job["sentences"]), model_writer=buf,
            vocab_size=job["vocab"], model_type="bpe", hard_vocab_limit=False,
            minloglevel=2)
        with open(os.path.join(job["folder"], "tokenizer.model"), "wb") as f:
            f.write(buf.getvalue())
        return {"pieces": spm.SentencePieceProcessor(model_proto=buf.getvalue()).vocab_size()}
    if task == "bpe_tokenizer":
        import tokenizers as tk
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=job["vocab"], show_progress=False,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(job["sentences"], trainer=trainer)
        tok.save(os.path.join(job["folder"], "tokenizer.json"))
        with open(os.path.join(job["folder"], "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
        return {"pieces": tok.get_vocab_size()}
    if task == "convert":  # the converter with its pre-tokenizer answer set (see above)
        import runpy
        sys.path.insert(0, os.path.dirname(os.path.abspath(job["script"])))
        from conversion import base  # (llama.cpp's converter package, as of 0.3.36)
        base.TextModel.get_vocab_base_pre = lambda self, tokenizer: job["pre"]
        sys.argv = [job["script"], *job["argv"]]
        runpy.run_path(job["script"], run_name="__main__")
        return {}
    if task == "inspect":
        import gguf
        reader = gguf.GGUFReader(job["gguf"])
        field = reader.fields["tokenizer.ggml.token_type"]
        types = [int(field.parts[i][0]) for i in field.data]
        return {"tensor_bytes": sum(int(t.n_bytes) for t in reader.tensors),
                "expert_bytes": sum(int(t.n_bytes) for t in reader.tensors
                                    if "_exps" in t.name),
                "tensor_types": sorted({t.tensor_type.name for t in reader.tensors}),
                "token_types": types}

    new, repeats = job["new"], 2
    if task == "llama":
        import llama_cpp
        rss_import = peak_rss_mib()
        kv = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}[job["kv"]]
        t0 = time.perf_counter()
        llm = llama_cpp.Llama(job["gguf"], n_ctx=len(job["prompt"]) + new,
                              n_batch=job["n_batch"], n_ubatch=job["n_batch"],
                              n_threads=job["threads"], n_threads_batch=job["threads"],
                              type_k=kv, type_v=kv, flash_attn=job["flash_attn"],
                              verbose=False)
        load = time.perf_counter() - t0
        rss_load = peak_rss_mib()

        def run() -> list[Any]:
            return list(_greedy_llama(llm, llama_cpp, job["prompt"], new))
        weight_bytes = expert_bytes = None
    else:
        import manyheads as mh
        from manyheads.models import from_pretrained
        rss_import = peak_rss_mib()
        mh.set_num_threads(job["threads"])
        t0 = time.perf_counter()
        model = from_pretrained(job["folder"], weight_dtype=job["weight_dtype"])
        load = time.perf_counter() - t0
        rss_load = peak_rss_mib()

        def run() -> list[Any]:
            return list(_greedy_manyheads(model, job["prompt"], new))
        weight_bytes = sum(int(p.nbytes) for p in model.parameters())
        expert_bytes = sum(int(w.nbytes) for b in model.blocks
                           for ws in (getattr(b, "w_gate_up", None), getattr(b, "w_down", None))
                           if isinstance(ws, list) for w in ws)
    runs = [run() for _ in range(repeats)]
    prefill, decode, tokens = runs[-1]
    result = {"load_s": load, "prefill_s": prefill, "decode_s": decode, "tokens": tokens,
              "weight_bytes": weight_bytes, "expert_bytes": expert_bytes,
              "rss_import_mib": rss_import,
              "rss_load_mib": rss_load, "peak_rss_mib": peak_rss_mib(),
              "rss_end_mib": rss_mib()}
    if new > 1:  # after the memory figures: the read-rate buffer is not the engine's
        def decode_only() -> float:
            runs.append(run())
            return float(runs[-1][1])

        result["beside"] = read_beside(decode_only, job["threads"])
    result["same_tokens_each_run"] = all(r[2] == tokens for r in runs)
    return result


def run_worker(python: str, job: dict[str, Any]) -> dict[str, Any]:
    """Run ``job`` in a fresh ``python`` process running this file; its result."""
    proc = subprocess.run([python, os.path.abspath(__file__), "--worker", json.dumps(job)],
                          capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the {job['task']} worker failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# -- the benchmark -------------------------------------------------------------------


def convert(python: str, script: str, folder: str, outtype: str, out: str,
            pre: str | None = None) -> None:
    """llama.cpp's converter: the checkpoint ``folder`` to GGUF ``out`` in ``outtype``
    (with ``pre``: its pre-tokenizer taken to be that one)."""
    part = out + ".part"  # renamed when whole: a later run never reuses a broken file
    argv = [folder, "--outtype", outtype, "--outfile", part]
    cmd = [python, script, *argv] if pre is None else [
        python, os.path.abspath(__file__), "--worker",
        json.dumps({"task": "convert", "script": script, "argv": argv, "pre": pre})]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.isfile(part):
        raise RuntimeError(f"convert_hf_to_gguf.py --outtype {outtype} failed "
                           f"(exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    os.replace(part, out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--convert", metavar="PATH",
                    help="llama.cpp's convert_hf_to_gguf.py (from llama.cpp's source or "
                         "the llama-cpp-python sdist)")
    ap.add_argument("--llama-python", default=sys.executable, metavar="PYTHON",
                    help="interpreter with llama_cpp and the converter's needs "
                         "(default: this one)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    ap.add_argument("--family", choices=("llama", "gpt_oss"), default="llama",
                    help="the checkpoint's shape: SmolLM2-135M (llama) or a small gpt-oss")
    ap.add_argument("--layers", type=int, help="fewer for a quick look (default 30 for "
                                               "llama, 8 for gpt_oss)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--long-prompt", type=int, default=2048,
                    help="prompt of the float32 / F32 prefill-only run (0: skip it)")
    ap.add_argument("--threads", type=int, default=2, help="threads of each engine")
    ap.add_argument("--n-batch", type=int, default=512,
                    help="llama.cpp's n_batch and n_ubatch (its default, 512)")
    ap.add_argument("--kv", choices=("f32", "f16"), default="f32",
                    help="llama.cpp's KV cache type (default f32, as manyheads' cache; "
                         "llama.cpp's own default is f16)")
    ap.add_argument("--flash-attn", action="store_true",
                    help="llama.cpp's flash attention (llama-cpp-python's default: off)")
    ap.add_argument("--tokenizer-vocab", type=int, default=64,
                    help="pieces of the tiny SentencePiece tokenizer")
    ap.add_argument("--bandwidth", type=float, metavar="GBPS",
                    help="read bandwidth for the decode bound, GB/s (default: measured)")
    ap.add_argument("--out", help="folder for the checkpoint and GGUF files, kept and "
                                  "reused (default: a temporary one)")
    ap.add_argument("--out-results", metavar="FILE", help="also write the report to FILE")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0

    if not args.convert:
        print("bench_llamacpp: skipped, no converter given (--convert "
              "PATH/convert_hf_to_gguf.py); see docs/guide/llamacpp.md")
        return 0
    if not os.path.isfile(args.convert):
        print(f"bench_llamacpp: skipped, {os.path.basename(args.convert)} is not a file "
              "(--convert)")
        return 0
    try:
        probe = run_worker(args.llama_python, {"task": "probe"})
    except RuntimeError as failure:
        last = str(failure).strip().splitlines()[-1]
        print("bench_llamacpp: skipped, the --llama-python interpreter cannot import "
              f"llama_cpp ({last})")
        return 0

    import manyheads as mh
    from benchmarks.bench_generate import SMOLLM2_135M
    from benchmarks.cases import read_bandwidth
    from benchmarks.timing import load_average
    from manyheads.models.random import TOKENIZER_TEXT, save_random_checkpoint

    def note(msg: str) -> None:
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()

    t_start = time.perf_counter()
    load_start = load_average()
    folder = args.out or tempfile.mkdtemp(prefix="bench-llamacpp-")
    ckpt = os.path.join(folder, "checkpoint")
    oss = args.family == "gpt_oss"
    if args.layers is None:
        args.layers = 8 if oss else 30
    cfg = dict(GPT_OSS_SMALL if oss else SMOLLM2_135M, num_hidden_layers=args.layers)
    if not os.path.isfile(os.path.join(ckpt, "model.safetensors")):
        note("writing the random checkpoint")
        save_random_checkpoint(ckpt, args.family, seed=0, **cfg)
    sentences = [s.strip() for s in TOKENIZER_TEXT.split(".") if s.strip()]
    if oss and not os.path.isfile(os.path.join(ckpt, "tokenizer.json")):
        run_worker(args.llama_python, {"task": "bpe_tokenizer", "folder": ckpt,
                                       "sentences": sentences, "vocab": 300})
    if not oss and not os.path.isfile(os.path.join(ckpt, "tokenizer.model")):
        run_worker(args.llama_python, {"task": "tokenizer", "folder": ckpt,
                                       "sentences": sentences, "vocab": args.tokenizer_vocab})
    ggufs, inspected = {}, {}
    for _, outtype, _ in PRECISIONS:
        ggufs[outtype] = os.path.join(folder, f"model-{outtype}.gguf")
        if not os.path.isfile(ggufs[outtype]):
            note(f"converting to GGUF {outtype}")
            convert(args.llama_python, args.convert, ckpt, outtype, ggufs[outtype],
                    "gpt-4o" if oss else None)
        inspected[outtype] = run_worker(args.llama_python,
                                        {"task": "inspect", "gguf": ggufs[outtype]})

    token_types = np.asarray(inspected["f32"]["token_types"])
    # (the BPE tokenizer's padding is user-defined [PAD] tokens: normal ones only)
    allowed = np.flatnonzero((token_types == _NORMAL) | ((token_types == _UNUSED) & (not oss)))
    rng = np.random.default_rng(1)
    prompt = rng.choice(allowed, size=args.prompt).tolist()
    long_prompt = rng.choice(allowed, size=args.long_prompt).tolist()

    bandwidths: list[float] = []

    def measure_bandwidth() -> None:
        if args.bandwidth is None:
            note("measuring the read bandwidth")
            bandwidths.append(read_bandwidth(args.threads).best)

    measure_bandwidth()

    common = {"threads": args.threads, "new": args.new}
    llama_opts = {"n_batch": args.n_batch, "kv": args.kv, "flash_attn": args.flash_attn}

    def llama_job(outtype: str, ids: list[int], new: int) -> dict[str, Any]:
        return {**common, **llama_opts, "task": "llama", "gguf": ggufs[outtype],
                "prompt": ids, "new": new}

    def ours_job(dtype: str, ids: list[int], new: int) -> dict[str, Any]:
        return {**common, "task": "manyheads", "folder": ckpt, "weight_dtype": dtype,
                "prompt": ids, "new": new}

    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    jobs_per_round = 2 * len(PRECISIONS) + (2 if args.long_prompt else 0)
    done = 0
    for r in range(args.rounds):
        for dtype, outtype, label in PRECISIONS:
            pair = [("llama.cpp", llama_job(outtype, prompt, args.new)),
                    ("manyheads", ours_job(dtype, prompt, args.new))]
            for engine, job in pair if r % 2 == 0 else pair[::-1]:
                results.setdefault((label, engine), []).append(
                    run_worker(args.llama_python if engine == "llama.cpp" else sys.executable,
                               job))
                done += 1
                note(f"round {r + 1}/{args.rounds}: {engine} {label} "
                     f"({done}/{jobs_per_round * args.rounds})")
        if args.long_prompt:
            pair = [("llama.cpp", llama_job("f32", long_prompt, 1)),
                    ("manyheads", ours_job("float32", long_prompt, 1))]
            for engine, job in pair if r % 2 == 0 else pair[::-1]:
                results.setdefault(("long", engine), []).append(
                    run_worker(args.llama_python if engine == "llama.cpp" else sys.executable,
                               job))
                done += 1
                note(f"round {r + 1}/{args.rounds}: {engine} {args.long_prompt}-token "
                     f"prefill ({done}/{jobs_per_round * args.rounds})")
        measure_bandwidth()
    elapsed = time.perf_counter() - t_start

    def med(label: str, engine: str, key: str) -> float:
        return float(np.median([x[key] for x in results[(label, engine)]]))

    engines = ("llama.cpp", "manyheads")
    steps = args.new - 1
    out: list[str] = []
    say = out.append
    v = probe["versions"]
    say(f"manyheads {mh.__version__} ({mh.kernel_isa()}) against llama.cpp through "
        f"llama-cpp-python {v['llama_cpp_python']} (converter with gguf {v['gguf']}, "
        f"torch {v['torch']}, transformers {v['transformers']}, "
        f"sentencepiece {v['sentencepiece']})")
    say(f"llama.cpp {probe['system']}")
    if oss:
        say(f"gpt-oss-shaped model, random weights (seed 0): {args.layers} layers, d 768, "
            "16 heads of 64, 2 kv heads, 32 experts of 768 (4 a token), sinks, window 128 "
            "in every other layer, vocab 32000; float experts")
        pieces = int(np.count_nonzero(token_types == _NORMAL))
        say(f"tokenizer: byte-level BPE of {pieces} pieces (llama.cpp's converter told its "
            f"pre-tokenizer is gpt-4o, gpt-oss's own); padded to {len(token_types)}")
    else:
        say(f"SmolLM2-135M-shaped Llama, random weights (seed 0): {args.layers} layers, "
            "d 576, 9 heads, 3 kv heads, MLP 1536, vocab 49152, tied embeddings")
        pieces = int(np.count_nonzero(token_types != _UNUSED))
        say(f"tokenizer: SentencePiece BPE of {pieces} pieces; llama.cpp's converter padded "
            f"its vocabulary to {len(token_types)} with "
            f"{int(np.count_nonzero(token_types == _UNUSED))} unused [PAD] tokens")
    say(f"{args.threads} threads each; llama.cpp n_batch = n_ubatch = {args.n_batch}, "
        f"KV cache {args.kv}, flash attention {'on' if args.flash_attn else 'off'}; "
        "manyheads float32 KV cache")
    say(f"every figure: median of {args.rounds} rounds, each engine and precision in a "
        "fresh process per round (its second run; peak RSS of the whole process)")
    say("")
    say(f"{args.prompt}-token prompt, then {args.new} greedy tokens "
        f"(decode: the {steps} after the first); RSS in MiB:")
    say(f"  {'precision':<16}{'engine':<12}{'prefill tok/s':>14}{'decode tok/s':>13}"
        f"{'peak RSS':>10}{'after load':>11}{'at end':>8}{'load s':>8}")
    for _, _, label in PRECISIONS:
        row: dict[str, tuple[float, float, float]] = {}
        for engine in engines:
            pre = args.prompt / med(label, engine, "prefill_s")
            dec = steps / med(label, engine, "decode_s")
            rss = med(label, engine, "peak_rss_mib")
            row[engine] = (pre, dec, rss)
            say(f"  {label if engine == engines[0] else '':<16}{engine:<12}{pre:14.1f}"
                f"{dec:13.1f}{rss:10.0f}{med(label, engine, 'rss_load_mib'):11.0f}"
                f"{med(label, engine, 'rss_end_mib'):8.0f}{med(label, engine, 'load_s'):8.2f}")
        a, b = row["manyheads"], row["llama.cpp"]
        say(f"  {'':<16}{'ratio m/l':<12}{a[0] / b[0]:13.2f}x{a[1] / b[1]:12.2f}x"
            f"{a[2] / b[2]:9.2f}x")
    imp = {e: med("float32 / F32", e, "rss_import_mib") for e in engines}
    say("  ratio m/l: manyheads over llama.cpp.  peak RSS: the whole process, loading and "
        "both measured runs (taken before the read-rate run below); after load: the peak "
        "when the model had loaded; at end: resident after the measured runs.  With the "
        "library imported, before loading, the interpreter held "
        f"{imp['llama.cpp']:.0f} MiB (llama.cpp) and {imp['manyheads']:.0f} MiB (manyheads).  "
        "llama.cpp maps the GGUF file and computes from the mapping; manyheads reads the "
        "safetensors file a slice of rows at a time into the chosen precision (no "
        "mapping), so it holds about its weights in that precision.")
    say("  each round, prefill / decode tok/s (a busy machine shows here first):")
    for _, _, label in PRECISIONS:
        for engine in engines:
            each = "  ".join(f"{args.prompt / x['prefill_s']:6.1f} / {steps / x['decode_s']:5.1f}"
                             for x in results[(label, engine)])
            say(f"    {label if engine == engines[0] else '':<16}{engine:<12}{each}")
    if args.long_prompt:
        say("")
        say(f"{args.long_prompt}-token prompt, prefill only (float32 / F32):")
        pre = {e: args.long_prompt / med("long", e, "prefill_s") for e in engines}
        for e in engines:
            each = "  ".join(f"{args.long_prompt / x['prefill_s']:6.1f}"
                             for x in results[("long", e)])
            say(f"  {e:<12}{pre[e]:8.1f} tok/s ({med('long', e, 'prefill_s'):5.2f} s), "
                f"peak RSS {med('long', e, 'peak_rss_mib'):5.0f} MiB; each round: {each}")
        say(f"  ratio m/l   {pre['manyheads'] / pre['llama.cpp']:7.2f}x")
    say("")
    say(f"greedy agreement over the {args.new} tokens (first round; not asserted):")
    for _, _, label in PRECISIONS:
        ta = results[(label, "manyheads")][0]["tokens"]
        tb = results[(label, "llama.cpp")][0]["tokens"]
        n, first = agreement(ta, tb)
        steady = all(x["tokens"] == ta and x["same_tokens_each_run"]
                     for x in results[(label, "manyheads")]) and all(
            x["tokens"] == tb and x["same_tokens_each_run"]
            for x in results[(label, "llama.cpp")])
        where = "identical" if first is None else f"first difference at token {first}"
        say(f"  {label:<16}{n:3d}/{args.new} positions agree, {where}"
            f"{'' if steady else ' (an engine changed its tokens from one run to the next)'}")
    say("")
    if args.bandwidth is not None:
        bandwidth = args.bandwidth
        basis = f"{bandwidth:.1f} GB/s given with --bandwidth"
    else:
        bandwidth = max(bandwidths)
        basis = (f"{bandwidth:.1f} GB/s, the best of {len(bandwidths)} measurements in this "
                 "run (" + ", ".join(f"{b:.1f}" for b in bandwidths) + f"; {args.threads} "
                 "threads each reducing its share of a 1 GiB array with NumPy's sum and max, "
                 "as the main benchmark measures it)")
    share = cfg["num_experts_per_tok"] / cfg["num_local_experts"] if oss else 1.0

    def active(total: float, experts: float | None) -> float:
        """Bytes a decoded token reads: its share of the experts, every other weight."""
        return total - (1 - share) * (experts or 0.0)

    say("decode against the memory-bandwidth bound (each decoded token reads every weight "
        + ("once, of the experts its own: on average top_k / num_experts of their bytes):"
           if oss else "once):"))
    say(f"  {'precision':<16}{'engine':<12}{'MB/token':>10}{'decode tok/s':>14}"
        f"{'GB/s read':>11}{'read beside':>13}{'of it':>7}{'bound tok/s':>13}"
        f"{'of bound':>10}")
    for _, outtype, label in PRECISIONS:
        per_token = {"llama.cpp": active(float(inspected[outtype]["tensor_bytes"]),
                                         float(inspected[outtype]["expert_bytes"])),
                     "manyheads": active(med(label, "manyheads", "weight_bytes"),
                                         med(label, "manyheads", "expert_bytes"))}
        for engine in engines:
            rounds = results[(label, engine)]
            bound = decode_bound(per_token[engine], bandwidth)
            dec = steps / med(label, engine, "decode_s")
            beside = float(np.median([(x["beside"][1] + x["beside"][2]) / 2 for x in rounds]))
            say(f"  {label if engine == engines[0] else '':<16}{engine:<12}"
                f"{per_token[engine] / 1e6:10.1f}{dec:14.1f}"
                f"{dec * per_token[engine] / 1e9:11.1f}{beside:13.1f}"
                f"{of_rate_beside(per_token[engine], steps, rounds):7.0%}"
                f"{bound:13.1f}{dec / bound:10.0%}")
    say("  MB/token: the bytes of every weight held (the tied embedding matrix is the "
        "output head" + ("; the experts' at their average share" if oss else "")
        + "); GB/s read: decode tok/s times MB/token, the rate at which the "
        "engine streamed its weights.  read beside: in each round's process, after the "
        f"measured runs, a third run's decode between two readings of {BESIDE_BYTES >> 20} "
        f"MiB ({args.threads} threads, NumPy's max, best of 3 each), their mean (median "
        "over rounds); of it: that run's weights' read rate over the mean beside it, median "
        f"over rounds.  bound tok/s and of bound: against {basis}.  A shared machine's read "
        "rate can move by 1.5-2x within seconds, so the rate read beside each run is the "
        "fairer bound; of bound is a lower estimate.")
    load_end = load_average()
    say("")
    say(f"(benchmark ran {elapsed:.0f} s, 1-minute load average "
        f"{load_start if load_start is not None else float('nan'):.2f} at the start and "
        f"{load_end if load_end is not None else float('nan'):.2f} at the end; a shared "
        "2-core machine moves single runs by 10-30%: repeat it)")
    text = "\n".join(out) + "\n"
    sys.stdout.write(text)
    if args.out_results:
        with open(args.out_results, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
