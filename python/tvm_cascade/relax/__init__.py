"""Relax integration: attention in a Relax module fused into one cascaded-reduction kernel.

* :class:`FuseAttention`: the module pass (patterns in :mod:`.patterns`, GPU schedule in
  :mod:`.gpu_schedule`);
* ``relax_pipeline="cascade"`` for ``tvm.compile``: TVM's default pipeline with the pass
  first (:func:`cascade_pipeline`), registered when this package is imported.
"""

from .fuse_attention import FuseAttention
from .patterns import attention_patterns
from .pipeline import PIPELINE_NAME, cascade_pipeline, register

register()

__all__ = ["FuseAttention", "PIPELINE_NAME", "attention_patterns", "cascade_pipeline"]
