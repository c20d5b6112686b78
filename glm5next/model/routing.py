"""Per-step call routing of stock modules, for the specialized decode executor.

During a planned step the executor may send the calls of particular stock
modules (a projection, an MLP) to its own kernels. The modules themselves are
never changed: `Linear.forward`, `MLP.forward` and `RMSNorm.forward` look their
own id up in the table that `routed(...)` installs for the duration of one
forward, and run stock when it holds nothing for them (always, outside planned
steps). `cast_input` does the same for a cast that stock code applies to a
module's input, under the key `("input", id(module))`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

_ROUTES: dict[object, Callable] = {}


def route_of(module) -> Callable | None:
    """The callable replacing `module`'s forward in the current planned step, or None."""
    return _ROUTES.get(id(module)) if _ROUTES else None


def cast_input(consumer, x, dtype):
    """`x.to(dtype)`, which stock code then passes to module `consumer`, or what the current planned step
    routes it to (the same values, possibly with a copy the consumer's kernel reads)."""
    route = _ROUTES.get(("input", id(consumer))) if _ROUTES else None
    return x.to(dtype) if route is None else route(x, dtype)


@contextmanager
def routed(table: dict[object, Callable]):
    """Install `table` (module id, or `("input", module id)` -> callable) for the duration of the block;
    not reentrant."""
    if _ROUTES:
        raise RuntimeError("a planned step is already routing module calls")
    _ROUTES.update(table)
    try:
        yield
    finally:
        _ROUTES.clear()
