"""Hub ids for model.path and data.tokenizer (issue 35 item 1), offline: a Hugging Face cache laid out as
huggingface_hub lays it out (models--owner--name/{blobs, refs/main, snapshots/<commit>} with links into the
blobs) is written by the test, HF_HUB_OFFLINE=1, no network and no mock of zoff's code.

`zoff validate` and `zoff train` resolve the ids through huggingface_hub, pin the commit in the resolved config,
and a run from the ids trains exactly as the same run from the snapshot folders; an id that is not there is
one line naming it, exit 2, before anything starts."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.datafiles import DOCS, make_tokenizer
from zoff.files.hub import is_hub_id

transformers = pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"


def _cache_repo(cache: Path, repo_id: str, files: Path) -> str:
    """Lay `files` out as huggingface_hub caches repository `repo_id` at one commit; returns the commit."""
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    root = cache / f"models--{repo_id.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in sorted(files.iterdir()):
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return commit


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hub")
    tok = make_tokenizer(root / "tok-src", DOCS)
    model_src = root / "model-src"
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=320, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(str(model_src))
    (root / "data.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    cache = root / "cache"
    commits = {
        "model": _cache_repo(cache, "zoff-test/tiny-llama", model_src),
        "tok": _cache_repo(cache, "zoff-test/tiny-tok", tok),
    }
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    snapshots = {k: cache / f"models--zoff-test--tiny-{n}" / "snapshots" / c for (k, c), n in
                 zip(commits.items(), ("llama", "tok"), strict=True)}  # fmt: skip
    return {"root": root, "env": env, "commits": commits, "snapshots": snapshots}


def _zoff(hub: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zoff", *args], capture_output=True, text=True, env=hub["env"],
                          cwd=hub["root"], timeout=600)  # fmt: skip


def _overrides(hub: dict, model: str, tok: str) -> list[str]:
    return [
        "model.name=hf:LlamaForCausalLM", f"model.path={model}", f"data.tokenizer={tok}", "data.name=jsonl",
        f"data.paths=[{hub['root'] / 'data.jsonl'}]", "data.seq_len=16", "launch.nproc_per_node=1",
        "train.max_steps=3", "log.progress=false", f"data.cache_dir={hub['root'] / 'tokens'}",
    ]  # fmt: skip


def test_validate_resolves_the_ids_from_the_cache_and_pins_their_commits(hub) -> None:
    p = _zoff(hub, "validate", str(TINY), *_overrides(hub, "zoff-test/tiny-llama", "zoff-test/tiny-tok"))
    assert p.returncode == 0, p.stderr
    cfg = yaml.safe_load(p.stdout)
    assert (
        cfg["model"]["path"] == "zoff-test/tiny-llama" and cfg["model"]["revision"] == hub["commits"]["model"]
    )
    assert cfg["data"]["tokenizer_revision"] == hub["commits"]["tok"]


def test_a_run_from_the_ids_reads_the_pinned_snapshot(hub) -> None:
    """It trains, its config pins the commit, and its checkpoint names the snapshot folder it read the weights
    from, with their checksum: a rerun of that config reads the very same files."""
    from zoff.checkpoint.base_ref import weights_digest
    from zoff.checkpoint.format import find_checkpoint, read_manifest

    run = hub["root"] / "run-ids"
    p = _zoff(hub, "train", str(TINY), *_overrides(hub, "zoff-test/tiny-llama", "zoff-test/tiny-tok"),
              "--run-dir", str(run))  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    losses = [
        json.loads(line)["loss"]
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line
    ]
    assert len(losses) == 3
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["revision"] == hub["commits"]["model"]
    assert saved["data"]["tokenizer_revision"] == hub["commits"]["tok"]
    base = read_manifest(find_checkpoint("auto", run / "checkpoints"))["base"]
    snapshot = hub["snapshots"]["model"]
    assert base == {"path": str(snapshot.resolve()), "sha256": weights_digest(snapshot.resolve())}


@pytest.mark.parametrize(
    "override, needle",
    [
        (
            "model.path=zoff-test/not-there",
            "model.path: 'zoff-test/not-there' is not in the Hugging Face cache",
        ),
        (
            "model.revision=v9",
            "model.path: 'zoff-test/tiny-llama' at revision 'v9' is not in the Hugging Face",
        ),
        (
            "data.tokenizer=zoff-test/no-tok",
            "data.tokenizer: 'zoff-test/no-tok' is not in the Hugging Face cache",
        ),
    ],
)
def test_an_id_that_is_not_there_is_one_line_before_anything_starts(hub, override, needle) -> None:
    run = hub["root"] / "never"
    args = [*_overrides(hub, "zoff-test/tiny-llama", "zoff-test/tiny-tok"), override, "--run-dir", str(run)]
    p = _zoff(hub, "train", str(TINY), *args)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and needle in lines[0] and "HF_HUB_OFFLINE" in lines[0], (
        p.stderr
    )
    assert not run.exists()


def test_a_local_folder_always_wins_over_an_id(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("owner/name")
    (tmp_path / "owner" / "name").mkdir(parents=True)
    assert not is_hub_id("owner/name")  # a folder of that name here: the folder
    for spec in ("./a/b", "/a/b", "~/a", "a/../b", "bytes", "a/b/c", None):
        assert not is_hub_id(spec), spec
