"""Hugging Face repo ids for --checkpoint, --config and inspect's PATH, read from a real cache
layout (blobs, refs/main, snapshots of links) that huggingface_hub's own `scan_cache_dir`
accepts; the command line runs in a subprocess whose sockets refuse and record every use, so
that a network attempt would show."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import scan_cache_dir

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "compiler" / "partc" / "examples" / "tiny-llama"
REPO = "acme/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"

RUNNER = """
import socket, sys
log = sys.argv[1]
def refuse(*args, **kwargs):
    with open(log, "a") as out:
        out.write(repr(args[1:]) + "\\n")
    raise OSError("network blocked by the test")
socket.socket.connect = refuse
socket.socket.connect_ex = refuse
socket.create_connection = refuse
socket.getaddrinfo = refuse
{block}
from partc.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


def make_cache(hub: Path, repo: str, source: Path, files: tuple[str, ...] | None = None) -> Path:
    """Lay `source`'s files out as huggingface_hub caches a download of `repo`: content in
    blobs/, refs/main naming the commit, snapshots/COMMIT/NAME linking to the blob."""
    root = hub / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir()
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    for path in sorted(source.iterdir()):
        if files is not None and path.name not in files:
            continue
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        (root / "blobs" / digest).write_bytes(data)
        os.symlink(f"../../blobs/{digest}", snapshot / path.name)
    return snapshot


def _env(**set_: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.pop("HF_HUB_OFFLINE", None)  # partc must not need it to stay offline
    return env | set_


def _partc(tmp_path: Path, *argv: str, env: dict[str, str], block: str = "",
           cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    log = tmp_path / "network.log"
    done = subprocess.run([sys.executable, "-c", RUNNER.format(block=block), str(log), *argv],
                          capture_output=True, text=True, timeout=300, env=env,
                          cwd=cwd or tmp_path)
    assert not log.exists(), f"a network connection was attempted: {log.read_text()}"
    return done


@pytest.fixture()
def hub(tmp_path: Path) -> Path:
    folder = tmp_path / "hf" / "hub"
    make_cache(folder, REPO, TINY)
    info = scan_cache_dir(folder)  # the independent oracle: huggingface_hub reads it back
    assert info.warnings == []
    (repo,) = info.repos
    (revision,) = repo.revisions
    assert (repo.repo_id, repo.repo_type, revision.commit_hash) == (REPO, "model", COMMIT)
    assert sorted(f.file_name for f in revision.files) == ["config.json", "model.safetensors"]
    assert revision.refs == frozenset({"main"})
    return folder


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_repo_id_compiles_the_same_build_as_the_path_it_names(tmp_path, hub):
    env = _env(HF_HUB_CACHE=str(hub))
    done = _partc(tmp_path, "compile", "--checkpoint", REPO, "--tp", "2", "--pp", "2",
                  "--digests", "--out", str(tmp_path / "from-id"), env=env)
    assert done.returncode == 0, done.stderr
    done = _partc(tmp_path, "compile", "--checkpoint", str(TINY), "--tp", "2", "--pp", "2",
                  "--digests", "--out", str(tmp_path / "from-path"), env=env)
    assert done.returncode == 0, done.stderr
    by_id, by_path = _tree(tmp_path / "from-id"), _tree(tmp_path / "from-path")
    assert "plan.json" in by_id and by_id == by_path
    plan = json.loads(by_id["plan.json"])
    assert plan["checkpoint_fingerprint"] is not None  # the checkpoint was read, not skipped
    done = _partc(tmp_path, "compile", "llama", "--config", REPO, "--tp", "2", "--out",
                  str(tmp_path / "config-id"), "--format", "json", env=env)
    assert done.returncode == 0, done.stderr
    done = _partc(tmp_path, "compile", "llama", "--config", str(TINY / "config.json"), "--tp",
                  "2", "--out", str(tmp_path / "config-path"), env=env)
    assert _tree(tmp_path / "config-id") == _tree(tmp_path / "config-path")


def test_check_shard_init_and_inspect_take_a_repo_id_under_hf_home(tmp_path, hub):
    env = _env(HF_HOME=str(hub.parent))  # the cache is HF_HOME/hub without HF_HUB_CACHE
    done = _partc(tmp_path, "check", "--checkpoint", REPO, "--tp", "2", env=env)
    assert done.returncode == 0 and done.stdout.startswith(
        "ok: family, config binding, checkpoint, topology checked"), done.stderr
    inspected = _partc(tmp_path, "inspect", REPO, "--format", "json", env=env)
    direct = _partc(tmp_path, "inspect", str(TINY), "--format", "json", env=env)
    found, expected = json.loads(inspected.stdout), json.loads(direct.stdout)
    assert found["path"] == str(hub / "models--acme--tiny-llama" / "snapshots" / COMMIT)
    assert {k: v for k, v in found.items() if k not in ("path", "files")} == {
        k: v for k, v in expected.items() if k not in ("path", "files")}
    assert _partc(tmp_path, "demo", "--tp", "2", "--pp", "1", "--out", str(tmp_path / "b"),
                  env=env).returncode == 0
    done = _partc(tmp_path, "shard", str(tmp_path / "b"), "--checkpoint", REPO, "--out",
                  str(tmp_path / "shards"), "--format", "json", env=env)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["files"]) == 2
    done = _partc(tmp_path, "init", "--checkpoint", REPO, "--format", "json", env=env)
    assert done.returncode == 0 and "family:" in json.loads(done.stdout)["text"], done.stderr


def test_a_repo_missing_from_the_cache_names_the_folder_searched(tmp_path, hub):
    env = _env(HF_HUB_CACHE=str(hub))
    done = _partc(tmp_path, "compile", "--checkpoint", "meta-llama/Llama-3.1-8B", "--tp", "2",
                  "--out", str(tmp_path / "b"), "--format", "json", env=env)
    (error,) = json.loads(done.stdout)["errors"]
    assert done.returncode == 1 and error["kind"] == "LoadError"
    assert f"no Hugging Face repo meta-llama/Llama-3.1-8B in the local cache {hub}" in (
        error["message"])
    assert str(hub / "models--meta-llama--Llama-3.1-8B") in error["message"]
    assert "partc never downloads" in error["message"]
    assert not (tmp_path / "b").exists()
    done = _partc(tmp_path, "check", "--config", "acme/other", env=env)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"--config: no such file or folder, and no Hugging Face repo acme/other in the " \
           f"local cache {hub}" in done.stderr
    done = _partc(tmp_path, "inspect", "acme/tiny-lama", env=env)
    assert done.returncode == 1 and "models--acme--tiny-lama" in done.stderr


def test_offline_mode_is_respected_and_the_snapshot_still_found(tmp_path, hub):
    env = _env(HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
    done = _partc(tmp_path, "check", "--checkpoint", REPO, env=env)
    assert done.returncode == 0, done.stderr
    done = _partc(tmp_path, "check", "--checkpoint", "acme/absent", env=env)
    assert done.returncode == 1 and str(hub) in done.stderr


def test_a_path_that_exists_wins_over_a_repo_id(tmp_path, hub):
    env = _env(HF_HUB_CACHE=str(hub))
    local = tmp_path / "work" / "acme" / "tiny-llama"
    shutil.copytree(TINY, local)
    (local / "model.safetensors").unlink()  # a local folder of that name, without weights
    done = _partc(tmp_path, "check", "--checkpoint", REPO, env=env, cwd=tmp_path / "work")
    assert done.returncode == 1, done.stdout
    assert "acme/tiny-llama" in done.stderr and "Hugging Face" not in done.stderr
    assert "snapshots" not in done.stderr  # the cached snapshot (with weights) was not used


def test_a_snapshot_without_weights_and_a_missing_huggingface_hub_are_clear(tmp_path):
    hub = tmp_path / "hf" / "hub"
    make_cache(hub, REPO, TINY, files=("config.json",))
    env = _env(HF_HUB_CACHE=str(hub))
    done = _partc(tmp_path, "compile", "--checkpoint", REPO, "--out", str(tmp_path / "b"),
                  env=env)
    assert done.returncode == 1 and "holds no .safetensors file (it holds config.json)" in (
        done.stderr)
    done = _partc(tmp_path, "compile", "--config", REPO, "--out", str(tmp_path / "b"), env=env)
    assert done.returncode == 0, done.stderr  # the config alone is there
    blocked = "sys.modules['huggingface_hub'] = None"
    done = _partc(tmp_path, "check", "--config", REPO, env=env, block=blocked)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "needs huggingface_hub, which is not installed: pip install 'partc[hub]'" in (
        done.stderr)
    done = _partc(tmp_path, "check", "--config", str(TINY / "config.json"), env=env,
                  block=blocked)
    assert done.returncode == 0, done.stderr  # paths never need it


def test_names_that_look_like_files_are_never_repo_ids(tmp_path, hub):
    env = _env(HF_HUB_CACHE=str(hub))
    done = _partc(tmp_path, "check", "--checkpoint", "acme/model.safetensors", env=env)
    assert done.returncode == 1 and "Hugging Face" not in done.stderr
    assert "no such checkpoint file or directory" in done.stderr
    done = _partc(tmp_path, "check", "--config", "acme/config.json", env=env)
    assert done.returncode == 1 and "Hugging Face" not in done.stderr
