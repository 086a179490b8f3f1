"""Checkpoint folders without torch: the errors, the torch-free road, the random writer."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("safetensors")

from manyheads.models import from_pretrained  # noqa: E402
from manyheads.models.random import save_random_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=1,
                                  max_position_embeddings=64)


def _edit_config(folder, **changes):
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))


def _copy(src, dst):
    os.makedirs(dst)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
            g.write(f.read())
    return str(dst)


def test_missing_folder_config_or_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        from_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match="safetensors") as info:
        from_pretrained(tmp_path)
    assert "no weights" in str(info.value) and "PyTorch" not in str(info.value)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 8)
    with pytest.raises(FileNotFoundError, match=r"its weights are PyTorch files "
                                                r"\(pytorch_model.bin\), which this loader "
                                                r"does not read"):
        from_pretrained(tmp_path)


def test_unsupported_model_type_names_the_supported_ones(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "bert")
    _edit_config(d, model_type="bert")
    with pytest.raises(ValueError, match="'bert'.*gemma2, gemma3_text, gpt2, gpt_oss, llama, "
                                         "ministral, mistral, phi3, qwen2, qwen3"):
        from_pretrained(d)


@pytest.mark.parametrize("text, match", [
    ("{not json", "malformed config.json"),
    ("[1, 2]", "malformed config.json in .*: expected a JSON object"),
    ('{"hidden_size": 64}', "no 'model_type'"),
])
def test_malformed_config_json(llama_dir, tmp_path, text, match):
    d = _copy(llama_dir, tmp_path / "bad")
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write(text)
    with pytest.raises(ValueError, match=match):
        from_pretrained(d)


@pytest.mark.parametrize("changes, match", [
    ({"hidden_size": "64"}, "'hidden_size' must be an integer"),
    ({"num_hidden_layers": 0}, "'num_hidden_layers' must be an integer >= 1"),
    ({"vocab_size": None, "hidden_size": 64}, "missing 'vocab_size'"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    ({"rope_theta": -1.0}, "'rope_theta' must be a positive number"),
    ({"rope_scaling": {"rope_type": "ntk-by-parts", "factor": 4.0}},
     "rotary scaling 'ntk-by-parts' is not supported; supported: default, linear, dynamic"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                       "long_factor": [2.0] * 8}}, "rotary scaling 'longrope'.*not supported"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rotary scaling 'linear' needs 'factor'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2}}, "'factor' must be a positive"),
    ({"rope_scaling": [1, 2]}, "'rope_scaling' must be an object"),
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
    ({"intermediate_size": 100}, "has shape .* the config implies"),
    # (an FP8 checkpoint's values are float8 tensors over scales that only the config's
    # quantization_config announces: read as floats they would give wrong logits)
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     r"quantised checkpoints are not supported \(quantization_config with quant_method "
     r"'fp8'\): use the unquantised checkpoint, and weight_dtype='int8'"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method 'gptq'"),
])
def test_config_values_are_checked(llama_dir, tmp_path, changes, match):
    d = _copy(llama_dir, tmp_path / "bad")
    _edit_config(d, **changes)
    with pytest.raises(ValueError, match=match):
        from_pretrained(d)


def test_context_vocabulary_and_mask_limits(llama_dir):
    model = from_pretrained(llama_dir)
    assert model.context_length == 64
    with pytest.raises(ValueError, match="exceed the model's context length 64"):
        model.generate(np.arange(60)[None], 5)
    with pytest.raises(ValueError, match="context length 64"):
        model.logits(np.zeros((1, 65), dtype=int))
    model.generate(np.arange(60)[None], 4)  # exactly the context: fine
    with pytest.raises(ValueError, match=r"token id 320 is outside the vocabulary.*\[0, 319\]"):
        model.logits([[1, 2, 320]])
    with pytest.raises(ValueError, match="token id -1 is outside the vocabulary"):
        model.generate([[-1, 2]], 3)
    with pytest.raises(TypeError, match="integer token ids"):
        model.logits([[1.0, 2.0]])
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="left padding"):
        model.generate(ids, 2, attention_mask=[[1, 1, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match="without any token"):
        model.generate(ids, 2, attention_mask=[[0, 0, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match="the shape of ids"):
        model.generate(ids, 2, attention_mask=[[1, 1], [1, 1]])
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(ids, -1)
    assert model.generate(ids, 0).shape == (2, 0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8", "int4"])
def test_cache_dtype_goes_to_the_caches(dtype, tmp_path):
    d = save_random_checkpoint(tmp_path, "llama", seed=3, hidden_size=128)  # head_dim 32
    model = from_pretrained(d)
    prompt = np.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    caches = model.new_caches(1, 8 + 10, dtype)
    out = model.generate(prompt, 10, caches=caches)
    assert out.shape == (1, 10) and ((0 <= out) & (out < model.vocab_size)).all()
    assert all(getattr(c.dtype, "name", c.dtype) == dtype and len(c) == 17 for c in caches)
    full = model.new_caches(1, 18)
    assert caches[0].nbytes < full[0].nbytes
    np.testing.assert_array_equal(model.generate(prompt, 10, cache_dtype=dtype), out)


def test_eos_stops_and_fills(llama_dir):
    model = from_pretrained(llama_dir)
    prompt = np.array([[3, 1, 4, 1, 5]])
    free = model.generate(prompt, 12)[0]
    eos = int(free[4])
    out = model.generate(prompt, 12, eos_token_id=eos)[0]
    first = int(np.flatnonzero(free == eos)[0])
    np.testing.assert_array_equal(out[:first + 1], free[:first + 1])
    assert (out[first:] == eos).all()


def test_random_checkpoint_generates_varied_tokens(llama_dir):
    out = from_pretrained(llama_dir).generate([[3, 1, 4, 1, 5]], 24)
    assert len(set(out[0].tolist())) > 5


def _run(code, *args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=300, env=env)


def test_torch_is_never_imported(tmp_path):
    """from_pretrained, generate and the generate command with torch made unimportable."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("ml_dtypes")
    code = """
        import sys
        sys.modules["torch"] = None          # any `import torch` now raises ImportError
        sys.modules["transformers"] = None
        import numpy as np, ml_dtypes
        import manyheads
        from manyheads.models import from_pretrained
        from manyheads.models.random import save_random_checkpoint
        from manyheads.__main__ import main
        d32 = save_random_checkpoint(sys.argv[1] + "/f32", "qwen2", tokenizer=True)
        d16 = save_random_checkpoint(sys.argv[1] + "/bf16", "gpt2", dtype=ml_dtypes.bfloat16)
        for d in (d32, d16):
            m = from_pretrained(d)
            out = m.generate(np.array([[1, 2, 3]]), 5, cache_dtype=np.float16)
            assert out.shape == (1, 5), out.shape
        assert main(["generate", "--model", d32, "--prompt", "the cat", "--max-new-tokens",
                     "4"]) == 0
        loaded = [k for k, v in sys.modules.items()
                  if v is not None and k.split(".")[0] in ("torch", "transformers")]
        print("torch-free:", loaded == [])
    """
    res = _run(code, str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "torch-free: True" in res.stdout


def test_reading_needs_no_safetensors_package(llama_dir):
    """The loader reads the safetensors format itself (a header, then each tensor's bytes,
    a slice of rows at a time), so loading works where the package is missing."""
    code = """
        import sys
        sys.modules["safetensors"] = None
        from manyheads.models import from_pretrained
        model = from_pretrained(sys.argv[1])
        print("tokens:", model.generate([[1, 2, 3]], 4).tolist())
    """
    res = _run(code, llama_dir)
    assert res.returncode == 0, res.stderr
    assert "tokens: [[" in res.stdout


@pytest.mark.parametrize("damage, match", [
    (lambda raw: raw[:6], "malformed safetensors file"),
    (lambda raw: (10 ** 6).to_bytes(8, "little") + raw[8:], "malformed safetensors file"),
    (lambda raw: raw[:8] + b"[" + raw[9:], "malformed safetensors header"),
    (lambda raw: raw[:-100], "outside the file"),
])
def test_a_damaged_safetensors_file_is_named(llama_dir, tmp_path, damage, match):
    import shutil
    folder = tmp_path / "damaged"
    shutil.copytree(llama_dir, folder)
    path = folder / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=match):
        from_pretrained(folder)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_random_checkpoint_loads_in_transformers_with_equal_logits(arch, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d = save_random_checkpoint(tmp_path, arch, seed=2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    ids = np.random.default_rng(0).integers(0, 320, size=(1, 30))
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)).logits.numpy()
    ours = from_pretrained(d).logits(ids)
    assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("entry, match", [
    ({"dtype": "F32", "shape": [2, 2], "data_offsets": [-16, 0]}, "malformed"),
    ({"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 16]}, "16 bytes for shape"),
    ({"dtype": "F32", "shape": "44", "data_offsets": [0, 64]}, "malformed"),
    ({"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}, "malformed"),
])
def test_a_safetensors_entry_must_match_its_bytes(llama_dir, tmp_path, entry, match):
    """Each entry's byte range must lie in the file and hold exactly its shape's bytes."""
    import shutil
    folder = tmp_path / "bad"
    shutil.copytree(llama_dir, folder)
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["extra.weight"] = entry
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    with pytest.raises(ValueError, match=match):
        from_pretrained(folder)


def test_int8_from_a_bfloat16_checkpoint(tmp_path):
    """Quantising at load reads a bfloat16 file's slices as they are stored."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    folder = save_random_checkpoint(tmp_path / "bf16", "llama", dtype=ml_dtypes.bfloat16)
    model = from_pretrained(folder, weight_dtype="int8")
    assert model.weight_dtype == "int8"
    ref = from_pretrained(folder).logits([[1, 2, 3, 4]])
    got = model.logits([[1, 2, 3, 4]])
    assert 0 < np.abs(got - ref).max() <= 0.25 * np.abs(ref).max()


def test_auto_joins_projections_saved_in_different_precisions(tmp_path):
    """A checkpoint whose k projection was saved in float32 beside bfloat16 q and v loads
    with weight_dtype="auto": the fused qkv weight is float32 (holding each exactly), the
    rest keeps the file's bfloat16, and the logits are those of a float32 load."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from safetensors.numpy import load_file, save_file
    folder = save_random_checkpoint(tmp_path / "mixed", "llama", dtype=ml_dtypes.bfloat16)
    name = next(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    tensors = load_file(os.path.join(folder, name))
    for key in [k for k in tensors if "k_proj" in k]:
        tensors[key] = tensors[key].astype(np.float32)
    save_file(tensors, os.path.join(folder, name))
    model = from_pretrained(folder, weight_dtype="auto")
    block = model.blocks[0]
    assert block.attn.W_qkv.dtype == np.float32
    assert block.w_gate_up.dtype == block.w_down.dtype == ml_dtypes.bfloat16
    ids = [[1, 2, 3, 4, 5]]
    ref = from_pretrained(folder, weight_dtype="float32").logits(ids)
    np.testing.assert_allclose(model.logits(ids), ref, rtol=0, atol=1e-5 * np.abs(ref).max())


LOAD_PEAK = """
import sys, numpy as np
from manyheads.models import from_pretrained

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

from_pretrained(sys.argv[2], weight_dtype=sys.argv[3]).generate(np.arange(4), 2)  # imports
before = status("VmRSS")
model = from_pretrained(sys.argv[1], weight_dtype=sys.argv[3])
print((status("VmHWM") - before) / model.nbytes)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc (Linux)")
@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16", "int8"])
def test_loading_adds_little_beyond_the_weights_at_its_peak(tmp_path, weight_dtype):
    """A float32 checkpoint of 60 MB, loaded in a fresh process (its imports done on a tiny
    one first): the process's peak resident memory grows by at most 1.15 times the
    weights in their final format (model.nbytes), as the file is read a slice at a time."""
    if weight_dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    big = save_random_checkpoint(tmp_path / "big", "llama", hidden_size=384,
                                 intermediate_size=1536, num_hidden_layers=6,
                                 num_attention_heads=6, num_key_value_heads=2,
                                 vocab_size=16000)
    tiny = save_random_checkpoint(tmp_path / "tiny", "llama")
    res = subprocess.run([sys.executable, "-c", LOAD_PEAK, big, tiny, weight_dtype],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert float(res.stdout) <= 1.15, res.stdout


def _root(a):
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a


@pytest.mark.parametrize("weight_dtype", ["float32", "bfloat16", "int8"])
def test_projections_are_packed_side_by_side(llama_dir, weight_dtype):
    """from_pretrained places every layer's projections in one shared block of memory
    (WeightArena), each on a 64-byte boundary and none overlapping another, and the
    logits are those of the same weights held as arrays of their own, bit for bit."""
    if weight_dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    from manyheads.models import ARCHITECTURES
    from manyheads.models._checkpoint import Checkpoint, read_config
    model = from_pretrained(llama_dir, weight_dtype=weight_dtype)
    arrays = [getattr(w, "_blocked", w) for b in model.blocks
              for w in (b.attn.W_qkv, b.attn.W_out, b.w_gate_up, b.w_down)]
    assert len({id(_root(a)) for a in arrays}) == 1
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays)
    assert all(s % 64 == 0 for s, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    cfg = read_config(llama_dir)
    with Checkpoint(llama_dir) as ckpt:
        ckpt.weight_dtype = weight_dtype
        apart = ARCHITECTURES[cfg["model_type"]](cfg, ckpt)
    assert all(_root(getattr(w, "_blocked", w)) is not _root(arrays[0])
               for w in (apart.blocks[0].attn.W_qkv, apart.blocks[0].w_down))
    ids = [[3, 1, 4, 1, 5, 9, 2, 6]]
    assert np.array_equal(model.logits(ids), apart.logits(ids))
    caches, caches_apart = model.new_caches(1, 16), apart.new_caches(1, 16)
    np.testing.assert_array_equal(model.generate(ids, 6, caches=caches),
                                  apart.generate(ids, 6, caches=caches_apart))


def test_weight_arena_places_arrays_apart_and_large_ones_alone():
    """WeightArena.empty: arrays on 64-byte boundaries, none overlapping, the writes
    of one never seen in another; an array over a quarter of a block is its own, and a
    block that cannot hold the next array gives way to a new one."""
    from manyheads.weights import WeightArena
    arena = WeightArena()
    shapes = [(3, 5), (7,), (1000, 33), (1, 1), (64, 64)]
    got = [arena.empty(s, np.float32) for s in shapes]
    for i, a in enumerate(got):
        assert a.shape == shapes[i] and a.dtype == np.float32
        assert a.flags.c_contiguous and a.ctypes.data % 64 == 0
        a[...] = i
    for i, a in enumerate(got):
        assert (a == i).all()
    assert len({id(_root(a)) for a in got}) == 1
    big = arena.empty((WeightArena.BLOCK // 4 // 8 + 1,), np.float64)
    assert _root(big) is not _root(got[0]) and big.base is None
    first = _root(got[0])
    filler = arena.empty((WeightArena.BLOCK // 4 - 64,), np.uint8)
    rest = [arena.empty((WeightArena.BLOCK // 4 - 64,), np.uint8) for _ in range(3)]
    assert _root(filler) is first and _root(rest[-1]) is not first
    assert all(a.dtype == np.uint8 for a in rest)


def test_loading_a_model_loads_the_blas_its_prefill_uses(llama_dir):
    """from_pretrained loads the projections' BLAS (SciPy's) before it reads the weights:
    the library starts threads that spin for about 0.1 s, which the loading covers rather
    than the first prompt's prefill."""
    code = """
        import sys
        from manyheads import _blas
        from manyheads.models import from_pretrained
        before = _blas._state["loaded"]
        from_pretrained(sys.argv[1])
        print("loaded before:", before, "after:", _blas._state["loaded"])
    """
    res = _run(code, str(llama_dir))
    assert res.returncode == 0, res.stderr
    assert "loaded before: False after: True" in res.stdout


def test_a_step_that_fails_part_way_takes_its_tokens_back_from_every_layer(tmp_path):
    # a value of layer 1 that a float16 cache cannot hold fails the step after layer 0
    # stored its token: layer 0 takes it back, so the caches still agree and go on as if
    # the step had not been tried
    model = from_pretrained(save_random_checkpoint(tmp_path / "m", "llama", seed=2))
    attn = model.blocks[1].attn
    kv = (attn.num_heads + attn.num_kv_heads) * attn.head_dim  # the values' columns
    ids = np.array([[5, 17, 3, 9]])
    ref_caches = model.new_caches(1, 8, np.float16)
    ref = [model.logits(ids[:, :3], caches=ref_caches, last_only=True),
           model.logits(ids[:, 3:], caches=ref_caches, last_only=True)]
    caches = model.new_caches(1, 8, np.float16)
    model.logits(ids[:, :3], caches=caches, last_only=True)
    saved = attn.W_qkv
    W = saved.copy()
    W[:, kv:] *= 1e6
    attn.W_qkv = W
    for step in (ids[:, 3:], ids[:, :2]):  # a decoding step, then a prefill of two tokens
        with pytest.raises(ValueError, match="float16 cache holds values up to 65504"):
            model.logits(step, caches=caches, last_only=True)
        assert [len(c) for c in caches] == [3] * model.num_layers
    attn.W_qkv = saved
    np.testing.assert_array_equal(model.logits(ids[:, 3:], caches=caches, last_only=True),
                                  ref[1])
    caches[0].truncate(2)  # layers that disagree are refused, not run
    with pytest.raises(ValueError, match=r"caches must hold the same tokens .* \[2, 4\]"):
        model.logits(ids[:, 3:], caches=caches)
