"""The simulated accelerator: a stand-in GPU whose tensors are fake (shapes, no memory).

The scale simulator runs the real job's code on a device the code treats exactly like a
GPU: ``torch.device("simgpu", 0)``, PrivateUse1 renamed, with a Python device module (no-op
streams and events, so FSDP2's stream logic runs) and torch's fake process group
registered for it. Every tensor created on it, moved to it, or computed from one of its
tensors is a ``FakeTensor``: shapes, dtypes, strides and storages are real, memory is not.
Host (CPU) tensors stay real, so host-side code (tokenising, packing, CP plans, document
bounds read from host ``cu_seqlens``) runs for real with real values.

What differs from CUDA, and how the simulator treats it:

* reading a device tensor on the host (``.item()``, ``.tolist()``, ``bool(t)``, a
  data-dependent shape) raises ``DataDependentOutputException``: its value is unknown. The
  GPU hot path must not sync; the few legitimate reads (once-per-step metrics) go through
  a seam the simulator overrides (``RealRun.host_values``, ``simulate.Simulation``'s);
* ``torch.autograd`` on fake *cuda* tensors aborts a CPU-only torch build, which is why a
  renamed PrivateUse1 device stands in for CUDA rather than ``cuda`` itself;
* kernels run their meta (shape) implementations: ``aten._flash_attention_forward`` has
  one, so the CUDA attention path's shapes and temporaries are what the simulator sees;
* ``torch.tensor(data, device=simgpu)`` (which bypasses the dispatcher) is built on the host
  and moved; the one host read inside torch's pipeline schedules (their first step's vote on
  static shapes) is answered "static", which the project's stages are;
* collectives go to torch's fake process group: they complete at once and move nothing.
  A collective handed a tensor that is not on the simulated device is recorded, with the
  caller's file and line (NCCL has no CPU path).

Use ``with SimulatedDevice():`` (the dispatch mode) and build on ``sim_device()``. Registration is once per process (PrivateUse1 can be renamed once).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from titan_cotrain.simulate.memory import code_site

__all__ = ["SIM_BACKEND", "SIM_DEVICE_TYPE", "SimulatedDevice", "register_simulated_device", "sim_device"]

SIM_DEVICE_TYPE = "simgpu"
SIM_BACKEND = "simfake"


class _Event:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    """A stream on which everything has already happened (fake kernels are instant)."""

    def __init__(self, *args, **kwargs) -> None:
        self.device = None

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class _DeviceModule:
    """What ``torch.simgpu`` answers: one device, always available, no-op streams."""

    Stream = _Stream
    Event = _Event
    _stream = _Stream()

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device) -> None:
        pass

    @classmethod
    def current_stream(cls, device=None) -> _Stream:
        return cls._stream

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def manual_seed(seed) -> None:
        pass

    @staticmethod
    def manual_seed_all(seed) -> None:
        pass

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        return torch.zeros(8, dtype=torch.uint8)

    @staticmethod
    def set_rng_state(state, device=None) -> None:
        pass


_registered = False


def register_simulated_device() -> None:
    """Rename PrivateUse1 to ``simgpu`` with a Python device module and register torch's fake
    process group for it (backend ``simfake``). Idempotent; once per process."""
    global _registered
    if _registered:
        return
    from torch._C._distributed_c10d import FakeProcessGroup
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(rename=SIM_DEVICE_TYPE, backend_module=_DeviceModule())

    def create(common_opts, backend_opts):
        return FakeProcessGroup._create_internal(common_opts.group_rank, common_opts.group_size, backend_opts)

    dist.Backend.register_backend(SIM_BACKEND, create, extended_api=True, devices=["cpu", SIM_DEVICE_TYPE])
    _registered = True


def sim_device() -> torch.device:
    register_simulated_device()
    return torch.device(SIM_DEVICE_TYPE, 0)


_PIPELINING = "torch/distributed/pipelining/"


def _called_from(path: str) -> bool:
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return False
        if path in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _targets_sim(device) -> bool:
    return device is not None and torch.device(device).type == SIM_DEVICE_TYPE


_FROM_DATA = ("tensor", "as_tensor", "asarray")


def _host_then_device(make):
    @functools.wraps(make)
    def build(*args, **kwargs):
        if _targets_sim(kwargs.get("device")):
            device = kwargs.pop("device")
            return make(*args, **kwargs).to(device)
        return make(*args, **kwargs)

    return build


class _HostThenDevice:
    """``torch.tensor(data, device=simgpu)`` (and ``as_tensor``, ``asarray``) builds on the host,
    then moves: tensor construction from Python data bypasses the dispatcher, so no dispatch mode
    can fake it. The three are wrapped while the device is in use, not watched by a
    ``TorchFunctionMode``: a function mode sees every torch call and costs each a trip through
    Python, the simulator's largest overhead. Re-entrant (the ring's ops enter the device again)."""

    def __init__(self) -> None:
        self._depth = 0

    def __enter__(self):
        if self._depth == 0:
            for name in _FROM_DATA:
                setattr(torch, name, _host_then_device(getattr(torch, name)))
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            for name in _FROM_DATA:
                setattr(torch, name, getattr(torch, name).__wrapped__)


@functools.cache
def _ring_ops() -> dict:
    """The CP ring's custom ops -> the Python code they run."""
    from titan_cotrain.ops.ring_attention import RING_OP_IMPLEMENTATIONS

    return {getattr(torch.ops.titan_cotrain, name).default: fn for name, fn in RING_OP_IMPLEMENTATIONS.items()}


@functools.cache
def _kernel_kind(func) -> str:
    """``func``'s flash-kernel kind: ``"varlen"`` (named by its arguments), a counted name, or ''
    (found once per op: ``_attention_kernel`` runs for every op)."""
    if func.namespace == "torch_attn" and func.name().startswith("torch_attn::_varlen_attn") and "backward" not in func.name():
        return "varlen"
    if func is torch.ops.aten._flash_attention_forward.default:
        return "flash forward (private)"
    if func is torch.ops.aten._flash_attention_backward.default:
        return "flash backward"
    return ""


def _attention_kernel(func, args, kwargs) -> str | None:
    """The name ``SimulatedDevice.attention_kernels`` counts ``func`` under, if a flash kernel."""
    kind = _kernel_kind(func)
    if kind == "varlen":
        block_table = kwargs.get("block_table", args[12] if len(args) > 12 else None)
        return "varlen_attn paged" if block_table is not None else "varlen_attn"
    return kind or None


class SimulatedDevice(TorchDispatchMode):
    """The dispatch mode behind ``simgpu``: ops that touch a fake tensor or create one on the
    simulated device run under one ``FakeTensorMode``; everything else runs for real.

    ``on_alloc(tensor)`` (optional) sees every tensor an op on the device returns (the
    memory tracker uses it). ``host_collectives`` lists the collectives that were handed a
    host tensor, as ``"op at file:line"``. ``attention_kernels`` counts the flash kernels the
    code reached (their fake implementations ran): ``varlen_attn``, ``varlen_attn paged``
    (with a block table: the engine's decoding) and ``flash backward``.
    """

    def __init__(self, on_alloc=None) -> None:
        super().__init__()
        register_simulated_device()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.on_alloc = on_alloc
        self.host_collectives: list[str] = []
        self.attention_kernels: collections.Counter[str] = collections.Counter()
        self._host_first = _HostThenDevice()

    def __enter__(self):
        self._host_first.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._host_first.__exit__(*exc)

    def _to_fake(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, FakeTensor):
            return t
        if t.device.type == "meta":
            # A fresh fake meta tensor: converting the meta tensor itself would attach a
            # weakref to it, and modules swap meta parameters when they are materialised.
            with self.fake:
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return self.fake.from_tensor(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t not in (torch.Tensor, FakeTensor, torch.nn.Parameter) for t in types):
            return NotImplemented  # tensor subclasses (DTensor) unwrap first, then come back
        if func in _ring_ops():
            with self:  # the ring's implementation, on fake tensors: its buffers and messages count
                return _ring_ops()[func](*args, **kwargs)
        leaves = tree_leaves((args, kwargs))
        namespace = func.namespace
        if namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            host = [t for t in leaves if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)
                    and t.device.type == "cpu" and t.numel() > 0]
            if host:
                self.host_collectives.append(f"{func} on a host tensor at {code_site()}")
        kernel = _attention_kernel(func, args, kwargs)
        if kernel is not None:
            self.attention_kernels[kernel] += 1
        fake = any(isinstance(t, FakeTensor) for t in leaves)
        if fake and func is torch.ops.aten._local_scalar_dense.default and _called_from(_PIPELINING):
            # torch's pipeline schedules read one device int at their first step: the stages'
            # vote on static shapes. Ours declare their shapes, so the answer is "static".
            return 1
        if not fake and not _targets_sim(kwargs.get("device")):
            return func(*args, **kwargs)
        if any(isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) for t in leaves):
            args, kwargs = tree_map_only(torch.Tensor, self._to_fake, (args, kwargs))
        with self.fake:
            out = func(*args, **kwargs)
        if self.on_alloc is not None:
            for t in tree_leaves(out):
                if isinstance(t, FakeTensor) and t.device.type == SIM_DEVICE_TYPE:
                    self.on_alloc(t)
        return out
