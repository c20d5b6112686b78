"""The specialized decode executor: a measured policy, one plan per captured step, fused stages."""

from __future__ import annotations

import logging

import torch

from .decode import LayerStages, SpecializedDecode, Step, is_decode
from .policy import STAGES, Policy, PolicyError

__all__ = ["LayerStages", "Policy", "PolicyError", "SpecializedDecode", "STAGES", "Step", "is_decode",
           "build_executor", "DECODE_BACKENDS"]

logger = logging.getLogger(__name__)

DECODE_BACKENDS = ("auto", "specialized", "stock")


def build_executor(model, backend: str, policy_path: str | None, capture_sizes, enforce_eager: bool, q: int = 1):
    """The executor the runner plans captured decode steps with, or None (stock).

    `q`: tokens per decoding row in captured steps (k + 1 under speculative decoding).
    'auto' (the default) picks the specialized executor on one GPU for which a measured policy ships
    (or one is given), stock otherwise, and stock under tensor parallelism, where the executor has not
    yet been run on several GPUs; 'specialized' insists (an error names what is missing); 'stock' never.
    """
    if backend not in DECODE_BACKENDS:
        raise ValueError(f"decode_backend={backend!r}: choose one of {', '.join(DECODE_BACKENDS)}")
    if backend == "stock":
        return None
    if backend == "auto" and model.tp.size > 1:
        logger.info("decode_backend='auto' under tensor parallelism: captured steps run the stock forward "
                    "(pass decode_backend='specialized' to plan them)")
        return None
    device = model.embed_tokens.device
    if policy_path is not None:
        policy = Policy.from_file(policy_path)
    elif device.type == "cuda":
        policy = Policy.for_gpu(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
    else:
        policy = None
    if policy is None:
        if backend == "specialized":
            where = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"
            raise ValueError(f"decode_backend='specialized': no measured policy ships for {where}; "
                             f"measure one with `glm5next tune-policy` and pass it as the policy file")
        return None
    if enforce_eager and device.type == "cuda":
        if backend == "specialized":
            logger.warning("decode_backend='specialized' with enforce_eager: nothing is captured, so nothing is planned")
        return None
    return SpecializedDecode(model, policy, capture_sizes, q)
