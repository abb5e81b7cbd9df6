"""A ``torch.compile`` backend that counts the FLOPs its graphs run (tests of plans under compile)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sacplan.collector.runtime import op_flops


class _Flops(TorchDispatchMode):
    """FLOPs of the ops dispatched inside (higher-order ops such as RNG save/replay run uncounted)."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(func, torch._ops.OpOverload):
            self.flops += op_flops(func, args, kwargs, out)
        return out


class CountingBackend:
    """``torch.compile`` backend: AOTAutograd, graphs run as traced (like ``aot_eager``), FLOPs counted."""

    def __init__(self) -> None:
        from torch._dynamo.backends.common import aot_autograd

        self.flops = 0
        self.graphs = 0
        self._backend = aot_autograd(fw_compiler=self._compiler, bw_compiler=self._compiler)

    def _compiler(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        self.graphs += 1

        def run(args: list[Any]) -> Any:
            with _Flops() as fc:
                out = gm(*args)
            self.flops += fc.flops
            return out

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return self._backend(gm, example_inputs)
