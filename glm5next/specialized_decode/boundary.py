"""The boundary stage: the fused mHC post -> pre -> RMSNorm between two sublayers, plus the
first layer's expand + pre and the last layer's post + contract + final norm."""

from __future__ import annotations

from ..config import MHC_POST_MULT, Glm5NextConfig


class BoundaryStage:
    """Calls the Triton boundary kernels with one layer's mixer and norm."""

    def __init__(self, config: Glm5NextConfig) -> None:
        self.consts = dict(hc_eps=config.hc_eps, rms_eps=config.rms_norm_eps, sinkhorn_iters=config.hc_sinkhorn_iters,
                           post_mult=MHC_POST_MULT)

    def __call__(self, out, streams, post, comb, hc, norm, release_late: bool = False):
        """(new streams, post, comb, normalized next input) after a sublayer output `out`. With
        `release_late` the launch after it (a programmatic dependent) starts only once the boundary's
        partial products are stored, beside its finisher."""
        from ..kernels.boundary import mhc_boundary

        return mhc_boundary(out, streams, post, comb, hc.fn, hc.base, hc.scale, norm.weight, norm_eps=norm.eps,
                            pdl="late" if release_late else None, **self.consts)

    def first(self, embedded, hc, norm, release_late: bool = False):
        """(streams, post, comb, normalized input) of layer 0 from the embeddings."""
        from ..kernels.boundary import mhc_first

        return mhc_first(embedded, hc.fn, hc.base, hc.scale, norm.weight, norm_eps=norm.eps,
                         pdl="late" if release_late else None, **self.consts)

    def last(self, out, streams, post, comb, final_norm):
        """The post-norm hidden states after the last sublayer."""
        from ..kernels.boundary import mhc_last

        return mhc_last(out, streams, post, comb, final_norm.weight, norm_eps=final_norm.eps)
