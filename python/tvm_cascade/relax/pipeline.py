"""The ``"cascade"`` Relax pipeline: TVM's default pipeline for the target, with
:class:`.DispatchRowChains` first (on CUDA and ROCm a cross-entropy loss, as
``torch.export`` gives it or ``nll_loss`` of a log-softmax, a log-sum-exp and an MoE
router's top-k become one fused kernel each, one block per row; before TVM's library
dispatch, which makes sort kernels of ``topk``) and :class:`.DispatchScaledGemm` (on
CUDA and ROCm an RMSNorm feeding a GEMM becomes one tensor-core kernel), then the attention
passes, before legalization: on GPUs :class:`.DispatchAttention` (attention on
the kernel library's kernels; what they do not serve is left to the default lowering,
so that the pipeline is never slower than the default one there) and
:class:`.KVCacheAttention` (TVM's paged KV cache on the library's kernels), on other
targets :class:`.FuseAttention` (every attention fused into one generic kernel). On
CUDA and ROCm, :func:`~.row_kernels.schedule_row_chains` runs before dlight's
default schedules: a softmax or log-softmax over rows of a static length up to 4096 (an
MoE router's, an attention's the library left) becomes one block per row.

``tvm.compile(mod, target, relax_pipeline="cascade")`` resolves the name through
``tvm.relax.get_pipeline`` once ``tvm_cascade`` is imported. A module without attention,
loss, router, row chains or RMSNorm + GEMM goes through exactly the passes of
``relax_pipeline="default"``.
"""

from typing import Optional

import tvm
from tvm import relax

from .dispatch import DispatchAttention
from .fuse_attention import FuseAttention
from .kv_cache import KVCacheAttention
from .row_dispatch import DispatchRowChains
from .scaled_gemm_dispatch import DispatchScaledGemm
from .row_kernels import schedule_row_chains

PIPELINE_NAME = "cascade"


def cascade_pipeline(tile: int = 64, method: str = "auto", chunks: Optional[int] = None):
    """TVM's default Relax pipeline for the current target with attention on the kernel
    library's kernels (GPUs) or fused first (other targets; see :class:`.FuseAttention`
    for ``tile``, ``method`` and ``chunks``)."""

    @tvm.transform.module_pass(opt_level=0, name="CascadePipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
        dispatch = relax.pipeline.library_dispatch_passes(target) if target is not None else []
        on_gpu = target is not None and "gpu" in target.keys
        attention = [DispatchAttention(), KVCacheAttention()] if on_gpu else [FuseAttention(tile, method, chunks)]
        # Row chains first: the library dispatch turns ``topk`` into TVM's sort kernels.
        passes = [DispatchRowChains(), DispatchScaledGemm()] + dispatch + attention + [_default_pipeline(target)]
        return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def _default_pipeline(target):
    """The pipeline ``relax.build`` runs for ``relax_pipeline="default"`` on ``target``,
    on CUDA and ROCm with :func:`~.row_kernels.schedule_row_chains` before dlight."""
    if target is None or "gpu" not in target.keys:
        return relax.get_pipeline("default")
    backend = {"cuda": relax.backend.cuda, "rocm": relax.backend.rocm}.get(target.kind.name)
    if backend is None:
        return relax.get_default_pipeline(target)
    phases = backend.pipeline
    legalize = phases.legalize_passes(target)
    dlight = next((k for k, p in enumerate(legalize) if p.info.name == "ApplyDefaultSchedule"), len(legalize))
    legalize.insert(dlight, schedule_row_chains)
    passes = phases.library_dispatch_passes(target) + legalize
    passes += phases.dataflow_lower_passes(target) + phases.finalize_passes(target)

    @tvm.transform.module_pass(opt_level=0, name="CascadeDefaultPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline


def register() -> None:
    """Make ``"cascade"`` a pipeline name of ``tvm.relax.get_pipeline`` (once)."""
    if PIPELINE_NAME not in relax.pipeline.PIPELINE_MAP:
        relax.pipeline.register_pipeline(PIPELINE_NAME)(cascade_pipeline)
