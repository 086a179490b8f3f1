"""``python -m manyheads generate`` and ``show --model`` on tiny random checkpoints, run
as a user would: in a subprocess, reading what it prints."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("safetensors")
tokenizers = pytest.importorskip("tokenizers")

from manyheads.models import from_pretrained  # noqa: E402
from manyheads.models.random import save_random_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("tok"), "llama", seed=4,
                                  tokenizer=True)


@pytest.fixture(scope="module")
def ids_only(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("ids"), "gpt2", seed=5,
                                  vocab_size=50)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "manyheads", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_streams_the_greedy_text(with_tokenizer):
    prompt = "the cat sat on the"
    res = cli("generate", "--model", with_tokenizer, "--prompt", prompt,
              "--max-new-tokens", "16", "--ignore-eos")
    assert res.returncode == 0, res.stderr
    tok = tokenizers.Tokenizer.from_file(os.path.join(with_tokenizer, "tokenizer.json"))
    ids = tok.encode(prompt).ids
    new = from_pretrained(with_tokenizer).generate(np.array([ids]), 16)[0].tolist()
    assert res.stdout == tok.decode(ids + new) + "\n"
    assert res.stdout.startswith(prompt)
    assert "Llama(model_type='llama'" in res.stderr
    assert f"prompt: {len(ids)} tokens in" in res.stderr
    assert "generated 16 tokens" in res.stderr and "tokens/s" in res.stderr
    # the caches of 2 layers: 2 kv heads x 16 dims x (prompt + 16) slots, keys and values
    nbytes = 2 * 2 * 2 * 16 * (len(ids) + 16) * 4
    assert f"KV cache {nbytes} bytes" in res.stderr and "float32" in res.stderr


def test_generate_takes_token_ids_without_a_tokenizer(ids_only):
    res = cli("generate", "--model", ids_only, "--prompt", "1 2 3 4", "--max-new-tokens", "7",
              "--cache-dtype", "float16")
    assert res.returncode == 0, res.stderr
    new = from_pretrained(ids_only).generate(np.array([[1, 2, 3, 4]]), 7)[0].tolist()
    assert res.stdout.split() == ["1", "2", "3", "4"] + [str(t) for t in new]
    assert "float16" in res.stderr and "generated 7 tokens" in res.stderr


def test_generate_with_an_int8_cache(with_tokenizer):
    res = cli("generate", "--model", with_tokenizer, "--prompt", "the cat", "--max-new-tokens",
              "5", "--cache-dtype", "int8", "--ignore-eos")
    assert res.returncode == 0, res.stderr
    assert "generated 5 tokens" in res.stderr and "int8)" in res.stderr


@pytest.mark.parametrize("args, message", [
    (["--prompt", "the cat"], "no tokenizer.json: give the prompt as token ids"),
    (["--prompt", "1 2 99"], "token id 99 is outside the vocabulary"),
    (["--prompt", "1 2", "--max-new-tokens", "600"], "context length 512"),
    (["--prompt", "1 2", "--cache-dtype", "int3"], "int3"),
])
def test_generate_errors_are_one_line(ids_only, args, message):
    res = cli("generate", "--model", ids_only, *args)
    assert res.returncode == 2
    assert message in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("args, message", [
    (["--prompt", "1 2 3000"], "token id 3000 is outside the vocabulary"),
    (["--prompt", "1 -2 3"], "token id -2 is outside the vocabulary"),
    (["--prompt", "1 2", "--max-new-tokens", "600"], "context length 512"),
    (["--prompt", "1 2", "--max-new-tokens", "-1"], "--max-new-tokens must be 0 or more"),
    (["--prompt", " "], "the prompt has no tokens"),
])
def test_a_prompt_the_model_cannot_take_is_refused_before_anything_is_printed(ids_only, args,
                                                                                message):
    res = cli("generate", "--model", ids_only, *args)
    assert res.returncode == 2
    assert res.stdout == ""  # the prompt is not echoed
    err = res.stderr.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_generate_missing_folder(tmp_path):
    res = cli("generate", "--model", str(tmp_path / "nowhere"), "--prompt", "1 2")
    assert res.returncode == 2 and "no checkpoint folder" in res.stderr


def test_show_draws_one_layer_of_a_checkpoint(with_tokenizer, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "heads.png"
    res = cli("show", "--model", with_tokenizer, "--layer", "1", "--text",
              "the cat sat on the mat. the cat sat on the mat.", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "layer 1 of 2" in res.stdout
    assert "previous-token" in res.stdout and "induction" in res.stdout
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()[:1].isdigit()]
    assert len(lines) == 4  # one row per head
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_show_checks_the_layer(with_tokenizer, tmp_path):
    res = cli("show", "--model", with_tokenizer, "--layer", "5", "--text", "the cat sat",
              "--out", str(tmp_path / "x.png"))
    assert res.returncode == 2 and "layer must be in [0, 1]" in res.stderr
    res = cli("show", "--layer", "1", "--text", "the cat sat", "--out", str(tmp_path / "x.png"))
    assert res.returncode == 2 and "--layer needs --model" in res.stderr


def _with_files(src, dst, **files):
    """A copy of checkpoint ``src`` with JSON files changed (config.json's keys updated,
    the others written whole)."""
    shutil.copytree(src, dst)
    for name, content in files.items():
        path = os.path.join(dst, name.replace("__", "."))
        if name == "config__json":
            with open(path) as f:
                content = {**json.load(f), **content}
        with open(path, "w") as f:
            json.dump(content, f)
    return str(dst)


def test_generate_stops_at_every_end_of_sequence_id(with_tokenizer, tmp_path):
    """Each id of config.json's list, generation_config.json's eos_token_id (one or a
    list) and tokenizer_config.json's eos_token ends the text, as transformers' generate
    stops at each of the first two."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    prompt = "the cat sat on the"
    tok = tokenizers.Tokenizer.from_file(os.path.join(with_tokenizer, "tokenizer.json"))
    ids = tok.encode(prompt).ids
    model = from_pretrained(with_tokenizer)
    greedy = model.generate(np.array([ids]), 20)[0].tolist()
    end = greedy[6]
    stop = greedy.index(end) + 1  # the tokens printed, the end included
    unused = next(t for t in range(model.vocab_size) if t not in greedy)
    cases = {
        "list": dict(config__json={"eos_token_id": [unused, end]}),
        "generation list": dict(config__json={"eos_token_id": unused},
                                generation_config__json={"eos_token_id": [unused, end]}),
        "generation int": dict(generation_config__json={"eos_token_id": end}),
        "tokenizer": dict(tokenizer_config__json={"eos_token": tok.id_to_token(end)}),
    }
    for name, files in cases.items():
        folder = _with_files(with_tokenizer, tmp_path / name.replace(" ", "-"), **files)
        res = cli("generate", "--model", folder, "--prompt", prompt, "--max-new-tokens", "20")
        assert res.returncode == 0, res.stderr
        assert res.stdout == tok.decode(ids + greedy[:stop]) + "\n", name
        assert f"generated {stop} tokens" in res.stderr, name
        if name != "tokenizer":  # transformers does not read the tokenizer's eos_token
            hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
            with torch.no_grad():
                ref = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                                  pad_token_id=0)[0, len(ids):].tolist()
            assert ref == greedy[:stop], name
    res = cli("generate", "--model", folder, "--prompt", prompt, "--max-new-tokens", "20",
              "--ignore-eos")
    assert res.returncode == 0 and res.stdout == tok.decode(ids + greedy) + "\n"
    listed = _with_files(with_tokenizer, tmp_path / "python",
                         config__json={"eos_token_id": [unused, end]})
    model = from_pretrained(listed)
    assert model.eos_token_id == [unused, end]
    out = model.generate(np.array([ids]), 20, eos_token_id=model.eos_token_id)[0].tolist()
    assert out == greedy[:stop] + [unused] * (20 - stop)


def test_generate_with_no_new_tokens_prints_the_prompt(with_tokenizer):
    res = cli("generate", "--model", with_tokenizer, "--prompt", "the cat",
              "--max-new-tokens", "0")
    assert res.returncode == 0, res.stderr
    assert res.stdout == "the cat\n"


def test_generate_takes_a_prompt_that_is_not_utf8(with_tokenizer):
    res = subprocess.run([sys.executable, "-m", "manyheads", "generate", "--model",
                          with_tokenizer, "--prompt", b"the cat \xff", "--max-new-tokens", "2"],
                         capture_output=True, timeout=300)
    assert res.returncode == 0, res.stderr  # (the word-level tokenizer drops U+FFFD)
    assert res.stdout.startswith(b"the cat ") and b"generated 2 tokens" in res.stderr


def test_a_reader_that_goes_away_ends_generate_quietly(with_tokenizer):
    """As in `generate ... | head -c 5`: here the pipe is closed before anything is
    written, so that the first write meets it closed whatever the timing."""
    proc = subprocess.Popen([sys.executable, "-m", "manyheads", "generate", "--model",
                             with_tokenizer, "--prompt", "the cat", "--max-new-tokens", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err


def test_a_corrupt_tokenizer_is_a_one_line_error(with_tokenizer, tmp_path):
    folder = tmp_path / "badtok"
    shutil.copytree(with_tokenizer, folder)
    (folder / "tokenizer.json").write_text("{\n")
    res = cli("generate", "--model", str(folder), "--prompt", "the cat")
    assert res.returncode == 2
    assert "cannot read" in res.stderr and "tokenizer.json" in res.stderr
    assert "Traceback" not in res.stderr


class _Pieces:
    """A tokenizer whose ids are bytes of UTF-8 text (decode joins them, and an
    incomplete character decodes to U+FFFD, as byte-level tokenizers do)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", "replace")


def test_the_stream_writes_a_last_incomplete_character_at_the_end():
    import io

    from manyheads.__main__ import _Stream

    out = io.StringIO()
    stream = _Stream(_Pieces(), list(b"ab"), out)
    text = "c\u00e9\u20ac".encode()  # then the first byte of another euro sign
    for step, t in enumerate(list(text) + [0xE2]):
        stream(step, np.array([t]))
    assert out.getvalue() == "c\u00e9\u20ac"  # held back: it may be completed
    stream.finish()
    assert out.getvalue() == "c\u00e9\u20ac\ufffd"  # what decoding every id gives
