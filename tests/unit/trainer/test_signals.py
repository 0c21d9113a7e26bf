"""SignalWatch: the first signal is recorded for the trainer, the second interrupts at once."""

from __future__ import annotations

import os
import signal

import pytest

from gspo_megatron.trainer.signals import SignalWatch, TrainingInterrupted


def test_first_signal_is_recorded_second_interrupts():
    before = signal.getsignal(signal.SIGTERM)
    with SignalWatch() as watch:
        assert watch.agreed_signal() == 0
        os.kill(os.getpid(), signal.SIGTERM)
        assert watch.agreed_signal() == signal.SIGTERM
        with pytest.raises(TrainingInterrupted, match="SIGTERM received twice") as stop:
            os.kill(os.getpid(), signal.SIGTERM)
        assert stop.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is before
