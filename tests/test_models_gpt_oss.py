"""manyheads.models' gpt-oss against transformers (eager attention): attention sinks,
sliding and full layers in turn, YaRN, and the mixture of experts, from float and from
MXFP4 expert weights.

The tiny random models are built here and saved with save_pretrained.  Their settings
make each feature matter: sinks large enough to take a share of the weight, a clamp
limit the experts' gate and up values pass, windows shorter than the prompts, positions
past YaRN's original context.  The last tests show that each setting is read: changed in
config.json, it moves the logits.
"""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
pytest.importorskip("transformers.models.gpt_oss")

from manyheads import Int8Weight  # noqa: E402
from manyheads.models import GptOss, from_pretrained  # noqa: E402
from manyheads.models._checkpoint import mxfp4_values  # noqa: E402
from manyheads.weights import convert_weight  # noqa: E402
from test_models import (VOCAB, assert_logits_close, hf_greedy, hf_logits,  # noqa: E402
                         left_padded)
from test_models_families import assert_a_change_moves_the_logits  # noqa: E402

CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
              num_experts_per_tok=2, max_position_embeddings=256, sliding_window=8,
              swiglu_limit=1.5, initializer_range=0.2, tie_word_embeddings=False,
              rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None,
              rope_parameters=dict(rope_type="yarn", factor=4.0,
                                   original_max_position_embeddings=64, rope_theta=10000.0,
                                   beta_fast=32.0, beta_slow=1.0, truncate=False))


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build(folder, seed=0, dtype=None, **changes):
    """A random gpt-oss (eager attention) saved in ``folder``; norms and sinks moved
    away from their initial values so that they count."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.GptOssConfig(**{**CONFIG, **changes}), attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("sinks"):
                p.add_(torch.randn(p.shape, generator=g))
    if dtype is not None:
        model.to(dtype).save_pretrained(folder, safe_serialization=True)
        return fresh_hf(folder)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def fresh_hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss")
    hf = build(folder)
    return folder, hf, from_pretrained(folder)


def test_loads_as_gpt_oss(pair):
    _, hf, model = pair
    assert type(model) is GptOss
    assert [b.attn.window for b in model.blocks] == [8, None, 8]
    assert f"{sum(p.numel() for p in hf.parameters()) / 1e6:.2f}M parameters" in repr(model)
    assert "2 of 4 experts" in repr(model) and "attention sinks" in repr(model)
    np.testing.assert_array_equal(model.blocks[1].attn.sinks,
                                  hf.model.layers[1].self_attn.sinks.detach().numpy())


def test_logits_match_transformers(pair):
    _, hf, model = pair
    ids = np.random.default_rng(1).integers(0, VOCAB, size=(2, 100))  # past the window and 64
    ref = hf_logits(hf, ids)
    assert_logits_close(model.logits(ids), ref)
    caches = model.new_caches(2, 100)  # a prefill of 70 tokens, then one at a time
    parts = [model.logits(ids[:, :70], caches=caches)]
    parts += [model.logits(ids[:, t:t + 1], caches=caches) for t in range(70, 100)]
    assert_logits_close(np.concatenate(parts, axis=1), ref)


def test_routing_and_clamping_are_exercised(pair):
    """The test model is one where the features count: tokens take different experts,
    and gate and up values pass the clamp limit."""
    _, hf, model = pair
    ids = np.random.default_rng(1).integers(0, VOCAB, size=(1, 60))
    block = model.blocks[0]
    x, _ = model.hidden_states(ids, stop_at=1)
    h = block.attention_input(x)
    h = x + block.attn(h)
    from manyheads.models._decoder import rms_norm

    h = rms_norm(h, block.norm_mlp, block.eps).reshape(60, -1)
    chosen, weights = block.route(h)
    assert len({tuple(sorted(r)) for r in chosen.tolist()}) >= 3
    np.testing.assert_allclose(weights.sum(axis=1), 1, rtol=1e-6)
    gu = np.concatenate([h @ np.asarray(w) for w in block.w_gate_up])
    assert (np.abs(gu) > block.limit).mean() > 0.05
    # the experts' output against transformers' module on the same input
    with torch.no_grad():
        ref = hf.model.layers[0].mlp(torch.from_numpy(h[None]))[0][0].numpy()
    np.testing.assert_allclose(block.experts(h), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_greedy_tokens_match_transformers_generate(pair):
    _, hf, model = pair
    prompt = np.random.default_rng(2).integers(0, VOCAB, size=(2, 30))
    ours = model.generate(prompt, 40)
    np.testing.assert_array_equal(ours, hf_greedy(hf, prompt, 40))
    assert len(set(ours[0].tolist())) > 5, "the test model should not repeat itself"


def test_left_padded_batch_matches_transformers(pair):
    _, hf, model = pair
    prompts, ids, mask = left_padded((5, 21, 13))
    out = model.generate(ids, 15, attention_mask=mask)
    np.testing.assert_array_equal(out, hf_greedy(hf, ids, 15, mask))
    for i, p in enumerate(prompts):
        np.testing.assert_array_equal(out[i], model.generate(p[None], 15)[0])


def test_bfloat16_checkpoint(tmp_path):
    pytest.importorskip("ml_dtypes")
    hf = build(tmp_path, seed=6, dtype=torch.bfloat16)
    model = from_pretrained(tmp_path, weight_dtype="auto")
    assert model.blocks[0].w_gate_up[0].dtype.name == "bfloat16"
    ids = np.random.default_rng(6).integers(0, VOCAB, size=(1, 40))
    assert_logits_close(model.logits(ids), hf_logits(hf, ids))
    np.testing.assert_array_equal(model.generate(ids[:, :20], 12), hf_greedy(hf, ids[:, :20], 12))


@pytest.mark.parametrize("weight_dtype", ["bfloat16", "int8"])
def test_weights_in_another_precision_are_those_weights_exactly(weight_dtype, tmp_path):
    """Loaded with ``weight_dtype``, the model is transformers' with its projections,
    embeddings and experts rounded that way (each expert's columns quantised on their
    own) and its router kept in float32."""
    pytest.importorskip("ml_dtypes")
    build(tmp_path, seed=7)
    model = from_pretrained(tmp_path, weight_dtype=weight_dtype)
    hf = fresh_hf(tmp_path)

    def rounded(w):  # (in, out) as manyheads holds it
        if weight_dtype == "int8":
            return Int8Weight.quantize(w).dequantize()
        return convert_weight(w, weight_dtype).astype(np.float32)

    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "router" in name or p.ndim < 2:
                continue
            w = p.detach().numpy()
            new = rounded(w.T).T if p.ndim == 2 else np.stack([rounded(e) for e in w])
            p.copy_(torch.from_numpy(np.ascontiguousarray(new)))
    assert type(model.blocks[0].w_down[1]).__name__ == (
        "Int8Weight" if weight_dtype == "int8" else "ndarray")
    assert model.blocks[0].router.dtype == np.float32
    ids = np.random.default_rng(7).integers(0, VOCAB, size=(2, 40))
    assert_logits_close(model.logits(ids), hf_logits(hf, ids))
    np.testing.assert_array_equal(model.generate(ids[:, :16], 24), hf_greedy(hf, ids[:, :16], 24))


# -- MXFP4 experts, as OpenAI's checkpoints hold them ------------------------------------------
def test_mxfp4_values_are_transformers_dequantisation():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(3, 40, 2, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, size=(3, 40, 2), dtype=np.uint8)
    ref = mxfp4.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                           dtype=torch.float32).numpy()  # (3, 64, 40)
    np.testing.assert_array_equal(mxfp4_values(blocks, scales).transpose(0, 2, 1), ref)


def mxfp4_checkpoint(tmp_path, seed=3):
    """A float checkpoint (``float/``) whose experts hold MXFP4 values, and the same
    model with its experts as MXFP4 blocks and scales (``mxfp4/``)."""
    rng = np.random.default_rng(seed)
    hf = build(tmp_path / "float", seed=seed)
    tensors = safetensors_numpy.load_file(str(tmp_path / "float" / "model.safetensors"))
    E, d, F = CONFIG["num_local_experts"], CONFIG["hidden_size"], CONFIG["intermediate_size"]
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for proj, (d_in, d_out) in (("gate_up_proj", (d, 2 * F)), ("down_proj", (F, d))):
                blocks = rng.integers(0, 256, size=(E, d_out, d_in // 32, 16), dtype=np.uint8)
                scales = rng.integers(123, 128, size=(E, d_out, d_in // 32), dtype=np.uint8)
                values = mxfp4_values(blocks, scales).transpose(0, 2, 1)  # (E, d_in, d_out)
                getattr(layer.mlp.experts, proj).copy_(torch.from_numpy(values.copy()))
                name = f"model.layers.{i}.mlp.experts.{proj}"
                del tensors[name]
                tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    (tmp_path / "mxfp4").mkdir()
    safetensors_numpy.save_file(tensors, str(tmp_path / "mxfp4" / "model.safetensors"))
    cfg = json.loads((tmp_path / "float" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn",
                                                             "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(cfg))
    return hf


@pytest.mark.parametrize("weight_dtype", ["float32", "auto"])
def test_an_mxfp4_checkpoint_runs_as_its_values(weight_dtype, tmp_path):
    pytest.importorskip("ml_dtypes")
    hf = mxfp4_checkpoint(tmp_path)
    model = from_pretrained(tmp_path / "mxfp4", weight_dtype=weight_dtype)
    expected = "bfloat16" if weight_dtype == "auto" else "float32"  # (exact either way)
    assert model.blocks[2].w_gate_up[3].dtype.name == expected
    assert model.blocks[2].attn.W_qkv.dtype.name == "float32"  # (a float32 file's own)
    ids = np.random.default_rng(3).integers(0, VOCAB, size=(2, 50))
    assert_logits_close(model.logits(ids), hf_logits(hf, ids))
    np.testing.assert_array_equal(model.generate(ids[:, :20], 20), hf_greedy(hf, ids[:, :20], 20))


def test_unknown_quantisation_and_bad_shapes_are_named(tmp_path):
    build(tmp_path, seed=2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(
        {**cfg, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(ValueError, match="quantization_config .* is not supported"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 48}))
    with pytest.raises(ValueError, match=r"gate_up_proj' has shape \(4, 64, 128\), the config "
                                         r"implies \(4, 64, 96\)"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 5}))
    with pytest.raises(ValueError, match="num_experts_per_tok 5 exceeds num_local_experts 4"):
        from_pretrained(tmp_path)


CHANGES = [{"swiglu_limit": 7.0}, {"swiglu_alpha": 1.0}, {"num_experts_per_tok": 1},
           {"sliding_window": 64}, {"layer_types": ["full_attention"] * 3},
           {"rope_parameters": {**CONFIG["rope_parameters"], "truncate": True}}]


@pytest.mark.parametrize("change", CHANGES, ids=[next(iter(c)) for c in CHANGES])
def test_each_setting_changes_the_logits(change, tmp_path):
    assert_a_change_moves_the_logits(build(tmp_path, seed=1), tmp_path, change)


def test_the_sinks_change_the_logits(pair):
    folder, hf, _ = pair
    model = from_pretrained(folder)
    ids = np.random.default_rng(4).integers(0, VOCAB, size=(1, 50))
    ref = model.logits(ids)
    for b in model.blocks:
        b.attn.sinks = np.full(4, -1e4, np.float32)  # no share for the sinks: softmax alone
    assert np.abs(model.logits(ids) - ref).max() > 1e-2 * np.abs(ref).max()


def test_a_config_without_rotary_settings_takes_gpt_oss_yarn(tmp_path):
    """transformers gives a gpt-oss config without rope_scaling or rope_parameters
    YaRN x32 over 4096 positions (base 150000); so does manyheads."""
    build(tmp_path, seed=5)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["rope_parameters"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = fresh_hf(tmp_path)
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    model = from_pretrained(tmp_path)
    assert "theta 150000 yarn x32" in repr(model)
    ids = np.random.default_rng(5).integers(0, VOCAB, size=(1, 60))
    assert_logits_close(model.logits(ids), hf_logits(hf, ids))


def test_a_random_checkpoint_is_the_model_transformers_reads(tmp_path):
    from manyheads.models.random import save_random_checkpoint
    folder = save_random_checkpoint(tmp_path, "gpt_oss", seed=1, num_hidden_layers=3,
                                    sliding_window=8)
    model, hf = from_pretrained(folder), fresh_hf(folder)
    ids = np.random.default_rng(6).integers(0, 320, size=(2, 40))
    assert_logits_close(model.logits(ids), hf_logits(hf, ids))
    np.testing.assert_array_equal(model.generate(ids[:, :10], 20), hf_greedy(hf, ids[:, :10], 20))


def test_the_decode_steps_are_the_general_step_bit_for_bit(pair, monkeypatch):
    """A decoding step of one token a row takes the blocks' lean path: the attention
    through DecoderAttention.decode (sinks included) and the experts one row at a time.
    Its logits are those of the general module path exactly, in every cache format (int4
    with heads of 32), through the sliding layers' rings (11 + 10 tokens, windows of 8)
    and for two rows at once."""
    from manyheads.models import gpt_oss, llama

    _, _, model = pair
    used = {"lean": 0}
    lean_attention = llama.DecoderAttention.decode

    def counted_lean(self, *args, **kwargs):
        out = lean_attention(self, *args, **kwargs)
        used["lean"] += out is not None
        return out

    ids = np.stack([np.arange(11), np.arange(11)[::-1] * 3]) % VOCAB

    def steps(cache_dtype, rows):
        caches = model.new_caches(rows, 21, cache_dtype)
        z = model.logits(ids[:rows], caches=caches, last_only=True)
        out = []
        for _ in range(10):
            z = model.logits(np.argmax(z[:, -1], axis=-1)[:, None], caches=caches,
                             last_only=True)
            out.append(z)
        return out

    formats = [None, "float16", "bfloat16", "int8", "int4"]
    monkeypatch.setattr(llama.DecoderAttention, "decode", counted_lean)
    lean = [steps(f, r) for f in formats for r in (1, 2)]
    assert used["lean"] == 10 * 2 * len(formats) * model.num_layers
    monkeypatch.setattr(gpt_oss.ExpertsBlock, "decode", None)
    general = [steps(f, r) for f in formats for r in (1, 2)]
    assert used["lean"] == 10 * 2 * len(formats) * model.num_layers
    for a_steps, b_steps in zip(lean, general):
        for a, b in zip(a_steps, b_steps):
            np.testing.assert_array_equal(a, b)


def test_a_rows_experts_are_the_same_alone_or_in_a_batch(pair):
    """One row's experts (a decoding step: each half's products in one parallel region)
    give the bits the batch's loop over experts gives that row."""
    _, _, model = pair
    block = model.blocks[1]
    h = np.random.default_rng(9).standard_normal((6, 64)).astype(np.float32)
    batch = block.experts(h)
    for i in range(6):
        np.testing.assert_array_equal(block.experts(h[i:i + 1]), batch[i:i + 1])
