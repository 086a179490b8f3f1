"""The README and every page of docs/ show code that runs as written.

On each page, ```python blocks run as scripts (``__name__ == "__main__"``) and
```pycon blocks run as doctests that must print what they show, in the order
of the page, in one scratch folder per page: a block may read a file that an
earlier block of its page wrote.  A block that needs an optional package this
environment lacks is skipped, and so is the rest of its page, and the test
says which package; the test extra installs them all.  Shell (```bash) and
output (```text) blocks are shown, not run.
"""
import doctest
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results" / "results.md"
LLAMACPP = ROOT / "benchmarks" / "results" / "llamacpp_xeon.txt"
PAGES = [p for p in [README, *sorted((ROOT / "docs").rglob("*.md"))]
         if p.exists() and "_build" not in p.parts]

RUN = {"python", "pycon"}
SHOWN = {"bash", "text"}

# what a block mentions -> the optional package it needs
NEEDS = {
    "torch": r"^\s*(>>> )?(import|from) torch\b",
    "transformers": r"\btransformers\b",
    "matplotlib": r"\bmatplotlib\b|plot_attention\(",
    "distributed": r"^\s*(>>> )?(import|from) distributed\b",
    "ml_dtypes": r"\bml_dtypes\b",
    "safetensors": r"manyheads\.models\b|from_pretrained\(|save_random_checkpoint\(",
    "tokenizers": r"tokenizer=True",
}


@dataclass
class Block:
    lang: str
    code: str
    line: int  # line of the page where the code starts (1-based)


def fenced_blocks(text):
    """Every fenced code block of a Markdown page (MyST directives excluded)."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^( *)(`{3,})\s*([^`\s]*)[^`]*$", lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, lang = opening.groups()
        body, j = [], i + 1
        while j < len(lines) and not re.match(rf"^ *{fence}`*\s*$", lines[j]):
            line = lines[j]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            j += 1
        if not lang.startswith("{"):
            yield Block(lang, "\n".join(body) + "\n", i + 2)
        i = j + 1


def missing_package(code):
    for package, pattern in NEEDS.items():
        if re.search(pattern, code, flags=re.M) and importlib.util.find_spec(package) is None:
            return package
    return None


def absent_optional(exc):
    """The optional package whose absence raised exc (or caused it), else None."""
    while exc is not None:
        name = getattr(exc, "name", None)
        if isinstance(exc, ImportError) and name:
            top = name.split(".")[0]
            if top in NEEDS and importlib.util.find_spec(top) is None:
                return top
        exc = exc.__cause__ or exc.__context__
    return None


def run_python(block, page):
    # blank lines in front, so that a traceback names the page's own line numbers
    code = "\n" * (block.line - 1) + block.code
    exec(compile(code, str(page), "exec"), {"__name__": "__main__"})


def run_pycon(block, page):
    test = doctest.DocTestParser().get_doctest(block.code, {"__name__": "__main__"},
                                               f"{page.name}, line {block.line}", str(page),
                                               block.line - 1)
    report = []
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)


def page_id(page):
    return str(page.relative_to(ROOT))


RUNNABLE = [p for p in PAGES if any(b.lang in RUN for b in fenced_blocks(p.read_text()))]


@pytest.mark.parametrize("page", RUNNABLE, ids=page_id)
def test_every_example_on_the_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples write files (modules, checkpoints, pictures)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    blocks = [b for b in fenced_blocks(page.read_text()) if b.lang in RUN]
    ran = 0
    for block in blocks:
        package = missing_package(block.code)
        if package is None:
            try:
                (run_python if block.lang == "python" else run_pycon)(block, page)
                ran += 1
                continue
            except ImportError as exc:
                package = absent_optional(exc)
                if package is None:
                    raise
        pytest.skip(f"{page_id(page)}: ran {ran} of {len(blocks)} examples; the one at line "
                    f"{block.line} (and those after it) needs {package}")
    assert ran == len(blocks)


def test_the_pages_have_examples_to_run():
    assert README in RUNNABLE
    guide = ROOT / "docs" / "guide"
    if guide.exists():
        assert sorted(guide.glob("*.md")) == sorted(p for p in RUNNABLE if p.parent == guide)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_code_block_says_whether_it_runs(page):
    """A block in another language (or none) would be neither run nor meant as output."""
    langs = {(b.line, b.lang) for b in fenced_blocks(page.read_text())}
    assert {(line, lang) for line, lang in langs if lang not in RUN | SHOWN} == set()


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= 200


def first_table(text, heading):
    """The data rows of the first Markdown table after a heading, as lists of cells."""
    lines = text.split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([c.strip() for c in line.strip().strip("|").split("|")])
    return table[2:]  # without the header and the alignment row


@pytest.mark.skipif(not RESULTS.exists(), reason="benchmarks/results not shipped with this copy")
def test_the_readmes_performance_figures_are_the_recorded_runs():
    """Every figure in the README's table is a cell of benchmarks/results/results.md."""
    recorded = {c.strip() for line in RESULTS.read_text().splitlines()
                if line.startswith("|") for c in line.strip("|").split("|")}
    rows = first_table(README.read_text(), "## Performance")
    assert len(rows) >= 4
    figures = [cell for row in rows for cell in row[1:] if cell != "—"]  # — : not measured
    assert all(re.fullmatch(r"[\d.]+×?", f) for f in figures), figures
    assert [f for f in figures if f not in recorded] == []


@pytest.mark.skipif(not LLAMACPP.exists(), reason="benchmarks/results not shipped with this copy")
def test_the_readmes_llamacpp_ratios_are_the_recorded_run():
    """The README's paragraph on llama.cpp says what its recorded run shows: every ratio
    is one of the run's, and the run's peak memory and greedy tokens bear out the rest."""
    text = README.read_text()
    paragraph = text.split("Whole models against llama.cpp", 1)[1].split("\n\n", 1)[0]
    ratios = re.findall(r"([\d.]+)×", paragraph)
    assert len(ratios) == 4
    run = LLAMACPP.read_text()
    lines = [line.split()[2:] for line in re.findall(r"ratio m/l.*", run)]
    assert [r for r in ratios if f"{r}x" not in {c for line in lines for c in line}] == []
    # "with the same greedy tokens and no higher peak memory": each precision's
    # (prefill, decode, peak RSS) ratios, and its greedy tokens
    peaks = [float(line[2].rstrip("x")) for line in lines if len(line) == 3]
    assert len(peaks) == 3 and max(peaks) <= 1.0
    greedy = re.findall(r"(\d+)/(\d+) positions agree, (\w+)", run)
    assert len(greedy) == 3 and all(a == b and w == "identical" for a, b, w in greedy)
