"""The policy's distributed checkpoints: written in megatron's formats, read trusting nothing in the file."""
