"""Fences, commits and waits for the batches of asynchronous wgmma instructions.

A loop annotated :data:`.wgmma.BATCH` issues a batch of ``wgmma.mma_async``. The pass
:func:`sync_batches` (on device functions, before warp memory is lowered) fences before
each batch, commits it, and waits for it as late as the code allows: before the first
later statement that touches the registers it reads or writes (its accumulators, its fp16
A operand), with the ``wait_group`` depth that leaves the batches committed after it in
flight. So a schedule that issues tile j+1's Q·Kᵀ and tile j's P·V back to back
(FlashAttention-3's intra-warpgroup overlap) gets ``wait_group 1`` before the softmax
reads the scores while P·V still runs. A wait never moves past a thread-block barrier
(past it other threads overwrite the shared memory a batch may still read), out of a
loop or branch body, or out of the kernel.
"""
import tvm
import tvm_ffi
from tvm.ir import expr as ir_expr
from tvm.script import tirx as T

from ..analysis.chain import substitute
from ..analysis.scope import uses_var
from ..primitives import ir
from .wgmma import BATCH

_INSTRUCTIONS = ("tirx.ptx.wgmma_f16_ss", "tirx.ptx.wgmma_f16_rs")
FENCE_OPERAND = "tvm_cascade_wgmma_fence_operand"
#: An empty asm statement that takes a register as input and output: the compiler must
#: have computed the value before it and cannot assume it after it. Without it, the
#: register writes before a batch (zeroed accumulators, the fp16 or bf16 operand) and the reads
#: after its wait move across the wgmma fence and wait (asm statements order memory, not
#: registers), and ptxas serialises the instructions around them.
FENCE_OPERAND_SOURCE = f"""
__forceinline__ __device__ void {FENCE_OPERAND}(float& r) {{ asm volatile("" : "+f"(r) :: "memory"); }}
template <typename Pair> __forceinline__ __device__ void {FENCE_OPERAND}(Pair& r) {{
  static_assert(sizeof(Pair) == 4, "a pair of fp16 or bf16");
  asm volatile("" : "+r"(*reinterpret_cast<unsigned*>(&r)) :: "memory");
}}
"""


def fence_operand(register):
    """The operand fence (:data:`FENCE_OPERAND`) of ``register``, a load of a float32 or a
    ``float16x2`` register."""
    return T.cuda.func_call(FENCE_OPERAND, register, source_code=FENCE_OPERAND_SOURCE)


def register_fence(count):
    """A TVMScript macro ``fence(registers, first)``: :func:`fence_operand` of
    ``registers[first]`` to ``registers[first + count - 1]``, unrolled."""

    @T.macro
    def fence(registers, first):
        for i in T.unroll(count):
            T.evaluate(fence_operand(registers[first + i]))

    return fence


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvm_cascade.SyncWgmmaBatches")
def sync_batches(func, _mod, _ctx):
    """Each loop annotated :data:`.wgmma.BATCH` is fenced before (shared memory for the
    async proxy, registers for the instructions) and committed, and waited for before
    the first statement that needs it (module docstring); the annotation goes. In a
    function with batches, each thread also fences its shared-memory stores for the
    async proxy before every barrier of the thread block: a batch reads what other
    threads stored, and their fences after the barrier could come after its
    instructions read (with two warpgroups a block, results were wrong one run in a few
    without)."""
    if not ir.contains(func.body, _is_batch):
        return func
    body = _Batches().region(func.body)
    return func.with_body(tvm_ffi.structural_map(body, (tvm.tirx.Evaluate, _fence_before_barrier)))


class _Batches:
    """Straight-line code in program order, with the batches committed and not yet
    waited for."""

    def __init__(self):
        self.pending = []  # (fences after its wait, names of the registers it touches)
        self.steps = {}  # one-step loops around the statement visited: variable -> value

    def region(self, stmt):
        """``stmt`` with every batch in it waited for by its end."""
        out = self.visit(stmt)
        self.wait(0, out)
        return _seq(out)

    def wait(self, depth, out):
        """Wait until ``depth`` batches are left in flight."""
        if len(self.pending) <= depth:
            return
        done = len(self.pending) - depth
        out.append(tvm.tirx.Evaluate(T.ptx.wgmma.wait_group.sync.aligned(depth)))
        out.extend(fences for fences, _ in self.pending[:done])
        self.pending = self.pending[done:]

    def wait_for(self, stmt, out):
        """Wait for the batches whose registers ``stmt`` touches (and those before them)."""
        touched = _buffer_names(stmt)
        needed = [k for k, (_, registers) in enumerate(self.pending) if registers & touched]
        if needed:
            self.wait(len(self.pending) - needed[-1] - 1, out)

    def visit(self, stmt):
        """The statements that replace ``stmt``."""
        if isinstance(stmt, tvm.tirx.SeqStmt):
            return [new for child in stmt.seq for new in self.visit(child)]
        out = []
        if _is_batch(stmt):
            self.wait_for(stmt, out)
            inner = ir.copy_loop(stmt, annotations={k: v for k, v in stmt.annotations.items() if k != BATCH})
            out += [
                # Shared memory written by ordinary (and cp.async) stores, read by the async proxy.
                tvm.tirx.Evaluate(T.ptx.fence.proxy.async_.shared__cta()),
                _register_operands(inner, accumulators_only=False),
                # Accumulators and register operands written before the batch.
                tvm.tirx.Evaluate(T.ptx.wgmma.fence.sync.aligned()),
                inner,
                tvm.tirx.Evaluate(T.ptx.wgmma.commit_group.sync.aligned()),
            ]
            # (Its wait may come after the one-step loops around it end.)
            fences = substitute(_register_operands(inner, accumulators_only=True), self.steps)
            self.pending.append((fences, _register_names(inner)))
            return out
        if ir.contains(stmt, ir.is_block_barrier):
            # Past the barrier other threads may overwrite what the batches read.
            self.wait(0, out)
        has_batches = ir.contains(stmt, _is_batch)
        if has_batches and _straight_line(stmt):
            if isinstance(stmt, tvm.tirx.For):
                self.steps[stmt.loop_var] = stmt.min
            stmt = _map_bodies(stmt, lambda body: _seq(self.visit(body)))
            self.steps.pop(getattr(stmt, "loop_var", None), None)
            return out + [stmt]
        self.wait_for(stmt, out)
        if has_batches:
            # A loop or a branch: its batches are waited for inside it.
            stmt = _map_bodies(stmt, lambda body: _Batches().region(body))
        return out + [stmt]


def _straight_line(stmt):
    """Whether ``stmt``'s body runs once, right after ``stmt`` begins, in the same
    threads: attributes (but not the kernel's thread scopes), lets and one-step loops."""
    if isinstance(stmt, tvm.tirx.AttrStmt):
        return stmt.attr_key not in ("thread_extent", "virtual_thread")
    if isinstance(stmt, tvm.tirx.For):
        return isinstance(stmt.extent, tvm.tirx.IntImm) and stmt.extent.value == 1 and stmt.thread_binding is None
    return isinstance(stmt, tvm.tirx.LetStmt)


def _map_bodies(stmt, change):
    """``stmt`` (a loop, branch, scope or let) with ``change`` applied to its bodies."""
    if isinstance(stmt, tvm.tirx.IfThenElse):
        return tvm.tirx.IfThenElse(
            stmt.condition, change(stmt.then_case), None if stmt.else_case is None else change(stmt.else_case)
        )
    if isinstance(stmt, tvm.tirx.For):
        return ir.copy_loop(stmt, body=change(stmt.body))
    if isinstance(stmt, tvm.tirx.AttrStmt):
        return tvm.tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, change(stmt.body))
    if isinstance(stmt, tvm.tirx.LetStmt):
        return tvm.tirx.LetStmt(stmt.var, stmt.value, change(stmt.body))
    if isinstance(stmt, tvm.tirx.While):
        return tvm.tirx.While(stmt.condition, change(stmt.body))
    raise TypeError(f"cannot wait for wgmma batches inside a {type(stmt).__name__}")


def _is_batch(node):
    return isinstance(node, tvm.tirx.For) and BATCH in node.annotations


def _seq(stmts):
    return stmts[0] if len(stmts) == 1 else tvm.tirx.SeqStmt(stmts)


def _buffer_names(stmt):
    """Names of the buffers ``stmt`` loads from or stores to. (By name: at this point of
    the lowering an instruction's operand and a later load of the same register array
    can hold distinct variables of the same name; the names in a function are unique.)"""
    names = set()

    def visit(node):
        if isinstance(node, ir_expr.TensorLoad):
            names.add(node.source.name)
        elif isinstance(node, tvm.tirx.BufferStore):
            names.add(node.buffer.name)

    tvm_ffi.structural_walk(stmt, visit)
    return names


def _register_loads(call, accumulators_only):
    loads = []
    tvm_ffi.structural_walk(call.args, lambda node: loads.append(node) if isinstance(node, ir_expr.TensorLoad) else None)
    # (The descriptors are expressions of addresses, no registers.)
    return [
        load for load in loads
        if load.source.dtype == "float32" or (load.source.dtype == "float16" and not accumulators_only)
    ]


def _instructions(stmt):
    calls = []
    tvm_ffi.structural_walk(
        stmt,
        lambda node: calls.append(node)
        if isinstance(node, ir_expr.Call) and getattr(node.op, "name", "") in _INSTRUCTIONS
        else None,
    )
    return calls


def _register_names(loop):
    return {load.source.name for call in _instructions(loop) for load in _register_loads(call, False)}


def _register_operands(loop, accumulators_only):
    """``loop`` with each wgmma instruction replaced by operand fences on the registers
    it reads (the accumulators, and the fp16 A operand unless ``accumulators_only``)."""

    def fences(evaluate):
        call = evaluate.value
        if not (isinstance(call, ir_expr.Call) and getattr(call.op, "name", "") in _INSTRUCTIONS):
            return evaluate
        return tvm.tirx.SeqStmt(
            [tvm.tirx.Evaluate(fence_operand(load)) for load in _register_loads(call, accumulators_only)]
        )

    def unrolled(node):
        # Each register once: a loop its fences do not index goes (e.g. over the depth
        # for the accumulators); the others are unrolled, their indices constants.
        if not uses_var(node.body, node.loop_var):
            return node.body
        return ir.copy_loop(node, kind=tvm.tirx.ForKind.UNROLLED)

    return tvm_ffi.structural_map(tvm_ffi.structural_map(loop, (tvm.tirx.Evaluate, fences)), (tvm.tirx.For, unrolled))


def _fence_before_barrier(evaluate):
    if not ir.is_block_barrier(evaluate.value):
        return evaluate
    return tvm.tirx.SeqStmt([tvm.tirx.Evaluate(T.ptx.fence.proxy.async_.shared__cta()), evaluate])
