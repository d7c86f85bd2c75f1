"""Schedule helpers for warp tiles on ``mma.sync``: TVM's 16 x 16 fragment layout over
the last two axes of a buffer, the lanes that hold a fragment's elements, 16 x 16 tiles
to tensorize, and 128-bit copies to shared memory whose rows the ldmatrix of a tile
reads without bank conflicts. Shared by the prefill and scaled-GEMM schedules."""
from ..cuda import tensor_cores
from ..cuda.tensor_cores import cuda_intrinsics

WARP = 32
MMA = 16  # the m16n16k16 tile the TVM mma intrinsics cover
VECTOR = 8  # fp16 elements in a 128-bit copy
SHARED = "shared.dyn"


def fragment(*index):
    """Buffer index -> (its leading indices, 16 x 16 tile, lane, element) of the
    ldmatrix/mma fragment layout over the last two axes."""
    *outer, r, c = index
    layout = cuda_intrinsics().shared_16x16_to_ldmatrix_32x8_layout
    return (*outer, r // MMA, c // MMA, *layout(r % MMA, c % MMA))


def bind_fragment_lanes(sch, block, column_pairs=False):
    """Loops (rows, cols) of ``block``, which reads or writes a 16 x 16-tiled fragment
    at its own ``(row, col)``: each lane takes the elements its fragment holds (lane
    ``4 * (row % 8) + (col % 8) // 2``, two rows and two column pairs per tile); with
    ``column_pairs`` each pair is one vector access."""
    rows, cols = sch.get_loops(block)[-2:]
    row_tile, row_half, row = sch.split(rows, [None, 2, 8])
    col_tile, col_half, col_pair, col = sch.split(cols, [None, 2, 4, 2])
    unrolled = [row_tile, col_tile, row_half, col_half]
    if column_pairs:
        sch.reorder(*unrolled, row, col_pair, col)
        sch.vectorize(col)
    else:
        sch.reorder(*unrolled, col, row, col_pair)
        unrolled.append(col)
    sch.bind(sch.fuse(row, col_pair), "threadIdx.x")
    for loop in unrolled:
        sch.annotate(loop, tensor_cores.UNROLL, 1)


def tile(sch, block):
    """The loop over one 16 x 16 tile of ``block``'s last two loops."""
    r, c = sch.get_loops(block)[-2:]
    ro, ri = sch.split(r, [None, MMA])
    co, ci = sch.split(c, [None, MMA])
    sch.reorder(ro, co, ri, ci)
    return ri


def copy_in_words(sch, copy, writer, warps=None, lanes=WARP):
    """Block ``copy`` (loops rows x cols last) in 128-bit words by the ``lanes`` lanes of
    ``warps`` warps (None: of the warp whose loop already holds it), the rows of the
    shared buffer that block ``writer`` writes padded by one word: the eight row
    addresses of an ldmatrix, or the eight rows of a fragment's lanes, hit distinct
    banks."""
    fused = sch.fuse(*sch.get_loops(copy)[-2:])
    if warps is None:
        _, tx, vec = sch.split(fused, [None, lanes, VECTOR])
    else:
        _, ty, tx, vec = sch.split(fused, [None, warps, lanes, VECTOR])
        sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(vec)
    sch.storage_align(writer, 0, axis=-2, factor=MMA, offset=VECTOR)
