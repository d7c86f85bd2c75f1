"""TIR passes: fuse cascaded reductions without a hand-written schedule."""
from .fuse import FusedChain, fuse_cascaded_reductions
from .pass_ import FuseCascadedReductions

__all__ = ["FuseCascadedReductions", "FusedChain", "fuse_cascaded_reductions"]
