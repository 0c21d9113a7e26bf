"""The GPU and link numbers the planner's time estimates rest on; every one is overridable.

Design decisions:
- Peaks are the vendor's published dense numbers (no sparsity): H100 SXM and H200 SXM both
  advertise 989 TFLOP/s dense bf16 and 900 GB/s bidirectional NVLink 4 per GPU; H100 SXM has 80 GB
  HBM3 at 3.35 TB/s, H200 141 GB HBM3e at 4.8 TB/s. A DGX/HGX node holds 8 GPUs, one 400 Gb/s
  (50 GB/s per direction) InfiniBand NDR adapter per GPU.
- Bandwidths are per GPU and per direction, the number a ring collective's bus bandwidth is
  compared with. Achieved fractions (``mfu``, ``link_efficiency``) are assumptions a user should
  replace with measured ones; the defaults (40% of peak for MoE training matmuls, 70% of link
  bandwidth) are typical of published Megatron MoE runs, not measured here (no GPU on this machine).
- ``usable_memory_fraction`` leaves room for the CUDA context, NCCL buffers and fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GB = 1e9


@dataclass(frozen=True)
class GPUSpec:
    name: str
    bf16_tflops: float  # dense bf16 peak, TFLOP/s
    memory_bytes: float  # HBM capacity
    hbm_bandwidth: float  # bytes/s
    nvlink_bandwidth: float  # bytes/s per GPU per direction (intra-node)
    ib_bandwidth: float  # bytes/s per GPU per direction (inter-node)
    gpus_per_node: int = 8
    mfu: float = 0.40  # achieved fraction of bf16 peak in training matmuls (assumption)
    link_efficiency: float = 0.70  # achieved fraction of link bandwidth in collectives (assumption)
    usable_memory_fraction: float = 0.90  # of HBM, for tensors the planner counts

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction

    def describe(self) -> str:
        return (
            f"{self.name}: bf16 {self.bf16_tflops:.0f} TFLOP/s dense (mfu {self.mfu:.0%}), "
            f"HBM {self.memory_bytes / GB:.0f} GB ({self.usable_memory_fraction:.0%} usable), "
            f"NVLink {self.nvlink_bandwidth / GB:.0f} GB/s/dir, "
            f"IB {self.ib_bandwidth / GB:.0f} GB/s/dir per GPU "
            f"(link efficiency {self.link_efficiency:.0%}), {self.gpus_per_node} GPUs/node"
        )


GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec(
        "H100 SXM",
        bf16_tflops=989.0,
        memory_bytes=80 * GB,
        hbm_bandwidth=3.35e12,
        nvlink_bandwidth=450 * GB,
        ib_bandwidth=50 * GB,
    ),
    "h200": GPUSpec(
        "H200 SXM",
        bf16_tflops=989.0,
        memory_bytes=141 * GB,
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
