"""(HF name, tensor) pairs and their buckets: what the export produces and a weight sync consumes.

Design decision: a bucket is yielded as soon as the next tensor would overflow it and is not
referenced here afterwards, so a consumer that drops each bucket before asking for the next holds
one bucket at a time (the export streams tensor by tensor: ``policy/models/conversion.py``).
"""

from __future__ import annotations

from collections.abc import Generator, Iterable

import torch

NamedTensor = tuple[str, torch.Tensor]


def bucket_named_tensors(
    named_tensors: Iterable[NamedTensor], bucket_bytes: int
) -> Generator[list[NamedTensor], None, None]:
    """Group (name, tensor) pairs into lists of at most ``bucket_bytes`` (an oversize tensor: alone).

    A bucket is yielded as soon as the next tensor would overflow it and is not referenced here
    afterwards, so a consumer that drops each bucket before asking for the next holds one at a time."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: list[NamedTensor] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
