"""A stand-in for ``sgl_kernel`` (the ``sglang-kernel`` wheel) for SGLang 0.5.23 on a CPU without AMX.

Why: ``sglang-kernel`` on PyPI is CUDA-only (sm90/sm100); its CPU build is not published. With
``SGLANG_USE_CPU_ENGINE=1`` SGLang runs norms, RoPE, MoE and ``--attention-backend torch_native`` in
plain torch, but two modules still import from ``sgl_kernel`` when ``is_cpu()``:
- ``sglang/srt/mem_cache/allocation.py:46`` imports ``assign_req_to_token_pool_cpu``, called every
  scheduling step (``assign_req_to_token_pool_func``, allocation.py:737). Implemented here in torch.
- ``sglang/kernels/ops/kvcache/cache_move.py:10`` imports ``copy_all_layer_kv_cache_cpu`` (HiCache
  and speculative decoding only; never reached by the live tier). Not implemented: it, and every other
  symbol, can be imported (SGLang imports it at module level) but raises NotImplementedError naming
  the symbol when called, so a code path that needs a real kernel fails loudly.
Put on ``sys.path`` (and ``PYTHONPATH``, for SGLang's spawned processes) by ``launch_server.py``;
never installed into any environment.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+gspo-cpu-standin"

IMPLEMENTED = ("assign_req_to_token_pool_cpu",)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV-cache slots into its row of the request-to-token table, in place.

    The semantics of SGLang's Triton kernel ``assign_req_to_token_pool`` (allocation.py:692), request
    ``i`` of the batch:
        req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]
            = out_cache_loc[sum_{j<i}(end_offset[j] - start_offset[j]) : ...+ end_offset[i] - start_offset[i]]
    ``pool_len`` is ``req_to_token.shape[1]`` (the kernel's row stride); kept for the same signature.
    """
    if pool_len != req_to_token.shape[1]:
        raise ValueError(f"pool_len={pool_len} but req_to_token has rows of {req_to_token.shape[1]}")
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    consumed = 0
    for row, start, end in zip(req_pool_indices.tolist(), starts, ends, strict=True):
        length = end - start
        req_to_token[row, start:end] = out_cache_loc[consumed : consumed + length].to(req_to_token.dtype)
        consumed += length


def __getattr__(name: str):
    """Any other symbol: importable (SGLang imports some at module level), raises when called."""
    if name.startswith("__"):
        raise AttributeError(name)

    def not_provided(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not provided by the CPU stand-in (launch/sglang_cpu/standin/sgl_kernel), "
            f"which implements only {', '.join(IMPLEMENTED)}; this SGLang code path needs the real sglang-kernel"
        )

    not_provided.__name__ = name
    return not_provided
