"""megatron.core.timers' SummaryWriter is imported on first use: no TensorBoard at import, same checks after."""

from __future__ import annotations

import pytest

from gspo_megatron.testing.fresh_interpreter import run_in_fresh_interpreter

pytest.importorskip("tensorboard")  # without it megatron sets SummaryWriter = None and nothing is deferred


def test_importing_megatron_through_the_package_imports_no_tensorboard():
    probe = (
        "import sys, tempfile, gspo_megatron\n"
        "import megatron.core, megatron.core.timers as timers\n"
        "print(sorted(m for m in sys.modules if m.startswith(('tensorboard', 'torch.utils.tensorboard'))))\n"
        "from torch.utils.tensorboard import SummaryWriter\n"
        "assert sys.modules['torch.utils.tensorboard'].__file__.endswith('tensorboard/__init__.py')  # the real one\n"
        "writer = timers.SummaryWriter(tempfile.mkdtemp())  # megatron's name constructs torch's writer\n"
        "assert type(writer) is SummaryWriter\n"
        "assert isinstance(writer, timers.SummaryWriter) and not isinstance(timers, timers.SummaryWriter)\n"
        "assert issubclass(SummaryWriter, timers.SummaryWriter)\n"
        "writer.close()\n"
    )
    printed = run_in_fresh_interpreter(probe)
    assert printed == "[]", printed


def test_a_tensorboard_imported_first_is_used_as_it_is():
    probe = (
        "import torch.utils.tensorboard as real, gspo_megatron\n"
        "import megatron.core.timers as timers\n"
        "assert timers.SummaryWriter is real.SummaryWriter\n"
    )
    run_in_fresh_interpreter(probe)
