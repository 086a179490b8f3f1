"""The example decoder generates the same tokens with and without the KV cache."""
import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "generate.py"


@pytest.mark.skipif(not EXAMPLE.exists(), reason="examples/ not shipped with this copy")
def test_generate_with_and_without_cache_gives_identical_tokens():
    spec = importlib.util.spec_from_file_location("generate_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.TinyGPT(d=64, heads=4, layers=2, context=64, seed=3)
    prompt = list(b"hello, attention")
    slow, _ = mod.generate(model, prompt, 16, use_cache=False)
    fast, _ = mod.generate(model, prompt, 16, use_cache=True)
    assert slow == fast and len(fast) == 16
    assert len(set(fast)) > 1
