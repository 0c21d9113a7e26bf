"""The import contract: the package is split by role, and every import goes down the tiers.

Design decisions:
- The tiers are declared once, here (``TIERS``, bottom first); ``docs/architecture.md`` carries the
  same list in its ``tiers`` block and a test holds the two equal.
- A unit is a top-level subpackage (``rollout`` includes ``rollout/sglang``) or a top-level module; the
  entry points ``train``, ``launcher``, ``__main__`` and the package's ``__init__`` are the ``run`` unit.
  A unit may import itself and any unit of a LOWER tier; two units of one tier never import each other.
  That one rule holds the roles apart: ``rollout`` and ``policy`` share a tier, so neither imports the
  other.
- Every import counts: module level, inside functions (lazy) and under ``TYPE_CHECKING``, read with
  ``ast`` from the source (nothing is imported, so the test is fast and sees imports that only run on
  some paths). There are no exceptions.
- No cycle of any kind, between modules of one unit too: the module graph (every import above, lazy ones
  included) has no strongly connected component of more than one module.
- megatron-core is imported by the policy side alone (``testing`` aside: the test doubles' tiny models).
- ``testing`` (test doubles and fixtures) is the top tier: nothing in the runtime package imports it,
  and the wheel leaves it out (``pyproject.toml``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gspo_megatron"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

TIERS: tuple[tuple[str, ...], ...] = (
    ("core", "conf"),  # foundations: config nodes, registries, run-directory format, weight formats
    ("contracts",),  # typed data between the roles: samples, batches, shares, phase results, weight stream
    ("algorithms",),  # pure math
    ("rollout", "policy"),  # the two roles: the driver's rollout side; every rank's policy (megatron-core)
    ("config",),  # each role's sections composed, the rules across sections
    ("loop",),  # the RL step and the composition root
    ("run",),  # entry points, launcher, run-directory owner, signals, reaper, run log, reports
    ("testing",),  # test doubles and fixtures
)
# top-level modules that belong to a unit of another name
UNIT_OF_MODULE = {"train": "run", "launcher": "run", "__main__": "run", "__init__": "run"}
MEGATRON_UNITS = ("policy", "testing")


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
    """Whether ``dotted`` (e.g. ``gspo_megatron.contracts.samples``) is a module or package of gspo_megatron."""
    parts = dotted.split(".")
    if parts[0] != "gspo_megatron" or len(parts) == 1:
        return False
    path = PACKAGE.joinpath(*parts[1:])
    return path.with_suffix(".py").is_file() or path.is_dir()


def imported_names(source: str, module: str, is_package: bool) -> list[tuple[str, int]]:
    """Every module ``source`` imports, as (dotted name, line); relative imports resolved against ``module``."""
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
        found += [(name, node.lineno) for name in names]
    return found


def imports_of(source: str, module: str, is_package: bool) -> list[Import]:
    """Every gspo_megatron import in ``source``."""
    return [
        Import(module, name, line)
        for name, line in imported_names(source, module, is_package)
        if name.split(".")[0] == "gspo_megatron"
    ]


def package_sources() -> Iterable[tuple[Path, str]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, module_name(path)


def package_imports() -> list[Import]:
    found = []
    for path, module in package_sources():
        found += imports_of(path.read_text(), module, path.name == "__init__.py")
    return found


def unit_of(module: str) -> str:
    parts = module.split(".")
    name = "__init__" if len(parts) == 1 else parts[1]
    return UNIT_OF_MODULE.get(name, name)


TIER_OF = {unit: tier for tier, units in enumerate(TIERS) for unit in units}


def violations(found: list[Import]) -> list[str]:
    """Each import that is not into the importer's own unit or a lower tier."""
    problems = []
    for item in found:
        source, target = unit_of(item.importer), unit_of(item.imported)
        if source == target:
            continue
        if TIER_OF[target] == TIER_OF[source]:
            problems.append(f"{item.where()} -- {source} and {target} share tier {TIER_OF[source]}")
        elif TIER_OF[target] > TIER_OF[source]:
            problems.append(
                f"{item.where()} -- upward: {source} (tier {TIER_OF[source]}) -> {target} (tier {TIER_OF[target]})"
            )
    return problems


def cycles(edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (and modules that import themselves):
    Tarjan's algorithm, iterative."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))
    return found


def test_every_unit_is_in_exactly_one_tier():
    declared = [unit for units in TIERS for unit in units]
    assert len(declared) == len(set(declared)), "a unit is declared in two tiers"
    present = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    present |= {UNIT_OF_MODULE.get(p.stem, p.stem) for p in PACKAGE.glob("*.py")}
    assert present == set(declared), (
        f"not in TIERS: {sorted(present - set(declared))}; declared but absent: {sorted(set(declared) - present)}"
    )


def test_the_package_imports_only_downward():
    problems = violations(package_imports())
    assert not problems, "imports against the tiers (tests/unit/test_import_layers.py):\n" + "\n".join(problems)


def test_the_package_has_no_import_cycle():
    found = cycles((item.importer, item.imported) for item in package_imports() if item.importer != item.imported)
    assert not found, "import cycles (lazy imports count):\n" + "\n".join(" -> ".join(c) for c in found)


def test_only_the_policy_side_imports_megatron():
    importers = sorted(
        f"{path.relative_to(ROOT)}:{line}"
        for path, module in package_sources()
        for name, line in imported_names(path.read_text(), module, path.name == "__init__.py")
        if name.split(".")[0] == "megatron" and unit_of(module) not in MEGATRON_UNITS
    )
    assert not importers, "megatron-core imported outside the policy side:\n" + "\n".join(importers)


@pytest.mark.parametrize(
    "source, module, is_package",
    [
        ("def f():\n    from gspo_megatron.loop import build\n", "gspo_megatron.policy.parallel.mesh", False),
        ("from ...loop.build import build_run\n", "gspo_megatron.policy.parallel.mesh", False),
        ("from ...loop import build\n", "gspo_megatron.policy.parallel", True),
        ("if TYPE_CHECKING:\n    import gspo_megatron.loop.build\n", "gspo_megatron.policy.parallel.mesh", False),
    ],
)
def test_lazy_relative_and_type_checking_imports_are_upward_imports(source, module, is_package):
    found = imports_of(source, module, is_package)
    assert [unit_of(item.imported) for item in found] == ["loop"]
    assert "upward: policy (tier 3) -> loop (tier 5)" in violations(found)[0]


def test_the_roles_never_import_each_other():
    found = imports_of(
        "from gspo_megatron.policy.models.chunks import ModelChunks\n", "gspo_megatron.rollout.producer", False
    )
    assert "rollout and policy share tier 3" in violations(found)[0]
    found = imports_of(
        "from gspo_megatron.rollout.engine import RolloutEngine\n", "gspo_megatron.policy.optimizer", False
    )
    assert "policy and rollout share tier 3" in violations(found)[0]


def test_cycles_are_strongly_connected_components():
    assert cycles([("m.a", "m.b"), ("m.b", "m.c"), ("m.c", "m.a"), ("m.c", "m.d")]) == [["m.a", "m.b", "m.c"]]
    assert cycles([("m.a", "m.b"), ("m.b", "m.c")]) == []
    assert cycles([("m.a", "m.a")]) == [["m.a"]]


def test_a_lazy_cycle_in_the_package_is_found():
    # the same reading as the package test, on two files that import each other, one of them lazily
    first = "from gspo_megatron.loop import trainer\n"
    second = "def f():\n    from gspo_megatron.loop import build\n"
    edges = [
        (item.importer, item.imported)
        for item in imports_of(first, "gspo_megatron.loop.build", False)
        + imports_of(second, "gspo_megatron.loop.trainer", False)
    ]
    assert cycles(edges) == [["gspo_megatron.loop.build", "gspo_megatron.loop.trainer"]]


def documented_tiers() -> tuple[tuple[str, ...], ...]:
    """The ``tiers`` block of docs/architecture.md: one line per tier, bottom first, ``N: unit unit ...``."""
    block = re.search(r"```tiers\n(.*?)```", ARCHITECTURE.read_text(), re.DOTALL)
    assert block, "docs/architecture.md has no ```tiers block"
    rows = [line.split(":", 1) for line in block.group(1).strip().splitlines()]
    assert [int(number) for number, _ in rows] == list(range(len(rows))), "tiers are numbered 0, 1, 2, ..."
    return tuple(tuple(units.split()) for _, units in rows)


def test_architecture_md_documents_the_declared_tiers():
    assert documented_tiers() == TIERS
