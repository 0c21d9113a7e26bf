"""Config of reward evaluation (the reward function's name comes from the task: ``TaskConfig.reward``)."""

from __future__ import annotations

from dataclasses import dataclass

from gspo_megatron.core.config_node import ConfigNode

START_METHODS = ("forkserver", "spawn")


@dataclass
class RewardConfig(ConfigNode):
    # None: in the trainer process only for trivial built-ins (string checks), else in workers; true forces
    # the trainer process (a call past timeout_s scores 0 and its thread is abandoned, it cannot be
    # killed), false forces workers
    in_process: bool | None = None
    num_workers: int = 2  # worker processes when not in_process
    timeout_s: float = 10.0  # per call; a call past it scores 0 and its worker is replaced (or thread abandoned)
    startup_timeout_s: float = 120.0  # a worker must import and warm up within this
    start_method: str = "forkserver"  # never fork: the trainer holds threads and process groups
    max_start_failures: int = 3  # consecutive worker start failures before the pool gives up

    def validate(self) -> None:
        if self.start_method not in START_METHODS:
            raise ValueError(f"reward.start_method={self.start_method!r} is unknown; valid: {list(START_METHODS)}")
        if self.num_workers < 1:
            raise ValueError(f"reward.num_workers must be >= 1, got {self.num_workers}")
        if self.timeout_s <= 0 or self.startup_timeout_s <= 0:
            raise ValueError(
                f"reward.timeout_s and reward.startup_timeout_s must be > 0, got "
                f"{self.timeout_s}, {self.startup_timeout_s}"
            )
        if self.max_start_failures < 1:
            raise ValueError(f"reward.max_start_failures must be >= 1, got {self.max_start_failures}")
