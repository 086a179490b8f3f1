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
