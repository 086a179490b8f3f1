"""The benchmark's Hugging Face models section (benchmarks/hf_models.py) on tiny models of the
two architectures it measures: each backend runs through its timer in the same
AttentionInterface, the logits agree, and the rows say what ran.  No time is asserted."""
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent
if not (REPO / "benchmarks" / "hf_models.py").is_file():
    pytest.skip("needs the source tree's benchmarks/", allow_module_level=True)
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import manyheads.transformers as mhtf  # noqa: E402
from benchmarks import hf_models  # noqa: E402

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.mark.parametrize("shape, decode", [
    (("tiny llama", "LlamaConfig", TINY, "sdpa"), True),
    (("tiny gemma2", "Gemma2Config", {**TINY, "head_dim": 8, "sliding_window": 8,
                                      "attn_logit_softcapping": 2.0,
                                      "query_pre_attn_scalar": 8}, "eager"), False)])
def test_each_backend_runs_timed_and_the_logits_agree(shape, decode, monkeypatch):
    mhtf.register()
    calls = []
    original = hf_models._register_timed

    def spy(*args):
        timed = original(*args)
        calls.append(timed)
        return timed

    monkeypatch.setattr(hf_models, "_register_timed", spy)
    with torch.inference_mode():
        rows = hf_models._prefill_rows(transformers, torch, shape, (20,), 20 if decode else None,
                                       1, lambda _: None)
    assert [(r.phase, r.tokens, r.baseline) for r in rows] == [
        ("prefill", 20, shape[3])] + [("decode", 20, shape[3])] * decode
    assert [t.name for t in calls] == ["timed_manyheads", f"timed_{shape[3]}"]
    for r in rows:
        assert r.max_abs_diff <= 1e-4
        assert 0 < r.manyheads_attention_s < r.manyheads_s
        assert 0 < r.baseline_attention_s < r.baseline_s
