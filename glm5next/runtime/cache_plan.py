"""How many paged cache blocks an engine gets.

On a GPU, from a memory budget: `gpu_memory_utilization` of the device's
memory, minus what is already in use (the weights, other processes), minus the
activation peak of the largest prefill chunk and of the largest captured decode
step, each measured by running it once over a throw-away cache. On the CPU, or
when the caller says so, an explicit block count. Either way the cache must hold
at least one sequence of `max_model_len` tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..model.backbone import Glm5NextModel
from .cache import allocate_cache, blocks_for_budget, bytes_per_block
from .runner import Runner

logger = logging.getLogger(__name__)

CPU_CACHE_BYTES = 512 * 2**20
"""The default cache budget on the CPU when no block count is given."""
GRAPH_MARGIN = 1.25
"""Head-room on the measured decode peak for the captured graphs' shared memory pool."""


@dataclass(frozen=True)
class CachePlan:
    num_blocks: int
    block_size: int
    num_slots: int
    budget_bytes: int | None
    """The bytes the cache was sized from (None: an explicit block count)."""
    activation_bytes: int | None
    """The measured activation peak reserved beside the cache (GPU only)."""

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size


def _profile_peak(model: Glm5NextModel, block_size: int, chunk: int, decode_rows: int) -> int:
    """Peak bytes above the current allocation while running one prefill chunk and one padded decode step."""
    device = model.embed_tokens.device
    blocks = -(-chunk // block_size)
    cache = allocate_cache(model.config, blocks, block_size, 1, model.embed_tokens.dtype, device, include_mtp=False,
                           tp_size=model.tp.size)
    runner = Runner(model, cache, max_model_len=blocks * block_size, capture_sizes=(max(decode_rows, 1),))
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.randint(0, model.config.vocab_size, (chunk,)).tolist()
    runner.execute([(ids, 0, chunk, 0, list(range(blocks)))], 0)
    prefill = torch.cuda.max_memory_allocated(device) - base
    decode = 0
    if decode_rows:
        torch.cuda.reset_peak_memory_stats(device)
        runner.graph_mode = True
        runner.execute([(ids, chunk - 1, 1, 0, list(range(blocks)))], 1)
        decode = int((torch.cuda.max_memory_allocated(device) - base) * GRAPH_MARGIN)
    del runner, cache
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return max(prefill, 0) + max(decode, 0)


def plan_cache(
    model: Glm5NextModel,
    max_model_len: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_blocks: int | None,
    gpu_memory_utilization: float,
    max_capture_size: int,
    include_mtp: bool = False,
    verify_tokens: int = 0,
) -> CachePlan:
    """The cache size for an engine over `model` (see the module docstring)."""
    config = model.config
    dtype = model.embed_tokens.dtype
    device = model.embed_tokens.device
    if block_size < 1 or block_size % config.index_kpool:
        raise ValueError(f"block_size={block_size} must be a positive multiple of index_kpool={config.index_kpool}")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization!r} must be in (0, 1]")
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs!r} must be a positive integer")
    need = -(-max_model_len // block_size)
    budget = activation = None
    if num_blocks is not None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r} must be a positive integer")
    elif device.type == "cuda":
        chunk = min(max_num_batched_tokens, max_model_len)
        activation = _profile_peak(model, block_size, chunk, max_capture_size)
        free, total = torch.cuda.mem_get_info(device)
        budget = int(gpu_memory_utilization * total) - (total - free) - activation
        num_blocks = blocks_for_budget(config, budget, block_size, max_num_seqs, dtype, include_mtp=include_mtp,
                                       verify_tokens=verify_tokens, tp_size=model.tp.size)
    else:
        budget = CPU_CACHE_BYTES
        num_blocks = min(blocks_for_budget(config, budget, block_size, max_num_seqs, dtype, include_mtp=include_mtp,
                                           verify_tokens=verify_tokens, tp_size=model.tp.size),
                         need * max_num_seqs)
    if num_blocks < need:
        per_block = bytes_per_block(config, block_size, dtype, include_mtp=include_mtp)
        raise ValueError(
            f"the cache holds {num_blocks} blocks of {block_size} tokens ({num_blocks * block_size} tokens), fewer "
            f"than one max_model_len={max_model_len} sequence needs ({need} blocks, "
            f"{need * per_block / 2**30:.2f} GiB): lower max_model_len or max_num_seqs, or raise "
            f"gpu_memory_utilization / num_blocks"
        )
    logger.info("cache: %d blocks of %d tokens, %d KDA slots", num_blocks, block_size, max_num_seqs)
    return CachePlan(num_blocks, block_size, max_num_seqs, budget, activation)
