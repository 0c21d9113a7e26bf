"""gspo-megatron: GSPO/GRPO post-training for MoE models on Megatron-core (see README.md)."""

from gspo_megatron.core import deferred_compile, deferred_tensorboard

deferred_compile.install()  # megatron's @jit_fuser kernels compile on first call, not at import
deferred_tensorboard.install()  # megatron.core.timers' SummaryWriter imported on first use, not at import
