"""HF-named weight tensors in flight: (name, tensor) streams, their byte buckets and safetensors shards.

Below both ``models/`` (HF export and checkpoints) and ``rollout/`` (the engines' weight sync), so
neither imports the other for them.
"""
