"""The GPU day proven here without a GPU: the kit builds (tools/gpu_kit.py), installs offline into a fresh
Python 3.12 venv standing in for the lent machine's image, and the day's command (tools/gpu_day.py
--dry-run) runs up to its CUDA check, where it stops naming the missing device.

The image stands in as ``.venv-gpu-image/`` (launch/setup_gpu_image_venv.sh: the image's versions of
what the project needs of it, torch 2.11.0 among them; made once, about 3 GB, then reused); each run
layers a fresh venv on it through a ``.pth`` file, so the kit lands in the fresh venv and the stand-in
stays as the image is. pip runs with no configuration and no index (``PIP_CONFIG_FILE`` = /dev/null,
``--no-index``), and the day's command in a network namespace of its own with no interface up
(``unshare -n``, where this machine allows it: as root), as on the lent machine, which reaches no
registry. Runs in the newest-stack leg (.ci/newest_stack), whose interpreter is the lent machine's
Python 3.12; skipped on any other.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_kit import IMAGE_VERSIONS

ROOT = Path(__file__).resolve().parents[2]
IMAGE_VENV = ROOT / ".venv-gpu-image"
BOX_SCALE = "20"  # this 2-core machine imports torch and megatron-core many times slower than the lent one

pytestmark = pytest.mark.skipif(
    sys.version_info[:2] != (3, 12),
    reason="the lent machine's Python is 3.12: this runs in the newest-stack leg (.ci/newest_stack)",
)


def _run(cmd: list, env: dict | None = None, timeout: int = 1800) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{cmd}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _without_network() -> list[str]:
    """``unshare -n`` (a network namespace with no interface up) where it is allowed, else nothing."""
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        print("unshare -n is not allowed here: the dry run is offline by pip's --no-index alone")
        return []
    return ["unshare", "-n"]


def _site_packages(venv: Path) -> Path:
    (path,) = (venv / "lib").glob("python3.12/site-packages")
    return path


@pytest.mark.timeout(1800)  # the stand-in's first set-up downloads about 3 GB
def test_the_kit_installs_offline_and_the_dry_run_stops_at_the_missing_device(tmp_path):
    kit = tmp_path / "kit"
    _run([sys.executable, "tools/gpu_kit.py", "build", f"--kit-dir={kit}"], timeout=900)
    manifest = json.loads((kit / "manifest.json").read_text())
    assert {w["name"] for w in manifest["wheels"]} >= {"megatron-core", "hydra-core", "omegaconf", "math-verify"}
    assert manifest["total_bytes"] == sum(p.stat().st_size for p in kit.glob("*.whl")) <= manifest["budget_bytes"]

    _run(["bash", "launch/setup_gpu_image_venv.sh"], env={**os.environ, "NEWEST_PYTHON": sys.executable})
    fresh = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(fresh)])  # pip is the image's, as there
    (_site_packages(fresh) / "gpu_image.pth").write_text(f"{_site_packages(IMAGE_VENV)}\n")

    offline = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    offline |= {"PIP_CONFIG_FILE": os.devnull, "CUDA_VISIBLE_DEVICES": "", "OUT": str(tmp_path / "out")}
    day = subprocess.run(
        [*_without_network(), fresh / "bin" / "python", "tools/gpu_day.py", "--dry-run", f"--kit={kit}"]
        + [f"--box-scale={BOX_SCALE}"],
        cwd=ROOT,
        env=offline,
        capture_output=True,
        text=True,
        timeout=2400,
        check=False,
    )
    print(day.stdout[-4000:])
    assert day.returncode == 0, day.stdout[-4000:] + day.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_day.json").read_text())
    steps = {step["step"]: step for step in report["steps"]}
    assert list(steps) == ["install", "preflight", "cuda"]
    assert steps["install"]["rc"] == 0 and steps["preflight"]["rc"] == 0, report
    versions = [f"torch {IMAGE_VERSIONS['torch']}", f"transformers {IMAGE_VERSIONS['transformers']}"]
    versions += [f"{w['name']} {w['version']}" for w in manifest["wheels"]]
    for version in versions:  # what the image stand-in holds and the kit brought, imported together
        assert f"\n{version}\n" in steps["preflight"]["tail"], (version, steps["preflight"]["tail"])
    assert report["verdict"].startswith("dry run") and report["exit_status"] == 0
    assert "no CUDA device" in report["device"] and "no CUDA device" in report["verdict"]
    not_run = {item["what"]: item["why"] for item in report["not_run"]}
    assert {not_run[s] for s in ("gpu_tier", "main_job", "calibrate")} == {"dry run"}
    assert "TransformerEngine" in not_run and "SGLang" in not_run
    for name in ("gpu_day.txt", "install.log", "preflight.log", "cuda.log"):
        assert (tmp_path / "out" / name).is_file(), name

    # the kit went into the fresh venv; the image's stand-in is as it was
    where = (
        "import importlib.metadata as md\n"
        "try: print(md.distribution('megatron-core').locate_file(''))\n"
        "except md.PackageNotFoundError: print(None)"
    )
    assert Path(_run([fresh / "bin" / "python", "-c", where], env=offline).stdout.strip()).is_relative_to(fresh)
    assert _run([IMAGE_VENV / "bin" / "python", "-c", where], env=offline).stdout.strip() == "None"
