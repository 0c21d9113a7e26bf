"""Test tiers: unit (default), distributed (gloo ranks on CPU), e2e (tiny training runs), gpu.

GPU tests are skipped without CUDA. Every test gets a fixed seed and a single intra-op thread so
results do not depend on what else shares the 2-core machine.
"""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
