"""generate's sampling: the logits processors against transformers' own, the seeded draw
against the distribution it draws from, stop strings and ids, and the argument checks."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from manyheads.models._sampling import check_sampling, choose, process_logits, softmax

torch = pytest.importorskip("torch")
lp = pytest.importorskip("transformers.generation.logits_process")
pytest.importorskip("safetensors")

from manyheads.models import from_pretrained  # noqa: E402
from manyheads.models.random import save_random_checkpoint  # noqa: E402


def transformers_processed(logits, input_ids, s):
    """The processors transformers' generate builds for these settings, in its order."""
    procs = lp.LogitsProcessorList()
    if s.repetition_penalty != 1.0:
        procs.append(lp.RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
    if s.do_sample:
        if s.temperature != 1.0:
            procs.append(lp.TemperatureLogitsWarper(s.temperature))
        if s.top_k is not None:
            procs.append(lp.TopKLogitsWarper(s.top_k, min_tokens_to_keep=1))
        if s.top_p is not None and s.top_p < 1.0:
            procs.append(lp.TopPLogitsWarper(s.top_p, min_tokens_to_keep=1))
        if s.min_p is not None:
            procs.append(lp.MinPLogitsWarper(s.min_p, min_tokens_to_keep=1))
    out = procs(torch.from_numpy(input_ids), torch.from_numpy(logits.copy()))
    return out.numpy()


def seen_of(input_ids, vocab):
    seen = np.zeros((len(input_ids), vocab), dtype=bool)
    seen[np.arange(len(input_ids))[:, None], input_ids] = True
    return seen


def assert_same_processing(ours, theirs):
    assert np.array_equal(np.isneginf(ours), np.isneginf(theirs))
    kept = np.isfinite(theirs)
    np.testing.assert_allclose(ours[kept], theirs[kept], rtol=2e-6, atol=1e-6)


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([2, 7, 50, 1000]),
       scale=st.sampled_from([0.1, 1.0, 4.0, 20.0]),
       do_sample=st.booleans(),
       temperature=st.sampled_from([1.0, 0.3, 0.7, 1.6]),
       top_k=st.sampled_from([None, 0, 1, 3, 40, 2000]),
       top_p=st.sampled_from([None, 1.0, 0.05, 0.5, 0.9, 0.99]),
       min_p=st.sampled_from([None, 0.0, 0.02, 0.2, 1.0]),
       penalty=st.sampled_from([1.0, 1.3, 0.7, 2.5]))
def test_processing_matches_transformers(seed, vocab, scale, do_sample, temperature, top_k,
                                         top_p, min_p, penalty):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((4, vocab)) * scale).astype(np.float32)
    input_ids = rng.integers(0, vocab, size=(4, 9))
    s = check_sampling(do_sample, temperature, top_k, top_p, min_p, penalty)
    ours = process_logits(logits, s, seen_of(input_ids, vocab))
    assert ours.dtype == np.float32 and np.isfinite(ours).any(axis=-1).all()
    assert_same_processing(ours, transformers_processed(logits, input_ids, s))


def tie_groups_of(logits, kept):
    """Every token whose logit equals that of a kept token."""
    return np.array([np.isin(row, row[k]) for row, k in zip(logits, kept)])


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("top_p", [0.13, 0.52, 0.83])
def test_ties_are_kept_together(seed, top_p):
    """Many equal logits (40 tokens, 5 values): top-k and min-p filter as transformers
    does; top-p keeps the tie groups of the tokens transformers keeps, whole."""
    rng = np.random.default_rng(seed)
    logits = rng.integers(0, 5, size=(3, 40)).astype(np.float32) * np.float32(0.75)
    ids = np.zeros((3, 1), dtype=np.int64)
    for s in (check_sampling(True, top_k=int(rng.integers(1, 12))),
              check_sampling(True, min_p=float(rng.choice([0.1, 0.3, 0.6])))):
        assert_same_processing(process_logits(logits, s, None),
                               transformers_processed(logits, ids, s))
    s = check_sampling(True, top_p=top_p)
    ours = np.isfinite(process_logits(logits, s, None))
    theirs = np.isfinite(transformers_processed(logits, ids, s))
    assert np.array_equal(ours, tie_groups_of(logits, theirs))


def test_top_p_keeps_equal_logits_together():
    x = np.zeros((1, 4), dtype=np.float32)
    assert np.isfinite(process_logits(x, check_sampling(True, top_p=0.3), None)).all()
    x = np.array([[1.0, 1.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    assert np.isfinite(process_logits(x, check_sampling(True, top_p=0.3), None)).tolist() == \
        [[True, True, False, False, False]]


def test_greedy_is_the_argmax_and_ignores_the_warpers():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 100)).astype(np.float32)
    s = check_sampling(False, temperature=0.2, top_k=3, top_p=0.1, min_p=0.5)
    assert np.array_equal(process_logits(logits, s, None), logits)
    assert np.array_equal(choose(logits, s, None), logits.argmax(-1))


def test_draws_follow_the_processed_distribution():
    """200000 seeded draws from one processed row: every filtered token has frequency 0,
    the others are within 5 standard deviations of their probability."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal(12).astype(np.float32) * 1.5
    s = check_sampling(True, temperature=0.8, top_k=8, top_p=0.95)
    row = process_logits(logits[None], s, None)[0]
    p = softmax(row.astype(np.float64))
    N = 200_000
    draws = choose(np.broadcast_to(row, (N, 12)), s, np.random.default_rng(123))
    freq = np.bincount(draws, minlength=12) / N
    assert (freq[np.isneginf(row)] == 0).all() and np.isneginf(row).sum() >= 4
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / N) + 1e-12)
    again = choose(np.broadcast_to(row, (N, 12)), s, np.random.default_rng(123))
    assert np.array_equal(draws, again)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("sampling"), "llama", seed=3,
                                  tokenizer=True)


@pytest.fixture(scope="module")
def model(model_dir):
    return from_pretrained(model_dir)


def reference_greedy(model, ids, n):
    """Today's greedy loop spelt out: argmax of the last logits, one token at a time."""
    caches = model.new_caches(len(ids), ids.shape[1] + n)
    logits = model.logits(ids, caches=caches, last_only=True)
    out = []
    for _ in range(n):
        tok = logits[:, -1].argmax(-1)
        out.append(tok)
        logits = model.logits(tok[:, None], caches=caches, last_only=True)
    return np.stack(out, axis=1)


def test_do_sample_false_is_unchanged_greedy(model):
    ids = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    assert np.array_equal(model.generate(ids, 12), reference_greedy(model, ids, 12))
    assert np.array_equal(model.generate(ids, 12, seed=5, temperature=0.3, top_k=2),
                          reference_greedy(model, ids, 12))


def test_seeded_sampling_is_reproducible(model):
    ids = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    kw = dict(do_sample=True, temperature=1.3, top_p=0.95, min_p=0.01)
    a = model.generate(ids, 20, seed=7, **kw)
    assert np.array_equal(a, model.generate(ids, 20, seed=7, **kw))
    assert np.array_equal(a, model.generate(ids, 20, seed=np.random.default_rng(7), **kw))
    others = [model.generate(ids, 20, seed=s, **kw) for s in (8, 9)]
    assert not all(np.array_equal(a, o) for o in others)
    assert not np.array_equal(a, reference_greedy(model, ids, 20))


def test_top_k_1_sampling_is_greedy(model):
    ids = np.array([[3, 1, 4, 1, 5]])
    assert np.array_equal(model.generate(ids, 15, do_sample=True, top_k=1, seed=0,
                                         temperature=2.0),
                          reference_greedy(model, ids, 15))


def test_first_sampled_token_follows_the_model(model):
    """2000 rows of one prompt, one sampled step each: the token frequencies match the
    processed distribution of the model's logits."""
    ids = np.array([[3, 1, 4, 1, 5]])
    kw = dict(temperature=1.5, top_k=10, repetition_penalty=1.2)
    s = check_sampling(True, **kw)
    row = process_logits(model.logits(ids)[:, -1], s, seen_of(ids, model.vocab_size))[0]
    p = softmax(row.astype(np.float64))
    N = 2000
    toks = model.generate(np.repeat(ids, N, axis=0), 1, do_sample=True, seed=11, **kw)[:, 0]
    freq = np.bincount(toks, minlength=model.vocab_size) / N
    assert (freq[np.isneginf(row)] == 0).all()
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / N) + 1e-12)


def test_repetition_penalty_greedy_matches_transformers(model_dir, model):
    """Greedy generation with a repetition penalty, on a left-padded batch: the tokens of
    transformers' generate (which leaves the padding out of the penalty)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = np.array([[0, 0, 3, 1, 4], [2, 7, 1, 8, 2]])
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    for penalty in (1.5, 0.8):
        with torch.no_grad():
            ref = hf.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                              max_new_tokens=16, do_sample=False, repetition_penalty=penalty,
                              pad_token_id=0)[:, ids.shape[1]:].numpy()
        ours = model.generate(ids, 16, attention_mask=mask, repetition_penalty=penalty)
        assert np.array_equal(ours, ref)
    assert not np.array_equal(ours, model.generate(ids, 16, attention_mask=mask))


def test_stop_ids_and_eos_lists_end_rows(model):
    ids = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    greedy = model.generate(ids, 12)
    a, b = int(greedy[0, 3]), int(greedy[1, 6])
    first = [int(np.flatnonzero(np.isin(row, (a, b)))[0]) for row in greedy]
    out = model.generate(ids, 12, stop=[a, b], pad_token_id=0)
    same = model.generate(ids, 12, eos_token_id=[a, b])  # filled with the first id
    for r in range(2):
        assert np.array_equal(out[r, :first[r] + 1], greedy[r, :first[r] + 1])
        assert np.array_equal(same[r, :first[r] + 1], greedy[r, :first[r] + 1])
        assert (out[r, first[r] + 1:] == 0).all() and (same[r, first[r] + 1:] == a).all()
    assert max(first) < 11  # some filling happened


def test_stop_strings_end_rows_on_the_decoded_text(model_dir, model):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    ids = np.array([tok.encode("the cat sat on the").ids])
    greedy = model.generate(ids, 16)[0]
    words = tok.decode(greedy.tolist()).split()
    # a stop string made of the end of one word and the start of the next one
    j = next(i for i in range(2, len(words) - 1) if words[i] not in words[:i])
    text = f"{words[j][-2:]} {words[j + 1][:2]}"
    end = next(k for k in range(1, 17) if text in tok.decode(greedy[:k].tolist()))
    seen = []
    out = model.generate(ids, 16, stop=[text], tokenizer=tok, pad_token_id=0,
                         callback=lambda step, t: seen.append(int(t[0])))
    assert out[0, :end].tolist() == greedy[:end].tolist() == seen
    assert (out[0, end:] == 0).all()


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(temperature=-1.0), "temperature must be > 0"),
    (dict(temperature=float("nan")), "temperature must be finite"),
    (dict(temperature="hot"), "temperature must be a number"),
    (dict(top_k=-1), "top_k must be an int >= 0 or None"),
    (dict(top_k=2.5), "top_k must be an int >= 0 or None"),
    (dict(top_k=True), "top_k must be an int >= 0 or None"),
    (dict(seed=-1), "seed must be an int >= 0"),
    (dict(do_sample=False, seed=-3), "seed must be an int >= 0"),
    (dict(top_p=0.0), "top_p must be in (0, 1]"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(min_p=-0.1), "min_p must be in [0, 1]"),
    (dict(min_p=1.1), "min_p must be in [0, 1]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be finite"),
    (dict(do_sample="yes"), "do_sample must be True or False"),
    (dict(stop=["the"]), "stop strings (['the']) need tokenizer="),
    (dict(stop=[""]), "stop: an empty string"),
    (dict(stop=[9999]), "stop: token id 9999 is outside the vocabulary"),
    (dict(stop=[1.5]), "stop must be a token id or a list of them"),
    (dict(eos_token_id=-1), "eos_token_id: token id -1 is outside the vocabulary"),
    (dict(pad_token_id=10**6), "pad_token_id: token id 1000000 is outside"),
    # (bytes had been read as lists of token ids, and a list as its first id)
    (dict(stop=b"%"), "bytes: decode them to a string"),
    (dict(eos_token_id=b"\x05"), "eos_token_id must be a token id or a list of them"),
    (dict(pad_token_id=[5, 6]), "pad_token_id must be one token id"),
])
def test_bad_settings_are_refused_before_anything_runs(model, kw, message):
    calls = []
    caches = model.new_caches(1, 16)
    with pytest.raises(ValueError) as info:
        model.generate([[3, 1, 4]], 4, do_sample=kw.pop("do_sample", True), caches=caches,
                       callback=lambda *a: calls.append(a), **kw)
    assert message in str(info.value)
    assert calls == [] and all(len(c) == 0 for c in caches)


def test_a_callback_that_cannot_be_called_is_refused_before_anything_runs(model):
    caches = model.new_caches(1, 16)
    with pytest.raises(TypeError, match="callback must be callable"):
        model.generate([[3, 1, 4]], 4, callback="print", caches=caches)
    assert all(len(c) == 0 for c in caches)


def test_stop_strings_read_special_tokens_and_may_begin_in_the_prompt(model_dir):
    # (special tokens had been skipped by the decode, so "<|im_end|>" never stopped a
    # row, and only the new tokens' text was read)
    tokenizers = pytest.importorskip("tokenizers")
    from manyheads.models._sampling import StopStrings
    tok = tokenizers.Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    tok.add_special_tokens(["<|im_end|>"])
    end = tok.token_to_id("<|im_end|>")
    prompt, new = np.array(tok.encode("the cat").ids), np.array(tok.encode(" sat").ids)
    assert StopStrings(["<|im_end|>"], tok).hit(prompt, np.append(new, end))
    assert not StopStrings(["<|im_end|>"], tok).hit(prompt, new)
    assert StopStrings(["t s"], tok).hit(prompt, new)        # "ca|t s|at": from the prompt on
    assert not StopStrings(["the c"], tok).hit(prompt, new)  # in the prompt alone
    assert StopStrings(["sat"], tok).hit(prompt[:0], new)
    long_prompt = np.array(tok.encode(" ".join(["the cat sat on the mat"] * 4)).ids)
    assert StopStrings(["mat the"], tok).hit(long_prompt[:-6], long_prompt[-6:-5])
    assert not StopStrings(["mat the"], tok).hit(long_prompt[:-5], long_prompt[-5:-4])


def test_stop_strings_need_a_filler(model_dir, model):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    with pytest.raises(ValueError, match="stop strings need pad_token_id"):
        model.generate([[3, 1, 4]], 4, stop=["cat"], tokenizer=tok)


def test_top_k_0_is_no_filter_as_in_transformers(model):
    """transformers' generate adds no top-k warper for top_k=0: neither does generate."""
    assert check_sampling(True, top_k=0).top_k is None
    ids = np.array([[3, 1, 4, 1, 5]])
    off = model.generate(ids, 20, do_sample=True, top_k=0, seed=4, temperature=1.5)
    assert np.array_equal(off, model.generate(ids, 20, do_sample=True, top_k=None, seed=4,
                                              temperature=1.5))
    assert not np.array_equal(off, model.generate(ids, 20, do_sample=True, top_k=3, seed=4,
                                                  temperature=1.5))


@pytest.mark.parametrize("temperature", [1e-30, 1e-38, 1e-45, 1e-50, 5e-324])
def test_tiny_temperatures_sample_the_greedy_tokens(model, temperature):
    """As the temperature goes to 0 sampling becomes greedy; a temperature whose quotients
    overflow float32 must not turn the logits into inf and NaN (and token 0)."""
    ids = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    for seed in (1, 2):
        out = model.generate(ids, 12, do_sample=True, temperature=temperature, seed=seed)
        assert np.array_equal(out, reference_greedy(model, ids, 12))


def test_a_tiny_temperature_keeps_the_largest_logits_and_their_ties():
    logits = np.array([[1.0, 3.0, 3.0, -2.0], [0.5, -40.0, 0.25, 7.0]], dtype=np.float32)
    for t in (1e-40, 1e-300):
        s = check_sampling(True, temperature=t)
        out = process_logits(logits, s, None)
        assert out.tolist() == [[-np.inf, 0.0, 0.0, -np.inf], [-np.inf, -np.inf, -np.inf, 0.0]]
        # the draws share the tie evenly, as softmax(logits / t) does as t goes to 0
        draws = choose(np.repeat(out[:1], 4000, axis=0), s, np.random.default_rng(0))
        assert set(draws.tolist()) == {1, 2} and abs((draws == 1).mean() - 0.5) < 0.05


def test_other_temperatures_divide_as_transformers_does_even_beside_minus_inf():
    # a logit already -inf (a banned token) is no overflow: the quotients stay float32's
    logits = np.array([[1.5, -np.inf, 0.25, 3.0], [2.0, 1.0, -1.0, 0.5]], dtype=np.float32)
    for t in (0.7, 0.1, 2.5):
        out = process_logits(logits, check_sampling(True, temperature=t), None)
        assert np.array_equal(out, logits / np.float32(t))


def test_a_seed_may_be_a_sequence_of_ints_as_numpy_takes_it(model):
    ids = np.array([[3, 1, 4]])
    a = model.generate(ids, 6, do_sample=True, seed=[1, 2])
    assert np.array_equal(a, model.generate(ids, 6, do_sample=True, seed=[1, 2]))
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        model.generate(ids, 2, do_sample=True, seed=[1, -2])


def test_wrong_argument_types_are_type_errors_that_name_them(model):
    calls = []
    for kw, message in [(dict(max_new_tokens=None), "max_new_tokens must be a non-negative int"),
                        (dict(max_new_tokens="3"), "max_new_tokens must be a non-negative int"),
                        (dict(seed="abc"), "seed must be an int >= 0"),
                        (dict(seed=2.0), "seed must be an int >= 0")]:
        args = {"max_new_tokens": 4, "do_sample": True, **kw}
        with pytest.raises(TypeError, match=message):
            model.generate([[3, 1, 4]], callback=lambda *a: calls.append(a), **args)
    assert calls == []
    with pytest.raises(TypeError, match="layer must be an int"):
        model.attention_weights([[3, 1, 4]], 1.0)


def test_caches_that_cannot_hold_the_generation_are_refused_before_it_starts(model):
    calls = []
    cb = lambda *a: calls.append(a)  # noqa: E731
    short = model.new_caches(1, 9)
    with pytest.raises(ValueError, match=r"caches hold 9 tokens \(max_len=9\), fewer than the "
                                         r"prompt's 4 plus max_new_tokens=6 \(10\)"):
        model.generate([[3, 1, 4, 1]], 6, caches=short, callback=cb)
    assert calls == [] and all(len(c) == 0 for c in short)
    assert model.generate([[3, 1, 4, 1]], 5, caches=short).shape == (1, 5)  # 9 fit
    wide = model.new_caches(2, 16)
    with pytest.raises(ValueError, match="caches were made for batch_size=2, but ids have "
                                         "batch size 1"):
        model.generate([[3, 1, 4, 1]], 3, caches=wide, callback=cb)
    assert calls == [] and all(len(c) == 0 for c in wide)
    with pytest.raises(ValueError, match="caches were made for batch_size=2, but ids have "
                                         "batch size 3"):
        model.logits(np.ones((3, 2), dtype=int), caches=wide)


def test_a_cache_dtype_is_checked_and_must_agree_with_caches_given_beside_it(model):
    calls = []
    cb = lambda *a: calls.append(a)  # noqa: E731
    caches = model.new_caches(1, 16, np.float16)
    with pytest.raises(ValueError, match="cache_dtype=int8 does not match the caches given "
                                         r"\(float16\): pass cache_dtype or caches, not both"):
        model.generate([[3, 1, 4]], 4, caches=caches, cache_dtype="int8", callback=cb)
    assert calls == [] and all(len(c) == 0 for c in caches)
    # an unknown dtype is refused even when nothing would be generated
    for n in (0, 3):
        with pytest.raises(TypeError, match="cache dtype must be one of"):
            model.generate([[3, 1, 4]], n, cache_dtype="int3", callback=cb)
    assert calls == []
    same = model.generate([[3, 1, 4]], 4, caches=caches, cache_dtype=np.float16)
    np.testing.assert_array_equal(same, model.generate([[3, 1, 4]], 4, cache_dtype="float16"))
