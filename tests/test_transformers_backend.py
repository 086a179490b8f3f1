"""attn_implementation="manyheads" in transformers' own terms: tiny random models of six
architectures, built here (nothing downloaded), against the same weights run with
attn_implementation="eager" (and "sdpa")."""
import copy
import inspect
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
mhtf = pytest.importorskip("manyheads.transformers")
import manyheads._core as core  # noqa: E402

VOCAB, PAD = 128, 0
PROMPT, PADDING, NEW_TOKENS = 30, 6, 24
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              # larger than the default 0.02, so that a random model's greedy tokens vary
              initializer_range=0.2, pad_token_id=PAD, bos_token_id=1, eos_token_id=None)
# the window (8) is shorter than the prompts, so it hides keys in prefill and in decoding
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=8),
    "phi3": lambda: transformers.Phi3Config(**COMMON),
    # a small soft cap, so that it changes the scores of these small random weights; with
    # tied embeddings this random model would repeat its last token forever
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=8,
                                                attn_logit_softcapping=2.0,
                                                query_pre_attn_scalar=16,
                                                tie_word_embeddings=False),
    # (YaRN's factor 32 over its 4096 original positions: the length that makes them agree)
    "gpt_oss": lambda: transformers.GptOssConfig(**{**COMMON, "max_position_embeddings": 131072},
                                                 head_dim=16, sliding_window=8,
                                                 num_local_experts=4, num_experts_per_tok=2),
}
ARCHS = list(CONFIGS)
# the models' cache argument: `cache` in recent releases, `past_key_values` in 5.0
CACHE = ("cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters
         else "past_key_values")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """torch's own threads are not what these tests check; on a busy two-core machine they
    make each step of these tiny models many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def name():
    return mhtf.register()


_PAIRS = {}


def pair(arch, name):
    """(eager model, manyheads model) with the same random weights, in eval mode."""
    if arch not in _PAIRS:
        config = CONFIGS[arch]()
        torch.manual_seed(0)
        eager = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="eager").eval()
        ours = transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(config), attn_implementation=name).eval()
        ours.load_state_dict(eager.state_dict())
        _PAIRS[arch] = eager, ours
    return _PAIRS[arch]


def left_padded_batch(seed=0):
    """Two prompts of PROMPT tokens, the second with PADDING pad tokens on the left."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (2, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :PADDING], mask[1, :PADDING] = PAD, 0
    return ids, mask


def assert_logits_close(theirs, ours, tol=1e-4):
    """Every real position; a padded position attends nothing real, so its output is
    arbitrary (zeros here, an average of padding in eager)."""
    assert (theirs[0] - ours[0]).abs().max().item() <= tol
    assert (theirs[1, PADDING:] - ours[1, PADDING:]).abs().max().item() <= tol


@pytest.fixture
def kernel_calls(monkeypatch):
    """The arguments of every core attention call: (q, k, v, keywords)."""
    calls = []
    original = core.attention

    def spy(q, k, v, **kw):
        calls.append((q, k, v, kw))
        return original(q, k, v, **kw)

    monkeypatch.setattr(core, "attention", spy)
    return calls


def test_register_names_the_backend_for_from_pretrained(name, tmp_path):
    eager, _ = pair("llama", name)
    eager.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="manyheads").eval()
    assert name == "manyheads" == loaded.config._attn_implementation
    ids, mask = left_padded_batch()
    with torch.no_grad():
        assert_logits_close(eager(ids, attention_mask=mask).logits,
                            loaded(ids, attention_mask=mask).logits)
    assert mhtf.register() == name  # again: no harm


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_eager_on_a_left_padded_batch(arch, name):
    eager, ours = pair(arch, name)
    ids, mask = left_padded_batch()
    with torch.no_grad():
        assert_logits_close(eager(ids, attention_mask=mask).logits,
                            ours(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("arch,cache", [(arch, "dynamic") for arch in ARCHS]
                         + [(arch, "static") for arch in ("llama", "mistral", "gemma2")])
def test_greedy_tokens_match_eager(arch, cache, name):
    """From transformers' dynamic cache, and from a static one (whose whole buffer the
    kernels read, the empty slots masked)."""
    eager, ours = pair(arch, name)
    ids, mask = left_padded_batch(seed=1 if cache == "dynamic" else 2)
    kw = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD)
    with torch.no_grad():
        expected = eager.generate(ids, **kw)
        got = ours.generate(ids, **kw, **({"cache_implementation": "static"}
                                            if cache == "static" else {}))
    assert expected.shape == (2, PROMPT + NEW_TOKENS)
    assert len(set(expected[0, PROMPT:].tolist())) > 3  # the tokens wander: a real check
    assert torch.equal(got, expected)


def test_logits_match_sdpa(name):
    eager, ours = pair("llama", name)
    sdpa = copy.deepcopy(eager)
    sdpa.set_attn_implementation("sdpa")
    ids, mask = left_padded_batch()
    with torch.no_grad():
        assert_logits_close(sdpa(ids, attention_mask=mask).logits,
                            ours(ids, attention_mask=mask).logits)
        assert (sdpa(ids).logits - ours(ids).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch,change", [("mistral", {"sliding_window": None}),
                                         ("gemma2", {"attn_logit_softcapping": None})])
def test_the_window_and_the_soft_cap_matter_to_these_models(arch, change, name):
    """The comparisons above would not notice a dropped window or soft cap otherwise."""
    eager, _ = pair(arch, name)
    config = copy.deepcopy(eager.config)
    for key, value in change.items():
        setattr(config, key, value)
    if arch == "gemma2":
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    other = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager").eval()
    other.load_state_dict(eager.state_dict())
    ids, _ = left_padded_batch()
    with torch.no_grad():
        assert (eager(ids).logits - other(ids).logits).abs().max().item() > 1e-3


def test_plain_causal_prefill_reaches_the_kernels_without_a_mask(name, kernel_calls):
    _, ours = pair("llama", name)
    ids, _ = left_padded_batch()
    with torch.no_grad():
        ours(ids)
    assert len(kernel_calls) == ours.config.num_hidden_layers
    for q, k, v, kw in kernel_calls:
        assert kw["mask"] is None and kw["causal_offset"] == 0  # the causal schedule
        assert kw["enable_gqa"] and k.shape[1] == 2 and q.shape[1] == 4  # kv heads shared
        assert kw["out"].shape == (2, 4, PROMPT, 16)


def test_sliding_windows_reach_the_kernels_as_a_window_not_a_mask(name, kernel_calls):
    """Without padding, a sliding layer runs the causal schedule with its window (Gemma 2:
    sliding and full layers alternate), and a decode step reads the window's keys only."""
    _, ours = pair("gemma2", name)
    ids, _ = left_padded_batch()
    cache = transformers.DynamicCache(config=ours.config)
    with torch.no_grad():
        out = ours(ids, use_cache=True, **{CACHE: cache})
        prefill = list(kernel_calls)
        del kernel_calls[:]
        ours(out.logits[:, -1:].argmax(-1), use_cache=True, **{CACHE: cache})
    windows = [8 if t == "sliding_attention" else None for t in ours.config.layer_types]
    assert 8 in windows and None in windows
    assert [kw["window"] for _, _, _, kw in prefill] == windows
    for _, k, _, kw in prefill:
        assert kw["mask"] is None and kw["causal_offset"] == 0 and k.shape[2] == PROMPT
    for (_, k, _, kw), window in zip(kernel_calls, windows):
        assert kw["mask"] is None and kw["causal_offset"] is None and kw["window"] is None
        assert k.shape[2] == (PROMPT + 1 if window is None else 8)


def test_padding_and_windows_arrive_as_boolean_masks(name, kernel_calls):
    _, ours = pair("mistral", name)
    ids, mask = left_padded_batch()
    with torch.no_grad():
        ours(ids, attention_mask=mask)
    for _, _, _, kw in kernel_calls:
        assert kw["causal_offset"] is None
        assert kw["mask"].dtype == bool and kw["mask"].shape == (2, 1, PROMPT, PROMPT)
        assert not kw["mask"][0, 0, -1, :-8].any()  # the window of 8
        assert not kw["mask"][1, 0, :, :PADDING].any()  # the padding


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_cache_tensors_are_read_in_place(cache_kind, name, kernel_calls, monkeypatch):
    _, ours = pair("llama", name)
    config = ours.config
    if cache_kind == "static":
        cache = transformers.StaticCache(config=config, max_cache_len=64)
    else:
        cache = transformers.DynamicCache(config=config)
    ids, _ = left_padded_batch()
    copied = []
    original = core.kernel_ready

    def kernel_ready(arr, contiguous_rows=True):
        kept = original(arr, contiguous_rows)
        copied.append(kept.ctypes.data != arr.ctypes.data)
        return kept

    monkeypatch.setattr(core, "kernel_ready", kernel_ready)
    with torch.no_grad():
        out = ours(ids, use_cache=True, **{CACHE: cache})
        del kernel_calls[:]
        ours(out.logits[:, -1:].argmax(-1), use_cache=True, **{CACHE: cache})  # one decode step
    assert not any(copied)
    for layer, (q, k, v, kw) in enumerate(kernel_calls):
        assert q.shape[2] == 1
        assert k.ctypes.data == cache.layers[layer].keys.data_ptr()
        assert v.ctypes.data == cache.layers[layer].values.data_ptr()
        assert k.shape[2] == (64 if cache_kind == "static" else PROMPT + 1)


def _bidirectional_window_model():
    cfg = transformers.ModernBertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        local_attention=4, global_attn_every_n_layers=2,
                                        max_position_embeddings=64, pad_token_id=PAD,
                                        bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                        sep_token_id=2)
    cfg._attn_implementation = "eager"
    return transformers.ModernBertModel(cfg)


def _chunked_model():
    cfg = transformers.Llama4TextConfig(**{**COMMON, "intermediate_size_mlp": 96}, head_dim=16,
                                        attention_chunk_size=4, num_local_experts=2,
                                        num_experts_per_tok=1)
    cfg._attn_implementation = "eager"
    return transformers.Llama4ForCausalLM(cfg)


@pytest.mark.parametrize("build", [_bidirectional_window_model, _chunked_model],
                         ids=["modernbert-local-window", "llama4-chunks"])
def test_local_patterns_other_than_a_causal_window_keep_their_mask(build, name):
    # transformers names the span of a bidirectional window and of attention chunks as it
    # names a sliding window's; they are no causal window, so they keep their masks
    torch.manual_seed(0)
    eager = build().eval()
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation(name)
    ids = torch.randint(3, VOCAB, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, :PADDING] = 0
    with torch.no_grad():
        for kw in ({}, {"attention_mask": mask}):
            want, got = (m(ids, **kw) for m in (eager, ours))
            if hasattr(want, "logits"):
                assert_logits_close(want.logits, got.logits)
            else:
                assert_logits_close(want.last_hidden_state, got.last_hidden_state)


def test_a_compiled_sliding_window_model_has_no_graph_break(name):
    # (the probe of a mask's pattern took bool() of tensors: a graph break at every mask)
    import torch._dynamo.utils as dynamo_utils

    eager, ours = (copy.deepcopy(m) for m in pair("mistral", name))
    ids, mask = left_padded_batch()
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    compiled = torch.compile(ours.forward, dynamic=True)
    with torch.no_grad():
        got = compiled(ids, attention_mask=mask).logits
        want = eager(ids, attention_mask=mask).logits
    assert sum(dynamo_utils.counters["graph_break"].values()) == 0
    assert_logits_close(want, got)
    torch._dynamo.reset()


def test_a_forward_that_needs_gradients_raises(name):
    _, ours = pair("llama", name)
    ids, _ = left_padded_batch()
    with pytest.raises(NotImplementedError, match="no backward pass"):
        ours(ids)  # grad mode is on and the weights require grad


def test_a_bfloat16_model_stays_close_to_eager(name):
    eager, ours = (copy.deepcopy(m).to(torch.bfloat16) for m in pair("llama", name))
    ids, mask = left_padded_batch()
    with torch.no_grad():
        theirs = eager(ids, attention_mask=mask).logits.float()
        got = ours(ids, attention_mask=mask).logits.float()
    assert got.dtype == torch.float32 and torch.isfinite(got[1, PADDING:]).all()
    assert_logits_close(theirs, got, tol=0.05 * theirs.abs().max().item())


def test_torch_compile_traces_a_whole_model_in_one_graph(name):
    eager, ours = pair("llama", name)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(ours, backend=capture, fullgraph=True)
    ids, mask = left_padded_batch()
    with torch.no_grad():
        assert_logits_close(eager(ids, attention_mask=mask).logits,
                            compiled(ids, attention_mask=mask).logits)
    called = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert called.count(torch.ops.manyheads.scaled_dot_product_attention) == 2


def test_position_bias_is_refused_with_a_clear_error():
    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(NotImplementedError, match="position_bias"):
        mhtf.attention_forward(None, q, q, q, None, position_bias=torch.zeros(1, 2, 3, 3))


def test_importing_manyheads_imports_neither_torch_nor_transformers():
    code = ("import sys, manyheads, manyheads.models\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
