"""The policy side, on every rank: parallel layout and mesh, the CPU bridges, models and conversion,
routing replay and its diagnostics, the loss heads over ``algorithms/``, optimizer, the non-finite
guard, the reference model, checkpoints and the weight export. The only package that imports
megatron-core; it never imports the rollout side."""
