"""The sampling flags of ``python -m manyheads generate``, the ``chat`` command on a
tiny template written here, and chat templates rendered as transformers renders them."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("safetensors")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from manyheads.models import from_pretrained  # noqa: E402
from manyheads.models._chat import render_chat  # noqa: E402
from manyheads.models.random import save_random_checkpoint  # noqa: E402

# roles and words the word-level tokenizer of a random checkpoint knows
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
            "{% if add_generation_prompt %}a bird :{% endif %}")


def rendered(messages):
    """TEMPLATE spelt out in Python."""
    return "".join(f"{m['role']} : {m['content']} . " for m in messages) + "a bird :"


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    folder = save_random_checkpoint(tmp_path_factory.mktemp("chat"), "llama", seed=4,
                                    tokenizer=True)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": TEMPLATE, "eos_token": "."}, f)
    return folder


def cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "manyheads", *args], capture_output=True,
                          text=True, timeout=300, input=stdin)


def test_generate_samples_with_the_flags(chat_dir):
    tok = tokenizers.Tokenizer.from_file(os.path.join(chat_dir, "tokenizer.json"))
    ids = tok.encode("the cat sat").ids
    model = from_pretrained(chat_dir)
    kw = dict(do_sample=True, seed=3, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05,
              repetition_penalty=1.1)
    res = cli("generate", "--model", chat_dir, "--prompt", "the cat sat", "--max-new-tokens",
              "14", "--ignore-eos", "--do-sample", "--seed", "3", "--temperature", "0.8",
              "--top-k", "20", "--top-p", "0.9", "--min-p", "0.05",
              "--repetition-penalty", "1.1")
    assert res.returncode == 0, res.stderr
    new = model.generate(np.array([ids]), 14, **kw)[0].tolist()
    assert res.stdout == tok.decode(ids + new) + "\n"
    assert new != model.generate(np.array([ids]), 14)[0].tolist()  # not greedy


def test_generate_stops_at_a_stop_string(chat_dir):
    tok = tokenizers.Tokenizer.from_file(os.path.join(chat_dir, "tokenizer.json"))
    ids = tok.encode("the cat sat").ids
    new = from_pretrained(chat_dir).generate(np.array([ids]), 20)[0].tolist()
    words = tok.decode(new).split()
    stop = f"{words[4]} {words[5]}"
    end = next(k for k in range(1, 21) if stop in tok.decode(new[:k]))
    res = cli("generate", "--model", chat_dir, "--prompt", "the cat sat", "--max-new-tokens",
              "20", "--stop", "nothing like this", "--stop", stop)
    assert res.returncode == 0, res.stderr
    assert res.stdout == tok.decode(ids + new[:end]) + "\n"
    assert res.stdout.rstrip("\n").endswith(stop) and f"generated {end} tokens" in res.stderr


@pytest.mark.parametrize("args, message", [
    (["--temperature", "0.5"], "--temperature apply to sampling: add --do-sample"),
    (["--do-sample", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--do-sample", "--temperature", "0"], "temperature must be > 0"),
    (["--do-sample", "--top-k", "-1"], "top_k must be an int >= 0 or None"),
    (["--do-sample", "--seed", "-1"], "seed must be an int >= 0"),
    (["--do-sample", "--min-p", "2"], "min_p must be in [0, 1]"),
    (["--repetition-penalty", "-1"], "repetition_penalty must be > 0"),
    (["--stop", ""], "stop: an empty string"),
])
def test_bad_sampling_flags_are_one_line_before_anything_is_printed(chat_dir, args, message):
    res = cli("generate", "--model", chat_dir, "--prompt", "the cat", *args)
    assert res.returncode == 2 and res.stdout == ""
    err = res.stderr.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_stop_takes_token_ids_without_a_tokenizer(tmp_path):
    folder = save_random_checkpoint(tmp_path / "ids", "gpt2", seed=5, vocab_size=50)
    new = from_pretrained(folder).generate(np.array([[1, 2, 3]]), 10)[0].tolist()
    res = cli("generate", "--model", folder, "--prompt", "1 2 3", "--max-new-tokens", "10",
              "--stop", str(new[4]))
    assert res.returncode == 0, res.stderr
    end = new.index(new[4]) + 1
    assert res.stdout.split() == ["1", "2", "3"] + [str(t) for t in new[:end]]
    res = cli("generate", "--model", folder, "--prompt", "1 2 3", "--stop", "cat")
    assert res.returncode == 2 and "--stop takes token ids" in res.stderr


def test_chat_renders_the_conversation_and_streams_the_replies(chat_dir):
    tok = tokenizers.Tokenizer.from_file(os.path.join(chat_dir, "tokenizer.json"))
    model = from_pretrained(chat_dir)
    end = tok.token_to_id(".")
    kw = dict(do_sample=True, seed=5, top_k=30)
    messages = [{"role": "system", "content": "many heads look at the same text"}]
    expected = []
    for text in ("the cat sat on the mat", "a dog sang in the tree"):
        messages.append({"role": "user", "content": text})
        ids = tok.encode(rendered(messages), add_special_tokens=False).ids
        new = model.generate(np.array([ids]), 12, eos_token_id=[end], **kw)[0].tolist()
        reply = new[:new.index(end)] if end in new else new
        expected.append(tok.decode(ids + reply)[len(tok.decode(ids)):])
        messages.append({"role": "assistant", "content": tok.decode(reply)})
    res = cli("chat", "--model", chat_dir, "--max-new-tokens", "12", "--system",
              messages[0]["content"], "--do-sample", "--seed", "5", "--top-k", "30",
              stdin="the cat sat on the mat\n\na dog sang in the tree\n")
    assert res.returncode == 0, res.stderr
    assert res.stdout == "".join(e + "\n" for e in expected)
    assert "chat: one message a line" in res.stderr


def test_chat_ends_a_reply_at_each_id_of_config_json(chat_dir, tmp_path):
    """config.json's eos_token_id list: its second id ends the reply too."""
    folder = tmp_path / "eos-list"
    shutil.copytree(chat_dir, folder)
    tok = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    model = from_pretrained(chat_dir)
    messages = [{"role": "user", "content": "the cat sat on the mat"}]
    ids = tok.encode(rendered(messages), add_special_tokens=False).ids
    dot = tok.token_to_id(".")
    greedy = model.generate(np.array([ids]), 12)[0].tolist()
    cut = greedy.index(dot) if dot in greedy else 12
    assert cut >= 3
    end = greedy[2]
    reply = greedy[:greedy.index(end)]
    unused = next(t for t in range(model.vocab_size) if t not in greedy)
    with open(folder / "config.json") as f:
        cfg = json.load(f)
    with open(folder / "config.json", "w") as f:
        json.dump({**cfg, "eos_token_id": [unused, end]}, f)
    res = cli("chat", "--model", str(folder), "--max-new-tokens", "12",
              stdin="the cat sat on the mat\n")
    assert res.returncode == 0, res.stderr
    assert res.stdout == tok.decode(ids + reply)[len(tok.decode(ids)):] + "\n"


def test_top_k_0_turns_the_filter_off(tmp_path):
    """--top-k 0 means no top-k filter (as top_k 0 does in transformers): not the
    default 50."""
    folder = save_random_checkpoint(tmp_path / "ids", "gpt2", seed=5, vocab_size=400)
    model = from_pretrained(folder)
    prompt = np.array([[1, 2, 3]])
    res = cli("generate", "--model", folder, "--prompt", "1 2 3", "--max-new-tokens", "24",
              "--do-sample", "--seed", "7", "--top-k", "0", "--temperature", "3")
    assert res.returncode == 0, res.stderr
    kw = dict(do_sample=True, seed=7, temperature=3.0)
    off = model.generate(prompt, 24, **kw)[0].tolist()
    assert res.stdout.split() == ["1", "2", "3"] + [str(t) for t in off]
    assert off != model.generate(prompt, 24, top_k=50, **kw)[0].tolist()
    assert "top_k off (flag)" in res.stderr


def test_chat_needs_a_template(chat_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(chat_dir, bare)
    os.remove(bare / "tokenizer_config.json")
    res = cli("chat", "--model", str(bare), stdin="hello\n")
    assert res.returncode == 2 and "has no chat template" in res.stderr
    (bare / "chat_template.jinja").write_text(TEMPLATE)  # where newer checkpoints keep it
    res = cli("chat", "--model", str(bare), "--max-new-tokens", "3", stdin="the cat\n")
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.splitlines()) == 1


RICH = """{%- set ns = namespace(turns=0) -%}
{%- if messages[0]['role'] != 'system' %}<|system|>You help.{{ eos_token }}
{% endif %}
{%- for message in messages %}
  {%- if message['role'] not in ['system', 'user', 'assistant'] %}
    {{- raise_exception('unknown role ' + message['role']) }}
  {%- endif %}
  {%- set ns.turns = ns.turns + 1 %}
<|{{ message['role'] }}|>
{{ message['content'] | trim }}{{ eos_token }} {{ {'turn': ns.turns, 'text': message['content']} | tojson }}
  {% if loop.last and message['role'] == 'assistant' %}{% break %}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_templates_render_as_transformers_renders_them(chat_dir, tmp_path, generation_prompt):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "rich"
    shutil.copytree(chat_dir, folder)
    with open(folder / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": RICH, "eos_token": ".", "bos_token": "the"}, f)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    for messages in ([{"role": "user", "content": "  café <b>\"quoted\"</b> "}],
                     [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}]):
        ours = render_chat(RICH, messages, add_generation_prompt=generation_prompt,
                           eos_token=".", bos_token="the")
        assert ours == hf.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=generation_prompt)
    with pytest.raises(ValueError, match="unknown role tool"):
        render_chat(RICH, [{"role": "tool", "content": "x"}], eos_token=".")


def test_settings_not_given_as_flags_come_from_generation_config(chat_dir, tmp_path):
    """As transformers' generate: the checkpoint's generation_config.json, then
    transformers' defaults (top_k 50), fill in what no flag gives; stderr says which."""
    folder = str(tmp_path / "gen")
    shutil.copytree(chat_dir, folder)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"temperature": 0.7, "top_p": 0.85, "repetition_penalty": 1.05,
                   "eos_token_id": 0}, f)
    tok = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    ids = tok.encode("the cat sat").ids
    model = from_pretrained(folder)
    run = ("generate", "--model", folder, "--prompt", "the cat sat", "--max-new-tokens", "12",
           "--ignore-eos")
    res = cli(*run, "--do-sample", "--seed", "3")
    assert res.returncode == 0, res.stderr
    new = model.generate(np.array([ids]), 12, do_sample=True, seed=3, temperature=0.7,
                         top_k=50, top_p=0.85, repetition_penalty=1.05)[0].tolist()
    assert res.stdout == tok.decode(ids + new) + "\n"
    assert ("sampling: temperature 0.7 (generation_config.json), top_k 50 (transformers' "
            "default), top_p 0.85 (generation_config.json), repetition_penalty 1.05 "
            "(generation_config.json)") in res.stderr
    res = cli(*run, "--do-sample", "--seed", "3", "--temperature", "1.3", "--top-k", "7")
    new = model.generate(np.array([ids]), 12, do_sample=True, seed=3, temperature=1.3,
                         top_k=7, top_p=0.85, repetition_penalty=1.05)[0].tolist()
    assert res.returncode == 0 and res.stdout == tok.decode(ids + new) + "\n"
    assert "temperature 1.3 (flag), top_k 7 (flag)" in res.stderr
    res = cli(*run)  # greedy: the file's repetition penalty still applies
    new = model.generate(np.array([ids]), 12, repetition_penalty=1.05)[0].tolist()
    assert res.returncode == 0 and res.stdout == tok.decode(ids + new) + "\n"
    assert "sampling:" not in res.stderr
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"temperature": 0.0, "top_k": 0}, f)
    res = cli(*run, "--do-sample")
    assert res.returncode == 2 and "temperature must be > 0" in res.stderr
    assert "generation_config.json" in res.stderr
    res = cli(*run, "--do-sample", "--seed", "3", "--temperature", "0.5")  # top_k 0: off
    new = model.generate(np.array([ids]), 12, do_sample=True, seed=3, temperature=0.5
                         )[0].tolist()
    assert res.returncode == 0 and res.stdout == tok.decode(ids + new) + "\n"
    assert "top_k" not in res.stderr


@pytest.mark.parametrize("system, expected", [
    (None, 0), ("many heads", 2)])
def test_chat_takes_a_template_that_reads_the_first_message(chat_dir, tmp_path, system,
                                                            expected):
    """Llama 3's, Qwen2.5's, Mistral's and Gemma's templates look at messages[0]; Gemma's
    refuses a system message, which only --system gives."""
    folder = tmp_path / "first"
    shutil.copytree(chat_dir, folder)
    gemma_like = ("{% if messages[0]['role'] == 'system' %}"
                  "{{ raise_exception('System role not supported') }}{% endif %}" + TEMPLATE)
    with open(folder / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": gemma_like, "eos_token": "."}, f)
    res = cli("chat", "--model", str(folder), "--max-new-tokens", "4",
              *(["--system", system] if system else []), stdin="the cat sat\n")
    assert res.returncode == expected, res.stderr
    if system:
        assert "System role not supported" in res.stderr and res.stdout == ""
    else:
        assert len(res.stdout.splitlines()) == 1 and "Traceback" not in res.stderr


@pytest.mark.parametrize("stdin_errors", ["surrogateescape", "strict"])
def test_chat_reads_bytes_that_are_not_utf8(chat_dir, stdin_errors):
    """Python reads stdin with surrogate escapes in the C locale and strictly in a UTF-8
    one (en_US.UTF-8)."""
    env = dict(os.environ, PYTHONIOENCODING=f"utf-8:{stdin_errors}")
    res = subprocess.run([sys.executable, "-m", "manyheads", "chat", "--model", chat_dir,
                          "--max-new-tokens", "3", "--system", b"many \xff heads"],
                         input=b"the cat \xff sat\n", capture_output=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.splitlines()) == 1


def test_ctrl_c_ends_chat_without_a_traceback(chat_dir):
    import signal

    # (Python raises KeyboardInterrupt only where SIGINT was not ignored at its start, and a
    # shell's background jobs, such as a CI run, start with it ignored: the default here)
    proc = subprocess.Popen([sys.executable, "-m", "manyheads", "chat", "--model", chat_dir],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen = []
        while not seen or "chat: one message a line" not in seen[-1]:
            seen.append(proc.stderr.readline())
            assert seen[-1], "".join(seen)  # (the process ended before it waited for input)
        proc.send_signal(signal.SIGINT)  # while it waits for a line
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
