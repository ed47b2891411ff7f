"""Hugging Face Hub ids wherever zoff takes a model or tokenizer folder (model.path, data.tokenizer): resolved
through huggingface_hub, with its cache (HF_HOME, HF_HUB_CACHE), HF_HUB_OFFLINE and the token from the
environment or `hf auth login`.

`zoff train` and `zoff validate` fetch once per node before any rank starts (`fetch`: only the files zoff
reads, huggingface_hub's progress bar) and pin the revision they got (a commit hash) in the resolved config,
so the ranks, a restart and a rerun of the run's config.yaml read the very same files; the ranks then resolve
the id from the cache alone (`folder`), never over the network. A local folder is used as it is: a spec is a
Hub id only when no such path exists and it reads `owner/name`."""

from __future__ import annotations

import os
import re
from pathlib import Path

from zoff.errors import UserError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
# What zoff reads from a model repository and from a tokenizer's: never the .bin/.pt pickles, never code.
MODEL_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json"]
TOKENIZER_FILES = [
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "config.json",  # AutoTokenizer reads the model type from it where tokenizer_config.json names no class
]  # fmt: skip


def is_hub_id(spec: str | None) -> bool:
    """`owner/name` with no local path of that name (a local folder always wins)."""
    if not spec or spec.startswith((".", "/", "~")) or ".." in spec:
        return False
    return HUB_ID.fullmatch(spec) is not None and not Path(spec).exists()


def fetch(spec: str, revision: str | None, key: str, files: list[str]) -> tuple[Path, str]:
    """Download (or find in the cache) what zoff reads of Hub repository `spec` at `revision` (a branch, tag or
    commit; None: main): (the snapshot folder, its commit hash). Errors are one line naming `key` and the id."""
    return _snapshot(spec, revision, key, files, local_only=_offline())


def folder(spec: str, revision: str | None, key: str, files: list[str]) -> Path:
    """The local folder `spec` names: itself, or the cached snapshot of a Hub id (never the network: the
    pre-flight fetched it)."""
    if not is_hub_id(spec):
        return Path(spec).expanduser()
    return _snapshot(spec, revision, key, files, local_only=True)[0]


def pin(cfg, weights: bool = True):
    """`cfg` with each Hub id fetched and its revision pinned to the commit fetched (zoff.config.Config).
    weights False (zoff validate): the model's config and index only, not its safetensors files."""
    import dataclasses

    model, data = cfg.model, cfg.data
    if is_hub_id(model.path):
        code = ["*.py"] if model.config.get("trust_remote_code") else []  # only when the user allows it
        files = MODEL_FILES if weights else [f for f in MODEL_FILES if not f.endswith(".safetensors")]
        _, sha = fetch(model.path, model.revision, "model.path", files + code)
        model = dataclasses.replace(model, revision=sha)
    if is_hub_id(data.tokenizer):
        _, sha = fetch(data.tokenizer, data.tokenizer_revision, "data.tokenizer", TOKENIZER_FILES)
        data = dataclasses.replace(data, tokenizer_revision=sha)
    return dataclasses.replace(cfg, model=model, data=data)


def model_folder(cfg) -> Path:
    """model.path as a local folder (zoff.config.ModelConfig with a path)."""
    return folder(cfg.path, cfg.revision, "model.path", MODEL_FILES)


def tokenizer_folder(cfg) -> Path:
    """data.tokenizer as a local folder (zoff.config.DataConfig whose tokenizer is not bytes)."""
    return folder(cfg.tokenizer, cfg.tokenizer_revision, "data.tokenizer", TOKENIZER_FILES)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _snapshot(
    spec: str, revision: str | None, key: str, files: list[str], local_only: bool
) -> tuple[Path, str]:
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError:
        raise UserError(f"{key}: '{spec}' is a Hugging Face Hub id: pip install zoff[hf]") from None
    at = f"'{spec}'" + (f" at revision '{revision}'" if revision else "")
    try:
        path = Path(
            huggingface_hub.snapshot_download(
                spec, revision=revision, allow_patterns=files, local_files_only=local_only
            )
        )
    except errors.GatedRepoError:
        raise UserError(
            f"{key}: {at} is gated: accept its terms on huggingface.co and log in (hf auth login, or HF_TOKEN)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise UserError(
            f"{key}: no Hugging Face repository {at} (or it is private: log in with hf auth login or HF_TOKEN)"
        ) from None
    except errors.RevisionNotFoundError:
        raise UserError(f"{key}: {at}: no such revision (a branch, tag or commit hash)") from None
    except errors.LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if _offline() else "the network was not reached"
        raise UserError(
            f"{key}: {at} is not in the Hugging Face cache ({os.environ.get('HF_HOME') or '~/.cache/huggingface'}) "
            f"and {why}: fetch it where there is a network (zoff validate CONFIG fetches it), or name a local folder"
        ) from None
    except (errors.HfHubHTTPError, OSError, ValueError) as e:
        raise UserError(
            f"{key}: cannot fetch {at} from the Hugging Face Hub ({str(e).splitlines()[0][:200]})"
        ) from None
    return path, path.name  # a snapshot folder is named by its commit hash
