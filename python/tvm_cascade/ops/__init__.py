"""Unfused TE compute definitions of cascaded reductions.

Every builder returns a ``tvm.tirx.PrimFunc`` (``te.create_prim_func``) with one
block per stage; the block names are a contract with the ``rolling_update``
schedule primitive (see the ``*_BLOCKS`` constants).  This package imports only
``tvm`` and ``numpy`` (and ``ml_dtypes`` lazily for bfloat16 test data), never
other ``tvm_cascade`` modules.

Modules
-------
``flex_attention`` -- :func:`attention`, :func:`variant_te_mods`
``variants``       -- :class:`AttentionVariant`, :data:`VARIANTS` (no TVM import)
``cascades``       -- :func:`logsumexp`, :func:`cross_entropy`,
                      :func:`absmax_quant_gemm`, :func:`rmsnorm_gemm`, :func:`moe_routing`
``reference``      -- numpy float64 references (never calls TVM)
``testing``        -- :func:`testing.run_prim_func`, :func:`testing.random_attention_inputs`,
                      :func:`testing.block_names`, ...

(The module is called ``flex_attention`` so that ``tvm_cascade.ops.attention``
is unambiguously the builder function.)
"""

from . import reference, testing
from .flex_attention import (
    ATTENTION_BLOCKS,
    ATTENTION_BLOCKS_NORMALIZE_FIRST,
    attention,
    variant_te_mods,
)
from .cascades import (
    ABSMAX_QUANT_GEMM_BLOCKS,
    CROSS_ENTROPY_BLOCKS,
    LOGSUMEXP_BLOCKS,
    MOE_ROUTING_BLOCKS,
    MOE_TOPK_BLOCKS,
    RMSNORM_GEMM_BLOCKS,
    absmax_quant_gemm,
    cross_entropy,
    logsumexp,
    moe_routing,
    rmsnorm_gemm,
)
from .variants import VARIANTS, AttentionVariant, get_variant

__all__ = [
    "ATTENTION_BLOCKS",
    "ATTENTION_BLOCKS_NORMALIZE_FIRST",
    "ABSMAX_QUANT_GEMM_BLOCKS",
    "CROSS_ENTROPY_BLOCKS",
    "LOGSUMEXP_BLOCKS",
    "MOE_ROUTING_BLOCKS",
    "MOE_TOPK_BLOCKS",
    "RMSNORM_GEMM_BLOCKS",
    "VARIANTS",
    "AttentionVariant",
    "absmax_quant_gemm",
    "attention",
    "cross_entropy",
    "get_variant",
    "logsumexp",
    "moe_routing",
    "reference",
    "rmsnorm_gemm",
    "testing",
    "variant_te_mods",
]
