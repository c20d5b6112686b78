"""The README's result files exist: each `bench/results/...` it cites (braces expanded, a `*` matching at least
one file)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _expand(path: str) -> list[str]:
    m = re.search(r"\{([^}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in _expand(path[:m.start()] + alt + path[m.end():])]


def test_readme_cites_result_files_that_exist():
    cited = set(re.findall(r"bench/results/[A-Za-z0-9_.{},*-]+", (ROOT / "README.md").read_text()))
    assert cited
    missing = [p for c in sorted(cited) for p in _expand(c.rstrip(".,"))
               if not (list(ROOT.glob(p)) if "*" in p else (ROOT / p).exists())]
    assert not missing, missing
