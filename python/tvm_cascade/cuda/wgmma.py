"""Hopper's warpgroup MMA (``wgmma.mma_async``, sm_90a) in per-warp schedules.

A schedule whose warps each own 16 rows of each 64-row tile of their warpgroup (four
consecutive warps) tensorizes one warp's part of a GEMM step (16 rows x N columns x 16)
with the intrinsics here; each one's implementation issues the whole warpgroup's
m64nNk16 (all four warps reach it together, each with its own accumulators). Shared-memory operands
are in the core-matrix layout (:func:`core_matrices`); the accumulators in TVM's 16 x 16
fragment layout with the column tiles folded into the element index
(:func:`accumulator`). The instructions are asynchronous: a loop annotated
:data:`BATCH` issues a batch of them, which :func:`.wgmma_batches.sync_batches` fences
before and waits for (docs/WGMMA.md has the verified facts).
"""
from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder


WARP = 32
WARPS = 4  # a warpgroup
BLOCK_ROWS = 128  # query rows of a tile of the A operand: two m64 halves
ROWS = 16  # a warp's rows of one m64 instruction
DEPTH = 16  # k of one instruction (fp16)
CORE = 8  # a core matrix: 8 rows of 8 fp16 (16 contiguous bytes each)
SHARED = "shared.dyn"
#: A loop annotation: the loop issues a batch of wgmma instructions;
#: :func:`.wgmma_batches.sync_batches` fences before it and waits for the batch.
BATCH = "tvm_cascade.wgmma_batch"
#: The column counts the intrinsics are registered for (keys of a score tile, columns of
#: a pass over the output).
COLUMNS = (32, 64, 128)


def core_matrices(*index):
    """Buffer index -> the core-matrix layout over the last two axes (x, y with y
    contiguous in memory): 8 x 8 blocks of 128 contiguous bytes, ``(x // 8, y // 8,
    x % 8, y % 8)``. Both a K-major operand (Q, K: x the row, y the depth) and an MN-major
    one (V: x the depth, i.e. the key, y the column) are read from it."""
    *outer, x, y = index
    return (*outer, x // CORE, y // CORE, x % CORE, y % CORE)


def row_slices(slice_rows):
    """Index map (buffer index -> core matrices) of an A operand whose 128-row tiles (the
    last two axes: row, depth) warps own in slices of ``slice_rows``, four warps a
    warpgroup. With 16-row slices a warpgroup's 64 rows are one m64 instruction's; with
    32, the m64 instruction of half ``h`` gives warp ``w`` the rows ``16 w`` to ``16 w +
    15`` of its 64-row tile, so those hold rows ``32 w + 16 h`` onward. ``(tile, 8-row
    group, depth // 8, row % 8, depth % 8)``: a tile per 128 rows, its 16 row groups in
    the instruction's order."""
    if slice_rows not in (ROWS, 2 * ROWS):
        raise ValueError(f"a warp's rows are {ROWS} or {2 * ROWS}, not {slice_rows}")

    def layout(*index):
        *outer, r, k = index
        group = (r % BLOCK_ROWS) // CORE
        if slice_rows == 2 * ROWS:
            # (64 h + 16 w + r % 16) // 8 as a sum of independent terms (TVM inverts it).
            group = ((r % 32) // ROWS) * 8 + ((r % BLOCK_ROWS) // 32) * 2 + (r % ROWS) // CORE
        return (*outer, r // BLOCK_ROWS, group, k // CORE, r % CORE, k % CORE)

    return layout


def _fragment(r, c):
    """(lane, element) of TVM's 16 x 16 mma fragment layout (the wgmma accumulator's and
    register A operand's layout per warp)."""
    return 4 * (r % 8) + (c % 8) // 2, 4 * (c // 8) + (r // 8) * 2 + c % 2


def accumulator(*index):
    """Buffer index -> (leading indices, 16-row tile, lane, element) of a wgmma
    accumulator over the last two axes: the fragment layout with the 16-column tiles in
    the element index. (With the column tile as an index of its own, ``LowerWarpMemory``
    cannot lower the instruction's constant operands.)"""
    *outer, r, c = index
    lane, element = _fragment(r % 16, c % 16)
    return (*outer, r // 16, lane, (c // 16) * 8 + element)


def scores_intrin(columns):
    """Name of the intrinsic for ``C[16, columns] += A[16, 16]·B[columns, 16]ᵀ`` with A
    and B in shared memory (K-major core matrices), registering it on first use."""
    return _register("scores", columns)


def output_intrin(columns):
    """Name of the intrinsic for ``C[16, columns] += A[16, 16]·B[16, columns]`` with A in
    registers (a fp16 warp fragment) and B in shared memory (MN-major core matrices),
    registering it on first use."""
    return _register("output", columns)


def _register(kind, columns):
    name = f"tvm_cascade.wgmma_{kind}_m64n{columns}k16_f16_f32"
    if columns not in COLUMNS:
        raise ValueError(f"wgmma intrinsics exist for {COLUMNS} columns, not {columns}")
    if TensorIntrin.get(name, allow_missing=True) is None:
        desc, impl = (_scores if kind == "scores" else _output)(columns)
        TensorIntrin.register(name, desc, impl)
    return name


def descriptor(pointer, leading, stride, swizzle=False):
    """The wgmma shared-memory matrix descriptor of the matrix at ``pointer``: its leading
    and stride byte offsets, its layout 128-byte swizzled or not."""
    address = T.Cast("uint64", T.cuda.cvta_generic_to_shared(pointer))
    start = (address >> T.uint64(4)) & T.uint64(0x3FFF)
    flags = (1 << 62) if swizzle else 0
    if isinstance(leading, int) and isinstance(stride, int):
        # One constant: the fields as expressions would be shared by every descriptor of a
        # function, and common subexpression elimination would hoist them out of the
        # kernels where a function holds several (a host branch between kernels), as
        # 64-bit unsigned arguments, which TVM's CUDA launcher cannot pass.
        return start | T.uint64((leading >> 4) << 16 | (stride >> 4) << 32 | flags)
    bits = (start
            | (T.Cast("uint64", leading >> 4) << T.uint64(16))
            | (T.Cast("uint64", stride >> 4) << T.uint64(32)))
    return bits | T.uint64(flags) if swizzle else bits


def _descriptor(buf, offset, leading, stride):
    """:func:`descriptor` (no swizzle) of ``buf``'s fp16 element ``offset``, the leading
    and stride offsets given in elements."""
    pointer = T.tvm_access_ptr(T.type_annotation("float16"), buf.data, offset, 1, 1)
    return descriptor(pointer, leading * 2, stride * 2)


def _instruction(columns):
    return getattr(T.ptx.wgmma.mma_async.sync.aligned, f"m64n{columns}k16").f32.f16.f16


def _operands(kind, columns, a, b, c):
    """The buffers (A, B, C) of intrinsic ``kind`` ("scores" or "output") over ``columns``
    columns, declared for the description and the implementation alike: shared-memory
    operands with the strides of the buffers they are matched to (the descriptors are
    computed from them), the accumulator strided for a pass over part of its columns."""

    def strides(n):
        return [T.int32() for _ in range(n)]

    if kind == "scores":
        A = T.match_buffer(a, (2, 2, 8, 8), "float16", scope=SHARED, offset_factor=1, strides=strides(4))
        B = T.match_buffer(b, (columns // 8, 2, 8, 8), "float16", scope=SHARED, offset_factor=1, strides=strides(4))
    else:
        A = T.match_buffer(a, (1, 1, WARP, 8), "float16", scope="warp", offset_factor=1)
        B = T.match_buffer(b, (2, columns // 8, 8, 8), "float16", scope=SHARED, offset_factor=1, strides=strides(4))
    C = T.match_buffer(c, (1, WARP, columns // 2), "float32", scope="warp", offset_factor=1, strides=strides(3))
    for name, buf in zip("ABC", (A, B, C)):
        IRBuilder.name(name, buf)
    return A, B, C


def _root_regions(A, B, C):
    """The root block's regions: the whole of each buffer, C read and written."""
    whole = [buf[tuple(slice(0, extent) for extent in buf.shape)] for buf in (C, A, B)]
    T.reads(*whole)
    T.writes(whole[0])


def _description(kind, columns, a_element, b_element):
    """The description of intrinsic ``kind`` over ``columns`` columns: one warp's
    ``C[16, columns] += A[16, 16]·B`` with row ``i``, column ``j`` and depth ``k`` of the
    operands at ``a_element(A, i, k)`` and ``b_element(B, j, k)``."""

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle):
        A, B, C = T.meta_var(_operands(kind, columns, a, b, c))
        with T.sblock("root"):
            _root_regions(A, B, C)
            for i, j, k in T.grid(ROWS, columns, DEPTH):
                with T.sblock("update"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    _, lane, element = T.meta_var(accumulator(vi, vj))
                    C[0, lane, element] = C[0, lane, element] + T.Cast(
                        "float32", a_element(A, vi, vk)
                    ) * T.Cast("float32", b_element(B, vj, vk))

    return desc


def _implementation(kind, columns, sources, flags):
    """The implementation of intrinsic ``kind`` over ``columns`` columns: the warp's lanes
    issue the warpgroup's instruction with their accumulators, the A and B operands
    ``sources(A, B, tx)`` gives and the instruction's trailing ``flags``."""
    mma = _instruction(columns)

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle):
        A, B, C = T.meta_var(_operands(kind, columns, a, b, c))
        with T.sblock("root"):
            _root_regions(A, B, C)
            for tx in T.thread_binding(WARP, "threadIdx.x"):
                T.evaluate(mma(*[C[0, tx, r] for r in range(columns // 2)], *sources(A, B, tx), *flags))

    return impl


def _scores(columns):
    # A[row, depth] and B[column, depth], both K-major core matrices.
    desc = _description(
        "scores", columns,
        lambda A, i, k: A[i // 8, k // 8, i % 8, k % 8],
        lambda B, j, k: B[j // 8, k // 8, j % 8, k % 8],
    )

    def sources(A, B, tx):
        # The warpgroup's A tile: the 64-row half (eight 8-row groups) that this warp's
        # two row groups belong to, at the same depth.
        half = A.elem_offset // (8 * A.strides[0]) * (8 * A.strides[0]) + A.elem_offset % A.strides[0]
        return [
            _descriptor(A, half, A.strides[1], A.strides[0]),
            _descriptor(B, B.elem_offset, B.strides[1], B.strides[0]),
        ]

    return desc, _implementation("scores", columns, sources, (T.bool(True), 1, 1, 0, 0))


def _output(columns):
    def pair(A, tx, element):
        # Two fp16 of the fragment as one register (low half first).
        return T.reinterpret("uint32", A.vload([0, 0, tx, element], "float16x2"))

    # A the warp's fp16 fragment, B[depth, column] MN-major core matrices.
    desc = _description(
        "output", columns,
        lambda A, i, k: A[(0, 0, *_fragment(i, k))],
        lambda B, j, k: B[k // 8, j // 8, k % 8, j % 8],
    )

    def sources(A, B, tx):
        # MN-major B (trans_b = 1): the leading offset steps along the depth (keys), the
        # stride offset along the columns.
        return [*(pair(A, tx, element) for element in (0, 2, 4, 6)), _descriptor(B, B.elem_offset, B.strides[0], B.strides[1])]

    return desc, _implementation("output", columns, sources, (T.bool(True), 1, 1, 1))
