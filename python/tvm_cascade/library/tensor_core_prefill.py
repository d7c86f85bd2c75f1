"""The tensor-core prefill family: :mod:`tvm_cascade.schedules.prefill`'s schedule of
``ops.attention`` on ``mma.sync`` (``ldmatrix``, ``cp.async``), for CUDA GPUs from
sm_80, every variant. It has a schedule of static lengths only
(:mod:`.static_lengths`): the runtime-length kernels take
:class:`~.warp_specialized_prefill.WarpSpecializedPrefill` on Hopper and the generic
kernel elsewhere.
"""
from __future__ import annotations

import math

from ..cuda import tensor_cores
from ..schedules import prefill
from .spec import AttentionSpec


class TensorCorePrefill:
    """Prefill of static lengths on ``mma.sync`` tensor cores."""

    name = "tensor_core_prefill"
    queries = None
    runtime = False
    kind = "prefill"
    space = "mma"
    config_type = prefill.PrefillConfig
    needs_variant = False
    # Its shared memory is dynamic and larger than the static 48 KB VerifyGPUCode allows.
    verifies_gpu_code = False
    build_func = prefill.BUILD_FUNC

    def schedule_supports(self, spec: AttentionSpec, seq_q, seq_kv):
        if spec.target_kind != "cuda":
            return f"the tensor-core prefill schedule is for CUDA, not {spec.target_kind}"
        return None

    def padding(self, group, seq_q, head_dim, config=None):
        """Whole tiles of every choice of the design space, and of ``config``'s."""
        rows, keys = prefill.PADDING
        if config is None:
            return rows, keys
        return math.lcm(rows, config.rows), math.lcm(keys, config.keys)

    def schedule(self, func, spec: AttentionSpec, config=None):
        return prefill.schedule_prefill(func, config or prefill.PrefillConfig())

    def design_space(self, spec: AttentionSpec):
        return prefill.prefill_design_space()

    def scheduled(self, mod):
        return prefill.chooses_registers(mod)

    def prefers(self, spec: AttentionSpec):
        return True

    def compile(self, mod, target):
        return prefill.build(mod, target)

    def register_intrinsics(self):
        tensor_cores.cuda_intrinsics()
