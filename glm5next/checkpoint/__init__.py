"""Reading and writing GLM-5.3-Flash checkpoints in the Hugging Face layout."""

from .fp8 import quantize_fp8_blocks
from .inventory import Expected, checkpoint_key, expected_tensors
from .loader import CheckpointError, LoadReport, load_checkpoint

__all__ = [
    "CheckpointError",
    "Expected",
    "LoadReport",
    "checkpoint_key",
    "expected_tensors",
    "load_checkpoint",
    "quantize_fp8_blocks",
]
