"""Where HF-named weights come from: a dict, or a HF checkpoint directory read tensor by tensor
(``SafetensorsSource``: shards checked at open and kept inside the directory (``shard_path``), block-FP8
weights dequantized, float8 without scales refused), and the check that a checkpoint holds nothing the
model config has no place for (``check_checkpoint_names``; multi-token-prediction layers are set aside).
``policy/models/conversion.py`` loads from them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from gspo_megatron.core.fp8_blocks import BLOCK, SCALE_SUFFIX, dequantize_block_fp8, scale_name
from gspo_megatron.policy.models.config import MoEModelConfig
from gspo_megatron.policy.models.hf_shapes import hf_shapes


class ConversionError(ValueError):
    """Weights that do not fit the model (missing names, wrong shapes)."""


class WeightSource:
    """Read-only access to HF-named full tensors."""

    def keys(self) -> Iterable[str]:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError


class DictSource(WeightSource):
    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors

    def keys(self):
        return self.tensors.keys()

    def get(self, name):
        if name not in self.tensors:
            raise ConversionError(f"the HF state dict has no tensor {name!r}")
        return self.tensors[name]


def shard_path(directory: Path, entry: object, index: Path | None) -> Path:
    """The file ``entry`` (a shard name from ``index``'s weight_map; None: the single ``model.safetensors``)
    names, refused unless it lies inside ``directory``.

    An index is data, not a path policy: a checkpoint downloaded or copied from elsewhere must not read
    ``/etc/...`` or a neighbour's weights because its index says so. So an entry is a relative name without
    ``..``, and the file it names, symlinks resolved, lies inside the (resolved) directory. The one symlink
    outside it that is accepted is the Hugging Face hub cache's own layout: ``<repo>/snapshots/<rev>/<shard>``
    links to ``<repo>/blobs/<sha>``, which ``huggingface_hub`` makes for every download into its cache."""
    where = f"{index}: weight_map names shard {entry!r}" if index else f"{directory / str(entry)}"
    if not isinstance(entry, str) or not entry:
        raise ConversionError(f"{where}, which is not a file name; rewrite the index (names relative to it)")
    name = Path(entry)
    if name.is_absolute() or ".." in name.parts:
        raise ConversionError(
            f"{where}, which is {'an absolute path' if name.is_absolute() else 'a path through ..'}: a shard "
            f"must lie inside {directory}; copy it there and name it relative to the index"
        )
    path = directory / name
    inside = directory.resolve()
    target = path.resolve()
    if not target.is_relative_to(inside) and target.parent != _hub_blobs(inside):
        raise ConversionError(
            f"{where}, which resolves through a symlink to {target}, outside {inside}: a shard must lie inside "
            "the checkpoint directory; copy the file in instead of linking it"
        )
    return path


def _hub_blobs(directory: Path) -> Path | None:
    """``<repo>/blobs`` when ``directory`` lies in a hub cache's ``<repo>/snapshots/<rev>/`` (None otherwise)."""
    parts = directory.parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots":
            return Path(*parts[:i]) / "blobs"
    return None


def _open_shard(path: Path):
    """``safe_open`` with errors that name the file (safetensors' own name none)."""
    from safetensors import safe_open

    if not path.is_file():
        raise ConversionError(f"{path} is missing (named by the checkpoint's index)")
    try:
        return safe_open(str(path), "pt")
    except Exception as error:  # SafetensorError: truncated, corrupt header, not safetensors
        raise ConversionError(
            f"{path} is not a readable safetensors file ({error}); re-download or re-export the checkpoint"
        ) from error


class SafetensorsSource(WeightSource):
    """A HF model directory (``model.safetensors`` or an index of shards), read tensor by tensor.

    Block-FP8 checkpoints (DeepSeek-V3's and Kimi-K2's published weights, Qwen3-*-FP8, this project's
    ``--fp8-block`` export; ``core/fp8_blocks.py``) are read as the weights they stand for: a float8
    tensor ``W`` with ``W_scale_inv`` beside it is ``dequantize_block_fp8(W, W_scale_inv)`` in float32,
    with the block size of config.json's ``quantization_config.weight_block_size`` (128 x 128 without
    one). A float8 tensor without its ``_scale_inv`` is refused by name -- never cast as it stands."""

    def __init__(self, directory: str | Path):
        from safetensors import safe_open

        self.directory = Path(directory)
        index_file = self.directory / "model.safetensors.index.json"
        index = index_file if index_file.is_file() else None
        if index is not None:
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            single = shard_path(self.directory, "model.safetensors", None)
            if not single.is_file():
                raise ConversionError(
                    f"{self.directory} has neither model.safetensors nor model.safetensors.index.json"
                )
            with _open_shard(single) as handle:
                weight_map = {k: "model.safetensors" for k in handle.keys()}  # noqa: SIM118 - keys() only: not a mapping, not iterable
        self.weight_map = weight_map
        self._shards = {file: shard_path(self.directory, file, index) for file in sorted(set(weight_map.values()))}
        for path in self._shards.values():  # a missing or truncated shard fails here, named
            with _open_shard(path):
                pass
        self._open = safe_open
        self._handles: dict[str, safe_open] = {}
        self.fp8_block = _fp8_block_size(self.directory)

    def keys(self):
        return self.weight_map.keys()

    def get(self, name):
        tensor = self.stored(name)
        if tensor.dtype not in FP8_DTYPES:
            return tensor
        scale = scale_name(name)
        if scale not in self.weight_map:
            raise ConversionError(
                f"{self.directory}: {name} is stored in {tensor.dtype} without {scale}, so its values cannot be "
                "recovered (only block FP8 with _scale_inv tensors is read); convert the checkpoint to bf16 first"
            )
        return dequantize_block_fp8(tensor, self.stored(scale), torch.float32, self.fp8_block)

    def stored(self, name: str) -> torch.Tensor:
        """The tensor as the file holds it (a float8 weight as float8: ``get`` dequantizes)."""
        if name not in self.weight_map:
            raise ConversionError(f"{self.directory} has no tensor {name!r}")
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = self._open(str(self._shards[file]), "pt")
        return self._handles[file].get_tensor(name)


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
_MTP_MODULE = "mtp."  # Qwen3-Next's and Qwen3.5's multi-token-prediction head


def unread_tensors(names: Iterable[str], cfg: MoEModelConfig) -> tuple[list[str], list[str]]:
    """A checkpoint's tensors the model does not read: (multi-token-prediction layers' -- layers past
    ``num_layers``, as DeepSeek-V3's layer 61 and GLM-4.5's MTP layer sit, and Qwen3-Next's and Qwen3.5's
    ``mtp.*`` module --, the rest). Scales of block-FP8
    weights are read with their weight; a tied model's ``lm_head.weight`` is the embedding (transformers
    ties it the same way)."""
    expected = hf_shapes(cfg)
    mtp: list[str] = []
    other: list[str] = []
    for name in names:
        base = name.removesuffix(SCALE_SUFFIX)
        if base in expected or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue
        layer = _LAYER_NAME.match(name)
        past_the_layers = layer is not None and int(layer.group(1)) >= cfg.num_layers
        (mtp if past_the_layers or name.startswith(_MTP_MODULE) else other).append(name)
    return mtp, other


def check_checkpoint_names(source: WeightSource, cfg: MoEModelConfig) -> list[str]:
    """Refuse a checkpoint with tensors the model config has no place for (a feature of the checkpoint the
    config misses: loading without them would train another model), naming them; return the
    multi-token-prediction layers' tensors, which are left unread (MTP is not built: RL trains the next token)."""
    mtp, other = unread_tensors(source.keys(), cfg)
    if other:
        raise ConversionError(
            f"the checkpoint has {len(other)} tensors the model config does not use, e.g. {sorted(other)[:4]}: "
            "the model config misses a feature of this checkpoint (check config.json against model.* keys)"
        )
    return mtp


def _fp8_block_size(directory: Path) -> tuple[int, int]:
    """config.json's ``quantization_config.weight_block_size`` (``BLOCK`` where there is none)."""
    config = directory / "config.json"
    if not config.is_file():
        return BLOCK
    try:
        quantization = json.loads(config.read_text()).get("quantization_config") or {}
    except json.JSONDecodeError as error:
        raise ConversionError(f"{config} is not valid JSON: {error}") from error
    block = quantization.get("weight_block_size") or BLOCK
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ConversionError(f"{config}: quantization_config.weight_block_size={block!r} is not two positive ints")
    return int(block[0]), int(block[1])
