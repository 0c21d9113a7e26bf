"""Weights by tensor handles: the body of SGLang's ``/update_weights_from_tensor`` for a server on this host.

Design decisions:
- The endpoint takes ``serialized_named_tensors``, one base64 payload per TP rank of the server (each
  rank loads only its own: ``TpModelWorker.deserialize_own_rank``), each a ``ForkingPickler`` pickle
  of ``[(name, tensor), ...]``, which SGLang loads with its ``SafeUnpickler``: an allow-list that
  admits torch's multiprocessing rebuild functions (``rebuild_storage_filename``, ``rebuild_cuda_tensor``,
  ...) and nothing that runs other code (``sglang/srt/utils/common.py``, 0.5.23). What travels is a
  handle to memory the trainer holds, not the bytes.
- CPU tensors: torch's default sharing strategy on Linux, ``file_descriptor``, pickles a storage as a
  file descriptor handed over by ``multiprocessing.resource_sharer``, which only a process sharing
  the sender's authkey (its children) can fetch -- an SGLang server is not one. Under the
  ``file_system`` strategy the storage becomes a named shared-memory file that any process on the host
  opens by name (``rebuild_storage_filename``), so the payload is pickled under it (the strategy is
  process-global: set for the pickling, restored after). Pickling moves each storage into shared
  memory, a copy of the bucket -- the exporter's HF-named tensors are its own, never the model's.
- CUDA tensors pickle to CUDA IPC handles (``rebuild_cuda_tensor``) that the server maps on the same
  GPU: the colocated path. SGLang's own sender patches torch's CUDA reductions to name the device by
  UUID (``monkey_patch_torch_reductions``) so processes with other visible-device orders agree; this
  module does not (the trainer does not import SGLang): trainer and server must see the device under
  the same index. Not run here (no GPU).
- One payload per TP rank, pickled separately: a CUDA IPC handle must not be opened twice by one
  pickle (SGLang's note on refcounting); for CPU files the second pickling only names the file again.
- The shared memory lives while the sender holds the tensors; the server answers after every rank has
  loaded its payload (its TP barrier), so the caller drops the bucket once the response is in.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as torch_mp

from gspo_megatron.core.named_tensors import NamedTensor

SHARING_STRATEGY = "file_system"  # CPU storages as named shared-memory files (see above)


def serialize_named_tensors(bucket: Sequence[NamedTensor]) -> str:
    """One rank's payload: base64 of the ForkingPickler pickle of ``[(name, tensor), ...]``."""
    previous = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy(SHARING_STRATEGY)
    try:
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump([(name, tensor.detach()) for name, tensor in bucket])
    finally:
        torch_mp.set_sharing_strategy(previous)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def update_from_tensor_body(bucket: Sequence[NamedTensor], tp_size: int, weight_version: int) -> dict:
    """The JSON body of ``/update_weights_from_tensor`` (SGLang's UpdateWeightsFromTensorReqInput) for a
    server of ``tp_size`` ranks; the cache is flushed once after the last bucket, not per bucket."""
    if tp_size < 1:
        raise ValueError(f"a server has at least one TP rank, got {tp_size}")
    return {
        "serialized_named_tensors": [serialize_named_tensors(bucket) for _ in range(tp_size)],
        "load_format": None,
        "flush_cache": False,
        "weight_version": str(weight_version),
    }


def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """What a receiving process makes of one payload (torch's own rebuild functions). For tests and
    diagnostics: the server uses SGLang's allow-listed unpickler on the same bytes."""
    import pickle

    return pickle.loads(base64.b64decode(payload))
