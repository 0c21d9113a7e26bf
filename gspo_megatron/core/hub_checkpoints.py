"""Model paths given as Hugging Face hub ids (``Qwen/Qwen3-30B-A3B``) resolved to local folders.

The rule, applied once at start-up (``train.py``) to ``model.hf_checkpoint``, ``tokenizer.path`` and
``rollout.sglang.model_path`` before anything reads them:

1. a value that is an existing local directory is that folder, as before;
2. otherwise a value shaped like a hub id (``owner/name``: one '/', no leading '/' or '.', valid to
   ``huggingface_hub``) is looked up in huggingface_hub's cache (``HF_HUB_CACHE``, by default
   ``~/.cache/huggingface/hub``) and, when cached, is that snapshot folder, with no network call;
3. a hub id not in the cache is downloaded into that cache by ``huggingface_hub.snapshot_download`` unless
   huggingface_hub's offline switch is on (``HF_HUB_OFFLINE=1``); a hub that cannot be reached, offline
   mode, or a repository the hub does not have is refused naming the key, the id, the cache directory
   and the fix;
4. anything else (``/no/such/dir``, ``./ckpt``) is left as given, for its loader to refuse as before.

Design decisions:
- Cache first, then the network: a cached id resolves to the revision the cache's ``refs/main`` names,
  even if the hub has moved on. A run (and its resume, which compares ``model.hf_checkpoint``) then
  reads the weights it recorded; ``hf download <id>`` (huggingface_hub's CLI) is how a user moves to a newer one.
  config.yaml records the resolved snapshot folder, whose name is the commit hash.
- huggingface_hub's own API, not a re-implementation of its layout: ``snapshot_download`` with
  ``local_files_only=True`` reads ``refs/<revision>`` and ``snapshots/<hash>/`` exactly as it wrote them,
  and its download takes a file lock per blob, so ranks of one node that start together share one copy.
  Its HTTP calls carry huggingface_hub's own timeouts (``HF_HUB_ETAG_TIMEOUT``, ``HF_HUB_DOWNLOAD_TIMEOUT``).
- The opt-out is huggingface_hub's, not a key of ours: ``HF_HUB_OFFLINE=1`` is the switch users of
  transformers, vLLM and SGLang already set on air-gapped clusters, and the cache directory
  (``HF_HUB_CACHE`` / ``HF_HOME``) is the one those tools share.
"""

from __future__ import annotations

from pathlib import Path


class HubCheckpointError(ValueError):
    """A model path that is neither a local folder nor a hub id that could be resolved; names key and fix."""


def looks_like_hub_id(value: str) -> bool:
    """``owner/name`` as the hub spells repository ids (``huggingface_hub``'s own validation)."""
    if value.startswith(("/", ".", "~")) or value.count("/") != 1:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def hub_cache_dir() -> str:
    """The cache huggingface_hub reads and writes (``HF_HUB_CACHE``; read at call time)."""
    from huggingface_hub import constants

    return str(Path(constants.HF_HUB_CACHE).expanduser())


def cached_snapshot(repo_id: str) -> str | None:
    """The cached snapshot folder of ``repo_id``'s main revision, or None; never touches the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, cache_dir=hub_cache_dir(), local_files_only=True)
    except LocalEntryNotFoundError:
        return None


def resolve_model_path(key: str, value: str) -> str:
    """``value`` of config key ``key`` as a local folder, by the rule in this module's docstring."""
    if Path(value).expanduser().is_dir() or not looks_like_hub_id(value):
        return value
    cached = cached_snapshot(value)
    if cached is not None:
        return cached
    return _download(key, value)


def _download(key: str, repo_id: str) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if constants.HF_HUB_OFFLINE:
        raise _not_available(key, repo_id, "HF_HUB_OFFLINE is set, so nothing is downloaded")
    try:
        return snapshot_download(repo_id, cache_dir=hub_cache_dir())
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as error:  # unreachable, unknown repo, gated
        cause = error.__cause__ or error  # huggingface_hub wraps the connection error in a paragraph of its own
        first_line = str(cause).splitlines()[0] if str(cause) else ""
        reason = f"the hub could not provide it: {type(cause).__name__}: {first_line}"
        raise _not_available(key, repo_id, reason) from error


def _not_available(key: str, repo_id: str, reason: str) -> HubCheckpointError:
    return HubCheckpointError(
        f"{key}={repo_id} is not a local directory, and as a Hugging Face hub id it is not in the cache "
        f"{hub_cache_dir()} ({reason}). Fix: download it where the hub is reachable with "
        f"`hf download {repo_id}` (huggingface_hub's CLI; the same HF_HUB_CACHE / HF_HOME), or pass a local folder: "
        f"{key}=/path/to/checkpoint"
    )
