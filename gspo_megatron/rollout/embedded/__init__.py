"""The embedded rollout engine: transformers' model with a KV cache, in the driver's process."""
