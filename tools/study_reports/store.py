"""The study store: what a study's report is computed from, kept in the repository beside the report.

Layout of ``reports/<study>/`` (``save_runs`` writes it, ``load_store`` reads it)::

    store.json                          {"format": 1, "report": <report kind, regenerate_report.REPORTS>,
                                         "seed_keys": [...], "runs": [run names, in the report's order],
                                         "inputs": {what the report reads besides the runs, e.g. the
                                         shaping study's evaluation of its warm start}}
    stored_runs/<name>/manifest.json    what besides the code the run's numbers depend on (``RunManifest``):
                                        seeds, CPU threads, commit, clean tree, warm start (weights'
                                        sha256 and the command that makes it), the run's command, each
                                        stored file's sha256, and the run's provenance.json verbatim
    stored_runs/<name>/config.yaml      the run's composed config, as the run wrote it
    stored_runs/<name>/metrics.jsonl.gz every step's metrics (gzip of the run's own file)
    stored_runs/<name>/routing.jsonl.gz every step's routing records, when the run wrote any

Design decisions:
- Whole runs, not summaries: every per-step record the report reads is stored, so the report's numbers
  are a function of these files and the report code alone (``tools/regenerate_report.py``), and any other
  number a reviewer wants can be computed too. Before this store the routing studies' per-step metrics
  lived in git-ignored ``multirun/`` and were lost.
- gzip at level 9 with mtime 0 and no file name: the same run stores as the same bytes, so re-storing an
  unchanged study shows no diff. A 2-step miniature run is a few kB; the size of each stored study is
  stated in docs/studies.md.
- The manifest holds each stored file's sha256 of its uncompressed bytes; ``load_store`` checks them and
  refuses a file that differs, naming it: a hand-edited number cannot pass as a run's.
- Loaded runs carry the path ``stored_runs/<name>`` (relative to the study directory), not where the store
  was unpacked, so a report written from the store is the same wherever the repository is checked out: a
  regenerated report equals the stored one except its own provenance (``generated_by``).
- Not stored: checkpoints and the warm start's weights (megabytes each); their sha256 and the command that
  makes them are, and ``tools/sft_warmstart.py`` rebuilds the same weights at the same thread count.
- A run from a checkout with uncommitted changes is stored (the report warns about it), with
  ``clean_tree`` false in its manifest: the store records what happened, it does not hide it.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gspo_megatron.core.config_node import flatten_dotted
from gspo_megatron.core.provenance import PROVENANCE_FILE
from gspo_megatron.core.run_dir import CONFIG_FILE, METRICS_FILE, ROUTING_FILE, RunData, RunDirError, load_run

STORE_FILE = "store.json"
RUNS_DIR = "stored_runs"  # not "runs/": .gitignore keeps run directories of that name out of git
MANIFEST_FILE = "manifest.json"
FORMAT = 1
COMPRESSED = (METRICS_FILE, ROUTING_FILE)  # stored as <name>.gz
SEED_KEYS = ("trainer.seed", "model.init_seed")


class StoreError(ValueError):
    """A study directory that holds no usable store: none, a bad store.json, or a stored file that differs
    from its manifest."""


@dataclass(frozen=True)
class RunManifest:
    """What besides the code one stored run's numbers depend on (``stored_runs/<name>/manifest.json``)."""

    seeds: dict
    cpu_threads: int | None  # torch's CPU reductions depend on it (None: the run predates the record)
    commit: str | None
    clean_tree: bool | None  # False: run from uncommitted changes; None: unknown
    warm_start_sha256: str | None  # None: random init (or a checkpoint sft_warmstart.py did not write)
    warm_start_command: str | None  # the command that makes that warm start
    command: str | None  # the run's command (under a Hydra multirun the sweep's; config.yaml has its overrides)
    files: dict[str, str]  # stored file -> sha256 of its uncompressed bytes
    provenance: dict  # the run's provenance.json, verbatim

    @classmethod
    def of_run(cls, run: RunData, files: dict[str, str]) -> RunManifest:
        record = run.provenance
        warm = record.get("warm_start") or {}
        flat = flatten_dotted(run.config)
        dirty = record.get("dirty")
        return cls(
            seeds={key: flat.get(key) for key in SEED_KEYS},
            cpu_threads=record.get("cpu_threads"),
            commit=record.get("commit"),
            clean_tree=None if dirty is None else not dirty,
            warm_start_sha256=warm.get("weights_sha256"),
            warm_start_command=warm.get("command"),
            command=record.get("command"),
            files=files,
            provenance=record,
        )


# what a pre-registered study's report.json records of each run (its "runs" section)
REPORTED_PROVENANCE = ("commit", "clean_tree", "cpu_threads", "warm_start_sha256", "command")


def reported_provenance(manifests: dict[str, RunManifest]) -> dict[str, dict]:
    """{run: its ``REPORTED_PROVENANCE`` fields}: the ``runs`` section of the E1-E4 reports."""
    return {name: {key: getattr(m, key) for key in REPORTED_PROVENANCE} for name, m in manifests.items()}


@dataclass(frozen=True)
class StoredStudy:
    """A study read from its store: the report kind and the runs in the report's order."""

    report: str
    seed_keys: tuple[str, ...]
    runs: list[RunData]
    manifests: dict[str, RunManifest]
    inputs: dict  # what the report reads besides the runs (store.json's "inputs")
    directory: Path  # the study directory it was read from (the report may read its other stored files)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _stored_files(run_dir: Path) -> dict[str, bytes]:
    """The run's files the store keeps (name in the store -> uncompressed bytes)."""
    files = {CONFIG_FILE: (run_dir / CONFIG_FILE).read_bytes()} if (run_dir / CONFIG_FILE).is_file() else {}
    for name in COMPRESSED:
        if (run_dir / name).is_file():
            files[name + ".gz"] = (run_dir / name).read_bytes()
    return files


def save_runs(
    run_dirs: Sequence[Path], study_dir: Path, report: str, seed_keys: Sequence[str], inputs: dict | None = None
) -> Path:
    """Store ``run_dirs`` (in this order) as ``study_dir``'s store, replacing any earlier store; returns
    the store file. Run names are the directories' names (unique within a sweep). ``inputs``: what the
    report reads besides the runs (JSON-able)."""
    names = [Path(d).name for d in run_dirs]
    if len(set(names)) != len(names):
        raise StoreError(f"run directories must have distinct names to be stored together, got {names}")
    runs = [load_run(d) for d in run_dirs]  # refuses a directory that is no run, naming what is missing
    study_dir = Path(study_dir)
    if (study_dir / RUNS_DIR).exists():
        shutil.rmtree(study_dir / RUNS_DIR)  # an earlier store's runs are replaced, not mixed in
    for run, name in zip(runs, names, strict=True):
        target = study_dir / RUNS_DIR / name
        target.mkdir(parents=True)
        files = _stored_files(run.path)
        for stored_name, data in files.items():
            if stored_name.endswith(".gz"):
                (target / stored_name).write_bytes(gzip.compress(data, compresslevel=9, mtime=0))
            else:
                (target / stored_name).write_bytes(data)
        manifest = RunManifest.of_run(run, {n: _sha256(d) for n, d in files.items()})
        (target / MANIFEST_FILE).write_text(json.dumps(dataclasses.asdict(manifest), indent=1) + "\n")
    index = {"format": FORMAT, "report": report, "seed_keys": list(seed_keys), "runs": names, "inputs": inputs or {}}
    (study_dir / STORE_FILE).write_text(json.dumps(index, indent=1) + "\n")
    return study_dir / STORE_FILE


def _read_index(study_dir: Path) -> dict:
    path = study_dir / STORE_FILE
    if not path.is_file():
        raise StoreError(
            f"{study_dir} has no {STORE_FILE}: its runs were not stored, so its report cannot be regenerated "
            f"(see its README.md for the command that reruns the study; tools/store_runs.py stores a sweep)"
        )
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise StoreError(f"{path}: not valid JSON ({err.msg})") from err
    if index.get("format") != FORMAT:
        raise StoreError(f"{path}: format {index.get('format')!r}, this code reads format {FORMAT}")
    for key in ("report", "seed_keys", "runs"):
        if key not in index:
            raise StoreError(f"{path}: no {key!r} (a store.json names report, seed_keys and runs)")
    return index


def _unpack_run(stored: Path, target: Path) -> RunManifest:
    """Write the stored run into ``target`` as a run directory, checking every file against the manifest."""
    manifest_path = stored / MANIFEST_FILE
    if not manifest_path.is_file():
        raise StoreError(f"{stored} has no {MANIFEST_FILE}")
    try:
        manifest = RunManifest(**json.loads(manifest_path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, TypeError) as err:
        raise StoreError(f"{manifest_path}: not a manifest of this store format ({err})") from err
    target.mkdir(parents=True)
    for stored_name, digest in manifest.files.items():
        raw = (stored / stored_name).read_bytes()
        data = gzip.decompress(raw) if stored_name.endswith(".gz") else raw
        if _sha256(data) != digest:
            raise StoreError(
                f"{stored / stored_name} differs from the sha256 its manifest records ({digest[:16]}...): "
                "a stored run is never edited; store the runs again with tools/store_runs.py"
            )
        (target / stored_name.removesuffix(".gz")).write_bytes(data)
    (target / PROVENANCE_FILE).write_text(json.dumps(manifest.provenance))
    return manifest


def load_store(study_dir: str | Path) -> StoredStudy:
    """Read ``study_dir``'s store: every run as ``RunData`` with the path ``stored_runs/<name>``."""
    study_dir = Path(study_dir)
    index = _read_index(study_dir)
    runs, manifests = [], {}
    with tempfile.TemporaryDirectory(prefix="study_store_") as scratch:
        for name in index["runs"]:
            stored = study_dir / RUNS_DIR / name
            if not stored.is_dir():
                raise StoreError(f"{study_dir / STORE_FILE} names run {name!r}, but {stored} does not exist")
            manifests[name] = _unpack_run(stored, Path(scratch) / name)
            try:
                run = load_run(Path(scratch) / name)
            except RunDirError as err:
                raise StoreError(f"stored run {stored}: {err}") from err
            runs.append(dataclasses.replace(run, path=Path(RUNS_DIR) / name))
    return StoredStudy(index["report"], tuple(index["seed_keys"]), runs, manifests, index.get("inputs", {}), study_dir)
