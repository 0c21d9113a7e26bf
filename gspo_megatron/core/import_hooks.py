"""Run one module's import inside a context manager: a meta-path finder for that one module name.

What ``core/deferred_compile.py`` and ``core/deferred_tensorboard.py`` use to move work that megatron-core does
at import to first use. The module is found and loaded by Python's own path finder as usual; only
its ``exec_module`` runs inside the context, so whatever the context changes (``torch.compile``, a
``sys.modules`` entry) is changed for that module's top level alone and restored right after.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from types import ModuleType

AroundImport = Callable[[], AbstractContextManager[object]]


class _LoaderWithin(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, around: AroundImport):
        self._loader, self._around = loader, around

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with self._around():
            self._loader.exec_module(module)


class ImportWithin(importlib.abc.MetaPathFinder):
    """Finds ``module_name`` like Python's path finder, and executes it inside ``around()``."""

    def __init__(self, module_name: str, around: AroundImport):
        self.module_name, self._around = module_name, around

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.module_name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoaderWithin(spec.loader, self._around)
        return spec


def import_within(module_name: str, around: AroundImport) -> None:
    """From now on, ``module_name`` is executed inside ``around()`` (idempotent per module name; no
    effect on a module that is already imported)."""
    if not any(isinstance(f, ImportWithin) and f.module_name == module_name for f in sys.meta_path):
        sys.meta_path.insert(0, ImportWithin(module_name, around))
