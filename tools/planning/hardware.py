"""The GPU and link numbers the planner's estimates rest on; every one is a stated, overridable assumption.

Design decisions (sources: the vendors' data sheets, NVIDIA's published Megatron runs, one H100 measured):
- Capacity is what torch can allocate, in GiB (2**30 bytes), not the marketing GB: an H100 SXM 80GB
  reports ``torch.cuda.get_device_properties(0).total_memory`` = 79.19 GiB (81,559 MiB in
  nvidia-smi). The H200 figure (139.8 GiB) is the one the H200 141GB exposes the same way (143,771
  MiB in nvidia-smi less the same ~0.46 GiB the H100 shows); with a GPU at hand, measure it
  (``--memory-gib``, or ``--calibrate`` reads it from the device).
- ``reserve_gib``: what the planner does not count but the process holds (CUDA context and
  kernels, NCCL buffers, the allocator's fragmentation), an assumption of 4 GiB; the counted tensors
  must fit in ``memory - reserve``.
- Peaks are the vendor's published dense numbers (no sparsity): H100 SXM and H200 SXM both
  advertise 989 TFLOP/s dense bf16 and 900 GB/s bidirectional NVLink 4 per GPU; H100 SXM HBM3 at
  3.35 TB/s, H200 HBM3e at 4.8 TB/s. A DGX/HGX node holds 8 GPUs, one 400 Gb/s (50 GB/s per
  direction) InfiniBand NDR adapter per GPU.
- ``mfu`` (achieved fraction of the bf16 peak in the trainer's matmuls) defaults to 0.19: the middle
  of NVIDIA's published Megatron runs of Qwen3-30B-A3B/235B-A22B on H100 (118-253 model TFLOP/s,
  12-26% of the bf16 peak, some in FP8). The range is the time model's known error: at 0.12 a
  step takes 1.6x longer, at 0.26 0.73x. ``link_efficiency`` 0.70 (achieved fraction of a link's
  bandwidth in NCCL collectives) is an assumption, not measured here. Replace both with measured ones.
- Host link: PCIe Gen5 x16, 64 GB/s per direction (the H100/H200 SXM's host interface), at
  ``link_efficiency`` like the other links: what brings offloaded weights back to the device.
- Host memory per node: 2 TB, the DGX H100 / DGX H200 data sheets' system memory (other nodes differ:
  ``--host-memory-gib``). ``host_reserve_bytes``, 128 GiB per node, is an assumption: the operating
  system and page cache (checkpoints, the dataset), and each rank's interpreter with torch, CUDA and
  NCCL's host-side state, none of which the planner counts. What it counts in host memory is what
  the trainer puts there (Adam in host memory, the reference model off the device: ``planner.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GB = 1e9
GiB = 2**30

PUBLISHED_MFU_RANGE = (0.12, 0.26)  # NVIDIA's Megatron runs of Qwen3 MoE on H100 (model TFLOP/s / 989)


@dataclass(frozen=True)
class GPUSpec:
    name: str
    bf16_tflops: float  # dense bf16 peak, TFLOP/s
    memory_bytes: float  # what torch can allocate on one GPU (total_memory)
    hbm_bandwidth: float  # bytes/s
    nvlink_bandwidth: float  # bytes/s per GPU per direction (intra-node)
    ib_bandwidth: float  # bytes/s per GPU per direction (inter-node)
    gpus_per_node: int = 8
    mfu: float = 0.19  # achieved fraction of bf16 peak in training matmuls (assumption; see above)
    link_efficiency: float = 0.70  # achieved fraction of link bandwidth in collectives (assumption)
    reserve_bytes: float = 4 * GiB  # CUDA context, NCCL buffers, fragmentation: not counted tensors
    pcie_bandwidth: float = 64 * GB  # bytes/s per GPU per direction, host <-> device
    host_memory_bytes: float = 2e12  # host RAM per node (DGX H100/H200: 2 TB)
    host_reserve_bytes: float = 128 * GiB  # per node: OS, page cache, the ranks' own processes (assumption)

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes - self.reserve_bytes

    @property
    def usable_host_bytes(self) -> float:
        """Host bytes per node that the counted tensors of its ranks may use."""
        return self.host_memory_bytes - self.host_reserve_bytes

    def describe(self) -> str:
        return (
            f"{self.name}: bf16 {self.bf16_tflops:.4g} TFLOP/s dense at mfu {self.mfu:.0%} "
            f"(NVIDIA's published Qwen3-MoE runs: {PUBLISHED_MFU_RANGE[0]:.0%}-{PUBLISHED_MFU_RANGE[1]:.0%}), "
            f"{self.memory_bytes / GiB:.2f} GiB per GPU less {self.reserve_bytes / GiB:.1f} GiB reserve, "
            f"HBM {self.hbm_bandwidth / 1e12:.3g} TB/s, NVLink {self.nvlink_bandwidth / GB:.3g} GB/s/dir, "
            f"IB {self.ib_bandwidth / GB:.3g} GB/s/dir, PCIe {self.pcie_bandwidth / GB:.3g} GB/s/dir per GPU "
            f"(link efficiency {self.link_efficiency:.0%}), {self.gpus_per_node} GPUs/node, "
            f"{self.host_memory_bytes / GiB:.0f} GiB host memory per node less {self.host_reserve_bytes / GiB:.0f}"
        )


GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec(
        "H100 SXM 80GB",
        bf16_tflops=989.0,
        memory_bytes=79.19 * GiB,
        hbm_bandwidth=3.35e12,
        nvlink_bandwidth=450 * GB,
        ib_bandwidth=50 * GB,
    ),
    "h200": GPUSpec(
        "H200 SXM 141GB",
        bf16_tflops=989.0,
        memory_bytes=139.8 * GiB,
        hbm_bandwidth=4.8e12,
        nvlink_bandwidth=450 * GB,
        ib_bandwidth=50 * GB,
    ),
}


def gpu_spec(name: str, **overrides) -> GPUSpec:
    """A preset with fields replaced (``None`` values are ignored); unknown names list the valid ones."""
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; valid: {sorted(GPUS)}")
    return replace(GPUS[name], **{k: v for k, v in overrides.items() if v is not None})
