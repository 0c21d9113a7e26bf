"""Build the GPU-day kit: the wheels the lent GPU machine's image lacks, for its Python (3.12, manylinux
x86_64), into ``.gpu_kit/`` with a manifest; ``tools/gpu_day.py`` installs them there offline.

    python3 tools/gpu_kit.py build                # .gpu_kit/: wheels, manifest.json, requirements.txt
    python3 tools/gpu_kit.py image-requirements   # the image's versions of what the project needs from it

Design decisions:
- What the image holds is data (``IMAGE_PACKAGES``, ``IMAGE_VERSIONS``: the device notes' package list,
  read on a machine of that image on 2026-11-17); the kit is computed from it: the project's requirements
  (pyproject's dependencies, and the test extra's pytest and pytest-timeout, which the GPU tier runs
  under) less what the image satisfies, then each kit wheel's own requirements, recursively. A
  requirement the image holds at a version outside pyproject's range goes into the kit at the tested
  version (transformers would, were the image's 5.17.0 outside ``>=5.0,<=5.24.0``).
- One pinned version per package, the tested one (``kit_pins()``: the newest-stack leg's pins
  from requirements/newest-stack.txt, the main leg's environment for the rest), checked against every
  specifier that asks for it; a needed package without a pin stops the build, naming it.
- Each wheel is downloaded with ``--no-deps``: pip's own resolver would pull torch and its CUDA
  libraries (GBs) that the image already has. The closure above replaces it.
- Pure-Python packages published only as an sdist (``SDIST_ONLY``) are built here into a
  ``py3-none-any`` wheel, which installs on any Python 3.
- The kit travels with the working tree, 64 MiB together (the device tool's limit). The build refuses,
  naming the package that crossed and its size, when the kit would exceed 64 MiB less the working
  tree's bytes (``git ls-files``, tracked and untracked-not-ignored) less ``MARGIN_BYTES``.
"""

from __future__ import annotations

import argparse
import dataclasses
import email.parser
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from datetime import UTC, datetime
from pathlib import Path

import tomllib
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
KIT_DIR = ROOT / ".gpu_kit"
MANIFEST = "manifest.json"
REQUIREMENTS = "requirements.txt"
CARRY_LIMIT_BYTES = 64 * 2**20  # the device tool: working tree + carried paths, together
MARGIN_BYTES = 4 * 2**20  # room for the working tree to grow between the build and that day
PIP_TIMEOUT_S = 600

# The lent machine's interpreter (Python 3.12.3, x86-64, glibc 2.39): pip matches manylinux tags exactly.
TARGET_PYTHON = "3.12"
TARGET_PLATFORMS = ["manylinux2014_x86_64", "manylinux1_x86_64"] + [
    f"manylinux_2_{minor}_x86_64" for minor in range(5, 40)
]
TARGET_MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}

# The image 'cuda' of the lent machines, as the device notes list it (read 2026-11-17).
IMAGE_PACKAGE_LIST = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
    build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
    jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
    llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
    multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
    nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
    nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
    nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
    opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
    patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
    py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
    pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
    safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
    setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
    tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
    torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
    typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
    zipp"""
IMAGE_PACKAGES = frozenset(canonicalize_name(name) for name in IMAGE_PACKAGE_LIST.split())
# The versions those notes recorded, for the packages this project or its kit asks for (the others' are
# checked there: tools/gpu_day.py's preflight prints them).
IMAGE_VERSIONS = {
    "torch": "2.11.0",
    "transformers": "5.17.0",
    "triton": "3.6.0",
    "numpy": "2.5.2",
    "safetensors": "0.8.0",
    "huggingface-hub": "1.33.0",
    "tokenizers": "0.23.2",
}
# What the GPU tier needs of the test extra: pytest and, for its timeout marks, pytest-timeout.
GPU_TIER_TEST_NEEDS = ("pytest", "pytest-timeout")

# The main leg's environment (launch/setup_tests.sh on Python 3.11, 2026-12-07) for the packages the
# newest-stack pins (requirements/newest-stack.txt, read below) do not name.
MAIN_LEG_VERSIONS = {
    "hydra-core": "1.3.8",
    "omegaconf": "2.3.1",
    "antlr4-python3-runtime": "4.9.3",
    "math-verify": "0.9.0",
    "latex2sympy2-extended": "1.11.0",
}
SDIST_ONLY = {"antlr4-python3-runtime": "4.9.3 is published as an sdist only (pure Python): built here"}


class KitError(RuntimeError):
    """The kit cannot be built as asked; the message names the package and what to change."""


@dataclasses.dataclass(frozen=True)
class KitWheel:
    name: str
    version: str
    file: str
    bytes: int
    why: str


@dataclasses.dataclass(frozen=True)
class FromImage:
    requirement: str
    image_version: str | None  # None: the notes recorded no version (the preflight prints it there)


def kit_pins() -> dict[str, str]:
    """Pins for the kit: the newest-stack leg's (requirements/newest-stack.txt), then the main leg's."""
    pins = dict(MAIN_LEG_VERSIONS)
    for line in (ROOT / "requirements" / "newest-stack.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[canonicalize_name(name)] = version.strip()
    return pins


def applies(requirement: Requirement) -> bool:
    """Whether a requirement holds on the lent machine's Python with no extra asked for."""
    return requirement.marker is None or Marker(str(requirement.marker)).evaluate(TARGET_MARKERS)


def project_requirements() -> list[Requirement]:
    """pyproject's dependencies for Python 3.12, and what the GPU tier needs of the test extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(line) for line in project["dependencies"]]
    test_extra = {
        str(canonicalize_name(Requirement(line).name)): line for line in project["optional-dependencies"]["test"]
    }
    wanted += [Requirement(test_extra[name]) for name in GPU_TIER_TEST_NEEDS]
    return [requirement for requirement in wanted if applies(requirement)]


def image_satisfies(requirement: Requirement) -> bool:
    """The image holds the package at a version the requirement accepts (or at one the notes did not record)."""
    name = canonicalize_name(requirement.name)
    if name not in IMAGE_PACKAGES:
        return False
    version = IMAGE_VERSIONS.get(name)
    return version is None or requirement.specifier.contains(version, prereleases=True)


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The Requires-Dist entries of a wheel that hold on the lent machine (no extras)."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        message = email.parser.Parser().parsestr(archive.read(metadata).decode())
    return [r for r in map(Requirement, message.get_all("Requires-Dist") or []) if applies(r)]


def run_pip(args: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        raise KitError(
            f"pip {' '.join(args)} failed (exit {done.returncode}):\n{done.stdout[-1500:]}{done.stderr[-1500:]}"
        )


def fetch_wheel(name: str, version: str, dest: Path) -> Path:
    """One wheel for the lent machine, without its dependencies, into ``dest``."""
    with tempfile.TemporaryDirectory(prefix="gpu_kit_") as scratch:
        if name in SDIST_ONLY:
            run_pip(["wheel", "--no-deps", "--no-binary", ":all:", "-w", scratch, f"{name}=={version}"])
        else:
            platforms = [arg for platform in TARGET_PLATFORMS for arg in ("--platform", platform)]
            target = ["--python-version", TARGET_PYTHON, "--implementation", "cp", *platforms, "--platform", "any"]
            run_pip(["download", "--no-deps", "--only-binary=:all:", *target, "-d", scratch, f"{name}=={version}"])
        (wheel,) = Path(scratch).glob("*.whl")
        if name in SDIST_ONLY and not wheel.name.endswith("-py3-none-any.whl"):
            raise KitError(
                f"{name} {version} built as {wheel.name}, not a py3-none-any wheel: it would not install there"
            )
        return Path(shutil.move(wheel, dest / wheel.name))


def working_tree_bytes() -> int:
    """What travels besides the kit: tracked and untracked-not-ignored files (the device tool's rule)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.split(b"\0")
    paths = (ROOT / name.decode() for name in listed if name)
    return sum(path.stat().st_size for path in paths if path.is_file())


def check_fits(wheels: list[KitWheel], budget_bytes: int) -> None:
    """Refuse, naming the package that crossed and its size, once the kit exceeds ``budget_bytes``."""
    total = 0
    for wheel in wheels:
        total += wheel.bytes
        if total > budget_bytes:
            largest = sorted(wheels, key=lambda w: -w.bytes)[:3]
            raise KitError(
                f"the kit does not fit: {wheel.name} {wheel.version} ({wheel.bytes / 2**20:.1f} MiB) brings it to "
                f"{total / 2**20:.1f} MiB, over the {budget_bytes / 2**20:.1f} MiB left of the device tool's "
                f"64 MiB once the working tree and a {MARGIN_BYTES // 2**20} MiB margin travel; largest: "
                + ", ".join(f"{w.name} {w.bytes / 2**20:.1f} MiB" for w in largest)
                + ". Drop that package from the kit (the GPU steps needing it then say so) or shrink the tree."
            )


def build(kit_dir: Path, budget_bytes: int) -> tuple[list[KitWheel], list[FromImage]]:
    """Download the closure of what the image lacks into ``kit_dir`` (emptied first: one version each)."""
    pins = kit_pins()
    shutil.rmtree(kit_dir, ignore_errors=True)
    kit_dir.mkdir(parents=True)
    wheels: dict[str, KitWheel] = {}
    from_image: dict[str, FromImage] = {}
    queue = [(requirement, f"pyproject: {requirement}") for requirement in project_requirements()]
    while queue:
        requirement, why = queue.pop(0)
        name = canonicalize_name(requirement.name)
        if image_satisfies(requirement):
            from_image.setdefault(str(requirement), FromImage(str(requirement), IMAGE_VERSIONS.get(name)))
            continue
        version = wheels[name].version if name in wheels else pins.get(name)
        if version is None:
            raise KitError(
                f"{why}: the image lacks {name} and the kit has no tested version of it; add one to "
                "MAIN_LEG_VERSIONS in tools/gpu_kit.py"
            )
        if not requirement.specifier.contains(version, prereleases=True):
            raise KitError(f"{why}: the kit's {name} {version} is outside it; change its pin in tools/gpu_kit.py")
        if name in wheels:
            continue
        image_note = f" (the image has {IMAGE_VERSIONS[name]})" if name in IMAGE_VERSIONS else " (the image lacks it)"
        print(f"[kit] {name}=={version}: {why}{image_note}", flush=True)
        wheel = fetch_wheel(name, version, kit_dir)
        wheels[name] = KitWheel(name, version, wheel.name, wheel.stat().st_size, why + image_note)
        check_fits(list(wheels.values()), budget_bytes)
        queue += [(sub, f"required by {name} {version}: {sub}") for sub in wheel_requirements(wheel)]
    return list(wheels.values()), list(from_image.values())


def write_manifest(kit_dir: Path, wheels: list[KitWheel], from_image: list[FromImage], budget_bytes: int) -> None:
    manifest = {
        "built": datetime.now(UTC).isoformat(timespec="seconds"),
        "target": f"CPython {TARGET_PYTHON}, manylinux x86_64 (the lent GPU machine's image)",
        "total_bytes": sum(w.bytes for w in wheels),
        "budget_bytes": budget_bytes,
        "wheels": [dataclasses.asdict(w) for w in wheels],
        "from_image": [dataclasses.asdict(f) for f in from_image],
    }
    (kit_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    (kit_dir / REQUIREMENTS).write_text("".join(f"{w.name}=={w.version}\n" for w in wheels))


def image_requirements() -> list[str]:
    """The project's requirements the image satisfies, at the image's versions where the notes give them,
    and the image's versions of what those pull (tokenizers, triton): a venv that stands in for the image."""
    lines = {name: f"{name}=={version}" for name, version in IMAGE_VERSIONS.items()}
    for requirement in project_requirements():
        name = canonicalize_name(requirement.name)
        if image_satisfies(requirement) and name not in lines:
            lines[name] = f"{name}{requirement.specifier}"
    return list(lines.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="download the kit into --kit-dir with its manifest")
    build_parser.add_argument("--kit-dir", type=Path, default=KIT_DIR)
    build_parser.add_argument("--max-bytes", type=int, help="the kit's budget (default: 64 MiB - tree - margin)")
    commands.add_parser("image-requirements", help="print the image's versions of what the project needs of it")
    args = parser.parse_args(argv)
    if args.command == "image-requirements":
        print("\n".join(image_requirements()))
        return 0
    budget = args.max_bytes if args.max_bytes is not None else CARRY_LIMIT_BYTES - working_tree_bytes() - MARGIN_BYTES
    try:
        wheels, from_image = build(args.kit_dir, budget)
    except KitError as error:
        shutil.rmtree(args.kit_dir, ignore_errors=True)  # no partial kit for tools/gpu_day.py to find
        print(f"[kit] refused: {error}", file=sys.stderr)
        return 1
    write_manifest(args.kit_dir, wheels, from_image, budget)
    total = sum(w.bytes for w in wheels)
    print(f"[kit] {len(wheels)} wheels, {total / 2**20:.2f} MiB of {budget / 2**20:.1f} MiB, in {args.kit_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
