"""Loading a Hugging Face GLM-5.3-Flash checkpoint into modules that declared their tensors.

Everything is validated before anything is installed: one `CheckpointError`
lists every offender (missing, unexpected, wrong shape or dtype, FP8 without
its scales, unreadable shards, a bad config). Then tensors are read and
installed one at a time, so the weights are never held twice.

Under tensor parallelism a spec names the part of its tensor this rank holds (`TensorSpec.shard`);
the loader reads only that slice from the shard file, and for an FP8 weight the matching rows or
columns of its 128x128 block scales. FP8 weights must split on scale-block boundaries.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from tqdm import tqdm

from ..config import ConfigError, Glm5NextConfig
from .fp8 import FP8_BLOCK, scale_shape
from .inventory import LM_HEAD, SCALE_SUFFIX, TEXT_PREFIX, VISUAL_PREFIX, checkpoint_key
from .specs import TensorSpec

INDEX_FILE = "model.safetensors.index.json"
"""Name of the index of a sharded checkpoint."""
SINGLE_FILE = "model.safetensors"
"""Name of the one file of an unsharded checkpoint."""
FP8_HEADER_DTYPE = "F8_E4M3"
"""safetensors header spelling of float8 e4m3fn."""
FLOAT_HEADER_DTYPES = ("BF16", "F16", "F32")
"""Header dtypes a non-FP8 tensor may be stored in."""
SCALE_HEADER_DTYPES = ("F32",)
"""Header dtypes an FP8 block-scale tensor may be stored in."""


class CheckpointError(RuntimeError):
    """A checkpoint that does not match what the model expects, listing every offender."""


@dataclass
class LoadReport:
    """What a load found and installed."""

    has_mtp: bool
    installed: int = 0
    fp8: int = 0
    bytes_read: int = 0
    """Tensor bytes read from the shard files (under tensor parallelism, this rank's slices only)."""
    bytes_by_key: dict[str, int] = field(default_factory=dict)
    """Bytes read per checkpoint key (FP8 scales under their own keys)."""
    skipped: list[str] = field(default_factory=list)
    """Checkpoint keys left alone (vision tower, MTP layer when none was asked for)."""


@dataclass(frozen=True)
class _Stored:
    """One tensor in a shard: its key, file, header dtype and shape."""

    key: str
    path: str
    dtype: str
    shape: tuple[int, ...]


def load_checkpoint(
    model_dir: str,
    specs: dict[str, TensorSpec],
    dtype: torch.dtype,
    device: torch.device | str,
    mtp_prefix: str | None,
    progress: bool = True,
) -> LoadReport:
    """The report of installing the checkpoint in `model_dir` through `specs`.

    `specs` are keyed by checkpoint name without `model.language_model.`. The
    specs under `mtp_prefix` (e.g. `layers.8.`) are optional as a group. FP8
    tensors are installed as (fp8 weight, fp32 scales); `keep_fp32` specs as
    fp32; the rest as `dtype`, all on `device`.
    """
    problems: list[str] = []
    config = _check_config(model_dir, problems)
    stored, lost = _read_headers(model_dir, problems)
    plan, skipped, has_mtp = _match(stored, lost, specs, mtp_prefix, config, problems)
    if problems:
        raise CheckpointError(f"checkpoint {model_dir} does not match the model ({len(problems)} problems):\n  "
                              + "\n  ".join(_fold_split_problems(problems)))
    report = LoadReport(has_mtp=has_mtp, skipped=skipped)
    handles: dict[str, object] = {}
    try:
        for name, weight, scale in tqdm(plan, desc="loading weights", unit="tensor", disable=not progress):
            spec = specs[name]
            t = _read(handles, weight, spec.shard, weight.shape, report)
            if scale is not None:
                s = _read(handles, scale, spec.shard, weight.shape, report)
                spec.install(t.to(device), s.to(device=device, dtype=torch.float32))
                report.fp8 += 1
            else:
                spec.install(t.to(device=device, dtype=torch.float32 if spec.keep_fp32 else dtype), None)
            report.installed += 1
            del t
    finally:
        handles.clear()
    return report


def _read(handles: dict, stored: _Stored, shard: Shard | None, weight_shape: tuple[int, ...],
          report: LoadReport) -> torch.Tensor:
    """The tensor `stored`, or only the part `shard` names of the weight of `weight_shape`: of the
    weight itself, or of its block scales (when `stored` is they) the blocks covering that part."""
    handle = _open(handles, stored.path)
    if shard is None:
        t = handle.get_tensor(stored.key)
    else:
        start, stop = shard.bounds(weight_shape[shard.dim])
        if stored.shape != weight_shape:  # the block scales: one row or column per FP8_BLOCK
            start, stop = start // FP8_BLOCK, -(-stop // FP8_BLOCK)
        index = [slice(None)] * len(stored.shape)
        index[shard.dim] = slice(start, stop)
        t = handle.get_slice(stored.key)[tuple(index)].contiguous()  # a column slice comes back strided
    n = t.numel() * t.element_size()
    report.bytes_read += n
    report.bytes_by_key[stored.key] = n
    return t


def _open(handles: dict, path: str):
    if path not in handles:
        handles[path] = safe_open(path, framework="pt", device="cpu")
    return handles[path]


def _check_config(model_dir: str, problems: list[str]) -> Glm5NextConfig | None:
    """The parsed config.json, or None with the reason added to `problems`."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        problems.append(f"config: no config.json in {model_dir}")
        return None
    try:
        return Glm5NextConfig.from_file(path)
    except ConfigError as e:
        problems.append(f"config: {e}")
        return None


def _read_headers(model_dir: str, problems: list[str]) -> tuple[dict[str, _Stored], set[str] | None]:
    """Every stored tensor by key, read from the shard headers only, and the keys the index
    maps to missing or unreadable shards (None: no index or file could be read at all)."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"index: {index_path} is unreadable: {type(e).__name__}: {e}")
            return {}, None
    elif os.path.isfile(single):
        weight_map = None
    else:
        problems.append(f"index: neither {INDEX_FILE} nor {SINGLE_FILE} in {model_dir}")
        return {}, None
    files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
    stored: dict[str, _Stored] = {}
    lost: set[str] = set()
    for fname in files:
        path = os.path.join(model_dir, fname)
        listed = sorted(k for k, v in weight_map.items() if v == fname) if weight_map is not None else None
        if not os.path.isfile(path):
            problems.append(f"shard: {fname} is missing (the index maps {len(listed)} tensors to it, e.g. {listed[0]})")
            lost.update(listed)
            continue
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                header = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
        except Exception as e:  # safetensors raises several error types for damaged files
            problems.append(f"shard: {fname} is unreadable (corrupt or truncated): {type(e).__name__}: {e}")
            if listed is None:
                return {}, None
            lost.update(listed)
            continue
        for key in listed if listed is not None else sorted(header):
            if key not in header:
                problems.append(f"shard: the index maps {key} to {fname}, which does not hold it")
                continue
            stored[key] = _Stored(key, path, *header[key])
        if listed is not None:
            for key in sorted(set(header) - set(listed)):
                problems.append(f"shard: {fname} holds {key}, which the index does not list")
    return stored, lost


SPLIT_PROBLEM = "tensor parallel: "
SPLIT_EXAMPLES = 3


def _fold_split_problems(problems: list[str]) -> list[str]:
    """`problems` with the FP8 split offenders after the first few folded into one count: a tensor-parallel
    size that cuts one expert's scale blocks cuts every expert's."""
    split = [p for p in problems if p.startswith(SPLIT_PROBLEM)]
    if len(split) <= SPLIT_EXAMPLES + 1:
        return problems
    rest = [p for p in problems if not p.startswith(SPLIT_PROBLEM)]
    more = f"{SPLIT_PROBLEM}... and {len(split) - SPLIT_EXAMPLES} more FP8 weights split the same way"
    return rest + split[:SPLIT_EXAMPLES] + [more]


def _check_fp8_shard(st: _Stored, spec: TensorSpec, problems: list[str]) -> None:
    """Adds a problem when this tensor-parallel split of an FP8 weight cuts through its scale blocks."""
    shard = spec.shard
    dim = shard.dim
    part = spec.shape[dim] // shard.size
    if part % FP8_BLOCK:
        problems.append(f"tensor parallel: {st.key} is FP8 with {FP8_BLOCK}x{FP8_BLOCK} scale blocks, but "
                        f"tensor_parallel_size={shard.size} splits its dimension {dim} ({spec.shape[dim]}) into "
                        f"parts of {part}, not a multiple of {FP8_BLOCK}")


def _text_name(key: str) -> str | None:
    """The inventory name of a text key, or None for a key outside the text namespaces."""
    if key in (LM_HEAD, LM_HEAD + SCALE_SUFFIX):
        return key
    if key.startswith(TEXT_PREFIX):
        return key[len(TEXT_PREFIX) :]
    return None


def _match(
    stored: dict[str, _Stored],
    lost: set[str] | None,
    specs: dict[str, TensorSpec],
    mtp_prefix: str | None,
    config: Glm5NextConfig | None,
    problems: list[str],
) -> tuple[list[tuple[str, _Stored, _Stored | None]], list[str], bool]:
    """The install plan (name, weight, FP8 scales or None), the skipped keys and whether the
    MTP layer is present; every mismatch is added to `problems`."""
    skipped: list[str] = []
    by_name: dict[str, _Stored] = {}
    # Without an MTP module the trunk skips the checkpoint's MTP layer (it is not an error).
    skip_prefix = f"layers.{config.mtp_layer_idx}." if mtp_prefix is None and config is not None else None
    for key, st in stored.items():
        name = _text_name(key)
        if key.startswith(VISUAL_PREFIX) or (skip_prefix and name and name.startswith(skip_prefix)):
            skipped.append(key)
        elif name is None:
            problems.append(f"unexpected: {key} [{st.dtype} {list(st.shape)}] is outside model.language_model., "
                            "lm_head. and model.visual.")
        else:
            by_name[name] = st

    mtp_names = {n for n in specs if mtp_prefix and n.startswith(mtp_prefix)}
    lost_names = {_text_name(k) for k in lost} if lost is not None else None
    has_mtp = any(n in by_name for n in mtp_names)
    if mtp_names and not has_mtp:
        required = [n for n in specs if n not in mtp_names]
    else:
        required = list(specs)
    partial_mtp = " (the MTP layer is partly present)" if has_mtp else ""

    plan = []
    used: set[str] = set()
    for name in required:
        spec = specs[name]
        st = by_name.get(name)
        if st is None:
            if lost_names is None or name in lost_names:
                continue  # already reported with its shard or index
            hint = partial_mtp if name in mtp_names else ""
            problems.append(f"missing: {checkpoint_key(name)} [expected shape {list(spec.shape)}]{hint}")
            continue
        used.add(name)
        if st.shape != tuple(spec.shape):
            problems.append(f"wrong shape: {st.key}: expected {list(spec.shape)}, found {list(st.shape)}")
        scale_name = name + SCALE_SUFFIX
        scale = by_name.get(scale_name)
        if st.dtype == FP8_HEADER_DTYPE:
            if not spec.fp8_ok:
                problems.append(f"wrong dtype: {st.key}: FP8 is not allowed for this tensor; expected one of "
                                f"{list(FLOAT_HEADER_DTYPES)}, found {st.dtype}")
            if scale is None and scale_name not in lost_names:
                problems.append(f"missing: {st.key}{SCALE_SUFFIX} (block scales of the FP8 tensor {st.key}, "
                                f"expected shape {list(scale_shape(tuple(spec.shape)))})")
            elif scale is not None:
                used.add(scale_name)
                if spec.shard is not None:
                    _check_fp8_shard(st, spec, problems)
                if scale.shape != scale_shape(tuple(spec.shape)):
                    problems.append(f"wrong shape: {scale.key}: expected {list(scale_shape(tuple(spec.shape)))}, "
                                    f"found {list(scale.shape)}")
                if scale.dtype not in SCALE_HEADER_DTYPES:
                    problems.append(f"wrong dtype: {scale.key}: expected one of {list(SCALE_HEADER_DTYPES)}, "
                                    f"found {scale.dtype}")
            plan.append((name, st, scale))
        else:
            if st.dtype not in FLOAT_HEADER_DTYPES:
                allowed = list(FLOAT_HEADER_DTYPES) + ([FP8_HEADER_DTYPE] if spec.fp8_ok else [])
                problems.append(f"wrong dtype: {st.key}: expected one of {allowed}, found {st.dtype}")
            plan.append((name, st, None))

    for name in sorted(set(by_name) - used):
        st = by_name[name]
        why = ""
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            why = (f" (block scales of {base}, which is not stored as FP8)" if base in by_name
                   else f" (block scales without a tensor {base})")
        problems.append(f"unexpected: {st.key} [{st.dtype} {list(st.shape)}]{why}")
    plan.sort(key=lambda item: (item[1].path, item[1].key))
    return plan, sorted(skipped), has_mtp
