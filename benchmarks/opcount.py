"""The ops a training step dispatches, counted by phase, and the ops that make the host wait.

On a GPU this model is launch-bound: every aten op a step dispatches is at least one kernel launch
(several microseconds of host time in eager mode: docs/performance.md, "Ops per training step"), so
the count is the step's speed limit whatever the arithmetic. `OpCounter` counts them (a
TorchDispatchMode: every op that reaches a kernel, forward and backward, views excluded since they
launch nothing); `step_phases` labels them loader / forward / loss / backward / optimizer /
bookkeeping with module and optimizer hooks and a wrapper around `Tensor.backward`, so nothing here
depends on how `Trainer.train_step` is split.

`SyncGuard` refuses, inside a training step, every op that makes the host wait for the device:
`.item()` and its kin, and the ops whose output shape depends on the data (SYNC_OPS,
`sync_reason` and `sync_kind`, for any tool that checks a step), naming the project's line that
called the op (`project_line`, installed packages excluded); on CUDA it also turns on
`torch.cuda.set_sync_debug_mode("error")`, which catches the rest (blocking copies,
cudaStreamSynchronize). `count_epoch` and `guard_epoch` drive `Trainer.train_epoch` over given
batches with one or the other, marking each step's boundary.
"""

from __future__ import annotations

import contextlib
import sysconfig
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
ROOT = Path(__file__).resolve().parents[1]  # the repository's root (benchmarks/..)

PHASES = ("loader", "forward", "loss", "backward", "optimizer", "bookkeeping")

# Ops that read a device value on the host, or whose output size depends on the data (the host
# must wait for the device to know it), by overload packet. Conditional ones are in sync_kind.
SYNC_OPS: dict[object, str] = {
    aten._local_scalar_dense: "a tensor read as a Python number (.item(), float(), int(), bool())",
    aten.item: "a tensor read as a Python number (.item())",
    aten.is_nonzero: "a tensor used as a condition (if tensor:, bool(tensor))",
    aten.equal: "torch.equal (a Python bool from two tensors)",
    aten.allclose: "torch.allclose (a Python bool from two tensors)",
    aten.nonzero: "nonzero (its output size depends on the data)",
    aten.nonzero_numpy: "nonzero(as_tuple=True) (its output size depends on the data)",
    aten.argwhere: "argwhere (its output size depends on the data)",
    aten.masked_select: "masked_select (its output size depends on the data)",
    aten._unique: "unique (its output size depends on the data)",
    aten._unique2: "unique (its output size depends on the data)",
    aten.unique_dim: "unique(dim=...) (its output size depends on the data)",
    aten.unique_consecutive: "unique_consecutive (its output size depends on the data)",
    aten.unique_dim_consecutive: "unique_consecutive (its output size depends on the data)",
    aten.bincount: "bincount (its output size depends on the largest value)",
    aten.lift_fresh: "a tensor built from Python data (torch.tensor): a blocking host copy",
    aten.lift_fresh_copy: "a tensor built from Python data (torch.tensor): a blocking host copy",
}
# Indexing ops that sync when an index is a boolean mask (the selected count is data).
_MASK_INDEXED = (aten.index, aten._unsafe_index, aten.index_put, aten.index_put_)
_MASK_INDEXED += (aten._index_put_impl_,)
# Copies that block the host unless asked not to: device -> host always waits for the device.
_COPIES = (aten._to_copy, aten.copy_)


def tensors_in(tree) -> list[torch.Tensor]:
    """The tensors in a nest of lists, tuples and dicts (an op's args: indices may be a list)."""
    if torch.is_tensor(tree):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for x in tree for t in tensors_in(x)]
    if isinstance(tree, dict):
        return [t for x in tree.values() for t in tensors_in(x)]
    return []


def _classify(func, args: tuple, kwargs: dict) -> tuple[str, str] | None:
    """(kind, reason) for an aten op that makes the host wait for the device, else None."""
    packet = func.overloadpacket
    name = packet.__name__
    if packet in SYNC_OPS:
        return name, SYNC_OPS[packet]
    if packet is aten.repeat_interleave:
        if func is aten.repeat_interleave.Tensor:
            repeats = args[0]
        else:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if torch.is_tensor(repeats) and kwargs.get("output_size") is None:
            return (
                "repeat_interleave without output_size",
                "repeat_interleave with tensor repeats and no output_size (the output size is "
                "their sum)",
            )
    if packet in _MASK_INDEXED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(t.dtype in (torch.bool, torch.uint8) for t in tensors_in(indices)):
            return (
                f"{name} with a boolean mask",
                "indexing with a boolean mask (the selected count is data)",
            )
    if packet is aten.histc:
        low = args[2] if len(args) > 2 else kwargs.get("min", 0)
        high = args[3] if len(args) > 3 else kwargs.get("max", 0)
        if low == high:
            return "histc without a range", "histc without a range (it reads the data's range)"
    if packet in _COPIES and args and torch.is_tensor(args[0]):
        source = args[0] if packet is not aten.copy_ else args[1]
        target = kwargs.get("device") if packet is not aten.copy_ else args[0].device
        non_blocking = kwargs.get("non_blocking", False)
        if packet is aten.copy_ and len(args) > 2:
            non_blocking = args[2]
        if (
            target is not None
            and torch.device(target).type == "cpu"
            and source.device.type != "cpu"
            and not non_blocking
        ):
            return f"{name} to the host", "a copy from the device to the host"
    return None


def sync_kind(func, args: tuple, kwargs: dict) -> str | None:
    """A short name for what makes the aten op `func` called with (args, kwargs) wait for the
    device ("nonzero", "index with a boolean mask", "repeat_interleave without output_size",
    ...), or None: sync_reason's cases, for a tool that lists the syncs it sees. Whether the op
    reads a device tensor is the caller's to check (on a CPU twin every tensor is a host one)."""
    found = _classify(func, args, kwargs)
    return found[0] if found else None


def sync_reason(func, args: tuple, kwargs: dict) -> str | None:
    """Why the aten op `func` called with (args, kwargs) makes the host wait for the device, or
    None. Covers the ops that read a value (`.item()`, `bool()`, torch.equal), those whose output
    shape is data (nonzero, masked_select, boolean-mask indexing, unique, repeat_interleave
    without output_size, bincount, histc with min == max), tensors from Python data, and copies
    from a non-CPU device to the host."""
    found = _classify(func, args, kwargs)
    return found[1] if found else None


class HostSyncError(AssertionError):
    """An op that makes the host wait for the device ran inside a guarded training step."""


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active, by `phase` (a label the caller moves), and
    by (phase, op) in `by_op`. Views (view, reshape's view, slicing, transpose, ...) are not
    counted: they launch no kernel. Ops that an autograd Function's forward or backward runs are
    counted like any other, and so are ops on host tensors (the loader's phase)."""

    def __init__(self):
        super().__init__()
        self.phase = "bookkeeping"
        self.counts: Counter[str] = Counter()
        self.by_op: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.counts[self.phase] += 1
            self.by_op[(self.phase, str(func.overloadpacket))] += 1
        return func(*args, **(kwargs or {}))

    def total(self) -> int:
        return sum(self.counts.values())


class OpRecorder(TorchDispatchMode):
    """Records every aten op dispatched while active, forward and backward, as (op name, its
    arguments with each tensor written as (shape, dtype) and everything else as it is): two
    calls that record the same list dispatch the same kernels in the same shapes, the condition
    for replaying them as one CUDA graph (gears/train/graph_step.py). Profiler markers (the
    optimizer's record_function) launch nothing and are left out."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    def _arg(self, value):
        if torch.is_tensor(value):
            return ("tensor", tuple(value.shape), str(value.dtype))
        if isinstance(value, (list, tuple)):
            return tuple(self._arg(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, self._arg(v)) for k, v in value.items())
        return repr(value)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not str(func).startswith("profiler."):
            self.ops.append((str(func), self._arg(args), self._arg(kwargs)))
        return func(*args, **kwargs)


class HostTensorWatch(TorchDispatchMode):
    """Every op, forward and backward, that reads a tensor of one or more dimensions that is
    neither device data given up front (`device`: the plan, the parameters, gradients,
    optimizer state, buffers and accumulators, by storage) nor the output of an earlier op
    while active: a tensor that came from the host (`found`, with the project line that called
    the op). A step that reads only device data reads none."""

    def __init__(self, device: Iterable[torch.Tensor]):
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in device}
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tensors_in((args, kwargs)):
            if t.dim() > 0 and t.untyped_storage().data_ptr() not in self.known:
                self.found.append(f"{func} {tuple(t.shape)} at {project_line()}")
        out = func(*args, **kwargs)
        self.known.update(t.untyped_storage().data_ptr() for t in tensors_in(out))
        return out


_HOST_READERS = ("tolist", "numpy", "__array__")


class SyncGuard(TorchDispatchMode):
    """Raises HostSyncError at any op that makes the host wait for the device (sync_reason),
    naming the op, the reason and the line of project code that called it. Also refuses
    `Tensor.tolist()`, `.numpy()` and numpy conversion, which read a CPU tensor without any op
    (on a GPU tensor they copy to the host and wait). `allowed()` lifts the refusal for a block
    that runs on the host by design (the loader's gather, the row layout from host counts) or
    syncs at an interval (the engine's stop / non-finite check). On CUDA, also
    `torch.cuda.set_sync_debug_mode("error")` while active."""

    def __init__(self, cuda: bool | None = None):
        super().__init__()
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.armed = True  # refusing while armed and not paused
        self.paused = 0
        self.refused: list[str] = []
        self._saved: dict = {}
        self._cuda_mode = None

    @contextlib.contextmanager
    def allowed(self):
        """A block where syncs are permitted (both the op refusal and CUDA's debug mode)."""
        self.paused += 1
        cuda_mode = None
        if self.cuda:
            cuda_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
        try:
            yield
        finally:
            self.paused -= 1
            if cuda_mode is not None:
                torch.cuda.set_sync_debug_mode(cuda_mode)

    def _refuse(self, what: str) -> None:
        where = project_line()
        message = f"host sync in the training step: {what}, at {where}"
        self.refused.append(message)
        raise HostSyncError(message)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.armed and not self.paused:
            reason = sync_reason(func, args, kwargs)
            if reason is not None:
                self._refuse(f"{func} ({reason})")
        return func(*args, **kwargs)

    def __enter__(self):
        for name in _HOST_READERS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._reader(name, original))
        if self.cuda:
            self._cuda_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, original in self._saved.items():
                setattr(torch.Tensor, name, original)
            self._saved = {}
            if self._cuda_mode is not None:
                torch.cuda.set_sync_debug_mode(self._cuda_mode)

    def _reader(self, name: str, original: Callable) -> Callable:
        guard = self

        def read(tensor, *args, **kwargs):
            if guard.armed and not guard.paused:
                guard._refuse(f"Tensor.{name}() (a host read of the tensor's values)")
            return original(tensor, *args, **kwargs)

        return read


def project_line(skip: Iterable[str | Path] = ()) -> str:
    """The innermost line of the project's code on the stack, as "path:line (function: code)":
    a file under the repository's root that is not in an installed package (a virtual
    environment may live inside the clone, as CI's does: torch's frames are not the project's),
    not this module and not one of `skip`. Outside the project (gears installed as a package, a
    user's script): the innermost frame that is neither installed nor the standard library's."""
    skipped = {Path(__file__).resolve(), *(Path(p).resolve() for p in skip)}
    stdlib = {Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib")}
    outside = None
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path in skipped or "site-packages" in path.parts or "dist-packages" in path.parts:
            continue
        code = f"{frame.lineno} ({frame.name}: {frame.line})"
        if ROOT in path.parents:
            return f"{path.relative_to(ROOT)}:{code}"
        if outside is None and path.is_file() and not any(p in path.parents for p in stdlib):
            outside = f"{path}:{code}"
    return outside or "unknown"


@contextlib.contextmanager
def step_phases(trainer, mark: Callable[[str], None]) -> Iterator[None]:
    """Calls mark(phase) where a training step's phase changes, with hooks only: "forward" at
    the network's forward pre-hook and "loss" at its forward hook (on trainer.model, the
    outermost wrapper: DDP or the compiled module), "backward" when Tensor.backward starts,
    "optimizer" when it returns (unscaling, clipping, the step), "bookkeeping" at the
    optimizer's step post-hook (zero_grad, the scaler's update, the engine's counters and
    checks). What a step runs before its forward (the row layout's gather) counts as the
    bookkeeping of the step."""

    def to(phase):
        def hook(*_args, **_kwargs):
            mark(phase)

        return hook

    original_backward = torch.Tensor.backward

    def backward(tensor, *args, **kwargs):
        mark("backward")
        try:
            return original_backward(tensor, *args, **kwargs)
        finally:
            mark("optimizer")

    handles = [
        trainer.model.register_forward_pre_hook(to("forward")),
        trainer.model.register_forward_hook(to("loss")),
        trainer.opt.register_step_post_hook(to("bookkeeping")),
    ]
    torch.Tensor.backward = backward
    try:
        yield
    finally:
        torch.Tensor.backward = original_backward
        for handle in handles:
            handle.remove()


class StepLoader:
    """A stand-in for the training loader over fixed batch requests: `gather(request)` makes each
    batch when the engine asks for it (the loader's work, timed and counted where it happens),
    `on_batch(i)` runs just before, marking step i's start. Has what Trainer.train_epoch uses:
    set_epoch, len, iteration."""

    def __init__(self, requests: list, gather: Callable, on_batch: Callable[[int], None]):
        self.requests, self.gather, self.on_batch = requests, gather, on_batch

    def set_epoch(self, epoch: int) -> None:
        pass

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self):
        for i, request in enumerate(self.requests):
            self.on_batch(i)
            yield self.gather(request)
        self.on_batch(len(self.requests))


def count_epoch(
    trainer, requests: list, gather: Callable, epoch: int = 1, method: str = "dispatch"
) -> list[Counter]:
    """Trainer.train_epoch over the batches gather(request) for each request, counting every
    op: -> one Counter per step (phase -> ops), step i from the gather of batch i to the gather
    of batch i + 1 (the last step ends where the loader runs out, before the epoch's end). The
    loader phase holds the gather and Trainer.row_layout (host counts); the rest as step_phases.
    The first step of an epoch also carries the epoch's start (and of a run, the optimizer's
    state creation): steady-state counts are the steps after it.

    method "dispatch": OpCounter (every aten op that reaches a kernel, views excluded).
    "profiler": for torch.compile'd networks, whose graphs run eagerly under a
    TorchDispatchMode: torch.profiler's top-level aten ops (views excluded) plus the kernels
    Inductor generated (set torch._inductor.config.cpp.enable_kernel_profile before compiling
    for the CPU's to be recorded; Triton kernels are recorded by name)."""
    if method == "profiler":
        return _profiled_epoch(trainer, requests, gather, epoch)
    counter = OpCounter()
    per_step: list[Counter] = []
    marks = [Counter()]

    def set_phase(phase: str) -> None:
        counter.phase = phase

    def on_batch(i: int) -> None:
        if i > 0:
            per_step.append(counter.counts - marks[0])
        marks[0] = Counter(counter.counts)
        counter.phase = "loader"

    with counter, _loader_phase(trainer, set_phase, lambda: counter.phase):
        _run_epoch(trainer, requests, gather, epoch, set_phase, on_batch)
    return per_step


@contextlib.contextmanager
def _loader_phase(trainer, set_phase: Callable[[str], None], phase: Callable[[], str]):
    """Trainer.row_layout (host counts) in the loader's phase."""
    row_layout = trainer.row_layout

    def layout(counts):
        before = phase()
        set_phase("loader")
        try:
            return row_layout(counts)
        finally:
            set_phase(before)

    trainer.row_layout = layout
    try:
        yield
    finally:
        del trainer.row_layout  # the instance attribute: the method shows through again


def _run_epoch(trainer, requests, gather, epoch, set_phase, on_batch) -> None:
    def gather_batch(request):
        set_phase("loader")
        batch = gather(request)
        set_phase("bookkeeping")
        return batch

    with step_phases(trainer, set_phase):
        trainer.train_epoch(StepLoader(requests, gather_batch, on_batch), epoch, progress=False)


_MARK = "opcount:"
_KERNEL_PREFIXES = ("triton_",)


def _profiled_epoch(trainer, requests: list, gather: Callable, epoch: int) -> list[Counter]:
    """count_epoch's "profiler" method: phase and step changes become instant profiler ranges,
    and every counted event takes the phase and step of the last mark before it starts (the
    autograd engine's thread included)."""
    state = {"phase": "loader"}

    def set_phase(phase: str) -> None:
        state["phase"] = phase
        with torch.profiler.record_function(f"{_MARK}phase:{phase}"):
            pass

    def on_batch(i: int) -> None:
        with torch.profiler.record_function(f"{_MARK}step:{i}"):
            pass
        set_phase("loader")

    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        with _loader_phase(trainer, set_phase, lambda: state["phase"]):
            _run_epoch(trainer, requests, gather, epoch, set_phase, on_batch)
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    per_step = [Counter() for _ in requests]
    step, phase = -1, "loader"
    for event in events:
        name = event.name
        if name.startswith(_MARK):
            kind, value = name[len(_MARK) :].split(":")
            step, phase = (int(value), "loader") if kind == "step" else (step, value)
        elif 0 <= step < len(requests) and _counted(event):
            per_step[step][phase] += 1
    return per_step


def _counted(event) -> bool:
    """A kernel Inductor generated, or an aten op called by no other aten op that is not a
    view."""
    name = event.name
    if "cpp_fused" in name or name.startswith(_KERNEL_PREFIXES):
        return True
    if not name.startswith("aten::"):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    packet = getattr(aten, name[len("aten::") :], None)
    return packet is None or not any(getattr(packet, o).is_view for o in packet.overloads())


def guard_epoch(
    trainer, batches: Iterable, epoch: int = 1, guard: SyncGuard | None = None
) -> SyncGuard:
    """Trainer.train_epoch over ready-made batches with every step under a SyncGuard (raising
    HostSyncError at the first sync). The loader's gather runs before (on the host, numpy: not
    part of the device step), Trainer.row_layout (host counts) and Trainer.check_step (the
    engine's interval check, which syncs by design) run allowed; batch.to(device), the forward,
    loss, backward, clipping, optimizer step and the engine's per-step bookkeeping are
    guarded, from the first batch until the loader runs out (the epoch's end syncs by design).
    Set trainer.check_every as on a GPU (the logging interval) to leave the check out of the
    steps."""
    guard = guard or SyncGuard()
    batches = list(batches)

    def on_batch(i: int) -> None:
        guard.armed = i < len(batches)  # the steps start at the first batch; the end syncs

    row_layout, check_step = trainer.row_layout, trainer.check_step

    def layout(counts):
        with guard.allowed():
            return row_layout(counts)

    def check(*args, **kwargs):
        with guard.allowed():
            return check_step(*args, **kwargs)

    trainer.row_layout, trainer.check_step = layout, check
    guard.armed = False  # until the first batch
    try:
        with guard:
            trainer.train_epoch(StepLoader(batches, lambda b: b, on_batch), epoch, progress=False)
    finally:
        del trainer.row_layout, trainer.check_step
        guard.armed = True
    return guard
