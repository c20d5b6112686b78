"""Move Triton's compiled kernels from one GPU machine to the next, so a fresh machine does not compile
again what an earlier call already compiled (the device calls of `benchmarks/gpu_run.sh` start on a fresh
machine whenever the last one went idle; compiling the kernel tests alone takes minutes there).

    python benchmarks/triton_cache.py pack CACHE_DIR ARCHIVE [--max-mib 15]
    python benchmarks/triton_cache.py unpack ARCHIVE CACHE_DIR

`pack` keeps what a cache hit reads (each kernel's binary, its metadata and the group file that
lists them, and the compiled launchers; no intermediate IR), newest entries first, within `--max-mib` of xz-compressed archive.
`unpack` adds them to CACHE_DIR and points every group file at the files' new place (the groups
hold absolute paths). A kernel whose source, specialization, options or Triton build differ hashes
to another entry, so an archive from another tree or machine never stands in for a fresh compile:
at worst nothing in it is used.
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import os
import sys
import tarfile

KEEP = (".cubin", ".json", ".so")
"""What a cache hit reads: a kernel's binary and metadata (the `__grp__*.json` group files end in .json too),
and the compiled launchers (one shared object per entry, without a group)."""


def _entries(cache_dir: str) -> list[tuple[float, str, list[str]]]:
    """(newest mtime, entry directory, files to keep) per hashed entry that holds a complete group."""
    out = []
    for name in os.listdir(cache_dir):
        d = os.path.join(cache_dir, name)
        if not os.path.isdir(d):
            continue
        files = sorted(f for f in os.listdir(d) if f.endswith(KEEP) and ".tmp." not in f)
        kernel = any(f.startswith("__grp__") for f in files) and any(f.endswith(".cubin") for f in files)
        launcher = len(files) == 1 and files[0].endswith(".so")
        if not (kernel or launcher):
            continue  # an interrupted compile, or an entry of something else
        out.append((max(os.path.getmtime(os.path.join(d, f)) for f in files), name, files))
    return sorted(out, reverse=True)


def pack(cache_dir: str, archive: str, max_mib: float) -> tuple[int, int, int]:
    """Write the newest complete entries of cache_dir that fit in max_mib of compressed archive;
    returns (entries kept, entries found, archive bytes)."""
    if not os.path.isdir(cache_dir):
        raise SystemExit(f"no Triton cache at {cache_dir}")
    limit = int(max_mib * 2**20)
    entries = _entries(cache_dir)
    # Compressed sizes are not known before compressing: take entries newest first against a budget of
    # their raw size over a ratio measured on the first few, then shrink until the archive fits.
    keep = len(entries)
    while True:
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w") as tar:
            for _, name, files in entries[:keep]:
                for f in files:
                    tar.add(os.path.join(cache_dir, name, f), arcname=f"{name}/{f}")
        data = lzma.compress(raw.getvalue(), preset=6)
        if len(data) <= limit or keep == 0:
            break
        keep = max(0, int(keep * limit / len(data) * 0.95))
    with open(archive, "wb") as fh:
        fh.write(data)
    return keep, len(entries), len(data)


def unpack(archive: str, cache_dir: str) -> int:
    """Add the archive's entries to cache_dir (existing files stay); returns the entries added or updated."""
    os.makedirs(cache_dir, exist_ok=True)
    root = os.path.realpath(cache_dir)
    with open(archive, "rb") as fh:
        raw = io.BytesIO(lzma.decompress(fh.read()))
    names = set()
    with tarfile.open(fileobj=raw, mode="r") as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if not member.isfile() or len(parts) != 2 or not parts[1].endswith(KEEP) or ".." in parts:
                raise SystemExit(f"{archive}: unexpected member {member.name!r}")
            names.add(parts[0])
        tar.extractall(root, filter="data")
    for name in names:
        d = os.path.join(root, name)
        for f in os.listdir(d):
            if not f.startswith("__grp__"):
                continue
            path = os.path.join(d, f)
            with open(path) as fh:
                group = json.load(fh)
            group["child_paths"] = {c: os.path.join(d, c) for c in group.get("child_paths", {})
                                    if os.path.exists(os.path.join(d, c))}
            with open(path, "w") as fh:
                json.dump(group, fh)
    return len(names)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("cache_dir")
    p.add_argument("archive")
    p.add_argument("--max-mib", type=float, default=15.0)
    u = sub.add_parser("unpack")
    u.add_argument("archive")
    u.add_argument("cache_dir")
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        kept, found, size = pack(args.cache_dir, args.archive, args.max_mib)
        print(f"triton cache: {kept} of {found} entries packed into {args.archive} ({size / 2**20:.1f} MiB)")
    else:
        added = unpack(args.archive, args.cache_dir)
        print(f"triton cache: {added} entries from {args.archive} in {args.cache_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
