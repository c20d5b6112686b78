"""Per-step call routing of stock modules, for the specialized decode executor.

During a planned step the executor may send the calls of particular stock
modules (a projection, an MLP) to its own kernels. The modules themselves are
never changed: `Linear.forward` and `MLP.forward` look their own id up in the
table that `routed(...)` installs for the duration of one forward, and run
stock when it holds nothing for them (always, outside planned steps).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

_ROUTES: dict[int, Callable] = {}


def route_of(module) -> Callable | None:
    """The callable replacing `module`'s forward in the current planned step, or None."""
    return _ROUTES.get(id(module)) if _ROUTES else None


@contextmanager
def routed(table: dict[int, Callable]):
    """Install `table` (module id -> callable) for the duration of the block; not reentrant."""
    if _ROUTES:
        raise RuntimeError("a planned step is already routing module calls")
    _ROUTES.update(table)
    try:
        yield
    finally:
        _ROUTES.clear()
