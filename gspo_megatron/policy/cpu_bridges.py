"""Let megatron-core (0.16.1 to 0.19.2) run on a machine without CUDA (CPU tensors, gloo collectives).

Every process-wide patch the project makes is here, applied by one call at start-up,
``apply_cpu_bridges()``, before process groups form (``policy/build.py``, and every tool or test that forms
them itself); it decides from the device whether the bridges apply -- only without CUDA
(``policy/parallel/device.py:cuda_kernels``) -- and returns the one line that says which did (the driver
prints it). Nothing patches as a side effect of another call: ``initialize_parallel`` refuses to form groups
on a CPU machine whose bridges were not applied. On a GPU machine nothing here runs.
``disable_cpu_megatron()`` puts back every attribute the bridges replaced (each bridge is applied through
``_patch``, which remembers the original). Written against
megatron-core 0.16.1 (torch 2.13, CPU build) and checked against 0.19.2 (torch 2.15, CUDA build on
CPU); a bridge whose upstream fact depends on the version looks for the fact, not the version number.
``tests/unit/policy/test_cpu_bridges.py`` (bridge 10 under gloo ranks: ``tests/distributed/
test_cpu_compat_uneven_gather.py``) shows, per bridge, what megatron does on a machine without
CUDA without it and with it, on whichever version is installed.

Where megatron-core has a seam we use it instead of patching, elsewhere in the package:
- core attention: the portable layer spec uses ``policy/models/layers.py:SDPACoreAttention`` (torch SDPA)
  instead of ``DotProductAttention``, whose global memory buffer allocates on the CUDA device;
- norms: the portable spec uses ``policy/models/layers.py:RMSNorm``, which supports sequence parallelism
  (torch's wrapped norm refuses it, and MoE with TP needs it);
- MoE experts: ``policy/models/grouped_experts.py`` (or megatron's ``SequentialMLP``) instead of
  ``TEGroupedMLP``, which needs TransformerEngine;
- initialisation: ``use_cpu_initialization=True`` in the TransformerConfig.

What has no seam is bridged here, one function per fact:
1. ``torch.cuda.current_device()`` is used as an allocation device all over megatron-core (router
   gating, tensor-parallel mappings and layers, p2p communication). It raises without CUDA; we make
   it return the CPU device. This is process-wide, which is why this module only ever runs in
   processes with no CUDA at all.
2. The RNG tracker (``model_parallel_cuda_manual_seed``, ``get_cuda_rng_tracker().fork()``) keeps
   CUDA generator states. We install a tracker that keeps CPU generator states instead, so forked
   regions (weight init of TP-sharded layers) still get their own reproducible streams.
3. megatron-core 0.16 defines ``te_general_gemm`` in ``moe_utils.py`` only inside a ``try`` that
   fails without TransformerEngine, then tests ``te_general_gemm is not None`` in the router GEMM ->
   ``NameError``. Where the name is missing we define it as ``None`` (the intended fallback); 0.17+
   defines it as ``None`` itself, and the bridge then patches nothing.
4. The pipeline schedules (token counter, ``torch.autocast("cuda")``), the optimizer wrappers
   (loss-scale and found-inf tensors), grad clipping (norm all-reduce buffer) and the local
   multi-tensor l2-norm fallback in ``megatron.core.utils`` allocate with the
   literal ``device="cuda"``. Each of those modules gets a torch namespace whose factories
   (zeros/ones/empty/tensor) map "cuda" to CPU and whose ``autocast("cuda")`` is a no-op.
5. ``torch.cuda.synchronize`` is called by p2p communication and ``record_stream`` on
   communication paths; megatron 0.19's ``start_grad_sync`` (``param_and_grad_buffer.py:632``) calls
   ``torch.cuda.current_stream()`` unconditionally and waits on CUDA-graph events only where a
   parameter carries one. Without CUDA the first two become no-ops and ``current_stream`` returns
   torch's CPU stream, whose ``wait_event``/``wait_stream`` do nothing.
6. ``clip_grad_by_total_norm_fp32`` asserts every grad is a ``torch.cuda.FloatTensor``; the
   optimizer module gets a version that scales fp32 CPU grads in place by the same coefficient.
7. Context parallelism: ``rope_utils.get_pos_emb_on_this_cp_rank`` builds its chunk index with
   ``pin_memory=True`` and ``.cuda()``. ``rotary_pos_embedding`` and ``yarn_rotary_pos_embedding``
   (which imported it by name) get the same load-balanced split from
   ``parallel/context_parallel.split_sequence`` on CPU.
8. The mixed-precision and distributed optimizers sort parameters by ``param.type()`` string
   (``optimizer/optimizer.py:671,690`` in ``Float16OptimizerWithFloat16Params.__init__``,
   ``optimizer/distrib_optimizer.py:361,420,582`` in ``DistributedOptimizer.__init__`` and the
   ``_build_model_and_main_param_groups`` it calls) and raise ``TypeError`` for anything but
   ``torch.cuda.{Float,Half,BFloat16}Tensor``. While those two constructors run, ``Tensor.type()``
   without arguments names a CPU tensor by its CUDA name (``torch.FloatTensor`` ->
   ``torch.cuda.FloatTensor``), so CPU parameters take the same fp32 / bf16 branches; outside the
   constructors ``Tensor.type`` is torch's own. gloo (torch 2.13) has ``reduce_scatter_tensor`` and
   ``all_gather_into_tensor`` (async and coalesced), so the gradient reduce-scatter and the parameter
   all-gather need no bridge.
9. The alltoall token dispatcher (``transformer/moe/token_dispatcher.py``,
   ``MoEAlltoAllTokenDispatcher``) copies its split sizes device-to-host on a side CUDA stream: its
   ``__init__`` creates the class-wide ``torch.cuda.Stream()`` (line 445) and
   ``_maybe_dtoh_and_synchronize`` (line 862) enters ``torch.cuda.stream``, records and waits on an
   event. On CPU the splits already live in host memory: the class gets a placeholder stream (so
   ``__init__`` creates none) and a ``_maybe_dtoh_and_synchronize`` that only converts the split
   sizes to numpy at the same point, which is what the GPU path hands to ``all_to_all_single``.
   gloo runs the all-to-all-v itself.
10. With expert tensor parallelism the alltoall dispatcher all-gathers a different number of rows
   from each ETP rank (``tensor_parallel/mappings.py:_gather_along_first_dim`` with
   ``output_split_sizes``, line 150: ``torch.distributed.all_gather`` into tensors of unequal
   sizes), which NCCL does and gloo refuses ("invalid tensor size"). The bridged function pads each
   rank's rows to the longest, all-gathers equal blocks and keeps each block's real rows; the even
   case is megatron's own. (The uneven reduce-scatter of the combine step runs on gloo as it is.)
11. Optimizer offload (``optimizer.cpu_offload``): megatron's ``HybridDeviceOptimizer``
   (``optimizer/cpu_offloading/hybrid_optimizer.py``) decides which parameters are device parameters
   by ``param.is_cuda`` (``_get_sub_optimizer_param_groups``, line 194) and makes their host copies
   with ``.cpu().pin_memory()``; its step runs the copies inside ``torch.cuda.stream(...)`` blocks.
   On CPU every parameter would count as already on the host, with no host copy in its maps (a
   ``KeyError`` at the first step). While that method runs, a CPU parameter counts as a device
   parameter and "pinning" marks the fresh host copy as the host's (it is a separate tensor: the
   clone megatron made), so the split, the host-side AdamW and the copy back are megatron's own
   code; the module's ``torch.cuda.stream`` becomes a no-op context and its streams and events ones
   that have finished (the copies are synchronous on CPU). Pinned host memory is off without a
   device (``policy/optimizer.py``).
12. Gated DeltaNet (``ssm/gated_delta_net.py``, megatron-core 0.16+; Qwen3-Next / Qwen3.5) imports
   ``chunk_gated_delta_rule`` and ``l2norm`` from flash-linear-attention (Triton: GPU) inside a ``try``
   and sets ``HAVE_FLA``; ``GatedDeltaNet.__init__`` raises ``ImportError`` without it, and its forward calls
   both (``l2norm`` even under ``deterministic_mode``, where megatron's own torch rule replaces FLA's). Where
   the module exists and FLA did not import, the bridge supplies those names from
   ``policy/models/gated_delta_rule.py`` (FLA's signatures, in torch) and sets ``HAVE_FLA``. Its other GPU
   import, ``causal_conv1d_fn``, megatron already replaces with ``nn.Conv1d`` when it is None. Checked on
   0.16.1 only; where a later version keeps the names elsewhere the bridge patches nothing (the layer then
   raises megatron's own ``ImportError``).
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch

_ABSENT = object()  # an attribute that did not exist before its bridge
_applied: list[tuple[object, str, object]] = []  # (owner, attribute, original), in patch order
_bridges_that_patched: list[str] = []  # the names of the bridges whose fact held, in order


def apply_cpu_bridges() -> str:
    """The one start-up call: without CUDA, every bridge below whose upstream fact holds on the installed
    megatron-core and torch, once per process; returns the line that says what was applied."""
    from importlib.metadata import version

    from gspo_megatron.core.known_warnings import filter_known_cpu_warnings
    from gspo_megatron.policy.parallel.device import cuda_kernels

    if cuda_kernels():
        return "[gspo] CUDA: megatron-core runs as it is (no CPU bridge applied)"
    enable_cpu_megatron()
    filter_known_cpu_warnings()  # megatron's CUDA-only advice, once per rank otherwise (core/known_warnings.py)
    names = ", ".join(_bridges_that_patched)
    return (
        f"[gspo] megatron-core {version('megatron-core')} without CUDA: {len(_bridges_that_patched)} CPU "
        f"bridges applied (policy/cpu_bridges.py): {names}"
    )


def enable_cpu_megatron() -> None:
    """Apply every bridge below once per process; a no-op where CUDA is available."""
    from gspo_megatron.policy.parallel.device import cuda_kernels

    if _applied or cuda_kernels():
        return
    _bridges_that_patched.clear()
    for bridge in BRIDGES:
        before = len(_applied)
        bridge()
        if len(_applied) > before:  # a bridge whose fact does not hold on this version patches nothing
            _bridges_that_patched.append(bridge.__name__.lstrip("_"))


def disable_cpu_megatron() -> None:
    """Undo every bridge: each patched attribute gets its original back (or is removed)."""
    while _applied:
        owner, name, original = _applied.pop()
        if original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def cpu_megatron_enabled() -> bool:
    return bool(_applied)


def _patch(owner: object, name: str, value: object) -> None:
    _applied.append((owner, name, vars(owner).get(name, _ABSENT) if hasattr(owner, "__dict__") else _ABSENT))
    setattr(owner, name, value)


def _current_device_is_cpu() -> None:
    _patch(torch.cuda, "current_device", lambda: torch.device("cpu"))


def _cuda_sync_noops() -> None:
    _patch(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    _patch(torch.cuda, "current_stream", torch.cpu.current_stream)  # its wait_event/wait_stream do nothing
    _patch(torch.Tensor, "record_stream", lambda self, stream: None)


def _define_missing_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        _patch(moe_utils, "te_general_gemm", None)


def _cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """megatron's tracker with CPU generator states standing in for CUDA ones."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            generator = torch.Generator()
            generator.manual_seed(seed)
            self.states_[name] = generator.get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    _patch(mrandom, "_CUDA_RNG_STATE_TRACKER", CpuRNGStatesTracker())
    _patch(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    # model_parallel_cuda_manual_seed re-creates the tracker only with force_reset; it also seeds
    # the (absent) CUDA generator, which torch queues lazily and never runs without CUDA.
    _original_initialize = mrandom.initialize_rng_tracker

    def initialize_rng_tracker(*args, force_reset: bool = False, **kwargs):
        if force_reset:
            mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
            mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    initialize_rng_tracker.__wrapped__ = _original_initialize  # type: ignore[attr-defined]
    _patch(mrandom, "initialize_rng_tracker", initialize_rng_tracker)


def _cuda_literals_to_cpu() -> None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import schedules

    for module in (schedules, optimizer, clip_grads, utils):
        _patch(module, "torch", _TorchWithoutCudaLiterals("torch"))


def _on_cpu(factory):
    def call(*args, device=None, **kwargs):
        if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
            device = "cpu"
        return factory(*args, device=device, **kwargs)

    return call


def _autocast(device_type, *args, **kwargs):
    if device_type == "cuda":
        return contextlib.nullcontext()
    return torch.autocast(device_type, *args, **kwargs)


_OVERRIDES = {
    "zeros": _on_cpu(torch.zeros),
    "ones": _on_cpu(torch.ones),
    "empty": _on_cpu(torch.empty),
    "tensor": _on_cpu(torch.tensor),
    "autocast": _autocast,
}


class _TorchWithoutCudaLiterals(types.ModuleType):
    """The torch namespace as seen by a megatron module whose code says ``device="cuda"``."""

    def __getattr__(self, item):
        if item in _OVERRIDES:
            return _OVERRIDES[item]
        return getattr(torch, item)


def _clip_grads_on_cpu() -> None:
    from megatron.core.optimizer import optimizer

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        # Same rule as megatron: scale by max_norm / (total_norm + 1e-6) when that is < 1.
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff >= 1.0:
            return
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        for param in parameters:
            grad = getattr(param, attr, None)
            if grad is not None:
                grad.detach().mul_(clip_coeff)

    _patch(optimizer, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_fp32)


def _rotary_cp_split_on_cpu() -> None:
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding

    from gspo_megatron.policy.parallel.context_parallel import split_sequence

    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        # chunks r and 2*cp-1-r of the rotary table, exactly megatron's index_select
        return split_sequence(pos_emb, cp_group.size(), cp_group.rank(), seq_dim=seq_dim)

    for module in (rotary_pos_embedding, yarn_rotary_pos_embedding):
        _patch(module, "get_pos_emb_on_this_cp_rank", get_pos_emb_on_this_cp_rank)


def _cpu_tensors_pass_optimizer_type_checks() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    for owner in (DistributedOptimizer, Float16OptimizerWithFloat16Params):
        _patch(owner, "__init__", _with_cuda_type_names(owner.__init__))


def _with_cuda_type_names(constructor):
    @functools.wraps(constructor)
    def construct(*args, **kwargs):
        with _cuda_type_names():
            return constructor(*args, **kwargs)

    return construct


@contextlib.contextmanager
def _cuda_type_names():
    """``tensor.type()`` -> 'torch.cuda.FloatTensor' for a CPU float32 tensor (and alike), for the
    duration of the block; ``tensor.type(dtype)`` (a conversion) is untouched."""
    torch_type = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):
        name = torch_type(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type_name  # type: ignore[method-assign]  # the bridge: patched, then restored
    try:
        yield
    finally:
        torch.Tensor.type = torch_type  # type: ignore[method-assign]


def _hybrid_optimizer_on_cpu() -> None:
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    split = hybrid_optimizer.HybridDeviceOptimizer._get_sub_optimizer_param_groups

    @functools.wraps(split)
    def split_on_cpu(self, offload_fraction):
        with _cpu_tensors_as_device_tensors():
            return split(self, offload_fraction)

    _patch(hybrid_optimizer.HybridDeviceOptimizer, "_get_sub_optimizer_param_groups", split_on_cpu)
    _patch(hybrid_optimizer, "torch", _TorchWithoutCudaStreams())


@contextlib.contextmanager
def _cpu_tensors_as_device_tensors():
    """For the block: ``pin_memory()`` marks the tensor as a host copy (and returns it), what
    ``detach``/``clone``/``float`` make of a host copy is one too (on a GPU machine it stays on the
    host: the fp32 copy the optimizer steps for an offloaded bf16 parameter), and ``tensor.is_cuda``
    is True for every CPU tensor but a marked one."""
    is_cuda, pin_memory = torch.Tensor.is_cuda, torch.Tensor.pin_memory
    derived = {name: getattr(torch.Tensor, name) for name in ("detach", "clone", "float")}

    def mark_host_copy(self, *args, **kwargs):
        self._gspo_host_copy = True
        return self

    def keeps_the_mark(method):
        @functools.wraps(method)
        def made_from(self, *args, **kwargs):
            out = method(self, *args, **kwargs)
            if getattr(self, "_gspo_host_copy", False):
                out._gspo_host_copy = True
            return out

        return made_from

    torch.Tensor.is_cuda = property(lambda self: not getattr(self, "_gspo_host_copy", False))  # type: ignore[assignment]
    torch.Tensor.pin_memory = mark_host_copy  # type: ignore[method-assign]
    for name, method in derived.items():
        setattr(torch.Tensor, name, keeps_the_mark(method))
    try:
        yield
    finally:
        torch.Tensor.is_cuda = is_cuda
        torch.Tensor.pin_memory = pin_memory  # type: ignore[method-assign]
        for name, method in derived.items():
            setattr(torch.Tensor, name, method)


class _SynchronousStream:
    """A stream on which every copy has already finished (CPU copies are synchronous): its waits and
    recorded events do nothing."""

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self) -> _SynchronousStream:
        return self

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _TorchWithoutCudaStreams:
    """``torch`` for the hybrid optimizer's module: ``torch.cuda.stream(s)`` is a no-op context and
    ``current_stream()`` / ``Stream()`` a ``_SynchronousStream``."""

    class _Cuda:
        def __getattr__(self, item):
            if item == "stream":
                return lambda stream=None: contextlib.nullcontext()
            if item in ("current_stream", "Stream"):
                return lambda *args, **kwargs: _SynchronousStream()
            return getattr(torch.cuda, item)

    cuda = _Cuda()

    def __getattr__(self, item):
        return getattr(torch, item)


class _NoStream:
    """Stands in for the alltoall dispatcher's DtoH stream on CPU; nothing may use it."""

    def __repr__(self) -> str:
        return "<no CUDA stream: policy/cpu_bridges.py bridge 9>"


def _split_sizes_as_numpy(value):
    return value.numpy() if torch.is_tensor(value) else value


def _alltoall_dispatcher_without_streams() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert=None):
        # megatron's rule without the side stream: at the DtoH point the EP/TP split sizes become
        # numpy arrays (num_out_tokens, tokens_per_expert and the per-expert counts stay tensors, as
        # on GPU); with tokens padded to capacity megatron skips this step and so do we.
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            self.input_splits = _split_sizes_as_numpy(self.input_splits)
            self.output_splits = _split_sizes_as_numpy(self.output_splits)
            self.output_splits_tp = _split_sizes_as_numpy(self.output_splits_tp)
        return tokens_per_expert

    _patch(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", _NoStream())
    _patch(MoEAlltoAllTokenDispatcher, "_maybe_dtoh_and_synchronize", _maybe_dtoh_and_synchronize)


def _uneven_all_gather_through_padding() -> None:
    from megatron.core.tensor_parallel import mappings

    original = mappings._gather_along_first_dim

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(size) for size in output_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        blocks = input_.new_empty((longest * len(sizes), *input_.shape[1:]))
        torch.distributed.all_gather_into_tensor(blocks, padded, group=group)
        return torch.cat([block[:size] for block, size in zip(blocks.split(longest), sizes, strict=True)])

    _patch(mappings, "_gather_along_first_dim", _gather_along_first_dim)


# Where megatron-core's gated DeltaNet binds what it imports from flash-linear-attention: 0.16-0.18 one module
# (chunk_gated_delta_rule, l2norm); 0.19 a package whose common.py imports them (and causal_conv1d) and whose
# gdn.py and __init__.py bind them again by name, so each binding is patched
GATED_DELTA_NET_MODULES = (
    "megatron.core.ssm.gated_delta_net",
    "megatron.core.ssm.gated_delta_net.common",
    "megatron.core.ssm.gated_delta_net.gdn",
)
GATED_DELTA_NET_FLA_NAMES = ("chunk_gated_delta_rule", "l2norm", "causal_conv1d")  # the union over versions


def gated_delta_net_modules() -> list:
    """The importable modules of ``GATED_DELTA_NET_MODULES`` (none before megatron-core 0.16)."""
    import importlib

    found = []
    for name in GATED_DELTA_NET_MODULES:
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            continue
    return found


def _gated_delta_net_without_fla() -> None:
    modules = gated_delta_net_modules()
    if not modules or getattr(modules[0], "HAVE_FLA", True):  # none (megatron < 0.16), or FLA is installed
        return
    from gspo_megatron.policy.models import gated_delta_rule

    for module in modules:
        imported = names_imported_from_fla(module)  # its source parsed once
        for name in GATED_DELTA_NET_FLA_NAMES:
            # a name the module binds to None (FLA absent) or, in 0.16's module, never binds (l2norm)
            if getattr(module, name, None) is None and (hasattr(module, name) or name in imported):
                _patch(module, name, getattr(gated_delta_rule, name))
        if hasattr(module, "HAVE_FLA"):
            _patch(module, "HAVE_FLA", True)


def names_imported_from_fla(module) -> set[str]:
    """The names ``module``'s source imports from flash-linear-attention (``from fla... import ...``)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(module))
    return {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fla"
        for alias in node.names
    }


BRIDGES = (
    _current_device_is_cpu,
    _cuda_sync_noops,
    _define_missing_te_general_gemm,
    _cpu_rng_tracker,
    _cuda_literals_to_cpu,
    _clip_grads_on_cpu,
    _rotary_cp_split_on_cpu,
    _cpu_tensors_pass_optimizer_type_checks,
    _alltoall_dispatcher_without_streams,
    _uneven_all_gather_through_padding,
    _hybrid_optimizer_on_cpu,
    _gated_delta_net_without_fla,
)
