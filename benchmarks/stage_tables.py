"""The MoE, KDA and DSA tables of a GPU's policy from the stage benchmarks' results on that GPU.

    python benchmarks/stage_tables.py --policy FILE [--moe moe.json] [--kda kda.json] [--dsa dsa.json]

Each stage's choice at a token count is the planned one where the stage beat the stock module in that run
(the DSA stage at every context it measured), "stock" elsewhere; decode rows only (verify rows are steps of
rows x q tokens that the tables' next larger count covers). The file keeps its other tables and says what
measured each table.
"""

from __future__ import annotations

import argparse
import json

CHOICE = {"moe": "grouped", "kda": "fused", "dsa": "sparse"}
SCRIPT = {"moe": "benchmarks/moe_stage.py", "kda": "benchmarks/kda_stage.py", "dsa": "benchmarks/dsa_stage.py"}


def table(stage: str, result: dict) -> dict[str, str]:
    """Token count -> choice from one stage benchmark's result."""
    wins: dict[int, bool] = {}
    for r in result["rows"]:
        tokens = r.get("tokens", r.get("rows"))
        if r.get("q", 1) != 1:
            continue
        if r.get("stock_us") is None:
            raise ValueError(f"{stage}: the run measured no stock module at {tokens} tokens (ran with --no-stock?)")
        wins[tokens] = wins.get(tokens, True) and r["stage_us"] < r["stock_us"]
    return {str(n): CHOICE[stage] if won else "stock" for n, won in sorted(wins.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", required=True, help="the policy file to write the tables into")
    for stage in CHOICE:
        ap.add_argument(f"--{stage}", default=None, help=f"a result JSON of {SCRIPT[stage]}")
    args = ap.parse_args()
    try:
        with open(args.policy) as f:
            doc = json.load(f)
    except FileNotFoundError:
        doc = {"tables": {}}
    for stage in CHOICE:
        path = getattr(args, stage)
        if path is None:
            continue
        with open(path) as f:
            result = json.load(f)
        doc.setdefault("tables", {})[stage] = table(stage, result)
        doc.setdefault(f"{stage}_measured", {})[result["gpu"]] = (
            f"{result['date']}, {SCRIPT[stage]}: stage vs stock module per token count")
        print(f"{stage}: {doc['tables'][stage]}")
    with open(args.policy, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
