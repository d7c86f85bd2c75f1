"""TVM's MFMA tensor intrinsics (``tvm.s_tir.tensor_intrin.rocm``: 16 x 16 x 16 fp16
products into fp32, a wavefront of 64 lanes) as a schedule uses them: the register
layouts of the A, B and accumulator tiles over the last two axes of a buffer, and a
load of a B operand stored [N, K] (a linear layer's weight), which TVM ships
unregistered. (TVM's module registers every ROCm intrinsic when imported: it is imported
when a ROCm schedule is made, by :func:`~tvm_cascade.tvm_intrinsics.imported`.)"""
from ..tvm_intrinsics import imported

LANES = 64  # a wavefront
TILE = 16  # m, n and k of one instruction


def _rocm():
    return imported("tvm.s_tir.tensor_intrin.rocm")


def _tiled(layout_name):
    def index_map(*index):
        *outer, r, c = index
        return (*outer, r // TILE, c // TILE, *getattr(_rocm(), layout_name)(r % TILE, c % TILE))

    return index_map


#: Buffer index -> (leading indices, 16 x 16 tile, lane, element) of an A operand
#: ([M, K]), a B operand ([K, N]) and an accumulator. Lane ``l`` holds A[l % 16, 4 *
#: (l // 16) + e] and B[4 * (l // 16) + e, l % 16]: a B stored [N, K] is held in A's
#: layout of its own indices.
a_fragment = _tiled("shared_16x16_to_local_64x4_layout_A")
b_fragment = _tiled("shared_16x16_to_local_64x4_layout_B")
accumulator = _tiled("shared_16x16_to_local_64x4_layout_C")


def intrinsics(transposed_b: bool) -> tuple:
    """Names of (A load, B load, product, zero fill) for a B operand stored [K, N] or,
    with ``transposed_b``, [N, K] (its load registered on first use; the product is the
    same: TVM's ``b_transposed`` product expects another register layout than its
    transposed load gives, so it is not used)."""
    from tvm.s_tir import TensorIntrin  # pylint: disable=import-outside-toplevel

    rocm = _rocm()
    load_b = rocm.ROCM_MFMA_LOAD_16x16_B_SHARED_f16_INTRIN
    if transposed_b:
        load_b = "tvm_cascade.rocm_mfma_load_b_nk_16x16_shared_f16"
        if TensorIntrin.get(load_b, allow_missing=True) is None:
            TensorIntrin.register(load_b, *rocm.get_mfma_load_intrin(16, "float16", "shared", is_b=True, transposed=True))
    return (
        rocm.ROCM_MFMA_LOAD_16x16_A_SHARED_f16_INTRIN,
        load_b,
        rocm.ROCM_MFMA_f16f16f32_INTRIN,
        rocm.ROCM_MFMA_fill_16x16_f32_INTRIN,
    )


def bind_accumulator_lanes(sch, block, unroll):
    """Loops (rows, cols) of ``block``, which reads an accumulator tile at its own
    ``(row, col)``: each lane takes the elements it holds (lane ``col % 16 + 16 * (row %
    16 // 4)``, element ``row % 4``); ``unroll(loop)`` marks the loops over tiles and
    elements."""
    rows, cols = sch.get_loops(block)[-2:]
    row_tile, quad, element = sch.split(rows, [None, 4, 4])
    col_tile, col = sch.split(cols, [None, TILE])
    sch.reorder(row_tile, col_tile, element, quad, col)
    sch.bind(sch.fuse(quad, col), "threadIdx.x")
    for loop in (row_tile, col_tile, element):
        unroll(loop)
