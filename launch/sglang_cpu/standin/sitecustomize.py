"""Runtime patch of SGLang 0.5.23 for ``--device cpu --enable-return-routed-experts``, in every process.

SGLang starts its scheduler and detokenizer with multiprocessing's ``spawn``: a patch made in the
launching process does not reach them. Python imports ``sitecustomize`` at start-up from ``sys.path``;
``launch_server.py`` puts this directory on ``PYTHONPATH``, so each SGLang process installs the hook
below before it imports anything of SGLang's. Nothing in site-packages is edited.

The bug worked around (``sglang/srt/mem_cache/pool_host/common.py``): ``ALLOC_MEMORY_FUNCS``
(common.py:453) maps every device but npu/musa/xpu to ``alloc_with_host_register``, which for pinned
buffers calls ``_cuda_host_register`` -> ``torch.cuda.cudart()`` (common.py:147). The routed-experts
capturer allocates its host buffer that way (``srt/state_capturer/base.py:66``, ``pin_memory=True``), so
a CPU server with ``--enable-return-routed-experts`` dies at start-up. On CPU there is nothing to
register: the fix maps ``"cpu"`` to a plain allocation by the given allocator.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

PATCHED_MODULE = "sglang.srt.mem_cache.pool_host.common"


def plain_cpu_alloc(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """``alloc_with_host_register`` without the CUDA host registration (CPU memory needs none)."""
    return allocator.allocate(dims, dtype=dtype, device=device)


def patch_pool_host_common(module) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = plain_cpu_alloc


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != PATCHED_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        original_exec = spec.loader.exec_module

        def exec_then_patch(module):
            original_exec(module)
            patch_pool_host_common(module)

        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


if not any(isinstance(finder, _PatchAfterImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _PatchAfterImport())
