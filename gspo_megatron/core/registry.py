"""A name -> object registry, shared by policy losses, advantage estimators and other pluggable parts.

Design decisions:
- One small generic class instead of per-component dicts, so every pluggable family behaves the same:
  duplicates are rejected at registration time (two modules silently fighting over a name is a bug),
  and an unknown name fails with the list of valid names, so a typo in a config names its own fix.
- The registry holds plain objects (usually functions); it does not construct or configure them.
- ``register`` works as a decorator (``@LOSSES.register("gspo")``) or as a call
  (``LOSSES.register("gspo", fn)``); both return the object unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar, overload

T = TypeVar("T")


class UnknownNameError(LookupError):
    """A registry was asked for a name it does not hold; the message lists the valid names."""


class Registry(Generic[T]):
    """Maps names to objects of one kind, e.g. ``Registry("policy loss")``."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    @overload
    def register(self, name: str) -> Callable[[T], T]: ...

    @overload
    def register(self, name: str, obj: T) -> T: ...

    def register(self, name, obj=None):
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} names must be non-empty strings, got {name!r}")

        def _add(item: T) -> T:
            if name in self._entries:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered (by {self._entries[name]!r}); "
                    f"pick another name or remove the earlier registration"
                )
            self._entries[name] = item
            return item

        return _add if obj is None else _add(obj)

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names()) or '(none registered)'}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"


IMPORT_PREFIX = "import:"


def import_function(spec: str, kind: str) -> Callable:
    """A user's function named ``import:package.module:function`` (``kind`` names it in errors: "reward").

    Whatever the module does wrong at import becomes a ValueError naming the spec and the module:
    an exception (chained, so its traceback shows), and ``sys.exit`` too, which is a BaseException
    that would otherwise end the whole run with its exit code and no message."""
    import importlib

    target = spec[len(IMPORT_PREFIX) :] if spec.startswith(IMPORT_PREFIX) else ""
    module_name, sep, function_name = target.partition(":")
    if not sep or not module_name or not function_name:
        raise ValueError(f"{kind} {spec!r} must look like 'import:package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"{kind} {spec!r}: cannot import module {module_name!r} ({error})") from error
    except SystemExit as stop:  # a BaseException: uncaught, the run would end with its code and no message
        raise ValueError(
            f"{kind} {spec!r}: module {module_name!r} exited while being imported (SystemExit, code "
            f"{stop.code!r}); move its script code under `if __name__ == '__main__':`"
        ) from None
    except Exception as error:  # the module's own bug: name the module, keep its traceback
        raise ValueError(
            f"{kind} {spec!r}: importing module {module_name!r} raised {type(error).__name__}: {error}"
        ) from error
    fn = getattr(module, function_name, None)
    if fn is None or not callable(fn):
        raise ValueError(f"{kind} {spec!r}: module {module_name!r} has no callable {function_name!r}")
    return fn
