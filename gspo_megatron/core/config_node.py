"""What every config section shares (torch-free: every config module imports it).

- ``ConfigNode``, the base of every config dataclass: a section checks its own fields in
  ``validate()``, run at construction and again by ``validate_config``; ``freeze_config(cfg)`` runs
  once at start-up, after validation, and from then on an assignment to any field of the tree
  raises naming the field, so no part of a run can change a setting the others already read (or
  that the run directory's ``config.yaml`` records). ``dataclasses.replace`` builds a new, unfrozen node.
- ``ConfigChoice``, the base of closed choices (``StrEnum``): Hydra refuses other values at compose time.
- ``flatten_dotted``: nested config containers as dotted keys (resume diffs, grouping runs).
"""

from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import Any

_FROZEN = "_config_frozen"


class ConfigNode:
    """The validation convention: a section checks its own fields in ``validate()`` (raising
    ``ValueError`` that names the key and the fix). It runs at construction -- so Hydra's
    ``to_object`` validates every section -- and again over the whole tree in
    ``config/validate.py:validate_config``, which adds the rules that span sections."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check this section's own fields (none by default)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get(_FROZEN, False):
            raise dataclasses.FrozenInstanceError(
                f"cannot set {type(self).__name__}.{name}: the config is frozen after start-up validation; "
                "set it in the YAML or as a Hydra override instead"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self.__dict__.get(_FROZEN, False):
            raise dataclasses.FrozenInstanceError(f"cannot delete {type(self).__name__}.{name}: the config is frozen")
        object.__delattr__(self, name)


def freeze_config(node: Any) -> Any:
    """Make ``node`` and every ``ConfigNode`` below it (through fields, lists and dicts) read-only."""
    for child in config_nodes(node):
        object.__setattr__(child, _FROZEN, True)
    return node


def config_nodes(node: Any) -> list[ConfigNode]:
    """Every ``ConfigNode`` in the tree below ``node`` (itself included), parents first."""
    found: list[ConfigNode] = []
    if isinstance(node, ConfigNode):
        found.append(node)
        for field in dataclasses.fields(node):  # type: ignore[arg-type]
            found.extend(config_nodes(getattr(node, field.name)))
    elif isinstance(node, list | tuple):
        for item in node:
            found.extend(config_nodes(item))
    elif isinstance(node, dict):
        for item in node.values():
            found.extend(config_nodes(item))
    return found


def is_frozen(node: Any) -> bool:
    return bool(getattr(node, "__dict__", {}).get(_FROZEN, False))


class ConfigChoice(StrEnum):
    """Base of the closed config choices: a ``str`` equal to its value, so it compares, hashes,
    formats and serialises like the YAML string; Hydra refuses other values at compose time."""

    def __repr__(self) -> str:
        return repr(self.value)  # error messages quote the value as the user wrote it


def flatten_dotted(tree: Any, *, hashable: bool = False, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1} over nested dicts (a plain config container). ``hashable``:
    lists become tuples of their items' reprs, so the values can key a dict (grouping runs)."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten_dotted(value, hashable=hashable, prefix=f"{prefix}{key}."))
        return out
    if hashable and isinstance(tree, list):
        return {prefix[:-1]: tuple(repr(v) for v in tree)}
    return {prefix[:-1]: tree}
