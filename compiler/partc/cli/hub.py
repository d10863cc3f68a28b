"""Hugging Face repo ids given for --checkpoint, --config or inspect's PATH
(`meta-llama/Llama-3.1-8B`), found in the local Hugging Face cache; never downloaded.

A path that exists always wins: only a value naming nothing on disk and spelled as a repo id
(`NAMESPACE/NAME`) is looked up, with huggingface_hub's own `snapshot_download(...,
local_files_only=True)`, which reads the cache (HF_HUB_CACHE, else HF_HOME/hub, else
~/.cache/huggingface/hub) and makes no network request.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from partc.errors import LoadError, SourceLocation

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
"""`NAMESPACE/NAME` as the Hub spells repo ids (letters, digits, `-`, `_`, `.`)."""
_FILE_SUFFIXES = (".json", ".safetensors", ".yaml", ".yml", ".toml", ".md")
"""Suffixes that make a value a file path, never a repo id."""
HUB_EXTRA = "pip install 'partc[hub]'"
"""How to install what reading repo ids needs (huggingface_hub)."""


def is_repo_id(text: str) -> bool:
    """Whether `text` names nothing on disk and is spelled as a Hugging Face repo id."""
    return (bool(_REPO_ID.fullmatch(text)) and "--" not in text and ".." not in text
            and not text.lower().endswith(_FILE_SUFFIXES) and not os.path.lexists(text))


def cache_folder() -> str:
    """The Hugging Face cache folder that repo ids are looked up in (huggingface_hub's own
    reading of HF_HUB_CACHE and HF_HOME)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def snapshot_folder(repo_id: str, option: str) -> Path:
    """The folder of `repo_id`'s cached snapshot (its `main` revision), read offline; a
    LoadError naming the cache folder searched when the repo is not there."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "huggingface_hub":
            raise
        raise LoadError(f"{option}: no such file or folder; reading it as a Hugging Face repo "
                        f"id needs huggingface_hub, which is not installed: {HUB_EXTRA}",
                        location=SourceLocation(repo_id)) from None
    where = cache_folder()
    try:
        found = snapshot_download(repo_id, local_files_only=True)
    except LocalEntryNotFoundError:
        folder = Path(where) / f"models--{repo_id.replace('/', '--')}"
        raise LoadError(
            f"{option}: no such file or folder, and no Hugging Face repo {repo_id} in the local "
            f"cache {where} (searched {folder}: "
            f"{'no snapshot of its main revision' if folder.exists() else 'no such folder'}). "
            "partc never downloads: fetch it first (`hf download " + repo_id + "`), point "
            "HF_HUB_CACHE or HF_HOME at the cache that holds it, or pass a path",
            location=SourceLocation(repo_id)) from None
    return Path(found)


def resolve_checkpoint(text: str, option: str = "--checkpoint") -> str:
    """`text`, or when it is a repo id, the folder of its cached snapshot (which must hold
    .safetensors files)."""
    if not is_repo_id(text):
        return text
    folder = snapshot_folder(text, option)
    if not any(name.endswith((".safetensors", ".safetensors.index.json"))
               for name in os.listdir(folder)):
        held = ", ".join(sorted(os.listdir(folder))) or "nothing"
        raise LoadError(f"{option}: the cached snapshot of Hugging Face repo {text} ({folder}) "
                        f"holds no .safetensors file (it holds {held}): fetch the weights "
                        f"(`hf download {text}`)",
                        location=SourceLocation(text))
    return str(folder)


def resolve_config(text: str, option: str = "--config") -> str:
    """`text`, or when it is a repo id, the config.json of its cached snapshot."""
    if not is_repo_id(text):
        return text
    config = snapshot_folder(text, option) / "config.json"
    if not config.is_file():
        raise LoadError(f"{option}: the cached snapshot of Hugging Face repo {text} "
                        f"({config.parent}) holds no config.json: fetch it (`hf download {text} "
                        "config.json`)",
                        location=SourceLocation(text))
    return str(config)
