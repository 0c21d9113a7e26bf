"""A Hugging Face hub cache laid out exactly as ``huggingface_hub.snapshot_download`` leaves a download,
built from a local folder, offline: ``models--owner--name/refs/main`` holds the commit hash,
``snapshots/<hash>/<file>`` links to ``../../blobs/<sha256 of the file>``."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

TEST_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_as_the_hub_does(folder: Path, cache: Path, repo_id: str, commit: str = TEST_COMMIT) -> Path:
    """Copy the files of ``folder`` into the hub cache ``cache`` as ``repo_id``; returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)  # no newline, as huggingface_hub writes it
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.join("..", "..", "blobs", blob))
    return snapshot


def use_offline_hub_cache(monkeypatch, cache: Path) -> None:
    """Point huggingface_hub at ``cache`` with its offline mode on, for one test (pytest's ``monkeypatch``).
    huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE into ``constants`` when it is imported, so the
    constants it reads at call time are set, and the environment for anything imported later."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
