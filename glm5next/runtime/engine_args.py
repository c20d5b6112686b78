"""The engine's arguments, in one place: the keywords of `LLM`, `LLMEngine` and `AsyncLLM.from_args`, and the
command-line options of `generate`, `demo` and `serve`, which are generated from the same fields."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

import torch

from ..model.backbone import Glm5NextModel
from .runner import DEFAULT_CAPTURE_SIZES


def _option(help: str, flag: str | None = None, **argparse_kwargs) -> dict:
    """Field metadata making a field a command-line option: its help, its flag when not `--field-name`,
    and further `ArgumentParser.add_argument` keywords."""
    return {"help": help, "flag": flag, "argparse": argparse_kwargs}


def _capture_sizes(text: str) -> tuple[int, ...]:
    """The sizes of `--cuda-graph-sizes`, e.g. "1,2,4,8"."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--cuda-graph-sizes={text!r}: give integers separated by commas") from None


@dataclass(frozen=True)
class EngineArgs:
    """How to build an engine: the checkpoint, its dtype and device, the cache and batch sizes, CUDA graphs,
    the decode backend, speculative decoding and tensor parallelism."""

    model: str | Glm5NextModel
    """The checkpoint folder, or an already built backbone (its dtype and device are kept)."""
    dtype: str = field(default="bfloat16", metadata=_option("", choices=["bfloat16", "float32"]))
    device: str | None = field(default=None, metadata=_option("cuda or cpu (default: cuda when available)"))
    max_model_len: int | None = field(default=None, metadata=_option("context length (default: the model's)",
                                                                     type=int))
    max_num_seqs: int = field(default=64, metadata=_option("requests running at once", type=int))
    max_num_batched_tokens: int | None = field(default=None, metadata=_option(
        "tokens per step (prefill chunking; default, as vLLM's: on a GPU of 70 GiB or more other than an A100 "
        "16384, or 8192 for `serve`; else 8192, or 2048 for `serve`)", type=int))
    block_size: int = field(default=16, metadata=_option("tokens per paged cache block", type=int))
    num_blocks: int | None = field(default=None, metadata=_option(
        "paged cache blocks (default: from the memory budget)", type=int))
    gpu_memory_utilization: float = field(default=0.9, metadata=_option("fraction of GPU memory to use", type=float))
    enforce_eager: bool = field(default=False, metadata=_option("never replay CUDA graphs", action="store_true"))
    capture_sizes: tuple[int, ...] = field(default=DEFAULT_CAPTURE_SIZES, metadata=_option(
        "decode sizes to capture, e.g. 1,2,4,8 (default: 1..64)", flag="--cuda-graph-sizes",
        metavar="CUDA_GRAPH_SIZES"))
    decode_backend: str = field(default="auto", metadata=_option(
        "captured decode steps: auto (default: the specialized executor on one GPU for which a measured policy "
        "ships, else stock), the specialized executor, or the stock forward", choices=["auto", "specialized", "stock"]))
    policy: str | None = field(default=None, metadata=_option("a policy JSON written by `glm5next tune-policy`"))
    speculative_config: str | dict | None = field(default=None, metadata=_option(
        'MTP speculative decoding, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\''))
    async_scheduling: bool = field(default=True, metadata=_option(
        "schedule and launch each step while the one before runs (plain steps on one process; the default) "
        "instead of after its tokens came back", flag="--no-async-scheduling", action="store_false"))
    warmup: bool | None = field(default=None, metadata=_option(
        "run dummy requests through a full prefill step and a mixed step (a prompt beside decodes) at startup, "
        "so their kernels compile before the first request instead of in its steps, as vLLM's profile run does; "
        "the engine is left as built (default: on a GPU, where a shape's first run compiles Triton kernels; on "
        "the CPU every step runs in PyTorch and nothing compiles)", action=argparse.BooleanOptionalAction))
    tensor_parallel_size: int = field(default=1, metadata=_option(
        "processes (one per GPU) the model is split over; outside torchrun, LLM and the command start the others",
        type=int, aliases=["-tp"]))
    seed: int = 0
    """Seeds the engine's per-request random streams when a request gives no seed."""
    serving: bool = False
    """Built for `serve` (online requests): the smaller default step budget, which stalls decoding requests
    less while a prompt is prefilled."""
    progress: bool = True
    """Whether loading shows a progress bar."""

    def step_budget(self, device: torch.device) -> int:
        """`max_num_batched_tokens`, or its default on `device` (the help of `--max-num-batched-tokens`): larger
        on a large-memory GPU, where a long prompt's chunks then run at the prefill kernels' full rate (H100,
        s42: an 8192-token prompt beside 16 decodes, first token after 303 ms at 2048 tokens a step, 234 ms at
        8192), smaller for a server, whose decoding requests wait out each chunk (their longest step 71 against
        149 ms)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        large = False
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            large = props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower()
        return (8192 if self.serving else 16384) if large else (2048 if self.serving else 8192)

    @classmethod
    def of(cls, model: str | Glm5NextModel | EngineArgs, **kwargs) -> EngineArgs:
        """`model` itself when it is already engine arguments (with `kwargs` replaced), else new arguments."""
        if isinstance(model, EngineArgs):
            return dataclasses.replace(model, **kwargs) if kwargs else model
        return cls(model, **kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Register the engine options (every field with option metadata) on `parser`."""
        for f in dataclasses.fields(cls):
            if "help" not in f.metadata:
                continue
            kw = dict(f.metadata["argparse"])
            names = [f.metadata["flag"] or "--" + f.name.replace("_", "-"), *kw.pop("aliases", [])]
            default = None if f.name == "capture_sizes" else f.default  # absent: the engine's default sizes
            parser.add_argument(*names, dest=f.name, default=default, help=f.metadata["help"] or None, **kw)

    @classmethod
    def from_cli(cls, args: argparse.Namespace, **kwargs) -> EngineArgs:
        """The arguments the parsed engine options of `add_cli_args` give, with `kwargs` (`model`, and whatever
        the command sets itself) added."""
        options = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if "help" in f.metadata}
        if options["capture_sizes"]:
            options["capture_sizes"] = _capture_sizes(options["capture_sizes"])
        else:
            del options["capture_sizes"]
        kwargs.setdefault("model", args.model)
        return cls(**options, **kwargs)
