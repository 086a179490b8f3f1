"""The README's usage example runs as written."""
import importlib.util
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.skipif(not README.exists(), reason="README not shipped with this copy of the tests")
def test_readme_python_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the examples write files
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    ran = 0
    for code in blocks:
        optional = [m for m in ("torch", "matplotlib", "transformers", "distributed")
                    if f"import {m}" in code or f"from {m} import" in code]
        if any(importlib.util.find_spec(m) is None for m in optional):
            continue  # an optional extra this environment lacks
        exec(compile(code, str(README), "exec"), {"__name__": "__main__"})  # as a script runs it
        ran += 1
    assert ran >= 2
