"""The rollout engines by name (``rollout.engine``): each one builds itself and checks its own settings.

    ENGINES.get("embedded").check(rollout_section, needs)   # at start-up, before anything is built
    ENGINES.get("sglang").build(rollout_section, model_shape, decode, run_dir)

A new engine is a folder of its own under ``rollout/`` and one entry here; ``config/validate.py`` only
says what the run needs of the engine (``EngineNeeds``: the routed experts, for R3 or a diagnostic;
colocated placement) and the engine answers whether it can, naming its own keys. Engines are built
lazily: the SGLang client (httpx) is imported only by a run that uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gspo_megatron.core.model_families import FAMILIES
from gspo_megatron.core.registry import Registry
from gspo_megatron.rollout.config import Placement, RolloutEngineName, RolloutSection
from gspo_megatron.rollout.sglang.config import WeightSync

if TYPE_CHECKING:
    from gspo_megatron.rollout.engine import RolloutEngine


@dataclass(frozen=True)
class ModelShape:
    """The policy's shape as an engine builds it: its family (``core/model_families.py``) and its
    ``config.json`` dictionary."""

    family: str
    config: Mapping[str, Any]

    def hf_config(self) -> Any:
        """The family's transformers config object."""
        config_class, _ = FAMILIES[self.family].transformers_classes()
        return config_class(**self.config)


@dataclass(frozen=True)
class EngineNeeds:
    """What the run asks of its engine, decided across sections at start-up (``config/validate.py``)."""

    # why the run needs the engine's routed experts, one phrase per reason, e.g. "routing.replay=rollout (R3)"
    routed_experts: list[str] = field(default_factory=list)
    # the routed experts R3 replays (a reason of its own: R3 cannot run without them)
    replays_engine_routing: bool = False
    placement: Placement = Placement.separate


class EngineSpec(Protocol):
    def check(self, rollout: RolloutSection, needs: EngineNeeds) -> None:
        """Raise ``ValueError`` naming the key and the fix when this engine cannot serve the run."""

    def build(
        self, rollout: RolloutSection, model: ModelShape, decode: Callable[[list[int]], str], run_dir: Path | None
    ) -> RolloutEngine:
        """The engine, without weights (the first weight sync loads them); what it writes goes under
        ``run_dir`` (None: an engine a tool builds outside a run)."""


class EmbeddedSpec:
    """transformers in the driver's process: routed experts and colocation are its own, nothing to check."""

    def check(self, rollout: RolloutSection, needs: EngineNeeds) -> None:
        return None

    def build(
        self, rollout: RolloutSection, model: ModelShape, decode: Callable[[list[int]], str], run_dir: Path | None
    ) -> RolloutEngine:
        from gspo_megatron.rollout.embedded.engine import EmbeddedEngine

        return EmbeddedEngine(model.hf_config(), rollout.embedded, decode=decode)


class SGLangSpec:
    """SGLang servers, launched or attached (``rollout.sglang.*``)."""

    def check(self, rollout: RolloutSection, needs: EngineNeeds) -> None:
        sglang = rollout.sglang
        try:  # before the model is built, not when the engine starts
            sglang.require_targets()
        except ValueError as error:
            raise ValueError(f"rollout.sglang: {error}") from error
        wants = [reason for reason in needs.routed_experts if not sglang.enable_return_routed_experts]
        if wants:
            raise ValueError(
                f"{' and '.join(wants)} needs the engine's routed experts: set "
                "rollout.sglang.enable_return_routed_experts=true (or drop rollout_vs_train from routing.kinds)"
            )
        if needs.placement == Placement.colocated and sglang.weight_sync != WeightSync.tensor:
            # colocated servers share the trainer's devices: the weights go in by tensor handles
            # (rollout/sglang/tensor_handles.py), not over a broadcast group or a disk
            raise ValueError(
                f"rollout.placement=colocated with SGLang sends the weights by tensor handles to servers on the "
                f"trainer's devices: set rollout.sglang.weight_sync=tensor (got {sglang.weight_sync})"
            )
        if needs.replays_engine_routing and not sglang.enable_return_routed_experts:
            raise ValueError(
                "routing.replay=rollout (R3) needs the engine's routed experts: set "
                "rollout.sglang.enable_return_routed_experts=true"
            )

    def build(
        self, rollout: RolloutSection, model: ModelShape, decode: Callable[[list[int]], str], run_dir: Path | None
    ) -> RolloutEngine:
        from gspo_megatron.rollout.sglang.engine import SGLangEngine

        return SGLangEngine(rollout.sglang, run_dir)


ENGINES: Registry[EngineSpec] = Registry("rollout engine")
ENGINES.register(str(RolloutEngineName.embedded), EmbeddedSpec())
ENGINES.register(str(RolloutEngineName.sglang), SGLangSpec())
