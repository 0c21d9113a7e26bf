"""The CPU workarounds of launch/sglang_cpu/, checked against SGLang's own code in the server's python.

- The ``sgl_kernel`` stand-in's ``assign_req_to_token_pool_cpu`` writes exactly what SGLang's Triton
  kernel ``assign_req_to_token_pool`` (sglang/srt/mem_cache/allocation.py:692) writes, the kernel run
  by Triton's CPU interpreter (``TRITON_INTERPRET=1``) on random batches;
- any other ``sgl_kernel`` symbol imports (SGLang imports some at module level) and raises when
  called, naming itself;
- the allocator fix: SGLang's own ``alloc_with_host_register`` fails on CPU for a pinned buffer (the
  bug, pool_host/common.py:147), and under the launcher's hook the ``cpu`` entry of
  ``ALLOC_MEMORY_FUNCS`` allocates the same buffer without CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from support.live_server import CPU_LAUNCHER, server_python

INSTALL_WORKAROUNDS = f"""
import runpy, sys
runpy.run_path({str(CPU_LAUNCHER)!r})["install_cpu_workarounds"]()
"""


# One process for all three checks: importing SGLang takes about 30 s on a loaded machine.
CHECKS = """
import json, torch
import triton.runtime.interpreter as interpreter

# Triton 3.6's interpreter turns a loop bound into an int with int(array of shape (1,)), which numpy 2
# refuses; .item() is the same value (a test-only fix of the reference's runner)
patch_tensor = interpreter._patch_lang_tensor
def patched(tensor, scope):
    patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
interpreter._patch_lang_tensor = patched

from sglang.srt.mem_cache.allocation import assign_req_to_token_pool
from sglang.srt.mem_cache.pool_host import common
from sglang.srt.utils import next_power_of_2
from sgl_kernel import assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu

results = {"kernel_cases": 0, "kernel_written": 0, "kernel_mismatch": None}
generator = torch.Generator().manual_seed(0)
for batch in (1, 3, 5):
    pool_rows, pool_len = 8, 40
    rows = torch.randperm(pool_rows, generator=generator)[:batch]
    start = torch.randint(0, 20, (batch,), generator=generator)
    end = start + torch.randint(0, 20, (batch,), generator=generator)  # empty spans included
    out_cache_loc = torch.randint(1, 10_000, (int((end - start).sum()),), generator=generator)
    table = torch.randint(-5, 0, (pool_rows, pool_len), generator=generator, dtype=torch.int32)
    reference, standin = table.clone(), table.clone()
    assign_req_to_token_pool[(batch,)](rows, reference, start, end, out_cache_loc, pool_len, next_power_of_2(batch))
    assign_req_to_token_pool_cpu(rows, standin, start, end, out_cache_loc, pool_len)
    if not torch.equal(reference, standin):
        results["kernel_mismatch"] = f"batch {batch}: {reference} != {standin}"
    results["kernel_cases"] += 1
    results["kernel_written"] += int((reference != table).sum())

try:
    copy_all_layer_kv_cache_cpu(None, None, None, None)
    results["other_symbol"] = "no error"
except NotImplementedError as error:
    results["other_symbol"] = str(error)

try:  # SGLang's own allocator for a pinned host buffer, as the routed-experts capturer asks
    common.alloc_with_host_register((4, 2, 2), torch.int32, "cpu", True, common.HostTensorAllocator())
    results["unpatched"] = "no error"
except Exception as error:
    results["unpatched"] = f"{type(error).__name__}: {error}"
buffer = common.ALLOC_MEMORY_FUNCS["cpu"](
    (4, 2, 2), dtype=torch.int32, device="cpu", pin_memory=True, allocator=common.HostTensorAllocator())
results["patched"] = [list(buffer.shape), str(buffer.device)]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def checks() -> dict:
    done = subprocess.run(
        [str(server_python()), "-c", INSTALL_WORKAROUNDS + CHECKS],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_standin_matches_sglangs_triton_kernel(checks):
    assert checks["kernel_mismatch"] is None, checks["kernel_mismatch"]
    assert checks["kernel_cases"] == 3 and checks["kernel_written"] > 20  # the kernel really wrote, the same


def test_other_kernel_symbols_import_but_raise_naming_themselves(checks):
    assert "sgl_kernel.copy_all_layer_kv_cache_cpu is not provided by the CPU stand-in" in checks["other_symbol"]


def test_routed_experts_host_buffer_allocates_on_cpu_only_with_the_fix(checks):
    assert checks["unpatched"] != "no error", "SGLang's CPU host allocation no longer fails: drop the fix"
    assert checks["patched"] == [[4, 2, 2], "cpu"]
