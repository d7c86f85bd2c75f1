"""``Schedule.replicate``: compute a block's values redundantly, once per replica, so that
the threads that need a value each hold their own copy.

In the mma fragment layout the four lanes of a quad share a row: each holds some of
the row's scores and some of its output. Row statistics (the running max and sum, the
repair factors) computed once per row must reach those lanes through shared memory and a
barrier; replicated four times, as ``[row, replica]`` in warp memory with replica ``c``
held by lane ``4 * (row % 8) + c``, every lane computes its own copy in registers and only
the reduction over the quad reads other lanes (shuffles, by TVM's warp-memory lowering).
"""
import tvm
import tvm_ffi
from tvm.ir import expr as ir_expr
from tvm.s_tir import Schedule
from tvm.s_tir.stmt import SBlockRealize

from ..analysis.scope import buffer_accesses, buffer_params, dtype_of
from ..errors import FusionError
from ..trace import append_instruction
from ..trace.kinds import register_kind
from . import ir
from .rolling_update import scope_of

#: Block annotation of a replicated block: its number of replicas.
REPLICAS = "tvm_cascade.replicas"
SPATIAL = 0  # IterVar.iter_type of a spatial iterator


def replicate(self: Schedule, block, factor, stride=1) -> None:
    """Compute ``block`` ``factor`` times over, each replica into its own copy of the
    buffers it writes.

    ``block`` gains a spatial iterator ``v_replica`` over ``[0, factor)``, bound to a new
    innermost loop ``replica`` around it, and every buffer it writes a trailing axis of
    ``factor``; it writes and reads its own replica. A block that reads those buffers reads
    its own replica too if it is replicated itself (by an earlier or later ``replicate``
    with the same ``factor``), else replica ``(v_last // stride) % factor`` of its last
    spatial iterator ``v_last`` (0 without one): all replicas hold the same values, so the choice only places the
    read (the replica a thread holds). Reads ``block`` makes of buffers other replicated
    blocks write become reads of its own replica. The block gets the annotation
    ``REPLICAS`` = ``factor``.

    ``block`` must sit in the root scope and be the only writer of the buffers it writes,
    which must be allocated in the root block (not function parameters); ``factor`` must
    be at least 2 and ``stride`` at least 1. Otherwise :class:`tvm_cascade.FusionError` is
    raised and the schedule is left unchanged.

    Parameters
    ----------
    block : SBlockRV
        The block to replicate, e.g. a row's running max.
    factor : int
        The number of replicas, e.g. the 4 lanes of an mma fragment that share a row.
    stride : int
        Consecutive values of a reader's last iterator that read one replica, e.g. 2 for
        the element pairs of an mma fragment's lane.

    Examples
    --------
    Before replicate, in TensorIR, the IR is:

    .. code-block:: python

        @T.prim_func(s_tir=True)
        def before(S: T.Buffer((8, 16), "float32"), E: T.Buffer((8, 16), "float32")):
            m = T.sblock_alloc_buffer((8,))
            for i, j in T.grid(8, 16):
                with T.sblock("max"):
                    vi, vj = T.axis.remap("SR", [i, j])
                    with T.init():
                        m[vi] = T.min_value("float32")
                    m[vi] = T.max(m[vi], S[vi, vj])
            for i, j in T.grid(8, 16):
                with T.sblock("exp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    E[vi, vj] = T.exp(S[vi, vj] - m[vi])

    Create the schedule and do replicate:

    .. code-block:: python

        sch = tvm.s_tir.Schedule(before)
        sch.replicate(sch.get_sblock("max"), 4, 2)

    After applying replicate, the IR becomes:

    .. code-block:: python

        @T.prim_func(s_tir=True)
        def after(S: T.Buffer((8, 16), "float32"), E: T.Buffer((8, 16), "float32")):
            m = T.sblock_alloc_buffer((8, 4))
            for i, j in T.grid(8, 16):
                for replica in range(4):
                    with T.sblock("max"):
                        vi, vj, v_replica = T.axis.remap("SRS", [i, j, replica])
                        T.sblock_attr({"tvm_cascade.replicas": 4})
                        with T.init():
                            m[vi, v_replica] = T.min_value("float32")
                        m[vi, v_replica] = T.max(m[vi, v_replica], S[vi, vj])
            for i, j in T.grid(8, 16):
                with T.sblock("exp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    E[vi, vj] = T.exp(S[vi, vj] - m[vi, vj // 2 % 4])
    """
    factor, stride = int(factor), int(stride)
    target = self.get(block)
    name = target.name_hint
    func, root_sref = scope_of(self, block)
    root = root_sref.stmt
    if factor < 2 or stride < 1:
        raise FusionError(f"replicate: block '{name}' needs at least 2 replicas and a positive stride, got {factor}, {stride}")
    if REPLICAS in target.annotations:
        raise FusionError(f"replicate: block '{name}' is replicated already")
    written = [region.source for region in target.writes]
    outside = [b.name for b in written if not any(b.same_as(a) for a in root.alloc_buffers)]
    if outside:
        raise FusionError(
            f"replicate: block '{name}' writes {', '.join(outside)}, which the root block does "
            "not allocate (a function parameter keeps its shape)"
        )
    blocks = ir.blocks_in(root)
    for other in blocks:
        if not other.same_as(target) and any(r.source.same_as(b) for r in other.writes for b in written):
            raise FusionError(
                f"replicate: block '{other.name_hint}' also writes a buffer of block '{name}', "
                "whose replicas would differ"
            )
    # Buffers of replicated blocks, with their replica counts.
    replicated = {
        region.source: int(other.annotations[REPLICAS])
        for other in blocks
        if REPLICAS in other.annotations
        for region in other.writes
    }
    for buffer, indices in buffer_accesses(ir.body_and_init(target)):
        if buffer not in replicated:
            continue
        if replicated[buffer] != factor:
            raise FusionError(
                f"replicate: block '{name}' reads {buffer.name}, which has "
                f"{replicated[buffer]} replicas, not {factor}"
            )
        if not _is_selector(indices[-1], factor):
            raise FusionError(
                f"replicate: block '{name}' reads {buffer.name} at {list(indices)}, whose last "
                "index no longer picks a replica (replicate every block before transforming "
                "the layout of their buffers)"
            )
    grown = {b: ir.like_buffer(b, b.name, list(b.shape) + [factor]) for b in written}
    buffers = buffer_params(func) + [grown.get(b, b) for b in root.alloc_buffers]
    reuse = {}

    def rewrite(realize):
        old = realize.block
        if old.same_as(target):
            new, loop_var = _replicated(realize, grown, replicated, factor)
            reuse[old] = new = ir.with_regions(new, buffers)
            replicas = SBlockRealize(list(realize.iter_values) + [loop_var], realize.predicate, new)
            return ir.nest([(loop_var, tvm.tirx.const(factor, dtype_of(loop_var)))], replicas)
        if not any(_reads(old, b) for b in grown):
            return realize
        # A replicated reader reads its own replica (its last iterator).
        replica = old.iter_vars[-1].var if REPLICAS in old.annotations else _selector(old, factor, stride)
        reuse[old] = new = ir.with_regions(_with_reads(old, grown, replica), buffers)
        return SBlockRealize(realize.iter_values, realize.predicate, new)

    body = tvm_ffi.structural_map(root.body, (SBlockRealize, rewrite))
    alloc = [grown.get(b, b) for b in root.alloc_buffers]
    ir.replace_root(self, root_sref, ir.copy_block(root, body=body, alloc_buffers=alloc), reuse)
    append_instruction(self, "Replicate", [block], [factor, stride])


def _replicated(realize, grown, replicated, factor):
    """(the block of ``realize`` with a replica iterator, writing ``grown`` buffers and
    reading its own replica of those and of ``replicated`` ones; its new loop)."""
    block = realize.block
    dtype = dtype_of(realize.iter_values[0]) if len(realize.iter_values) else "int32"
    loop_var = tvm.tirx.Var("replica", dtype)
    var = tvm.tirx.Var("v_replica", dtype)
    iv = tvm.tirx.IterVar(tvm.ir.Range.from_min_extent(0, factor), var, SPATIAL)

    def store(s):
        new = grown.get(s.buffer)
        return s if new is None else tvm.tirx.BufferStore(new, s.value, list(s.indices) + [var])

    def load(l):
        if l.source in grown:
            return tvm.tirx.BufferLoad(grown[l.source], list(l.indices) + [var])
        if l.source in replicated:  # read so far at the replica its reader picked
            return tvm.tirx.BufferLoad(l.source, list(l.indices)[:-1] + [var])
        return l

    new = _mapped(
        block, [(ir_expr.TensorLoad, load), (tvm.tirx.BufferStore, store)],
        iter_vars=list(block.iter_vars) + [iv], annotations={**block.annotations, REPLICAS: factor},
    )
    return new, loop_var


def _with_reads(block, grown, replica):
    """``block`` reading replica ``replica`` of the ``grown`` buffers."""

    def load(l):
        new = grown.get(l.source)
        return l if new is None else tvm.tirx.BufferLoad(new, list(l.indices) + [replica])

    return _mapped(block, (ir_expr.TensorLoad, load))


def _mapped(block, callbacks, **changes):
    """``block`` with ``callbacks`` (``tvm_ffi.structural_map``'s) applied to its body and
    init, and ``changes`` to its other fields."""
    init = None if block.init is None else tvm_ffi.structural_map(block.init, callbacks)
    return ir.copy_block(block, body=tvm_ffi.structural_map(block.body, callbacks), init=init, **changes)


def _selector(block, factor, stride):
    spatial = [iv.var for iv in block.iter_vars if iv.iter_type == SPATIAL]
    if not spatial:
        return tvm.tirx.const(0, "int32")
    last = spatial[-1]
    dtype = dtype_of(last)
    return tvm.tirx.floormod(tvm.tirx.floordiv(last, tvm.tirx.const(stride, dtype)), tvm.tirx.const(factor, dtype))


def _is_selector(index, factor):
    """Whether ``index`` is a replica choice of :func:`_selector` for ``factor`` replicas."""
    if isinstance(index, tvm.tirx.IntImm):
        return int(index) == 0
    if not (isinstance(index, tvm.tirx.FloorMod) and isinstance(index.b, tvm.tirx.IntImm) and int(index.b) == factor):
        return False
    picked = index.a
    if isinstance(picked, tvm.tirx.FloorDiv) and isinstance(picked.b, tvm.tirx.IntImm):
        picked = picked.a
    return isinstance(picked, tvm.tirx.Var)


def _reads(block, buffer):
    return any(region.source.same_as(buffer) for region in block.reads)


register_kind("Replicate", "replicate", ("block",), ("factor", "stride"))
