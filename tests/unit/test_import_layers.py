"""The import contract: every package of gspo_megatron imports only from the layers below its own.

Design decisions:
- The layers are declared once, here (``LAYERS``, bottom first); ``docs/architecture.md`` carries the
  same list in its ``layers`` block and a test holds the two equal.
- A unit is a top-level subpackage (``rollout`` includes ``rollout/sglang``) or a top-level module.
  A unit may import itself and any unit of a LOWER layer; two units of one layer never import each
  other, so no package cycle can exist.
- Every import counts: module level, inside functions (lazy) and under ``TYPE_CHECKING``, read with
  ``ast`` from the source (nothing is imported, so the test is fast and sees imports that only run on
  some paths). The only exceptions are ``EXCEPTIONS`` below, each with its reason.
- ``testing`` (test doubles and fixtures) is the top layer: nothing in the runtime package imports it,
  and the wheel leaves it out (``pyproject.toml``).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gspo_megatron"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "config_node",
        "registry",
        "provenance",
        "known_warnings",
        "import_hooks",
        "process_tags",
        "trigger_words",
        "config_migrations",
        "model_families",
        "weights",
        "conf",
    ),
    ("parallel", "data", "rollout", "deferred_compile", "deferred_tensorboard", "run_dir"),
    ("models",),
    ("routing",),
    ("algorithms", "rewards"),
    ("shaping",),
    ("config",),
    ("trainer",),
    ("planning", "train", "launcher", "__init__"),
    ("__main__",),
    ("testing",),
)

# (importing module, imported module): reviewed imports that go against the layers, each with why.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("gspo_megatron.config.schema", "gspo_megatron.trainer.run_dir_owner"): (
        "lazy, in CheckpointConfig.validate: checkpoint.resume parsed by the run-dir owner's resume_mode "
        "until it is a ConfigChoice (issue 33 item 5)"
    ),
}


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    imported: str  # dotted module name (a ``from X import Y`` of a submodule Y names X.Y)
    line: int

    def where(self) -> str:
        path = self.importer.replace(".", "/")
        return f"{path}.py:{self.line}: imports {self.imported}"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_submodule(dotted: str) -> bool:
    """Whether ``dotted`` (e.g. ``gspo_megatron.rollout.types``) is a module or package of gspo_megatron."""
    parts = dotted.split(".")
    if parts[0] != "gspo_megatron" or len(parts) == 1:
        return False
    path = PACKAGE.joinpath(*parts[1:])
    return path.with_suffix(".py").is_file() or path.is_dir()


def imports_of(source: str, module: str, is_package: bool) -> list[Import]:
    """Every gspo_megatron import in ``source`` (relative imports resolved against ``module``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" if is_submodule(f"{base}.{a.name}") else base for a in node.names]
        else:
            continue
        found += [Import(module, name, node.lineno) for name in names if name.split(".")[0] == "gspo_megatron"]
    return found


def package_imports() -> list[Import]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += imports_of(path.read_text(), module_name(path), path.name == "__init__.py")
    return found


def unit_of(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


LAYER_OF = {unit: level for level, units in enumerate(LAYERS) for unit in units}


def violations(found: list[Import]) -> list[str]:
    """Each import that is not into the importer's own unit or a lower layer, unless excepted."""
    problems = []
    for item in found:
        source, target = unit_of(item.importer), unit_of(item.imported)
        if source == target or (item.importer, item.imported) in EXCEPTIONS:
            continue
        if LAYER_OF[target] == LAYER_OF[source]:
            problems.append(f"{item.where()} -- {source} and {target} share layer {LAYER_OF[source]}")
        elif LAYER_OF[target] > LAYER_OF[source]:
            problems.append(
                f"{item.where()} -- upward: {source} (layer {LAYER_OF[source]}) -> {target} (layer {LAYER_OF[target]})"
            )
    return problems


def test_every_unit_is_in_exactly_one_layer():
    declared = [unit for units in LAYERS for unit in units]
    assert len(declared) == len(set(declared)), "a unit is declared in two layers"
    present = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    present |= {p.stem for p in PACKAGE.glob("*.py")}
    assert present == set(declared), (
        f"not in LAYERS: {sorted(present - set(declared))}; declared but absent: {sorted(set(declared) - present)}"
    )


def test_the_package_imports_only_downward():
    problems = violations(package_imports())
    assert not problems, "imports against the layers (tests/unit/test_import_layers.py):\n" + "\n".join(problems)


def test_every_exception_is_still_an_import():
    found = {(item.importer, item.imported) for item in package_imports()}
    assert not set(EXCEPTIONS) - found, f"stale EXCEPTIONS: {sorted(set(EXCEPTIONS) - found)}"


@pytest.mark.parametrize(
    "source, module, is_package, expected",
    [
        ("def f():\n    from gspo_megatron.trainer import setup\n", "gspo_megatron.parallel.mesh", False, "trainer"),
        ("from ..trainer.setup import build\n", "gspo_megatron.parallel.mesh", False, "trainer"),
        ("from ..trainer import setup\n", "gspo_megatron.parallel", True, "trainer"),
        (
            "if TYPE_CHECKING:\n    import gspo_megatron.trainer.setup\n",
            "gspo_megatron.parallel.mesh",
            False,
            "trainer",
        ),
    ],
)
def test_lazy_relative_and_type_checking_imports_are_upward_imports(source, module, is_package, expected):
    found = imports_of(source, module, is_package)
    assert [unit_of(item.imported) for item in found] == [expected]
    assert "upward: parallel (layer 1) -> trainer (layer 7)" in violations(found)[0]


def test_a_same_layer_import_is_refused():
    found = imports_of("from gspo_megatron.rollout.types import Sample\n", "gspo_megatron.data.tasks", False)
    assert "data and rollout share layer 1" in violations(found)[0]


def documented_layers() -> tuple[tuple[str, ...], ...]:
    """The ``layers`` block of docs/architecture.md: one line per layer, bottom first, ``N: unit unit ...``."""
    block = re.search(r"```layers\n(.*?)```", ARCHITECTURE.read_text(), re.DOTALL)
    assert block, "docs/architecture.md has no ```layers block"
    rows = [line.split(":", 1) for line in block.group(1).strip().splitlines()]
    assert [int(number) for number, _ in rows] == list(range(len(rows))), "layers are numbered 0, 1, 2, ..."
    return tuple(tuple(units.split()) for _, units in rows)


def test_architecture_md_documents_the_declared_layers():
    assert documented_layers() == LAYERS
