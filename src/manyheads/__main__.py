"""``python -m manyheads``: a demo on built-in defaults, ``bench``, ``info``, ``show``,
``generate`` and ``chat``.

    python -m manyheads            # demo: a 768-wide, 12-head layer on built-in text
    python -m manyheads bench      # in a source checkout: python benchmarks/run.py
    python -m manyheads info       # kernel path, OpenMP, threads
    python -m manyheads show --text "..." --out patterns.png   # every head's pattern
    python -m manyheads show --model DIR --layer 5 --text "..."  # a checkpoint's layer
    python -m manyheads generate --model DIR --prompt "..."    # greedy text, streamed
    python -m manyheads generate --model org/name --prompt "..." --do-sample --top-p 0.9
    python -m manyheads chat --model DIR                       # the chat template, stdin
"""
from __future__ import annotations

import argparse
import io
import os
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

import manyheads as mh
from manyheads import oracle
from manyheads.cache import FORMATS
from manyheads.weights import WEIGHT_DTYPES

DEMO_TEXT = (
    "Attention lets every token of a sequence look back at the tokens before it and "
    "decide how much each of them matters. A causal mask hides the future, so a model "
    "that predicts the next token never peeks at it. Multi-head attention runs several "
    "of these lookups side by side, each head with its own queries, keys and values, and "
    "concatenates what they find. On a CPU the work is a stream of small matrix products "
    "and exponentials, and doing it well means never writing the full score matrix to "
    "memory."
)


def demo_input(d_model: int = 768, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    """Byte-level tokens of DEMO_TEXT embedded by a seeded table plus positions: (T, d)."""
    tokens = list(DEMO_TEXT.encode("utf-8"))
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((256, d_model)).astype(np.float32)
    pos = rng.standard_normal((len(tokens), d_model)).astype(np.float32) * 0.1
    x = table[tokens] + pos
    return x, [chr(t) for t in tokens]


def show_input(text: str, d_model: int = 768) -> tuple[np.ndarray, list[str]]:
    """Byte tokens of ``text`` as (T, 768) vectors with three readable parts.

    [one-hot of the token | one-hot of the previous token | sinusoidal position]
    (256 dims each), as if an earlier layer had already copied each token's
    predecessor into it; the ``show`` layer's hand-set heads read these parts.
    Other widths (a saved module's) get a seeded random embedding instead.
    """
    ids = list(text.encode("utf-8"))
    labels = [chr(t) if 32 <= t < 127 else f"\\x{t:02x}" for t in ids]
    T = len(ids)
    if d_model != 768:
        rng = np.random.default_rng(0)
        return (rng.standard_normal((256, d_model)).astype(np.float32)[ids]
                + rng.standard_normal((T, d_model)).astype(np.float32) * 0.1), labels
    x = np.zeros((T, 768), dtype=np.float32)
    x[np.arange(T), ids] = 1.0
    x[np.arange(1, T), 256 + np.array(ids[:-1], dtype=int)] = 1.0
    x[:, 512:] = _positions(T)
    return x, labels


def _positions(T: int, dims: int = 256) -> np.ndarray:
    """Sinusoidal positions: pairs (sin, cos) of pos * w_k, w_k = 10000^(-2k/dims)."""
    w = 10000.0 ** (-np.arange(dims // 2) * 2.0 / dims)
    ang = np.arange(T)[:, None] * w[None, :]
    out = np.empty((T, dims), dtype=np.float32)
    out[:, 0::2], out[:, 1::2] = np.sin(ang), np.cos(ang)
    return out


def show_layer(seed: int = 42) -> mh.MultiHeadAttention:
    """The demo layer (768 wide, 12 heads, seeded) with heads 0-2 set by hand.

    Head 0 is a previous-token head (its queries are positions rotated one step
    back, its keys positions), head 1 a first-token head (a constant query
    against keys that peak at position 0), head 2 an induction head (a
    query's token against each key's previous token).  Heads 3-11 are random.
    """
    m = mh.MultiHeadAttention(768, 768, 4096, 0.0, 12, qkv_bias=True, seed=seed)
    assert m.b_qkv is not None  # qkv_bias=True
    D = 64
    m.W_query[:, 3 * D:] *= 12.0  # sharper random heads: the input vectors are short
    m.W_query[:, :3 * D] = 0
    m.W_key[:, :3 * D] = 0
    m.b_qkv[: 3 * D] = 0
    m.b_qkv[768: 768 + 3 * D] = 0
    w = 10000.0 ** (-np.arange(128) * 2.0 / 256)
    # head 0: 32 position frequency pairs; query rotated by -1 step so q_i . k_j peaks at j = i-1
    pairs = np.arange(0, 64, 2)  # the higher frequencies resolve neighbours
    beta = 24.0
    for n, k in enumerate(pairs):
        c, s = np.cos(w[k]), np.sin(w[k])
        si, ci = 512 + 2 * k, 512 + 2 * k + 1
        # sin(a - w) = sin a cos w - cos a sin w ; cos(a - w) = cos a cos w + sin a sin w
        m.W_query[si, 2 * n] = beta * c
        m.W_query[ci, 2 * n] = -beta * s
        m.W_query[si, 2 * n + 1] = beta * s
        m.W_query[ci, 2 * n + 1] = beta * c
        m.W_key[si, 2 * n] = 1.0
        m.W_key[ci, 2 * n + 1] = 1.0
    # head 1: constant query; key = sum of the cosines, largest (128) at position 0
    m.b_qkv[D] = 6.0
    m.W_key[512 + 1::2, D] = 1.0
    # head 2: token of the query against the previous token of each key
    rng = np.random.default_rng(7)
    codes = rng.standard_normal((256, D))
    codes /= np.linalg.norm(codes, axis=1, keepdims=True)
    m.W_query[:256, 2 * D:3 * D] = codes * 60.0
    m.W_key[256:512, 2 * D:3 * D] = codes
    return m


def _time(fn: Callable[[], Any], repeats: int = 5, settle: float = 0.3) -> tuple[float, Any]:
    """Median seconds of ``repeats`` calls of ``fn`` (and its result), after calls for
    ``settle`` seconds (at most ten): a BLAS library's threads, started when it loads
    (NumPy's at import, SciPy's at manyheads' first projection), spin for about 0.1 s
    and took half the cores from the first calls (the demo's fused layer 2x its time)."""
    result = fn()
    t_end = time.perf_counter() + settle
    for _ in range(9):
        if time.perf_counter() >= t_end:
            break
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), result


def cmd_demo(args: argparse.Namespace) -> int:
    d, H = 768, 12
    x, _ = demo_input(d)
    T = x.shape[0]
    print(f"manyheads {mh.__version__} demo: causal self-attention, d_model={d}, {H} heads "
          f"(head_dim {d // H}), {T} byte tokens of built-in text, float32")
    print(f"kernel path: {mh.kernel_isa()}   threads: {mh.get_num_threads()}")
    fused = mh.MultiHeadAttention(d, d, 1024, 0.0, H, qkv_bias=True, seed=42)
    stacked = fused.to_stacked()
    heads = [(h.W_query, h.W_key, h.W_value, h.b_query, h.b_key, h.b_value)
             for h in stacked.heads]
    t_oracle, ref = _time(lambda: oracle.stacked_multi_head_attention(
        x, heads, fused.W_out, fused.b_out, dtype=np.float64), 3)
    t_fused, y_fused = _time(lambda: fused(x))
    t_stacked, y_stacked = _time(lambda: stacked(x))
    print(f"largest |fused   - oracle(float64)|: {np.abs(y_fused - ref).max():.2e}")
    print(f"largest |stacked - oracle(float64)|: {np.abs(y_stacked - ref).max():.2e}")
    print("median time per call:")
    print(f"  manyheads fused    {t_fused * 1e3:8.2f} ms")
    print(f"  manyheads stacked  {t_stacked * 1e3:8.2f} ms")
    print(f"  NumPy oracle       {t_oracle * 1e3:8.2f} ms  (float64, step by step)")
    try:
        import torch
    except ImportError:
        print("  PyTorch SDPA       (torch not installed: pip install 'manyheads[bench]', "
              "or '.[bench]' in a source checkout)")
    else:
        torch.set_num_threads(mh.get_num_threads())
        F = torch.nn.functional
        tx = torch.from_numpy(x)
        w = torch.from_numpy(np.ascontiguousarray(fused.W_qkv.T))
        b = torch.from_numpy(fused.b_qkv)
        wo = torch.from_numpy(np.ascontiguousarray(fused.W_out.T))
        bo = torch.from_numpy(fused.b_out)

        def torch_layer() -> Any:
            q, k, v = (p.view(T, H, d // H).transpose(0, 1)
                       for p in torch.split(F.linear(tx, w, b), d, dim=-1))
            ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return F.linear(ctx.transpose(0, 1).reshape(T, d), wo, bo)

        with torch.inference_mode():
            t_torch, y_torch = _time(torch_layer)
        print(f"  PyTorch SDPA layer {t_torch * 1e3:8.2f} ms  "
              f"(same weights; largest |torch - oracle|: {np.abs(y_torch.numpy() - ref).max():.2e})")
    _, w = fused(x, return_weights=True)  # (H, T, T): row i holds token i's weights
    ahead = float(np.triu(w, 1).max())  # weights on later tokens
    row_sums = float(np.abs(w.sum(-1) - 1.0).max())
    print(f"attention weights ({H} heads, {T}x{T}): largest weight on a later token "
          f"{ahead:g} (the causal mask); each row sums to 1 within {row_sums:.0e}")
    print("the weights are random (seed 42), so which tokens a head favours means nothing; "
          "`python -m manyheads show` draws hand-set heads")
    return 0


def _load_checkpoint(path: str, revision: str | None = None, weight_dtype: str = "float32"
                     ) -> tuple[Any, Any, str]:
    """(model, tokenizer or None, folder) of a checkpoint folder or Hub id; the tokenizer
    is read from ``tokenizer.json`` when there is one."""
    from manyheads.models import from_pretrained
    from manyheads.models._hub import resolve_checkpoint

    folder = resolve_checkpoint(path, revision)
    model = from_pretrained(folder, weight_dtype=weight_dtype)
    # one-time set-up of the first calls (SciPy's BLAS for products of many rows, the
    # thread pool) belongs to loading, not to the prompt's time
    model.logits([[0] * min(8, model.context_length)])
    tok = None
    tok_path = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(tok_path):
        from manyheads.models._checkpoint import require_package

        tokenizers = require_package("tokenizers", "reading tokenizer.json")
        try:
            tok = tokenizers.Tokenizer.from_file(tok_path)
        except Exception as exc:  # (tokenizers raises a bare Exception for a bad file)
            raise ValueError(f"cannot read {tok_path}: {exc}") from None
    return model, tok, folder


def _text(text: str) -> str:
    """``text`` with the bytes that are not UTF-8 (which Python hands on from the command
    line or stdin as lone surrogates, and tokenizers refuses) as U+FFFD."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _encode(tok: Any, text: str) -> list[int]:
    """Token ids of ``text``: the tokenizer's, or whitespace-separated integers."""
    text = _text(text)
    if tok is not None:
        return list(tok.encode(text).ids)
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError("this checkpoint has no tokenizer.json: give the prompt as token ids, "
                         f"e.g. \"1 2 3\" (got {text!r})") from None


def _check_prompt(model: Any, ids: list[int], new_tokens: int) -> None:
    """Refuse what the model would refuse, before the prompt is echoed: no tokens, ids
    outside the vocabulary, a negative count, more tokens than the context holds."""
    if not ids:
        raise ValueError("the prompt has no tokens")
    vocab = model.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary: ids must be in "
                         f"[0, {vocab - 1}] (vocab_size={vocab})")
    if new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be 0 or more, got {new_tokens}")
    if len(ids) + new_tokens > model.context_length:
        raise ValueError(f"the prompt's {len(ids)} tokens and {new_tokens} new ones exceed "
                         f"the model's context length {model.context_length}")


def _token_labels(tok: Any, ids: list[int]) -> list[str]:
    if tok is None:
        return [str(i) for i in ids]
    return [tok.decode([i], skip_special_tokens=False) or tok.id_to_token(i) or str(i)
            for i in ids]


def _show_checkpoint(args: argparse.Namespace) -> int:
    try:
        model, tok, _ = _load_checkpoint(args.model, args.revision)
        ids = _encode(tok, args.text)
        if len(ids) < 2:
            raise ValueError(f"show needs at least two tokens, the text has {len(ids)}")
        layer = model.num_layers // 2 if args.layer is None else args.layer
        w = model.attention_weights(np.array([ids]), layer)
    except (OSError, ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    layer %= model.num_layers
    print(f"{model}\nlayer {layer} of {model.num_layers}; {len(ids)} tokens")
    return _draw(args, w, ids, _token_labels(tok, ids),
                 f"{model.model_type} layer {layer}: {len(ids)} tokens, {w.shape[0]} heads")


def _draw(args: argparse.Namespace, w: np.ndarray, tokens: Sequence[Any], labels: Sequence[Any],
          title: str) -> int:
    """Print the head roles of weights ``w`` (H, T, T) and write their picture."""
    from manyheads.plot import format_roles, head_roles, plot_attention

    print(format_roles(head_roles(w, tokens)))
    try:
        fig = plot_attention(w, labels, scale=args.scale, title=title)
    except ImportError as exc:
        print(f"{exc}", file=sys.stderr)
        return 2
    fig.savefig(args.out, dpi=args.dpi)
    print(f"wrote {args.out} (colour scale: {args.scale})")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    folder = os.path.dirname(os.path.abspath(args.out))
    problem = (f"--dpi must be a positive number of dots per inch, got {args.dpi}"
               if args.dpi < 1 else
               f"--out {args.out!r}: there is no folder {folder!r}"
               if not os.path.isdir(folder) else None)
    if problem is not None:  # (before anything is computed)
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        return _show(args)
    except (OSError, ValueError) as exc:  # a module file that cannot be read, a full disk
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _show(args: argparse.Namespace) -> int:
    if args.model:
        return _show_checkpoint(args)
    if args.layer is not None:
        print("--layer needs --model (a checkpoint folder)", file=sys.stderr)
        return 2
    if len(args.text.encode("utf-8")) < 2:
        print(f"show needs a text of at least two byte tokens (got {args.text!r}): attention "
              "patterns and head roles are about how a token looks back at earlier ones",
              file=sys.stderr)
        return 2
    if args.weights:
        layer = mh.MultiHeadAttention.load(args.weights)
        source = f"module {args.weights}"
    else:
        layer = show_layer()
        source = "demo layer (heads 0-2 hand-set: previous-token, first-token, induction)"
    x, tokens = show_input(_text(args.text), layer.d_in)
    if len(tokens) > layer.context_length:
        print(f"text has {len(tokens)} byte tokens, more than the layer's context "
              f"{layer.context_length}", file=sys.stderr)
        return 2
    _, w = layer(x, return_weights=True)
    print(f"{source}; {len(tokens)} byte tokens")
    return _draw(args, w, tokens, tokens, f"{len(tokens)} tokens, {w.shape[0]} heads")


SAMPLING_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
                  "min_p": "--min-p", "seed": "--seed"}


# what transformers' generate takes when neither the call nor generation_config.json
# says (its GenerationConfig's defaults); top_k 0 there turns the filter off
HF_SAMPLING_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_k": 50, "top_p": None,
                                        "min_p": None}


def _sampling_kwargs(args: argparse.Namespace, model: Any, tok: Any,
                     folder: str) -> dict[str, Any]:
    """generate's sampling and stop arguments, checked (ValueError): the flags, then, as
    transformers' generate takes them, the checkpoint's generation_config.json and
    transformers' defaults (the repetition penalty applies greedy or not; the
    sampling settings with --do-sample).  With --do-sample, the settings and where
    each came from go to stderr."""
    from manyheads.models._checkpoint import read_json
    from manyheads.models._sampling import check_sampling, check_seed, check_stop

    given = [flag for name, flag in SAMPLING_FLAGS.items() if getattr(args, name) is not None]
    if given and not args.do_sample:
        raise ValueError(f"{', '.join(given)} apply to sampling: add --do-sample")
    kw: dict[str, Any] = {name: getattr(args, name) for name in SAMPLING_FLAGS
                          if getattr(args, name) is not None}
    gen = read_json(folder, "generation_config.json")
    source = {name: "flag" for name in kw}
    if args.repetition_penalty is not None:
        kw["repetition_penalty"], source["repetition_penalty"] = args.repetition_penalty, "flag"
    elif gen.get("repetition_penalty") is not None:
        kw["repetition_penalty"] = gen["repetition_penalty"]
        source["repetition_penalty"] = "generation_config.json"
    if args.do_sample:
        for name, default in HF_SAMPLING_DEFAULTS.items():
            if name in kw:
                continue
            value, where = (gen[name], "generation_config.json") if gen.get(name) is not None \
                else (default, "transformers' default")
            if value is not None and not (name == "top_k" and value == 0):
                kw[name], source[name] = value, where
    try:
        check_sampling(do_sample=args.do_sample, **{k: v for k, v in kw.items() if k != "seed"})
    except ValueError as exc:
        bad = [n for n in kw if source.get(n) == "generation_config.json" and n in str(exc)]
        if not bad:
            raise
        raise ValueError(f"{exc} (from the checkpoint's generation_config.json; a flag "
                         f"overrides it)") from None
    check_seed(kw.get("seed"))
    kw["do_sample"] = args.do_sample
    if args.do_sample:
        shown = ", ".join(f"{n} {'off' if n == 'top_k' and kw[n] == 0 else kw[n]} "
                          f"({source[n]})" for n in
                          ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
                          if n in kw)
        print(f"sampling: {shown or 'the plain distribution'}", file=sys.stderr)
    if args.stop:
        # strings with a tokenizer; a checkpoint without one stops at token ids
        stop: list[Any] = list(args.stop)
        if tok is None:
            try:
                stop = [int(t) for t in stop]
            except ValueError:
                raise ValueError("this checkpoint has no tokenizer.json: --stop takes token "
                                 f"ids (got {args.stop!r})") from None
        check_stop(stop, tok, model.vocab_size)
        kw.update(stop=stop, tokenizer=tok, pad_token_id=0)  # one row: the filler never shows
    return kw


class _Stream:
    """Writes a row's new tokens as they come: their text, decoded with what came before
    (so that a word split into pieces reads right), or their ids without a tokenizer."""

    def __init__(self, tok: Any, ids: list[int], out: Any, hide: Sequence[int] = ()) -> None:
        self.tok, self.ids, self.out, self.hide = tok, ids, out, set(hide)
        self.new: list[int] = []
        self.stamps: list[float] = []
        self.shown = self.pending = ""
        # the text shown is the tokenizer's decoding without special tokens (BOS, EOS)
        self.prompt_text = "" if tok is None else tok.decode(ids, skip_special_tokens=True)

    def __call__(self, step: int, tokens: np.ndarray) -> None:
        self.stamps.append(time.perf_counter())
        t = int(tokens[0])
        if t in self.hide:  # a reply's end
            return
        self.new.append(t)
        if self.tok is None:
            self.out.write(f" {t}")
        else:
            text = self.tok.decode(self.ids + self.new, skip_special_tokens=True)
            # the new text is what follows the prompt's decoding; a tokenizer that
            # rewrites the prompt's text once more tokens follow gets the new tokens
            # decoded on their own
            text = text[len(self.prompt_text):] if text.startswith(self.prompt_text) else \
                self.tok.decode(self.new, skip_special_tokens=True)
            self.pending = text
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                self.out.write(text[len(self.shown):])
                self.shown = text
        self.out.flush()

    def finish(self) -> None:
        """Write what a last incomplete character held back (as the tokenizer decodes it)."""
        if self.pending != self.shown:
            self.out.write(self.pending[len(self.shown):])
            self.shown = self.pending


def _end_ids(folder: str, model: Any, tok: Any) -> list[int]:
    """The ids that end generation (see ``end_token_ids``) that the model can produce."""
    from manyheads.models._chat import end_token_ids

    return [t for t in end_token_ids(folder, model.eos_token_id, tok)
            if 0 <= t < model.vocab_size]


def cmd_generate(args: argparse.Namespace) -> int:
    try:
        t0 = time.perf_counter()
        model, tok, folder = _load_checkpoint(args.model, args.revision, args.weight_dtype)
        load_s = time.perf_counter() - t0
        ids = _encode(tok, args.prompt)
        n = args.max_new_tokens
        _check_prompt(model, ids, n)  # before anything is printed
        kw = _sampling_kwargs(args, model, tok, folder)
        ends = [] if args.ignore_eos else _end_ids(folder, model, tok)
        # the storage name goes to KVCache as it is; it checks it and names what it accepts
        caches = model.new_caches(1, len(ids) + n, args.cache_dtype) if n else []
    except (OSError, ValueError, TypeError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{model}\nloaded in {load_s:.2f} s; kernel path {mh.kernel_isa()}, "
          f"{mh.get_num_threads()} threads; prompt {len(ids)} tokens", file=sys.stderr)
    out = sys.stdout
    stream = _Stream(tok, ids, out)
    out.write(args.prompt if tok is None else stream.prompt_text)
    out.flush()
    start = time.perf_counter()
    try:
        model.generate(np.array([ids]), n, eos_token_id=ends or None, callback=stream,
                       caches=caches or None, **kw)
    except (ValueError, TypeError) as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 2
    stream.finish()
    out.write("\n")
    out.flush()
    stamps = stream.stamps
    if stamps:
        first = stamps[0] - start
        rest = stamps[-1] - stamps[0]
        rate = f"{(len(stamps) - 1) / rest:.1f} tokens/s" if len(stamps) > 1 and rest > 0 \
            else "n/a"
        total = len(stamps) / (stamps[-1] - start)
        nbytes = sum(c.nbytes for c in caches)
        print(f"prompt: {len(ids)} tokens in {first * 1e3:.1f} ms (to the first new token); "
              f"generated {len(stream.new)} tokens: {rate} after the first, {total:.1f} "
              f"tokens/s overall; KV cache {nbytes} bytes ({nbytes / 2**20:.2f} MiB, "
              f"{getattr(caches[0].dtype, 'name', caches[0].dtype)})", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """A conversation on stdin, one user message per line, each reply streamed to stdout
    (the whole conversation, rendered by the chat template, is the prompt of each reply)."""
    from manyheads.models._chat import chat_template, render_chat, special_tokens

    try:
        model, tok, folder = _load_checkpoint(args.model, args.revision, args.weight_dtype)
        if tok is None:
            raise ValueError(f"chat needs the checkpoint's tokenizer.json ({args.model!r} has "
                             "none)")
        template = chat_template(folder)
        specials = special_tokens(folder)
        ends = _end_ids(folder, model, tok)
        kw = _sampling_kwargs(args, model, tok, folder)
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be 1 or more, got {args.max_new_tokens}")
        messages: list[dict[str, str]] = []
        if args.system:
            messages.append({"role": "system", "content": _text(args.system)})
        # a template that cannot render a first message fails here, before any input
        # (many read messages[0], so the probe holds one)
        render_chat(template, messages + [{"role": "user", "content": "hello"}],
                    add_generation_prompt=True, **specials)
    except (OSError, ValueError, TypeError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{model}\nchat: one message a line; end with Ctrl-D", file=sys.stderr)
    out = sys.stdout
    if isinstance(sys.stdin, io.TextIOWrapper):  # (a strict UTF-8 locale would raise)
        sys.stdin.reconfigure(errors="surrogateescape")
    for line in sys.stdin:
        text = _text(line.rstrip("\n"))
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        try:
            prompt = render_chat(template, messages, add_generation_prompt=True, **specials)
            # the template writes the special tokens (BOS and the like) itself
            ids = list(tok.encode(prompt, add_special_tokens=False).ids)
            n = min(args.max_new_tokens, model.context_length - len(ids))
            if n < 1:
                raise ValueError(f"the conversation's {len(ids)} tokens fill the model's "
                                 f"context length {model.context_length}")
            stream = _Stream(tok, ids, out, hide=ends)
            model.generate(np.array([ids]), n, eos_token_id=ends or None, callback=stream,
                           cache_dtype=args.cache_dtype, **kw)
        except (ValueError, TypeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        stream.finish()
        out.write("\n")
        out.flush()
        # one row: generation stops at its end, so the reply is every token shown
        messages.append({"role": "assistant",
                         "content": tok.decode(stream.new, skip_special_tokens=True)})
    return 0


def _shape(text: str, what: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(n) for n in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) < 2 or min(shape) < 0:
        raise SystemExit(f"--explain: {what} shape must be sizes joined by 'x', such as "
                         f"1x12x1x64, got {text!r}")
    return shape


def explain_call(q_shape: tuple[int, ...], k_shape: tuple[int, ...], dtype: str = "float32",
                 cache_dtype: str | None = None, causal: bool = False, gqa: bool = False,
                 threads: int | None = None) -> Any:
    """The plan of attention over zero arrays of these shapes (keys and values alike),
    the keys and values stored in a cache format with ``cache_dtype``."""
    from . import _config, _core, _formats
    from .cache import quantize

    q = np.zeros(q_shape, _formats.by_name(dtype).dtype)  # (zeros: no memory is touched)
    k = np.zeros(k_shape, q.dtype)
    plan = mh.explain(q, k, k, is_causal=causal, enable_gqa=gqa, num_threads=threads)
    if cache_dtype is None or cache_dtype == dtype:
        return plan
    if dtype != "float32":
        raise SystemExit("--cache-dtype serves float32 queries (--dtype float32)")
    kq, ks = quantize(k, cache_dtype)
    # a cache aligns the queries to the end of its keys: that does not change the plan
    return _core.explain(q, kq, kq, k_scale=ks, v_scale=ks, enable_gqa=gqa,
                         num_threads=_config.resolve_num_threads(threads))


def cmd_info(args: argparse.Namespace) -> int:
    if args.explain is None:
        given = [flag for flag, on in (("--dtype", args.dtype is not None),
                                       ("--cache-dtype", args.cache_dtype is not None),
                                       ("--causal", args.causal), ("--gqa", args.gqa),
                                       ("--threads", args.threads is not None)) if on]
        if given:
            print(f"error: {', '.join(given)} describe the call of --explain QUERY KEY",
                  file=sys.stderr)
            return 2
        mh.show_config()
        return 0
    q_shape, k_shape = (_shape(t, w) for t, w in zip(args.explain, ("query", "key")))
    try:
        plan = explain_call(q_shape, k_shape, args.dtype or "float32", args.cache_dtype,
                            args.causal,
                            args.gqa, args.threads)
    except (TypeError, ValueError, MemoryError) as exc:
        print(f"python -m manyheads info --explain: {exc}", file=sys.stderr)
        return 2
    print(plan)
    return 0


# the storage formats a float32 model's KV cache may take besides its own
CACHE_ONLY_FORMATS = tuple(name for name in FORMATS if name not in ("float32", "float64"))

BENCH_SCRIPT = os.path.join("benchmarks", "run.py")

BENCH_ELSEWHERE = """\
The benchmark is not part of the installed package: it lives in the benchmarks/
folder of manyheads' source repository.  In a checkout, run

    python benchmarks/run.py --help

(pip install '.[bench]' there brings the peers it compares with), or from any
folder: python -m manyheads bench --source CHECKOUT [options]."""


def cmd_bench(argv: Sequence[str]) -> int:
    """Run ``benchmarks/run.py`` of a source checkout with the remaining arguments.

    The checkout is the current folder, or the one given by ``--source DIR``;
    without a ``benchmarks/run.py`` there, say where the benchmark lives (exit 2).
    """
    p = argparse.ArgumentParser(prog="python -m manyheads bench", add_help=False,
                                allow_abbrev=False)
    p.add_argument("--source", default=os.curdir)
    args, rest = p.parse_known_args(argv)
    script = os.path.join(args.source, BENCH_SCRIPT)
    if not os.path.isfile(script):
        asked_help = "-h" in rest or "--help" in rest
        print(f"no {BENCH_SCRIPT} in {os.path.abspath(args.source)}\n{BENCH_ELSEWHERE}",
              file=sys.stdout if asked_help else sys.stderr)
        return 0 if asked_help else 2
    import subprocess

    return subprocess.call([sys.executable, script, *rest])


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m manyheads`` (``bench`` hands its arguments on)."""
    parser = argparse.ArgumentParser(prog="python -m manyheads", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"manyheads {mh.__version__}")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("demo", help="run the demo (the default)")
    inf = sub.add_parser("info", help="show the kernel path, OpenMP and thread count; with "
                                      "--explain, what one attention call will do")
    inf.add_argument("--explain", nargs=2, metavar=("QUERY", "KEY"),
                     help="shapes of the queries and of the keys (and values), sizes joined "
                          "by 'x', such as 1x12x1x64 1x12x16384x64: print the call's plan "
                          "(schedule, paths, reads, threads, scratch) instead")
    inf.add_argument("--dtype", choices=("float32", "float64", "float16", "bfloat16"),
                     help="with --explain: the dtype of the arrays (default: float32)")
    inf.add_argument("--cache-dtype", choices=CACHE_ONLY_FORMATS,
                     help="with --explain: keys and values stored in this KV cache format")
    inf.add_argument("--causal", action="store_true", help="with --explain: is_causal=True")
    inf.add_argument("--gqa", action="store_true",
                     help="with --explain: enable_gqa=True (fewer key heads than query heads)")
    inf.add_argument("--threads", type=int,
                     help="with --explain: num_threads (default: manyheads' own)")
    sub.add_parser("bench", add_help=False,
                   help="run the benchmark of a source checkout (benchmarks/run.py; "
                        "--source DIR names the checkout)")
    sh = sub.add_parser("show", help="draw every head's attention pattern for a text")
    sh.add_argument("--text", default="the cat sat on the mat. the cat sat on the mat.",
                    help="the text whose tokens are drawn: one token per byte, or with "
                         "--model the checkpoint's tokens (token ids such as \"1 2 3\" "
                         "without tokenizer.json) (default: %(default)r)")
    sh.add_argument("--out", default="patterns.png", help="PNG file to write")
    sh.add_argument("--weights", help="a module saved with MultiHeadAttention.save")
    sh.add_argument("--model", help="a checkpoint folder (config.json + *.safetensors): "
                                    "draw one of its layers for the text's tokens")
    sh.add_argument("--layer", type=int, help="with --model: the layer to draw (default: the "
                                              "middle one; negative counts from the end)")
    sh.add_argument("--dpi", type=int, default=110,
                    help="resolution of the PNG, dots per inch (default: %(default)s)")
    sh.add_argument("--scale", choices=("row", "power", "log", "linear"), default="row",
                    help="colour scale: each row divided by its largest weight (default), "
                         "a power (gamma 0.5) or log scale of the weights, or linear")
    sh.add_argument("--revision", help="with a Hub id as --model: branch, tag or commit")
    g = sub.add_parser("generate", help="text from a checkpoint, greedy or sampled, streamed")
    _add_model_flags(g, 32)
    g.add_argument("--prompt", required=True,
                   help="the text (token ids such as \"1 2 3\" without tokenizer.json)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence tokens (those of "
                        "config.json, generation_config.json and tokenizer_config.json)")
    c = sub.add_parser("chat", help="a conversation with a checkpoint through its chat "
                                    "template: one message a line on stdin")
    _add_model_flags(c, 256)
    c.add_argument("--system", help="a system message that opens the conversation")
    return parser


def _add_model_flags(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """The flags of ``generate`` and ``chat``: the checkpoint, the cache, the sampling."""
    p.add_argument("--model", required=True,
                   help="checkpoint folder (config.json, *.safetensors, tokenizer.json), or a "
                        "Hugging Face Hub id org/name (cached, or downloaded with "
                        "huggingface_hub)")
    p.add_argument("--revision", help="with a Hub id: branch, tag or commit (default: main)")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help="tokens to generate (per reply) (default: %(default)s)")
    p.add_argument("--cache-dtype", choices=CACHE_ONLY_FORMATS,
                   help="KV cache storage (default: float32, the model's own)")
    p.add_argument("--weight-dtype", default="float32",
                   choices=WEIGHT_DTYPES + ("auto",),
                   help="how the weights are held: auto keeps the file's precision; int8 "
                        "quantises per output column at load (default: %(default)s)")
    s = p.add_argument_group(
        "sampling (transformers' meanings and order; default: greedy). A setting not given "
        "as a flag comes from the checkpoint's generation_config.json, else transformers' "
        "default (with --do-sample: temperature 1, top-k 50; --top-k 0 turns it off)")
    s.add_argument("--do-sample", action="store_true",
                   help="draw each token from the processed distribution")
    s.add_argument("--temperature", type=float, help="divide the logits by it (> 0)")
    s.add_argument("--top-k", type=int,
                   help="keep the k most probable tokens (0: no top-k filter)")
    s.add_argument("--top-p", type=float,
                   help="keep the most probable tokens that add up to this probability")
    s.add_argument("--min-p", type=float,
                   help="drop tokens below this fraction of the top probability")
    s.add_argument("--seed", type=int, help="seed of the draws (the same seed, the same text)")
    s.add_argument("--repetition-penalty", type=float,
                   help="penalise the tokens already seen, greedy or not (default: "
                        "generation_config.json's, else 1.0, none)")
    s.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop once the generated text contains TEXT (a token id without "
                        "tokenizer.json); may be repeated")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # every option after it belongs to benchmarks/run.py
        return cmd_bench(argv[1:])
    args = build_parser().parse_args(argv)
    handlers = {None: cmd_demo, "demo": cmd_demo, "info": cmd_info,
                "show": cmd_show, "generate": cmd_generate, "chat": cmd_chat}
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:  # Ctrl-C: the shell's code for it, without a traceback
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader has gone (| head): stop quietly
        # (stdout to /dev/null, so that the interpreter's last flush does not fail again)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
