"""from_pretrained("org/name"): a Hugging Face cache laid out as the Hub writes it
(models--org--name/snapshots/<commit>/..., refs/main), made here from a tiny random
checkpoint and read offline (HF_HUB_OFFLINE=1) in a fresh interpreter, as a user would;
and the message without huggingface_hub."""
import json
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("huggingface_hub")

from manyheads.models import from_pretrained  # noqa: E402
from manyheads.models.random import save_random_checkpoint  # noqa: E402

REPO = "tiny-org/tiny-llama"
PARTIAL = "tiny-org/only-config"  # cached: config.json and the tokenizer, no weights
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
PROMPT = [[3, 1, 4, 1, 5]]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(HF_HOME, main checkpoint folder, older checkpoint folder): the cache holds two
    snapshots of REPO, refs/main names the newer."""
    root = tmp_path_factory.mktemp("hf")
    main = save_random_checkpoint(root / "src-main", "llama", seed=1, tokenizer=True)
    old = save_random_checkpoint(root / "src-old", "llama", seed=2, tokenizer=True)
    repo = root / "home" / "hub" / ("models--" + REPO.replace("/", "--"))
    for commit, src in ((COMMIT, main), (OLD_COMMIT, old)):
        shutil.copytree(src, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    # what AutoConfig / AutoTokenizer leave in the cache
    partial = root / "home" / "hub" / ("models--" + PARTIAL.replace("/", "--"))
    shutil.copytree(main, partial / "snapshots" / COMMIT,
                    ignore=shutil.ignore_patterns("*.safetensors"))
    (partial / "refs").mkdir()
    (partial / "refs" / "main").write_text(COMMIT)
    return str(root / "home"), main, old


def run(hf_home, code, cwd=None):
    env = {**os.environ, "HF_HOME": hf_home, "HF_HUB_CACHE": os.path.join(hf_home, "hub"),
           "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


GENERATE = """
import json, sys
from manyheads.models import from_pretrained
try:
    m = from_pretrained({path!r}, revision={revision!r})
except (OSError, ValueError) as exc:
    print(type(exc).__name__, exc)
    sys.exit(0)
print(json.dumps(m.generate({prompt!r}, 8).tolist()))
"""


def generated(hf_home, path, revision=None, cwd=None):
    res = run(hf_home, GENERATE.format(path=path, revision=revision, prompt=PROMPT), cwd)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def tokens_of(folder):
    return json.dumps(from_pretrained(folder).generate(PROMPT, 8).tolist())


def test_a_hub_id_reads_the_cached_snapshot(hub):
    home, main, old = hub
    assert tokens_of(main) != tokens_of(old)
    assert generated(home, REPO) == tokens_of(main)
    assert generated(home, REPO, revision=OLD_COMMIT) == tokens_of(old)


def test_an_uncached_revision_offline_is_an_error_that_says_so(hub):
    home, _, _ = hub
    out = generated(home, REPO, revision="v2")
    assert out.startswith("OSError") and repr(REPO) in out and "revision 'v2'" in out
    out = generated(home, "other-org/missing")
    assert out.startswith("OSError") and "neither in the local cache nor downloadable" in out


def test_a_cached_snapshot_without_weights_offline_says_they_are_missing(hub):
    home, _, _ = hub
    out = generated(home, PARTIAL)
    assert out.startswith("OSError") and repr(PARTIAL) in out
    assert "gave no safetensors weights" in out and "config.json, tokenizer.json" in out
    assert "could not be downloaded (HF_HUB_OFFLINE=1" in out
    assert f"hf download {PARTIAL}" in out


def test_a_cached_snapshot_without_weights_is_downloaded(hub, tmp_path, monkeypatch):
    """A snapshot in the cache without the weights (none, or some shards of an index
    only) is no cached checkpoint: the download follows, and its folder is read."""
    _, main, _ = hub
    bare = tmp_path / "bare"
    shutil.copytree(main, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    sharded = tmp_path / "sharded"
    shutil.copytree(bare, sharded)
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    shutil.copy(os.path.join(main, "model.safetensors"),
                sharded / "model-00001-of-00002.safetensors")
    for cached in (bare, sharded):
        calls = []

        def snapshot_download(repo_id, revision=None, allow_patterns=None,
                              local_files_only=False):
            calls.append((repo_id, local_files_only))
            return str(cached) if local_files_only else main

        fake = types.SimpleNamespace(snapshot_download=snapshot_download)
        monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
        model = from_pretrained(REPO)
        assert calls == [(REPO, True), (REPO, False)]
        assert json.dumps(model.generate(PROMPT, 8).tolist()) == tokens_of(main)


def test_a_local_folder_wins_over_the_hub(hub, tmp_path):
    home, _, old = hub
    shutil.copytree(old, tmp_path / REPO)
    assert generated(home, REPO, cwd=str(tmp_path)) == tokens_of(old)


def test_the_generate_command_takes_a_hub_id(hub):
    home, main, _ = hub
    code = ("import sys; from manyheads.__main__ import main; sys.exit(main(['generate', "
            f"'--model', {REPO!r}, '--prompt', 'the cat sat', '--max-new-tokens', '6', "
            "'--ignore-eos']))")
    res = run(home, code)
    assert res.returncode == 0, res.stderr
    local = run(home, code.replace(repr(REPO), repr(main)))
    assert res.stdout == local.stdout and res.stdout.startswith("the cat sat")


def test_without_huggingface_hub_the_error_says_what_to_do(hub, monkeypatch):
    _, main, _ = hub
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(ImportError) as info:
        from_pretrained("some-org/some-model")
    msg = str(info.value)
    assert "hf download some-org/some-model --local-dir DIR" in msg
    assert "pip install 'manyheads[hub]'" in msg and "huggingface_hub" in msg
    # a folder needs no huggingface_hub
    assert np.array_equal(from_pretrained(main).generate(PROMPT, 8),
                          np.array(json.loads(tokens_of(main))))


def test_a_missing_folder_that_is_no_hub_id_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        from_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        from_pretrained(str(tmp_path / "nowhere"), revision="main")
