"""Host memory apart from the device on a CPU: the fake host (GPTPAR_FAKE_HOST=1, tests).

On a CPU run host and device are one memory, so a host tensor handed to a device op or a
collective goes unseen there and fails on the first GPU. Under GPTPAR_FAKE_HOST=1 the host's
tensors are HostTensors, on a device of their own (HOST), and are refused where a GPU would
refuse them. common.to_host is the way down to the host (--offload); this module hands it the
hook that makes its copies HostTensors, so that common.py imports nothing from infra."""

import torch

import common


# On a CPU run host and device are one memory, so a host tensor handed to a device op or a
# collective goes unseen there and fails on the first GPU. Under GPTPAR_FAKE_HOST=1 the
# host's tensors are HostTensors, on a device of their own (HOST), and are refused where a
# GPU would refuse them.
HOST = torch.device("cpu", 1)


class HostTensor(torch.Tensor):
    """A tensor in the fake host's memory. Ops among host tensors (AdamW's host-side math)
    give host tensors; an op that mixes one with a tensor of the run's device raises, as
    CUDA does, and so does a collective (CommLedger's device check: its device is HOST).
    Explicit transfers pass: copy_, and .to(device) (a device tensor) or .to(HOST); so do
    view_as and its kin, which read only the other tensor's shape."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.Tensor.device.__get__:  # (a new method-wrapper at each access: ==, not is)
            return HOST
        if func is torch.Tensor.copy_:  # a transfer either way; the destination stays where it is
            with torch._C.DisableTorchFunctionSubclass():
                func(*args, **kwargs)
            return args[0]
        if func in (torch.Tensor.view_as, torch.Tensor.reshape_as, torch.Tensor.expand_as):  # only its shape
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs).as_subclass(type(args[0]))
        if func in (_TENSOR_TO, _to, torch.Tensor.cpu):  # (torch names the patched .to, _to)
            to = torch.device("cpu") if func is torch.Tensor.cpu else _target_device(args[1:], kwargs)
            if to not in (None, HOST):  # up to the device: a plain tensor
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs).as_subclass(torch.Tensor)
        tensors = [t for a in list(args) + list(kwargs.values())
                   for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
        if not all(isinstance(t, HostTensor) for t in tensors):
            raise RuntimeError(f"{func.__name__} mixes a tensor in host memory with one on the device "
                               "(GPTPAR_FAKE_HOST=1): a GPU refuses this; move one of them first")
        return super().__torch_function__(func, types, args, kwargs)


def _target_device(args, kwargs):
    """The device a .to(...) call's arguments name (None: it keeps the tensor's)."""
    return torch._C._nn._parse_to(*args, **{k: v for k, v in kwargs.items() if k != "copy"})[0]


_TENSOR_TO = torch.Tensor.to  # torch's own, before host_tensor() teaches it the HOST device


def _to(self, *args, **kwargs):
    """Tensor.to under the fake host: a move to HOST (`x.to(host_tensor.device)`) gives a
    host tensor (a patch of the method, not a TorchFunctionMode: a mode is off inside
    backward, where 05 moves gradient shards down to the host)."""
    out = _TENSOR_TO(self, *args, **kwargs)
    if not isinstance(self, HostTensor) and _target_device(args, kwargs) == HOST:
        return (out.clone() if out is self else out).as_subclass(HostTensor)
    return out


def host_tensor(t):
    """`t` as a HostTensor; teaches Tensor.to the HOST device for the rest of the process."""
    torch.Tensor.to = _to
    return t.as_subclass(HostTensor)


common.FAKE_HOST = host_tensor  # common.to_host's test hook: its copies down to the host, as HostTensors
