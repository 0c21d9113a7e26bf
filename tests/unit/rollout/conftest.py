"""Shared fixture of the SGLang client tests: test doubles of SGLang servers, stopped after the test."""

import pytest

from gspo_megatron.testing.sglang_double import SGLangServerDouble


@pytest.fixture
def doubles():
    started = []

    def make(**kwargs):
        double = SGLangServerDouble(**kwargs).start()
        started.append(double)
        return double

    yield make
    for double in started:
        double.stop()
