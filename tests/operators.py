"""Counting the PyTorch operators a piece of code runs (on CUDA each is at least one launch), for tests that bound
them."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class Operators(TorchDispatchMode):
    """The PyTorch operators run inside it, by name (``aten.add_``, ...), in ``calls``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))
