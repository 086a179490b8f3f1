"""A Hugging Face GPT-2 (small random config, nothing downloaded) run with manyheads attention."""
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
    runner = GPT2(hf_model)
    np.testing.assert_allclose(runner.logits(ids), ref, rtol=0, atol=1e-4)
    # with the KV cache: prefill 30 tokens, then one at a time
    caches = runner.new_caches(2, 40)
    parts = [runner.logits(ids[:, :30], 0, caches)]
    parts += [runner.logits(ids[:, t:t + 1], t, caches) for t in range(30, 40)]
    np.testing.assert_allclose(np.concatenate(parts, axis=1), ref, rtol=0, atol=1e-4)


def test_greedy_generation_of_20_tokens_is_identical(hf_model):
    prompt = [5, 17, 42, 8, 3, 91]
    ours = GPT2(hf_model).generate(prompt, 20)
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(20):
            logits = hf_model(torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(torch.argmax(logits)))
    assert ours == tokens[len(prompt):]
