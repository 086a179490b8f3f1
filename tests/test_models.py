"""manyheads.models against transformers: small random GPT-2, Llama (grouped queries) and
Qwen2 (tied embeddings, qkv biases) saved with save_pretrained, nothing downloaded."""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from manyheads.models import from_pretrained  # noqa: E402

VOCAB = 97


def _reinit(model, seed):
    """Weights large enough that a random model's greedy tokens wander (the default
    initialiser's 0.02 makes every logit nearly equal): 1/sqrt(fan_in) for products,
    unit-normal embeddings, norms near 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                p.copy_((1.0 + 0.1 * torch.randn(p.shape, generator=g)) if name.endswith("weight")
                        else 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "wte" in name or "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif "wpe" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:  # nn.Linear (out, in); GPT-2's Conv1D (in, out)
                fan_in = p.shape[0] if ".c_" in name else p.shape[1]
                p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
    return model


def _config(arch, **kw):
    common = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "gpt2":
        return transformers.GPT2Config(n_layer=3, n_head=4, n_embd=64, n_positions=256,
                                       tie_word_embeddings=False,
                                       **{**common, **kw})
    if arch == "llama":
        return transformers.LlamaConfig(hidden_size=64, intermediate_size=112,
                                        num_hidden_layers=3, num_attention_heads=8,
                                        num_key_value_heads=2, max_position_embeddings=2048,
                                        rope_theta=50000.0, rms_norm_eps=1e-5,
                                        tie_word_embeddings=False, **{**common, **kw})
    return transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=2048, tie_word_embeddings=True,
                                    **{**common, **kw})


CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
ARCHS = list(CLASSES)


def build(arch, folder, seed=0, **save_kw):
    """A random transformers model of ``arch`` saved as safetensors in ``folder``."""
    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[arch])(_config(arch)).eval()
    _reinit(model, seed)
    model.save_pretrained(folder, safe_serialization=True, **save_kw)
    return model


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    """(arch, folder, transformers model, manyheads model)."""
    folder = tmp_path_factory.mktemp(request.param)
    hf = build(request.param, folder)
    return request.param, folder, hf, from_pretrained(folder)


def hf_logits(hf, ids, mask=None):
    with torch.no_grad():
        kw = {} if mask is None else {"attention_mask": torch.from_numpy(mask)}
        return hf(torch.from_numpy(ids), **kw).logits.float().numpy()


def hf_greedy(hf, ids, n, mask=None):
    """transformers' greedy generate; only the new tokens."""
    t = torch.from_numpy(ids)
    m = torch.ones_like(t) if mask is None else torch.from_numpy(mask)
    with torch.no_grad():
        out = hf.generate(t, attention_mask=m, max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].numpy()


def assert_logits_close(ours, ref):
    """Within 1e-4 relative to the largest logit."""
    assert ours.shape == ref.shape and ours.dtype == np.float32
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err <= 1e-4, f"largest difference {err:.2e} of the largest logit"


def test_logits_match_transformers(pair):
    arch, _, hf, model = pair
    ids = np.random.default_rng(1).integers(0, VOCAB, size=(2, 37))
    assert_logits_close(model.logits(ids), hf_logits(hf, ids))
    # with KV caches: a prefill of 30 tokens, then one token at a time
    caches = model.new_caches(2, 37)
    parts = [model.logits(ids[:, :30], caches=caches)]
    parts += [model.logits(ids[:, t:t + 1], caches=caches) for t in range(30, 37)]
    assert_logits_close(np.concatenate(parts, axis=1), hf_logits(hf, ids))
    assert len(caches[0]) == 37
    last = model.logits(ids, last_only=True)
    assert last.shape == (2, 1, VOCAB)
    assert_logits_close(last, hf_logits(hf, ids)[:, -1:])


def test_greedy_tokens_match_transformers_generate(pair):
    arch, _, hf, model = pair
    prompt = np.array([[5, 17, 42, 8, 3, 91, 60]])
    ours = model.generate(prompt, 20)
    assert ours.shape == (1, 20) and ours.dtype == np.int64
    np.testing.assert_array_equal(ours, hf_greedy(hf, prompt, 20))
    if arch != "qwen2":  # tied random embeddings make a model repeat its input token
        assert len(set(ours[0].tolist())) > 3, "the test model should not repeat itself"
    # a batch of two prompts of the same length generates together
    batch = np.array([[5, 17, 42, 8, 3, 91, 60], [1, 2, 3, 4, 5, 6, 7]])
    np.testing.assert_array_equal(model.generate(batch, 12), hf_greedy(hf, batch, 12))


def test_float16_cache_dtype_is_passed_through(pair):
    _, _, _, model = pair
    prompt = np.array([[5, 17, 42, 8, 3, 91, 60]])
    caches = model.new_caches(1, 7 + 6, np.float16)
    out = model.generate(prompt, 6, caches=caches)
    assert all(c.dtype == np.float16 and len(c) == 12 for c in caches)
    assert out.shape == (1, 6)
    out16 = model.generate(prompt, 6, cache_dtype=np.float16)
    np.testing.assert_array_equal(out16, out)


def left_padded(lengths, seed=7):
    """Random prompts of these lengths, and the batch of them padded on the left (ids, mask)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, n) for n in lengths]
    T = max(lengths)
    ids = np.zeros((len(prompts), T), dtype=np.int64)
    mask = np.zeros((len(prompts), T), dtype=np.int64)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = p
        mask[i, T - len(p):] = 1
    return prompts, ids, mask


def test_left_padded_batch_equals_each_prompt_alone(pair):
    arch, _, hf, model = pair
    prompts, ids, mask = left_padded((5, 13, 9))
    out = model.generate(ids, 15, attention_mask=mask)
    np.testing.assert_array_equal(out, hf_greedy(hf, ids, 15, mask))  # transformers, batched
    for i, p in enumerate(prompts):
        np.testing.assert_array_equal(out[i], model.generate(p[None], 15)[0],
                                      err_msg=f"row {i} differs from its prompt alone")
        np.testing.assert_array_equal(out[i], hf_greedy(hf, p[None], 15)[0])
    # the logits of each row's real tokens equal its prompt's own logits
    lg = model.logits(ids, attention_mask=mask)
    for i, p in enumerate(prompts):
        assert_logits_close(lg[i:i + 1, ids.shape[1] - len(p):], hf_logits(hf, p[None]))


def test_repr_names_architecture_and_sizes(pair):
    arch, _, hf, model = pair
    text = repr(model)
    assert f"model_type={arch!r}" in text and "d_model=64" in text and f"vocab {VOCAB}" in text
    n_hf = sum(p.numel() for p in hf.parameters())
    assert f"{n_hf / 1e6:.2f}M parameters" in text
    if arch == "llama":
        assert "8 heads of 8" in text and "2 kv heads" in text
    if arch == "qwen2":
        assert "tied embeddings" in text and "qkv bias" in text


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rotary_positions_past_1000(arch, tmp_path):
    hf = build(arch, tmp_path, seed=3)
    model = from_pretrained(tmp_path)
    ids = np.random.default_rng(4).integers(0, VOCAB, size=(1, 1100))
    ref = hf_logits(hf, ids)
    assert_logits_close(model.logits(ids)[:, 1000:], ref[:, 1000:])
    # a cache started deep: 1090 tokens cached, then one token at a time
    caches = model.new_caches(1, 1100)
    model.logits(ids[:, :1090], caches=caches)
    steps = [model.logits(ids[:, t:t + 1], caches=caches) for t in range(1090, 1100)]
    assert_logits_close(np.concatenate(steps, axis=1), ref[:, 1090:])
    np.testing.assert_array_equal(model.generate(ids, 8), hf_greedy(hf, ids, 8))


@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_checkpoint(arch, tmp_path):
    hf = build(arch, tmp_path / "one", seed=5)
    hf.save_pretrained(tmp_path / "shards", safe_serialization=True, max_shard_size="40KB")
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    ids = np.random.default_rng(5).integers(0, VOCAB, size=(1, 20))
    sharded = from_pretrained(tmp_path / "shards").logits(ids)
    np.testing.assert_array_equal(sharded, from_pretrained(tmp_path / "one").logits(ids))
    assert_logits_close(sharded, hf_logits(hf, ids))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_bfloat16_checkpoint_is_widened_on_load(arch, tmp_path):
    pytest.importorskip("ml_dtypes")
    hf = build(arch, tmp_path / "f32", seed=6)
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", safe_serialization=True)
    hf.float()  # now holds the bfloat16-rounded weights in float32
    model = from_pretrained(tmp_path / "bf16")
    ids = np.random.default_rng(6).integers(0, VOCAB, size=(1, 25))
    assert_logits_close(model.logits(ids), hf_logits(hf, ids))
