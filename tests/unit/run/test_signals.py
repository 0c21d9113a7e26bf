"""SignalWatch: the first signal is recorded for the trainer, the second interrupts at once."""

from __future__ import annotations

import os
import signal

import pytest

from gspo_megatron.loop.trainer import TrainingInterrupted
from gspo_megatron.run.signals import SignalWatch


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


def test_stop_message_names_the_checkpoint_a_scheduled_save_wrote(tmp_path):
    """D18: with checkpoint.save_on_signal=false a step that saved on schedule said 'no checkpoint written'."""
    from gspo_megatron.loop.trainer import signal_stop_outcome

    saved = tmp_path / "checkpoints" / "step_000004"
    assert signal_stop_outcome(saved, saved) == f"checkpoint {saved}; continue with checkpoint.resume=true"
    earlier = tmp_path / "checkpoints" / "step_000002"
    assert signal_stop_outcome(None, earlier) == (
        "no checkpoint written for this step (checkpoint.save_on_signal=false); "
        f"checkpoint.resume=true continues from {earlier}"
    )
    assert signal_stop_outcome(None, None).endswith("there is no checkpoint to resume")
