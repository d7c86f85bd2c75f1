"""Relax integration: attention in a Relax module run as one kernel (the kernel library's,
or one cascaded-reduction kernel fused from it).

* :class:`DispatchAttention`: on CUDA targets, ``R.nn.attention`` as a call of the
  kernel library's kernels (:mod:`.dispatch`);
* :class:`FuseAttention`: the module pass (patterns in :mod:`.patterns`, GPU schedule in
  :mod:`.gpu_schedule`);
* ``relax_pipeline="cascade"`` for ``tvm.compile``: TVM's default pipeline with both
  passes first (:func:`cascade_pipeline`), registered when this package is imported.
"""

from .dispatch import DispatchAttention
from .fuse_attention import FuseAttention
from .patterns import attention_patterns
from .pipeline import PIPELINE_NAME, cascade_pipeline, register

register()

__all__ = ["DispatchAttention", "FuseAttention", "PIPELINE_NAME", "attention_patterns", "cascade_pipeline"]
