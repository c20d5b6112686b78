"""The boundary stage: the fused mHC post -> pre -> RMSNorm between two sublayers, plus the
first layer's expand + pre and the last layer's post + contract + final norm.

Choices: "fused"; "fused-deferred", the same with each comb left pending after its first Sinkhorn
iteration and finished by the next boundary's chunk programs (`mhc_boundary`'s `defer_sinkhorn`).
In a step that defers, every boundary defers, so each comb that passes between them is pending."""

from __future__ import annotations

import torch

from ..config import MHC_POST_MULT, Glm5NextConfig
from ..kernels import boundary as boundary_kernels
from .copies import Fp16Copies


class BoundaryStage:
    """Calls the Triton boundary kernels with one layer's mixer and norm."""

    def __init__(self, config: Glm5NextConfig, copies: Fp16Copies | None = None,
                 sinkhorn_in_registers: bool | None = None) -> None:
        self.consts = dict(hc_eps=config.hc_eps, rms_eps=config.rms_norm_eps, sinkhorn_iters=config.hc_sinkhorn_iters,
                           post_mult=MHC_POST_MULT)
        self.copies = copies
        """Where a boundary asked for an fp16 copy of its output files it."""
        self.sinkhorn_in_registers = sinkhorn_in_registers
        """Sinkhorn's form in every launch plan: None the plan's choice by device (registers on a GPU, tiles in
        the interpreter); True / False force it (tests run the GPU's register form in the interpreter)."""

    def _x16(self, like: torch.Tensor, want: bool) -> torch.Tensor | None:
        if not want or self.copies is None:
            return None
        return torch.empty(like.shape[0], like.shape[-1], dtype=torch.float16, device=like.device)

    def _filed(self, result, x16):
        if x16 is not None:
            self.copies.put(result[3], x16)
        return result

    def __call__(self, out, streams, post, comb, hc, norm, release_late: bool = False, deferred: bool = False,
                 x16: bool = False):
        """(new streams, post, comb, normalized next input) after a sublayer output `out`. With
        `release_late` the launch after it (a programmatic dependent) starts only once the boundary's
        partial products are stored, beside its finisher; `deferred`: `comb` and the new comb are pending;
        `x16`: the kernel also writes the input in fp16, filed in `copies` for the projections that read it."""
        buf = self._x16(out, x16)
        y = boundary_kernels.mhc_boundary(out, streams, post, comb, hc.fn, hc.base, hc.scale, norm.weight,
                                          norm_eps=norm.eps, pdl="late" if release_late else None,
                                          defer_sinkhorn=deferred, comb_pending=deferred, x16=buf,
                                          sinkhorn_in_registers=self.sinkhorn_in_registers, **self.consts)
        return self._filed(y, buf)

    def first(self, embedded, hc, norm, release_late: bool = False, deferred: bool = False, x16: bool = False):
        """(streams, post, comb, normalized input) of layer 0 from the embeddings (`deferred`: the comb
        is pending; `x16` as for a boundary)."""
        buf = self._x16(embedded, x16)
        y = boundary_kernels.mhc_first(embedded, hc.fn, hc.base, hc.scale, norm.weight, norm_eps=norm.eps,
                                       pdl="late" if release_late else None, defer_sinkhorn=deferred, x16=buf,
                                       sinkhorn_in_registers=self.sinkhorn_in_registers, **self.consts)
        return self._filed(y, buf)

    def last(self, out, streams, post, comb, final_norm, deferred: bool = False):
        """The post-norm hidden states after the last sublayer (`deferred`: `comb` is pending)."""
        return boundary_kernels.mhc_last(out, streams, post, comb, final_norm.weight, norm_eps=final_norm.eps,
                                         comb_pending=deferred, hc_eps=self.consts["hc_eps"],
                                         sinkhorn_iters=self.consts["sinkhorn_iters"],
                                         sinkhorn_in_registers=self.sinkhorn_in_registers)
