"""megatron-core's ``torch.utils.tensorboard`` import moved to first use (start-up time).

``megatron.core.timers`` imports ``SummaryWriter`` at its top level (``import megatron.core`` runs it)
only to recognise a writer in ``Timers.write``, which this project never calls. That import loads
TensorBoard's TensorFlow stub (numpy dtypes, protobufs, and boto3 where boto3 is installed): about
0.2 s of CPU, 0.5-1 s of wall time on a loaded 2-core machine, before the first round of every run,
tools and tests alike. Runs with ``logging.tensorboard=true`` still import it, when ``RunLog`` makes
its writer; runs with it off (the benchmarks, most tests) no longer do.

Design decisions:
- While ``megatron.core.timers`` executes, ``torch.utils.tensorboard`` in ``sys.modules`` is a
  stand-in whose ``SummaryWriter`` is a class that stands for torch's: ``isinstance``/``issubclass``
  against it and calling it import the real class and use it, so ``Timers.write`` behaves as before.
  The stand-in is removed right after: everyone else imports the real module.
- Only where TensorBoard is installed (a spec lookup, no import): without it megatron's own
  ``except ImportError`` leaves ``SummaryWriter = None`` as before. Not at all if the real module is
  already imported (nothing to save).
- Installed once, from ``gspo_megatron/__init__.py``, like ``core/deferred_compile.py``.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from gspo_megatron.core.import_hooks import import_within

MEGATRON_TIMERS_MODULE = "megatron.core.timers"
TENSORBOARD_MODULE = "torch.utils.tensorboard"


def _real_summary_writer() -> type:
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter


class _StandsForSummaryWriter(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _real_summary_writer())

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, _real_summary_writer())

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return _real_summary_writer()(*args, **kwargs)


class DeferredSummaryWriter(metaclass=_StandsForSummaryWriter):
    """torch's ``SummaryWriter``, imported when first checked against or constructed."""


@contextmanager
def _tensorboard_deferred() -> Iterator[None]:
    if TENSORBOARD_MODULE in sys.modules or importlib.util.find_spec("tensorboard") is None:
        yield
        return
    stand_in = ModuleType(
        TENSORBOARD_MODULE, "stand-in while megatron.core.timers imports (core/deferred_tensorboard.py)"
    )
    stand_in.SummaryWriter = DeferredSummaryWriter  # type: ignore[attr-defined]
    sys.modules[TENSORBOARD_MODULE] = stand_in
    try:
        yield
    finally:
        if sys.modules.get(TENSORBOARD_MODULE) is stand_in:
            del sys.modules[TENSORBOARD_MODULE]


def install() -> None:
    """Defer megatron's TensorBoard import (idempotent; no effect once megatron.core.timers is loaded)."""
    import_within(MEGATRON_TIMERS_MODULE, _tensorboard_deferred)
