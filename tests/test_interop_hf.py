"""MultiHeadAttention.from_torch on Hugging Face transformers' decoder attention layers
(tiny random configs built here): the imported module gives the layer's output, taken
from inside an eager forward of the whole model."""
import numpy as np
import pytest

import manyheads as mh

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = dict(intermediate_size=64, num_hidden_layers=2, vocab_size=97,
             max_position_embeddings=128)
# (model_type, config, what the layers carry); hidden 48 with 4 heads of 16 (Gemma 2,
# gpt-oss): the output projection maps 64 columns back to 48
ARCHS = [
    ("llama", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)),
    ("qwen2", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)),
    ("mistral", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                     sliding_window=6)),
    ("gemma2", dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    sliding_window=6, attn_logit_softcapping=2.0, query_pre_attn_scalar=12)),
    ("gpt_oss", dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     sliding_window=6, num_local_experts=4, num_experts_per_tok=2,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
]


def hf_model(model_type, cfg):
    config = transformers.AutoConfig.for_model(model_type, **SMALL, **cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # visible sinks and biases (they start at zero in some families),
        for layer in model.model.layers:  # scores large enough that the soft cap bends them
            attn = layer.self_attn
            attn.q_proj.weight.normal_(0, 0.3)
            attn.k_proj.weight.normal_(0, 0.3)
            if getattr(attn, "sinks", None) is not None:
                attn.sinks.normal_()
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0, 0.5)
    return model


def layer_io(model, ids):
    """Each layer's attention input and output in an eager forward of ``ids``."""
    seen = {}

    def grab(i):
        def hook(mod, args, kwargs, out):
            x = kwargs.get("hidden_states", args[0] if args else None)
            seen[i] = (x.detach().numpy().copy(), out[0].detach().numpy().copy())
        return hook

    hooks = [layer.self_attn.register_forward_hook(grab(i), with_kwargs=True)
             for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("model_type, cfg", ARCHS, ids=[a[0] for a in ARCHS])
def test_decoder_attention_layers_import_with_their_features(model_type, cfg, tmp_path):
    model = hf_model(model_type, cfg)
    ids = list(np.random.default_rng(1).integers(0, 97, 20))
    for i, (x, want) in layer_io(model, ids).items():
        attn = model.model.layers[i].self_attn
        m = mh.MultiHeadAttention.from_torch(attn)
        assert (m.num_heads, m.num_kv_heads, m.head_dim) == (
            4, model.config.num_key_value_heads, attn.head_dim)
        assert m.out_features == model.config.hidden_size and m.scale == attn.scaling
        assert m.window == getattr(attn, "sliding_window", cfg.get("sliding_window"))
        assert m.softcap == cfg.get("attn_logit_softcapping")
        assert (m.sinks is not None) == (model_type == "gpt_oss")
        got = m(x)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
        # and token by token through a cache (the window's ring included)
        cache = m.new_cache(1, len(ids))
        steps = np.concatenate([m(x[:, t:t + 1], cache=cache) for t in range(len(ids))], 1)
        np.testing.assert_allclose(steps, want, rtol=0, atol=2e-5 * np.abs(want).max())
        path = tmp_path / f"{model_type}{i}.npz"
        m.save(path)
        np.testing.assert_array_equal(mh.MultiHeadAttention.load(path)(x), got)


def test_layers_the_modules_cannot_represent_are_refused():
    qwen3 = hf_model("qwen3", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16))
    with pytest.raises(TypeError, match="normalises each head's queries and keys"):
        mh.MultiHeadAttention.from_torch(qwen3.model.layers[0].self_attn)
    llama3 = hf_model("llama", dict(hidden_size=64, num_attention_heads=4, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))
    with pytest.raises(TypeError, match="'llama3' cannot be imported"):
        mh.MultiHeadAttention.from_torch(llama3.model.layers[0].self_attn)
    gqa = hf_model("llama", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="use a fused"):
        mh.StackedMultiHeadAttention.from_torch(gqa.model.layers[0].self_attn)


# (model_type, config): ALiBi sources (BLOOM, Falcon-RW, MPT; 6 heads, so that the
# slopes past the largest power of two count, but for Falcon's) and Falcon's other layouts of its fused
# query_key_value (multi-query, the new decoder architecture's grouped heads; rotary)
FUSED_QKV = [
    ("bloom", dict(hidden_size=48, n_head=6, n_layer=2, vocab_size=97)),
    # Falcon rounds each ALiBi bias to bfloat16: exact with slopes of whole powers of two
    ("falcon", dict(hidden_size=48, num_attention_heads=4, num_hidden_layers=2, vocab_size=97,
                    alibi=True, multi_query=False, new_decoder_architecture=False, bias=True,
                    parallel_attn=False)),
    ("falcon", dict(hidden_size=48, num_attention_heads=6, num_hidden_layers=2, vocab_size=97,
                    alibi=False, multi_query=True, new_decoder_architecture=False)),
    ("falcon", dict(hidden_size=48, num_attention_heads=6, num_kv_heads=2, num_hidden_layers=2,
                    vocab_size=97, alibi=False, new_decoder_architecture=True)),
    ("mpt", dict(d_model=48, n_heads=6, n_layers=2, vocab_size=97, max_seq_len=64)),
]


def fused_qkv_layers(model_type, cfg):
    """(model, its attention layers) with weights large enough that positions matter."""
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    # Falcon's eager path adds its ALiBi twice (once folded into the mask, once to the
    # scores); its "sdpa" path, like Falcon-RW itself, once
    config._attn_implementation = "sdpa" if cfg.get("alibi") else "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    layers = ([b.attn for b in model.transformer.blocks] if model_type == "mpt"
              else [b.self_attention for b in model.transformer.h])
    with torch.no_grad():
        for attn in layers:
            for p in attn.parameters():
                p.normal_(0, 0.3)
    return model, layers


@pytest.mark.parametrize("model_type, cfg", FUSED_QKV,
                         ids=["bloom", "falcon-alibi", "falcon-multi-query", "falcon-grouped",
                              "mpt"])
def test_bloom_falcon_and_mpt_attention_import_with_alibi(model_type, cfg, tmp_path):
    """Each layer's output inside a forward of the whole model (BLOOM's layer adds its
    residual: taken off), whole and token by token through a cache; ALiBi's slopes
    come along (each family's formula and units), and without them the output would
    be far off."""
    model, layers = fused_qkv_layers(model_type, cfg)
    seen = {}

    def grab(i):
        def hook(mod, args, kwargs, out):
            x = kwargs.get("hidden_states", args[0] if args else None)
            y = out[0]
            if model_type == "bloom":
                y = y - kwargs.get("residual", args[1] if len(args) > 1 else None)
            seen[i] = (x.detach().numpy().copy(), y.detach().numpy().copy())
        return hook

    hooks = [a.register_forward_hook(grab(i), with_kwargs=True) for i, a in enumerate(layers)]
    ids = list(np.random.default_rng(1).integers(0, 97, 20))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    alibi = model_type in ("bloom", "mpt") or cfg.get("alibi")
    for i, (x, want) in seen.items():
        m = mh.MultiHeadAttention.from_torch(layers[i])
        heads = cfg.get("n_head") or cfg.get("n_heads") or cfg["num_attention_heads"]
        assert m.num_heads == heads and (m.alibi_slopes is not None) == bool(alibi)
        got = m(x)
        tol = 2e-5 * np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=tol)
        cache = m.new_cache(1, len(ids))
        steps = np.concatenate([m(x[:, t:t + 1], cache=cache) for t in range(len(ids))], 1)
        np.testing.assert_allclose(steps, want, rtol=0, atol=tol)
        path = tmp_path / f"{model_type}{i}.npz"
        m.save(path)
        np.testing.assert_array_equal(mh.MultiHeadAttention.load(path)(x), got)
        if alibi:
            m.alibi_slopes = m.alibi_slopes[::-1].copy()  # the slopes in the wrong heads
            assert np.abs(m(x) - want).max() > 100 * tol


def test_mpt_with_clipped_qkv_is_refused():
    _, layers = fused_qkv_layers("mpt", dict(d_model=48, n_heads=6, n_layers=1, vocab_size=97,
                                             attn_config={"clip_qkv": 1.0}))
    with pytest.raises(TypeError, match="clip_qkv"):
        mh.MultiHeadAttention.from_torch(layers[0])
