"""``ConfigNode``: the base of every config dataclass, so that a validated config can be frozen.

``freeze_config(cfg)`` runs once at start-up, after ``validate_config``: from then on an assignment
to any field of the tree raises, naming the field, so no part of a run can change a setting the
others already read (or that the run directory's ``config.yaml`` records). ``dataclasses.replace``
still works -- it builds a new, unfrozen node. Torch-free: every config module imports it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

_FROZEN = "_config_frozen"


class ConfigNode:
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
    if isinstance(node, ConfigNode):
        for field in dataclasses.fields(node):  # type: ignore[arg-type]
            freeze_config(getattr(node, field.name))
        object.__setattr__(node, _FROZEN, True)
    elif isinstance(node, list | tuple):
        for item in node:
            freeze_config(item)
    elif isinstance(node, dict):
        for item in node.values():
            freeze_config(item)
    return node


def is_frozen(node: Any) -> bool:
    return bool(getattr(node, "__dict__", {}).get(_FROZEN, False))
