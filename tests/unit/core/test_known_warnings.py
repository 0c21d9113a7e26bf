"""The reviewed-warning filters: a reviewed warning from its module is hidden, anything else shows."""

from __future__ import annotations

import logging
import warnings

import pytest

from gspo_megatron.core.known_warnings import (
    KNOWN_LOG_MESSAGES,
    KNOWN_WARNINGS,
    filter_known_cpu_warnings,
    filter_known_warnings,
)


def _shown(message: str, category: type[Warning], module: str) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        filter_known_warnings()
        warnings.warn_explicit(message, category, filename=f"/site/{module}.py", lineno=1, module=module)
    return len(caught) == 1


@pytest.mark.parametrize("known", KNOWN_WARNINGS, ids=lambda known: known.message[:30])
def test_a_reviewed_warning_is_hidden_only_from_its_module(known):
    message = known.message.replace("\\", "") + " (details)"
    module = known.module.replace("\\", "").rstrip(".") + ".sub"  # a module the pattern matches
    assert not _shown(message, known.category, module)
    assert _shown(message, known.category, "someone_else")  # the same text from elsewhere still shows
    assert _shown(message, DeprecationWarning if known.category is not DeprecationWarning else UserWarning, module)


# megatron-core's text (tensor_parallel/layers.py, 0.16.1), once per rank of a tp > 1 run
STREAM_ADVICE = (
    "When using sequence parallelism it is recommended to set the environment variable "
    "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup"
)


def test_the_cuda_stream_advice_is_hidden_by_the_cpu_start_up_only():
    """Shown where CUDA runs (the entry point's filters keep it), hidden once the CPU start-up filtered it."""
    module = "megatron.core.tensor_parallel.layers"
    assert _shown(STREAM_ADVICE, UserWarning, module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        filter_known_cpu_warnings()
        warnings.warn_explicit(STREAM_ADVICE, UserWarning, filename="/site/layers.py", lineno=1, module=module)
        warnings.warn_explicit(STREAM_ADVICE, UserWarning, filename="/site/other.py", lineno=1, module="other")
    assert [str(w.message) for w in caught] == [STREAM_ADVICE]  # only the one from elsewhere


def test_an_unreviewed_warning_shows():
    assert _shown("something new", UserWarning, "megatron.core.optimizer")
    assert _shown("past_key_values is deprecated", FutureWarning, "transformers.utils.generic")


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _logged(logger_name: str, message: str) -> bool:
    """Whether a WARNING logged on ``logger_name`` reaches a handler of that logger (where the library's
    own handler, or the root's through propagation, would print it)."""
    filter_known_warnings()
    logger, handler = logging.getLogger(logger_name), _Collect()
    logger.addHandler(handler)
    try:
        logger.warning(message)
    finally:
        logger.removeHandler(handler)
    return handler.messages == [message]


@pytest.mark.parametrize("known", KNOWN_LOG_MESSAGES, ids=lambda known: known.message[:30])
def test_a_reviewed_log_message_is_hidden_only_from_its_logger(known):
    message = known.message.replace("\\", "") + " (details)"
    assert not _logged(known.logger, message)
    assert _logged(known.logger + ".child", message)  # only the logger that emits it
    assert _logged("someone_else", message)
    assert _logged(known.logger, "something new")


def test_torch_single_process_checkpoint_load_is_quiet(tmp_path):
    """Issue 64: every resume and conversion printed torch's "torch.distributed is disabled ..." once per
    rank, from the no_dist=True loads policy/checkpoint/reader.py makes on purpose. Torch's real save and
    load, under the entry point's filters, show nothing."""
    import torch
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        filter_known_warnings()
        dcp.save({"x": torch.zeros(2)}, checkpoint_id=str(tmp_path), no_dist=True)
        state = {"x": torch.ones(2)}
        dcp.load(state, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(state["x"], torch.zeros(2))
    assert [str(w.message) for w in caught if "torch.distributed is disabled" in str(w.message)] == []
