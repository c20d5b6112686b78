"""The measured policy: for each stage and captured token count, which choice runs (or stock).

A policy file is JSON:

    {"gpu": "NVIDIA H200", "measured": "...", "tables": {"boundary": {"1": "fused", "2": "fused"}, ...}}

A stage missing from `tables`, or the choice "stock", means: the stock module runs. A token count
the table does not list takes the entry of the next larger count it lists (the choices are kernel
families that run at any count up to the one measured, and a verify step of q tokens per request
captures multiples of q that the table may not hold); above the largest listed count, stock. The tables shipped in
`policies/` are written by `glm5next tune-policy`, which measures every choice
of every stage at every token count on the GPU at hand; a user file given to
the engine replaces them.
"""

from __future__ import annotations

import json
import os
import re

MAX_TOKENS = 64
"""The largest planned step."""

STOCK = "stock"

STAGES: dict[str, tuple[str, ...]] = {
    "boundary": ("fused", "fused-deferred"),
    "kda_proj": ("grouped", "grouped-early", "grouped-overlap", "single"),
    "kda": ("fused",),
    "dsa_proj": ("grouped", "grouped-early", "grouped-overlap", "single"),
    "dsa": ("sparse",),
    "dense_mlp": ("fused", "fused-overlap"),
    "shared_expert": ("fused", "fused-overlap"),
    "moe": ("grouped",),
    "logits_head": ("gemv", "splitk"),
}
"""Every implemented stage and its choices (besides stock)."""

POLICY_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "policies")


class PolicyError(ValueError):
    """A policy file or table that names something that does not exist."""


def gpu_slug(name: str) -> str:
    """The shipped policy's file stem for a GPU name: 'NVIDIA H200' -> 'nvidia-h200'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


class Policy:
    """`policy(stage, tokens)` -> the choice for that token count, or None (stock)."""

    def __init__(self, tables: dict | None = None, source: str = "<tables>") -> None:
        self.source = source
        self.tables: dict[str, dict[int, str | None]] = {}
        """stage -> {token count: choice, or None for a measured stock}, counts ascending."""
        if not isinstance(tables or {}, dict):
            raise PolicyError(f"{source}: 'tables' must be an object of stage -> {{tokens: choice}}")
        for stage, table in (tables or {}).items():
            if stage not in STAGES:
                raise PolicyError(f"{source}: unknown stage {stage!r} (stages: {', '.join(STAGES)})")
            if not isinstance(table, dict):
                raise PolicyError(f"{source}: stage {stage!r} must map token counts to choices")
            rows = {}
            for tokens, choice in table.items():
                n = _token_count(tokens, f"{source}: stage {stage!r}")
                if choice == STOCK:
                    rows[n] = None
                    continue
                if choice not in STAGES[stage]:
                    raise PolicyError(f"{source}: stage {stage!r} at {n} tokens: unknown choice {choice!r} "
                                      f"(choices: {', '.join(STAGES[stage] + (STOCK,))})")
                rows[n] = choice
            self.tables[stage] = dict(sorted(rows.items()))

    def __call__(self, stage: str, tokens: int) -> str | None:
        if stage not in STAGES:
            raise PolicyError(f"unknown stage {stage!r}")
        table = self.tables.get(stage, {})
        if tokens in table:
            return table[tokens]
        return next((c for n, c in table.items() if n > tokens), None)

    def enabled(self, stage: str) -> bool:
        """Whether the stage runs at any token count."""
        return any(c is not None for c in self.tables.get(stage, {}).values())

    def tokens(self, stage: str, choice: str) -> set[int]:
        """The token counts at which `stage` runs `choice`."""
        return {n for n, c in self.tables.get(stage, {}).items() if c == choice}

    def to_dict(self, **header) -> dict:
        return {**header, "tables": {s: {str(n): c or STOCK for n, c in t.items()} for s, t in self.tables.items()}}

    @classmethod
    def from_file(cls, path: str) -> "Policy":
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as e:
            raise PolicyError(f"cannot read the policy file {path}: {e.strerror}") from None
        except ValueError as e:
            raise PolicyError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(data, dict) or "tables" not in data:
            raise PolicyError(f"{path}: a policy file is an object with a 'tables' entry")
        return cls(data["tables"], source=path)

    @classmethod
    def for_gpu(cls, name: str, capability: tuple[int, int] | None = None) -> "Policy | None":
        """The shipped policy for the GPU called `name` over the default table of its architecture
        (`sm90.json` for compute capability 9.x, Hopper, measured on one GPU of it): a stage that the GPU's own
        table lacks takes the default's entries, and a GPU without a table of its own runs the default.
        None where neither ships. Its source names the files inside the package, wherever that is installed."""
        own = os.path.join(POLICY_DIR, gpu_slug(name) + ".json")
        default = os.path.join(POLICY_DIR, f"sm{capability[0]}0.json") if capability is not None else ""
        paths = [p for p in (default, own) if os.path.exists(p)]
        if not paths:
            return None
        tables = {}
        for p in paths:
            tables.update(cls.from_file(p).to_dict()["tables"])
        return cls(tables, source=" over ".join(f"glm5next/specialized_decode/policies/{os.path.basename(p)}"
                                                for p in reversed(paths)))

    def __repr__(self) -> str:
        runs = {s: sorted(n for n, c in t.items() if c is not None) for s, t in self.tables.items()}
        return f"Policy({self.source}: {', '.join(f'{s}@{n}' for s, n in runs.items() if n)})"


def _token_count(value, where: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise PolicyError(f"{where}: token count {value!r} is not an integer") from None
    if str(n) != str(value).strip() or not 1 <= n <= MAX_TOKENS:
        raise PolicyError(f"{where}: token count {value!r} must be an integer in [1, {MAX_TOKENS}]")
    return n
