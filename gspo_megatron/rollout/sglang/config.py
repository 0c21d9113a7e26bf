"""Config of the SGLang rollout engine (launch or attach, HTTP client, weight sync).

Design decisions:
- One plain dataclass; the lead registers it in Hydra's ConfigStore and ``conf/rollout/sglang.yaml``
  holds its YAML defaults.
- ``mode`` is a value ("launch" | "attach"), not a pair of booleans: launch starts and owns the server
  processes, attach talks to servers somebody else runs and never stops them.
- The launch command is configurable (default ``python -m sglang.launch_server``) so tests can start
  the test double with the same code path, and site wrappers (e.g. ``srun``) can be put in front.
- The routed-experts layout (layers, top-k) is needed to check the decoded buffer strictly; it comes
  from here or from the checkpoint's ``config.json`` (``num_hidden_layers``, ``num_experts_per_tok``).
- Weight sync is "distributed" (NCCL broadcast from the trainer into the servers, the fast path) or
  "disk" (write safetensors, then ``/update_weights_from_disk``; the fallback that always works).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from gspo_megatron.core.config_node import ConfigChoice, ConfigNode
from gspo_megatron.rollout.sglang.auth import refuse_key_flags


class LaunchMode(ConfigChoice):
    """``rollout.sglang.mode``."""

    launch = "launch"  # start and own the server processes
    attach = "attach"  # talk to servers somebody else runs; never stop them


class WeightSync(ConfigChoice):
    """``rollout.sglang.weight_sync``."""

    distributed = "distributed"  # broadcast from the trainer into the servers (the fast path)
    disk = "disk"  # safetensors on disk, then /update_weights_from_disk (the fallback)
    tensor = "tensor"  # handles to the trainer's memory, /update_weights_from_tensor (servers on this host)


class PauseMode(ConfigChoice):
    """``rollout.sglang.pause_mode``: SGLang's PauseGenerationReqInput.mode."""

    abort = "abort"
    retract = "retract"
    in_place = "in_place"


class WeightSyncBackend(ConfigChoice):
    """``rollout.sglang.weight_sync_backend``: the process-group backend of the weight broadcast."""

    nccl = "nccl"
    gloo = "gloo"  # CPU tests


class WeightSenders(ConfigChoice):
    """``rollout.sglang.weight_senders``: who broadcasts a distributed sync under pipeline parallelism."""

    per_stage = "per_stage"  # each pipeline stage's first rank sends its own layers over its own group
    driver = "driver"  # every layer is shared with the driver, which alone sends


LAUNCH_MODES = tuple(LaunchMode)
WEIGHT_SYNC_MODES = tuple(WeightSync)
PAUSE_MODES = tuple(PauseMode)


class WeightQuantization(ConfigChoice):
    """How the engine holds the synced weights: as sent, or block FP8 (``core/fp8_blocks.py``)."""

    none = "none"
    fp8_block = "fp8_block"  # e4m3, 128 x 128 blocks with float32 scales (the FP8 checkpoints' format)


@dataclass
class SGLangConfig(ConfigNode):
    mode: LaunchMode = LaunchMode.launch

    # --- launch mode: `<launch_command> --model-path M --tp-size N --host H --port P [...] <extra_args>`
    model_path: str | None = None
    tp: int = 1  # tensor-parallel size of each server (attach mode: used when /server_info lacks it)
    num_servers: int = 1
    host: str = "127.0.0.1"
    ports: list[int] = field(default_factory=list)  # empty: free ports are picked
    launch_command: list[str] = field(default_factory=list)  # empty: [python, -m, sglang.launch_server]
    extra_args: list[str] = field(default_factory=list)  # appended verbatim (e.g. --mem-fraction-static)
    # each server's stdout+stderr goes to <log_dir>/server_<i>_<port>.log; a relative dir lies under the run
    # directory (under_run_dir), never the working directory
    log_dir: str = "logs/sglang"
    startup_timeout_s: float = 900.0  # deadline for /health to answer 200
    health_poll_interval_s: float = 1.0
    shutdown_grace_s: float = 15.0  # SIGTERM, then SIGKILL of the server's process group

    # --- attach mode
    urls: list[str] = field(default_factory=list)  # e.g. ["http://10.0.0.5:30000", ...]
    attach_timeout_s: float = 60.0  # running servers answer /health at once; a dead URL fails fast
    progress_every_s: float = 10.0  # a waiting message per server this often while /health is not 200
    # The NAME of an environment variable holding the servers' API key, never the key itself (auth.py).
    # attach: the key the servers were started with (--api-key); None: they take none. launch: the key to
    # launch with (so other processes can attach too); None: a fresh key each run.
    api_key_env: str | None = None

    # --- HTTP client
    max_concurrency: int = 256  # requests in flight over all servers
    # One attempt's wait for an answer (a non-streaming /generate answers when its sample is complete, so
    # this bounds the whole generation, a pause for a weight sync included). 600 s fits a long generation:
    # 16k tokens at 30 tokens/s, a request's decode rate in a full SGLang batch on an H100-class GPU, take
    # 9 min (the default max_new_tokens=1024 takes seconds); the live tests run real servers with 600 s.
    # The whole bound of a request that never gets an answer is
    #   request_timeout_s * (max_retries + 1) + the backoffs = 600 * 5 + 7.5 s, about 50 min
    # (client.RetryPolicy.bound_s, quoted by the warning and the error); the old 1800 s made it 2.5 h of
    # silence. At half of request_timeout_s on the wire a warning names the server and this key.
    # Raise it for generations longer than about 15k tokens.
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    # An idle pooled connection is dropped after this long. It must stay below the server's keep-alive
    # (SGLang: uvicorn's timeout_keep_alive, SGLANG_TIMEOUT_KEEP_ALIVE = 5 s): at httpx's default of
    # the same 5 s, connections left idle across a weight sync were reused just as the server closed
    # them, two ReadErrors marked a healthy server dead (seen live: tests/live_sglang).
    keepalive_expiry_s: float = 2.0
    max_retries: int = 4  # per request, on 5xx / timeouts / connection errors (not on 4xx)
    backoff_base_s: float = 0.5  # sleep base * 2**attempt, capped by backoff_max_s
    backoff_max_s: float = 15.0
    dead_after_failures: int = 2  # consecutive connection failures that mark a server dead
    abort_retries: int = 1  # an aborted sample is resubmitted this often, then returned as ABORT

    # --- /generate
    enable_return_routed_experts: bool = False  # launch flag; also needed to ask for routed experts
    # SGLang honours sampling_seed only under --enable-deterministic-inference (slower kernels); without
    # it the seed is not sent and samples are not reproducible. Attach mode reads it from /server_info.
    enable_deterministic_inference: bool = False
    num_hidden_layers: int | None = None  # routed-experts layout; None: read from config.json
    num_experts_per_tok: int | None = None
    skip_special_tokens: bool = False  # we consume ids, the text is only for logs
    no_stop_trim: bool = True

    # --- weight sync
    weight_sync: WeightSync = WeightSync.distributed
    # fp8_block: every projection weight is sent as block FP8 (e4m3 + weight_scale_inv), which an engine serving
    # an FP8 checkpoint (model_path's config.json: quantization_config fp8, weight_block_size [128, 128]) loads
    weight_quantization: WeightQuantization = WeightQuantization.none
    weight_bucket_bytes: int = 512 * 1024 * 1024  # bytes broadcast per /update_weights_from_distributed
    weight_sync_backend: WeightSyncBackend = WeightSyncBackend.nccl  # gloo for CPU tests
    weight_sync_master_address: str = "127.0.0.1"  # an address of the trainer the servers can reach
    weight_sync_master_port: int | None = None  # None: a free port
    weight_sync_group_name: str = "gspo_weight_update"  # stage k > 0 of per_stage senders: <name>_stage<k>
    weight_senders: WeightSenders = WeightSenders.per_stage  # distributed sync with pipeline stages
    weight_sync_timeout_s: float = 600.0
    # writes <dir>/v<version>/ (older v* removed); a relative dir lies under the run directory (disk_sync_root)
    disk_sync_dir: str = "sglang_sync"
    fallback_to_disk: bool = True  # a failed distributed update is retried through the disk path
    # in-flight requests are retracted and resume on the new weights; the syncs between rounds and turns use it,
    # an in-flight update (rollout.inflight_update_mode) pauses in its own mode (SGLangEngine.update_weights_in_flight)
    pause_mode: PauseMode = PauseMode.retract
    bracket_weight_update: bool = True  # /begin_weight_update.../end_weight_update (newer 0.5.x)

    def disk_sync_root(self, run_dir: Path | None) -> Path:
        """``disk_sync_dir`` as an absolute path (the servers resolve a relative one against their own cwd).
        A relative one lies under ``run_dir``, so two runs started from one working directory never load
        each other's weights; an engine built without a run directory (a tool's) puts it under the
        working directory. Not resolved: the engine checks the directory itself is no link."""
        return under_run_dir(self.disk_sync_dir, run_dir)

    def log_root(self, run_dir: Path | None) -> Path:
        """``log_dir`` as an absolute path: a relative one lies under ``run_dir`` (one place for a run's files;
        the working directory only for an engine built without a run directory, a tool's)."""
        return under_run_dir(self.log_dir, run_dir)

    def require_targets(self) -> None:
        """What the engine needs to reach servers; checked when the engine starts, not at construction,
        so the config can sit unused (and incomplete) in a run that uses the embedded engine."""
        if self.mode == LaunchMode.launch and not self.model_path:
            raise ValueError("SGLangConfig.mode='launch' needs model_path (an HF checkpoint directory)")
        if self.mode == LaunchMode.attach and not self.urls:
            raise ValueError("SGLangConfig.mode='attach' needs urls, e.g. ['http://127.0.0.1:30000']")

    def _check_fp8_checkpoint(self) -> None:
        """FP8 weights load only into a server that serves an FP8 checkpoint of the same block size: where
        ``model_path`` is a local directory its ``config.json`` must say so (a remote one is the user's)."""
        config_file = Path(self.model_path or "") / "config.json"
        if not self.model_path or not config_file.is_file():
            return
        quantization = json.loads(config_file.read_text()).get("quantization_config") or {}
        if quantization.get("quant_method") != "fp8" or quantization.get("weight_block_size") != [128, 128]:
            raise ValueError(
                f"rollout.sglang.weight_quantization=fp8_block sends block-FP8 weights, but {config_file} has "
                f"quantization_config={quantization or None}: the server must serve an FP8 checkpoint with "
                "weight_block_size [128, 128] (write one with tools/convert_checkpoint.py --fp8-block), or set "
                "rollout.sglang.weight_quantization=none"
            )

    def _check_api_key_env(self) -> None:
        """``api_key_env`` names a variable; ``extra_args`` holds no key (``auth.py``)."""
        refuse_key_flags(self.extra_args)
        if self.api_key_env is None:
            return
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env):
            raise ValueError(
                "rollout.sglang.api_key_env must be the NAME of an environment variable holding the key (e.g. "
                "SGLANG_API_KEY), not the key itself; the value given is not a variable name (not shown)"
            )

    def validate(self) -> None:
        if self.mode not in LAUNCH_MODES:
            raise ValueError(f"SGLangConfig.mode must be one of {LAUNCH_MODES}, got {self.mode!r}")
        self._check_api_key_env()
        if self.mode == LaunchMode.launch and self.ports and len(self.ports) != self.num_servers:
            raise ValueError(f"ports has {len(self.ports)} entries but num_servers={self.num_servers}")
        if self.weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(f"weight_sync must be one of {WEIGHT_SYNC_MODES}, got {self.weight_sync!r}")
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {self.pause_mode!r}")
        if self.keepalive_expiry_s <= 0:
            raise ValueError(
                f"SGLangConfig.keepalive_expiry_s must be > 0 (and below the server's keep-alive, 5 s for "
                f"SGLang), got {self.keepalive_expiry_s}"
            )
        if self.weight_senders not in tuple(WeightSenders):
            raise ValueError(
                f"rollout.sglang.weight_senders must be one of {tuple(WeightSenders)}, got {self.weight_senders!r}"
            )
        if self.weight_sync_backend not in tuple(WeightSyncBackend):
            raise ValueError(
                f"weight_sync_backend must be one of {tuple(WeightSyncBackend)}, got {self.weight_sync_backend!r}"
            )
        if self.attach_timeout_s <= 0 or self.progress_every_s <= 0:
            raise ValueError("SGLangConfig.attach_timeout_s and progress_every_s must be > 0")
        for name in ("tp", "num_servers", "max_concurrency", "dead_after_failures", "weight_bucket_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"SGLangConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_retries < 0 or self.abort_retries < 0:
            raise ValueError("max_retries and abort_retries must be >= 0")
        if self.request_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError(
                f"rollout.sglang.request_timeout_s and connect_timeout_s must be > 0, got "
                f"{self.request_timeout_s}, {self.connect_timeout_s}"
            )
        if self.weight_quantization == WeightQuantization.fp8_block:
            self._check_fp8_checkpoint()


def under_run_dir(path: str, run_dir: Path | None) -> Path:
    """``path`` made absolute: a relative one joined to ``run_dir`` (None: the working directory)."""
    base = run_dir if run_dir is not None else Path.cwd()
    return (base / Path(path).expanduser()).absolute()
