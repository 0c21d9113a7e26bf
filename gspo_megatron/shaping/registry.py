"""A minimal name -> object registry for reward shapers.

Design decisions:
- Registration is explicit (a decorator at the definition site) and a second registration under
  the same name is an error, so two modules can never silently shadow each other.
- An unknown name raises an error that lists every valid name, so a typo in a config is fixed
  from the message alone.
- This is deliberately generic and small: if ``gspo_megatron/algorithms/registry.py`` grows a
  shared ``Registry``, this one is meant to be replaced by it (same ``register``/``get``/``names``).
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects of one kind (``kind`` names that kind in error messages)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("name")`` adds the decorated object under ``name``."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{self.kind} names must be non-empty strings, got {name!r}")

        def decorator(obj: T) -> T:
            self.add(name, obj)
            return obj

        return decorator

    def add(self, name: str, obj: T) -> None:
        if name in self._entries:
            raise ValueError(
                f"{self.kind} {name!r} is already registered (by {self._entries[name]!r}); "
                f"pick another name -- registered: {', '.join(self.names())}"
            )
        self._entries[name] = obj

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names()) or '(none registered)'}"
            ) from None

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)


# name -> shaper(group: ShapingGroup, cfg) -> ShapedRewards; filled by the shaper modules on import.
SHAPERS: Registry = Registry("reward shaper")
