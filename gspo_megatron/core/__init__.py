"""Foundations every role may import: config nodes and registries, the run-directory format, provenance,
reviewed warnings, process tags, trigger words, config migrations, model families as data, and the
weight-file formats (safetensors shards, block FP8). Nothing here imports torch at module level but
the weight formats."""
