"""Wrappers over an engine that decide what is generated: Dynamic Truncated Rollout and over-sampling
with partial rollouts."""
