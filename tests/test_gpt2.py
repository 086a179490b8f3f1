"""A live Hugging Face GPT-2 (small random config, nothing downloaded) run through
``GPT2.from_transformers``: the same NumPy model as a checkpoint folder gives."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from manyheads.models.gpt2 import GPT2  # noqa: E402
import manyheads as mh  # noqa: E402


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=3, n_head=4, n_embd=64, vocab_size=97,
                                  n_positions=128, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_gpt2_attention_imports_exactly(hf_model, rng):
    attn = hf_model.transformer.h[1].attn
    x = rng.standard_normal((2, 30, 64)).astype(np.float32)
    ours = mh.MultiHeadAttention.from_torch(attn)
    with torch.no_grad():
        hidden = torch.from_numpy(x)
        res = attn(hidden)
        theirs = (res[0] if isinstance(res, tuple) else res).numpy()
    np.testing.assert_allclose(ours(x), theirs, rtol=0, atol=1e-5)


def test_next_token_logits_equal_the_original(hf_model, rng):
    ids = rng.integers(0, 97, size=(2, 40))
    with torch.no_grad():
        ref = hf_model(torch.from_numpy(ids)).logits.numpy()
    runner = GPT2.from_transformers(hf_model)
    assert runner.tied_embeddings and runner.num_layers == 3
    np.testing.assert_allclose(runner.logits(ids), ref, rtol=0, atol=1e-4)
    # with the KV cache: prefill 30 tokens, then one at a time
    caches = runner.new_caches(2, 40)
    parts = [runner.logits(ids[:, :30], caches=caches)]
    parts += [runner.logits(ids[:, t:t + 1], caches=caches) for t in range(30, 40)]
    np.testing.assert_allclose(np.concatenate(parts, axis=1), ref, rtol=0, atol=1e-4)


def test_greedy_generation_of_20_tokens_is_identical(hf_model):
    prompt = [5, 17, 42, 8, 3, 91]
    ours = GPT2.from_transformers(hf_model).generate([prompt], 20)
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(20):
            logits = hf_model(torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(torch.argmax(logits)))
    assert ours.tolist() == [tokens[len(prompt):]]


def test_from_transformers_equals_the_saved_checkpoint(hf_model, tmp_path):
    pytest.importorskip("safetensors")
    from manyheads.models import from_pretrained

    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    ids = np.arange(50)[None] % 97
    np.testing.assert_array_equal(from_pretrained(tmp_path).logits(ids),
                                  GPT2.from_transformers(hf_model).logits(ids))


def test_from_transformers_refuses_other_models():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, vocab_size=50)
    with pytest.raises(TypeError, match="not a Hugging Face GPT-2 model"):
        GPT2.from_transformers(transformers.LlamaForCausalLM(cfg))


@pytest.mark.parametrize("weight_dtype", ["bfloat16", "int8"])
def test_a_gpt2_checkpoint_in_another_precision(hf_model, tmp_path, weight_dtype):
    """GPT-2's Conv1D weights are stored (in, out): they load in any weight_dtype too, as
    the same model with its weights rounded, and nothing else (a prompt of more than 32
    tokens: fewer rows of int8 also round x, as decoding does; see test_linear)."""
    pytest.importorskip("ml_dtypes")
    from manyheads import Int8Weight
    from manyheads.models import from_pretrained
    from manyheads.weights import convert_weight

    def rounded(w):
        if weight_dtype == "int8":
            return Int8Weight.quantize(w).dequantize()
        return convert_weight(w, weight_dtype).astype(np.float32)

    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    ours = from_pretrained(tmp_path, weight_dtype=weight_dtype)
    assert ours.weight_dtype == weight_dtype
    ref = from_pretrained(tmp_path)
    for b in ref.blocks:
        b.attn.W_qkv, b.attn.W_out = rounded(b.attn.W_qkv), rounded(b.attn.W_out)
        b.fc, b.proj = (rounded(b.fc[0]), b.fc[1]), (rounded(b.proj[0]), b.proj[1])
    ref.head = rounded(ref.head)
    ids = np.random.default_rng(3).integers(0, ours.vocab_size, size=(1, 40))
    want = ref.logits(ids)
    np.testing.assert_allclose(ours.logits(ids), want, rtol=0,
                               atol=1e-5 * np.abs(want).max())
