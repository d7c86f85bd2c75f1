"""Tensor intrinsics for ``mma.sync.m16n8k16`` products of 16 rows by 8 columns.

TVM ships its mma intrinsics for 16 x 16 output tiles (two m16n8k16 instructions). A GQA
group of 8 query heads is one 8-wide tile: decode's scores of 16 keys with the group's
heads are ``C[key, head] += K[key, d] * Q[head, d]`` over 16 dims at a time, with K as
the 16 x 16 operand and Q as the 8 x 16 one, both read row by row from shared memory
(ldmatrix). The fragment layouts are PTX's:

* A (K, ``[row, dim]``): TVM's 16 x 16 ldmatrix layout (:func:`a_layout`);
* B (Q, ``[head, dim]``): lane ``4 * head + (dim % 8) // 2`` holds dims ``dim % 2`` of
  pairs ``dim // 8`` (4 halves, ``ldmatrix.x2``);
* C (fp32): lane ``4 * (row % 8) + col // 2`` holds ``col % 2`` of rows ``row // 8`` (4 floats).

:func:`register` registers the intrinsics, for ``float16`` and ``bfloat16`` operands.
"""
import functools

from tvm.s_tir import TensorIntrin
from tvm.script import tirx as T
from tvm.tirx import Cast

WARP = 32
ROWS, COLS, DEPTH = 16, 8, 16
A_LOCAL = ROWS * DEPTH // WARP  # halves of a lane's A fragment (8)
B_LOCAL = COLS * DEPTH // WARP  # halves of a lane's B fragment (4)
C_LOCAL = ROWS * COLS // WARP  # floats of a lane's accumulator (4)
_ABBREVIATION = {"float16": "fp16", "bfloat16": "bf16"}


def a_layout(row, col):
    """(lane, element) of a 16 x 16 A operand's ``(row, col)``: TVM's ldmatrix layout."""
    return 4 * (row % 8) + (col % 8) // 2, 4 * (col // 8) + 2 * (row // 8) + col % 2


def b_layout(col, depth):
    """(lane, element) of an 8 x 16 B operand stored ``[col, depth]``."""
    return 4 * col + (depth % 8) // 2, 2 * (depth // 8) + depth % 2


def c_layout(row, col):
    """(lane, element) of a 16 x 8 accumulator's ``(row, col)``."""
    return 4 * (row % 8) + col // 2, 2 * (row // 8) + col % 2


def load_name(operand, dtype):
    """The ldmatrix intrinsic of ``operand`` from shared memory: "A" (16 x 16, x4), "A_T"
    (the 16 x 16 A operand from a tile stored ``[depth, row]``, x4 .trans) or "B" (8 x 16,
    x2)."""
    return f"tvm_cascade_ldmatrix_{operand}_{dtype}"


def mma_name(dtype):
    return f"tvm_cascade_mma_16x8x16_{dtype}_f32"


FILL = "tvm_cascade_mma_fill_16x8_f32"


def store_name(scope):
    """Stores a 16 x 8 accumulator to a tile in ``scope`` stored ``[col, row]``."""
    return f"tvm_cascade_mma_store_8x16_f32_{scope}"


def _ldmatrix(dtype, rows, layout, local, matrices, transposed, address):
    """ldmatrix (``.trans`` if ``transposed``) of a ``rows x 16`` tile of shared memory,
    element ``(r, c)`` to ``layout(r, c)``; lane ``tx`` addresses the row that starts at
    ``address(tx, row stride)`` (lanes past the ``matrices`` 8 x 8 matrices' rows address
    rows that ldmatrix ignores)."""

    @T.prim_func(s_tir=True)
    def desc(warp_handle: T.handle, shared_handle: T.handle) -> None:
        shared = T.match_buffer(shared_handle, (rows, DEPTH), dtype, align=64, offset_factor=DEPTH, scope="shared")
        warp = T.match_buffer(warp_handle, (WARP, local), dtype, align=64, offset_factor=DEPTH, scope="warp")
        with T.sblock("root"):
            T.reads(shared[0:rows, 0:DEPTH])
            T.writes(warp[0:WARP, 0:local])
            for r, d in T.grid(rows, DEPTH):
                with T.sblock("shared_warp"):
                    vr, vd = T.axis.remap("SS", [r, d])
                    lane, element = T.meta_var(layout(vr, vd))
                    T.reads(shared[vr, vd])
                    T.writes(warp[lane, element])
                    warp[lane, element] = shared[vr, vd]

    @T.prim_func(s_tir=True)
    def impl(warp_handle: T.handle, shared_handle: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        shared = T.match_buffer(
            shared_handle, (rows, DEPTH), dtype, align=64, offset_factor=DEPTH, scope="shared", strides=[s0, s1]
        )
        warp = T.match_buffer(warp_handle, (WARP, local), dtype, align=64, offset_factor=DEPTH, scope="warp")
        with T.sblock("root"):
            T.reads(shared[0:rows, 0:DEPTH])
            T.writes(warp[0:WARP, 0:local])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                T.evaluate(
                    T.ptx_legacy.ldmatrix(
                        transposed,
                        matrices,
                        ".b16",
                        warp.data,
                        warp.elem_offset + local * tx,
                        shared.access_ptr("r"),
                        address(tx, s0),
                        dtype=dtype,
                    )
                )

    return desc, impl


def _mma(dtype):
    abbreviation = _ABBREVIATION[dtype]

    # The operands in the order attention's blocks multiply them: the B operand (query) first.
    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (WARP, A_LOCAL), dtype, align=64, offset_factor=DEPTH, scope="warp")
        B = T.match_buffer(b, (WARP, B_LOCAL), dtype, align=64, offset_factor=DEPTH, scope="warp")
        C = T.match_buffer(c, (WARP, C_LOCAL), "float32", align=64, offset_factor=COLS, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:C_LOCAL], B[0:WARP, 0:B_LOCAL], A[0:WARP, 0:A_LOCAL])
            T.writes(C[0:WARP, 0:C_LOCAL])
            for n, m, k in T.grid(COLS, ROWS, DEPTH):
                with T.sblock("C"):
                    vn, vm, vk = T.axis.remap("SSR", [n, m, k])
                    lane_c, element_c = T.meta_var(c_layout(vm, vn))
                    lane_a, element_a = T.meta_var(a_layout(vm, vk))
                    lane_b, element_b = T.meta_var(b_layout(vn, vk))
                    T.reads(C[lane_c, element_c], B[lane_b, element_b], A[lane_a, element_a])
                    T.writes(C[lane_c, element_c])
                    C[lane_c, element_c] = C[lane_c, element_c] + Cast("float32", B[lane_b, element_b]) * Cast(
                        "float32", A[lane_a, element_a]
                    )

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (WARP, A_LOCAL), dtype, align=64, offset_factor=DEPTH, scope="warp")
        B = T.match_buffer(b, (WARP, B_LOCAL), dtype, align=64, offset_factor=DEPTH, scope="warp")
        C = T.match_buffer(c, (WARP, C_LOCAL), "float32", align=64, offset_factor=COLS, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:C_LOCAL], B[0:WARP, 0:B_LOCAL], A[0:WARP, 0:A_LOCAL])
            T.writes(C[0:WARP, 0:C_LOCAL])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                T.evaluate(
                    T.ptx_legacy.mma(
                        "m16n8k16",
                        "row",
                        "col",
                        abbreviation,
                        abbreviation,
                        "fp32",
                        A.data,
                        A.elem_offset + tx * A_LOCAL,
                        B.data,
                        B.elem_offset + tx * B_LOCAL,
                        C.data,
                        C.elem_offset + tx * C_LOCAL,
                        False,
                        dtype="float32",
                    )
                )

    return desc, impl


def _fill():
    @T.prim_func(s_tir=True)
    def desc(c: T.handle) -> None:
        C = T.match_buffer(c, (WARP, C_LOCAL), "float32", scope="warp")
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:WARP, 0:C_LOCAL])
            for n, m in T.grid(COLS, ROWS):
                with T.sblock("C_warp"):
                    vn, vm = T.axis.remap("SS", [n, m])
                    lane, element = T.meta_var(c_layout(vm, vn))
                    T.reads()
                    T.writes(C[lane, element])
                    C[lane, element] = T.float32(0)

    @T.prim_func(s_tir=True)
    def impl(c: T.handle) -> None:
        C = T.match_buffer(c, (WARP, C_LOCAL), "float32", scope="warp", offset_factor=1)
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:WARP, 0:C_LOCAL])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                for element in T.serial(C_LOCAL):
                    C[tx, element] = T.float32(0)

    return desc, impl


def _store(scope):
    # The accumulator (row: key, col: head) goes to a tile stored [head, key], as
    # attention's scores are; each lane writes its 4 floats, 8 lanes a 32-byte run of keys.
    @T.prim_func(s_tir=True)
    def desc(c: T.handle, out: T.handle) -> None:
        C = T.match_buffer(c, (WARP, C_LOCAL), "float32", scope="warp")
        O = T.match_buffer(out, (COLS, ROWS), "float32", scope=scope)
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:C_LOCAL])
            T.writes(O[0:COLS, 0:ROWS])
            for n, m in T.grid(COLS, ROWS):
                with T.sblock("C_warp"):
                    vn, vm = T.axis.remap("SS", [n, m])
                    lane, element = T.meta_var(c_layout(vm, vn))
                    T.reads(C[lane, element])
                    T.writes(O[vn, vm])
                    O[vn, vm] = C[lane, element]

    @T.prim_func(s_tir=True)
    def impl(c: T.handle, out: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        C = T.match_buffer(c, (WARP, C_LOCAL), "float32", scope="warp", offset_factor=1)
        O = T.match_buffer(out, (COLS, ROWS), "float32", scope=scope, offset_factor=1, strides=[s0, s1])
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:C_LOCAL])
            T.writes(O[0:COLS, 0:ROWS])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                for element in T.serial(C_LOCAL):
                    O[tx % 4 * 2 + element % 2, tx // 4 + element // 2 * 8] = C[tx, element]

    return desc, impl


@functools.cache
def register():
    """Register the intrinsics (once; a few seconds): schedules tensorize with them and
    tuning records name them."""
    for dtype in _ABBREVIATION:
        TensorIntrin.register(mma_name(dtype), *_mma(dtype), override=True)
        for operand, loader in (
            ("A", (ROWS, a_layout, A_LOCAL, 4, False, lambda tx, stride: stride * (tx % 16) + 8 * (tx // 16))),
            # Lanes 0-7 address depths 0-7 at rows 0-7, lanes 8-15 the same depths at rows
            # 8-15, lanes 16-31 depths 8-15 likewise: the 8 x 8 matrices of a_layout's order.
            (
                "A_T",
                (DEPTH, lambda depth, row: a_layout(row, depth), A_LOCAL, 4, True,
                 lambda tx, stride: stride * (8 * (tx // 16) + tx % 8) + 8 * (tx // 8 % 2)),
            ),
            ("B", (COLS, b_layout, B_LOCAL, 2, False, lambda tx, stride: stride * (tx % 8) + 8 * (tx // 8 % 2))),
        ):
            TensorIntrin.register(load_name(operand, dtype), *_ldmatrix(dtype, *loader), override=True)
    TensorIntrin.register(FILL, *_fill(), override=True)
    for scope in ("global", "shared"):
        TensorIntrin.register(store_name(scope), *_store(scope), override=True)
