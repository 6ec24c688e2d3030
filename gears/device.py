"""Where tensors live: `to_device` places them, `to_host` is the one way back, and a CPU stand-in
for GPU memory (GEARS_DEVICE_STANDIN=1) makes every other host read fail in CI.

A GPU run differs from its CPU twin in one way the tests cannot otherwise see: a tensor on the
GPU cannot become a numpy array, and every `.item()`, `float()`, `.tolist()` or `if tensor:`
on it waits for the GPU. With GEARS_DEVICE_STANDIN=1 on a CPU run, the tensors the code places
on the device (the expression matrix, batches, masks, the model's parameters and buffers via
`module_to_device`, everything computed from them) become `DeviceTensor`s: ordinary CPU tensors
for every torch op, which refuse to be read on the host and name the call site. Code that needs
values on the host calls `to_host(tensor)`.
"""

from __future__ import annotations

import copy
import os
import traceback

import torch
from torch import nn

STANDIN_ENV = "GEARS_DEVICE_STANDIN"


def standin_enabled() -> bool:
    return os.environ.get(STANDIN_ENV, "0") == "1"


def holds_device_memory(device: torch.device | str) -> bool:
    """Whether tensors placed on `device` live apart from the host: a GPU, or the CPU while the
    stand-in is on (then the code takes its GPU data paths on the CPU)."""
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and standin_enabled())


def to_device(tensor: torch.Tensor, device: torch.device | str, non_blocking: bool = False):
    """`tensor.to(device)`; with the stand-in on and a CPU device, a DeviceTensor."""
    out = tensor.to(device, non_blocking=non_blocking)
    if torch.device(device).type == "cpu" and standin_enabled():
        return out.as_subclass(DeviceTensor)
    return out


def module_to_device(module: nn.Module, device: torch.device | str) -> nn.Module:
    """`module.to(device)`; with the stand-in on and a CPU device, every parameter and buffer
    becomes a DeviceTensor too (in place: the same module, its parameters still parameters, their
    gradients DeviceTensors once accumulated), so host reads of weights, gradients, optimizer
    states and batch-norm statistics fail as on a GPU.
    Call it before building an optimizer over the parameters (they are new tensors)."""
    module = module.to(device)
    if torch.device(device).type != "cpu" or not standin_enabled():
        return module
    placed: dict[int, torch.Tensor] = {}  # a tensor shared by two modules stays shared
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None and not isinstance(param, DeviceTensor):
                if id(param) not in placed:
                    data = param.detach().as_subclass(DeviceTensor)
                    new = nn.Parameter(data, param.requires_grad)
                    if new.requires_grad:  # autograd's engine makes plain gradients
                        new.register_post_accumulate_grad_hook(_gradient_to_device)
                    placed[id(param)] = new
                owner._parameters[name] = placed[id(param)]
        for name, buffer in owner._buffers.items():
            if buffer is not None and not isinstance(buffer, DeviceTensor):
                placed.setdefault(id(buffer), buffer.as_subclass(DeviceTensor))
                owner._buffers[name] = placed[id(buffer)]
    return module


def _gradient_to_device(param: torch.Tensor) -> None:
    """A stand-in parameter's gradient as a DeviceTensor (the same memory: accumulation and the
    optimizer keep updating it in place)."""
    if param.grad is not None and not isinstance(param.grad, DeviceTensor):
        param.grad = param.grad.as_subclass(DeviceTensor)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """The host copy of a (device) tensor, detached: the one legitimate way to read a device
    tensor's values (then `.numpy()`, `.tolist()`, `.item()`). A sync on a GPU: keep it out of
    the per-step path except at logging and checking intervals."""
    out = tensor.detach().cpu()
    return out.as_subclass(torch.Tensor) if isinstance(out, DeviceTensor) else out


class HostReadError(RuntimeError):
    """A device tensor was read on the host without `to_host` (GEARS_DEVICE_STANDIN=1)."""


def _call_site() -> str:
    """The innermost frame outside torch and this module: the line that read the tensor."""
    here = os.path.abspath(__file__)
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = os.path.abspath(frame.filename)
        if path != here and f"{os.sep}torch{os.sep}" not in path:
            return f"{frame.filename}:{frame.lineno} ({frame.name}: {frame.line})"
    return "unknown"


def _refuse(what: str):
    raise HostReadError(
        f"{what} of a device tensor at {_call_site()}: on a GPU this fails or waits for the "
        "device. Copy it with gears.device.to_host(tensor) first (GEARS_DEVICE_STANDIN=1 makes "
        "CPU runs refuse such reads)"
    )


_REFUSED = {
    torch.Tensor.numpy: "Tensor.numpy()",
    torch.Tensor.tolist: "Tensor.tolist()",
    torch.Tensor.item: "Tensor.item()",
    torch.Tensor.__float__: "float()",
    torch.Tensor.__int__: "int()",
    torch.Tensor.__bool__: "bool() (an `if`/`and`/`or` on a tensor)",
    torch.Tensor.__index__: "use as a Python index",
    torch.Tensor.__array__: "numpy conversion (np.asarray)",
    torch.Tensor.pin_memory: "pin_memory()",
}


class DeviceTensor(torch.Tensor):
    """A CPU tensor standing in for one in GPU memory: torch ops keep it a DeviceTensor (so the
    model's outputs, losses and metrics computed from device data are ones too), host reads
    raise HostReadError."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _REFUSED:
            _refuse(_REFUSED[func])
        return super().__torch_function__(func, types, args, kwargs or {})

    def __array__(self, *args, **kwargs):
        _refuse("numpy conversion (np.asarray)")

    def __deepcopy__(self, memo):
        # torch's default deep copy builds the copy with new_empty() under torch-function
        # dispatch switched off, which gives a plain tensor and then refuses the type change.
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            out = self.as_subclass(torch.Tensor).clone().as_subclass(DeviceTensor)
        out.requires_grad_(self.requires_grad)
        out.__dict__ = copy.deepcopy(self.__dict__, memo)  # a parameter's _is_param
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol):
        # torch.save writes a GPU tensor as a plain tensor (its storage tagged cuda:N, mapped to
        # the CPU on loading): so does the stand-in, or weights_only loading would refuse the
        # subclass in every checkpoint and model file.
        return torch.Tensor.__reduce_ex__(self.as_subclass(torch.Tensor), protocol)
