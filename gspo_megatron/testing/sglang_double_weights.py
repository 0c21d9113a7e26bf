"""The weight-update side of the SGLang test double (``sglang_double.py``): sessions, update groups,
distributed / disk updates and the weight version, as SGLang 0.5.23 answers them.

``WeightUpdateRoutes`` is a mixin of ``SGLangServerDouble``: its handlers read the double's ``_weights``
(``WeightState``), ``faults``, ``join_weight_groups``, ``weight_version``, ``model_path`` and the fault
counters ``_distributed_failures`` / ``_disk_failures`` and ``_stopped``, and call its ``_die``. With
``join_weight_groups`` the double really joins each update group (gloo or nccl, rank = rank_offset; several
names at once, as SGLang's ``_model_update_group`` dict) and receives every broadcast tensor, recording its
shape, dtype, sum and group.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gspo_megatron.testing.sglang_double_faults import HOLD_TIMEOUT_S

if TYPE_CHECKING:
    from gspo_megatron.testing.sglang_double_faults import DoubleFaults

DTYPE_NAMES = {"float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"}


@dataclass
class WeightState:
    groups: dict = field(default_factory=dict)  # group name -> the joined group (None without joining)
    in_update: bool = False
    received: dict = field(default_factory=dict)  # name -> {"shape", "dtype", "sum"} (+ "group" if broadcast)


class WeightUpdateRoutes:
    """The double's weight-update handlers (a mixin: see the module docstring for what it reads)."""

    _weights: WeightState
    faults: DoubleFaults
    join_weight_groups: bool
    weight_version: str
    model_path: str
    _distributed_failures: int
    _disk_failures: int
    _stopped: threading.Event

    def _die(self) -> None:
        raise NotImplementedError  # the double's own

    def _begin_weight_update(self, _body):
        if self._weights.in_update:
            return 400, {"success": False, "message": "a weight-update session is already open"}
        self._weights.in_update = True
        return 200, {"success": True, "message": "begun"}

    def _end_weight_update(self, _body):
        if not self._weights.in_update:
            return 400, {"success": False, "message": "end_weight_update without begin_weight_update"}
        self._weights.in_update = False
        return 200, {"success": True, "message": "ended"}

    def _init_group(self, body):
        error = check_fields(body, {"master_address": str, "master_port": int, "rank_offset": int, "world_size": int})
        if error:
            return 400, {"success": False, "message": error}
        group_name = body.get("group_name", "weight_update_group")
        if group_name in self._weights.groups:
            return 400, {"success": False, "message": f"Process group {group_name} already exists."}
        self._weights.groups[group_name] = _join_group(body, group_name) if self.join_weight_groups else None
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def _update_distributed(self, body):
        error = check_fields(body, {"names": list, "dtypes": list, "shapes": list})
        if not error and not len(body["names"]) == len(body["dtypes"]) == len(body["shapes"]):
            error = "names, dtypes and shapes must have the same length"
        if not error and any(d not in DTYPE_NAMES for d in body["dtypes"]):
            error = f"unknown dtype in {body['dtypes']}; valid: {sorted(DTYPE_NAMES)}"
        group_name = (body or {}).get("group_name", "weight_update_group")
        if not error and group_name not in self._weights.groups:
            error = f"Group {group_name} not in {list(self._weights.groups)}. Call init_weights_update_group first."
        if not error and not self._weights.in_update:
            error = "update_weights_from_distributed outside begin_weight_update / end_weight_update"
        if error:
            return 400, {"success": False, "message": error}
        if self._weights.groups[group_name] is not None:
            self._receive(body, group_name)
        if self._distributed_failures < self.faults.fail_distributed_updates:
            self._distributed_failures += 1  # received, then the weight loader fails (e.g. a name it lacks)
            return 400, {"success": False, "message": "injected fault: loading the received weights failed"}
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return 200, {"success": True, "message": "Succeeded to update parameter online."}

    def _update_from_disk(self, body):
        if self.faults.die_on_disk_update:
            self._die()
            return None  # drop the connection without an answer
        if self.faults.disk_update_never_answers:
            self._stopped.wait(HOLD_TIMEOUT_S)
            return None  # no answer: the connection is dropped
        error = check_fields(body, {"model_path": str})
        shards: list[Path] = []
        if not error:
            path = Path(body["model_path"])
            if not (path / "config.json").is_file():
                error = f"{path} has no config.json"
            elif not (shards := sorted(path.glob("*.safetensors"))):
                error = f"{path} has no *.safetensors"
        if not error and self._disk_failures < self.faults.fail_disk_updates:
            self._disk_failures += 1
            error = "injected fault: loading the checkpoint failed"
        if error:
            return 400, {"success": False, "message": error, "num_paused_requests": 0}
        from safetensors import safe_open

        for shard in shards:
            with safe_open(str(shard), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - keys() only: not a mapping, not iterable
                    tensor = handle.get_tensor(name)
                    self._weights.received[name] = _describe(tensor)
        self.model_path = str(path)
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def _destroy_group(self, body):
        group_name = (body or {}).get("group_name", "weight_update_group")
        if group_name not in self._weights.groups:
            return 400, {"success": False, "message": f"Group {group_name} not in {list(self._weights.groups)}"}
        group = self._weights.groups.pop(group_name)
        if group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(group)
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}

    def _update_weight_version(self, body):
        error = check_fields(body, {"new_version": str})
        if error:
            return 400, {"success": False, "message": error}
        self.weight_version = body["new_version"]
        return 200, {"success": True, "message": f"Weight version updated to {body['new_version']}"}

    def _receive(self, body: dict, group_name: str) -> None:
        import torch
        import torch.distributed as dist

        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(tensor, src=0, group=self._weights.groups[group_name])
            self._weights.received[name] = {**_describe(tensor), "group": group_name}


def check_fields(body: Any, fields: dict) -> str | None:
    """None when ``body`` is an object with each field of the given type, else what is wrong."""
    if not isinstance(body, dict):
        return "body must be a JSON object"
    for name, kind in fields.items():
        if not isinstance(body.get(name), kind):
            return f"field {name!r} must be {kind.__name__}, got {body.get(name)!r}"
    return None


def _describe(tensor) -> dict:
    return {
        "shape": list(tensor.shape),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "sum": float(tensor.double().sum()),
    }


def _join_group(body: dict, group_name: str):
    """Join the update group as SGLang's init_custom_process_group does (rank = rank_offset): the same
    rendezvous the trainer's side runs (``weight_sync.open_weight_update_group``)."""
    from gspo_megatron.rollout.sglang.weight_sync import open_weight_update_group

    return open_weight_update_group(
        body["master_address"],
        body["master_port"],
        body["world_size"],
        rank=body["rank_offset"],
        backend=body.get("backend", "nccl"),
        group_name=group_name,
        timeout_s=120.0,
    )
