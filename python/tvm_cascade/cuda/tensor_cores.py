"""Building schedules that run on tensor cores: TVM's CUDA tensor intrinsics, registered
on first use, and ``tvm.compile`` with every warp fragment lowered to registers."""
import contextlib
import os

import tvm
import tvm_ffi
from tvm.s_tir.stmt import SBlock

from ..primitives import ir
from ..tvm_intrinsics import imported
from . import dependent_launch, wgmma_batches
from .copy_waits import defer_copy_waits
from .cast_offsets import hoist_cast_offsets


def cuda_intrinsics():
    """TVM's CUDA tensor intrinsics module, registered on first import
    (:func:`~tvm_cascade.tvm_intrinsics.imported`): the prefill schedule tensorizes with
    them, the CUDA codegen reads their index maps, and tuning records name them."""
    return imported("tvm.s_tir.tensor_intrin.cuda")


def build(mod, target, register_usage_level=None, min_blocks=None):
    """``tvm.compile``; a module with warp-scope buffers (tensor-core fragments) gets TVM's
    default pipeline except that every warp-scope buffer is lowered to registers and
    the small loops over fragments are unrolled afterwards. ``register_usage_level``, if
    given, is ptxas's ``--register-usage-level`` for the kernels (TVM passes 10, or
    ``TVM_CUDA_PTXAS_REG_LEVEL``, which a user's setting keeps precedence over).
    ``min_blocks``, if given, is the thread blocks per multiprocessor the kernels are
    compiled to fit (``__launch_bounds__(threads, min_blocks)``). A module whose
    fragments PTX instructions read or write (``mma.sync``, ``ldmatrix``) for a target
    other than CUDA raises ``ValueError``; one on AMD's matrix cores (MFMA, through TVM's
    ROCm intrinsics: :mod:`tvm_cascade.rocm.mfma`) builds for ROCm the same way.

    TVM 0.27's ``LowerWarpMemory`` lowers only the first warp buffer of a statement
    sequence per run (it rewrites the rest of the sequence for that buffer and stops);
    an accumulator left in warp scope is then filled and stored by lane 0's offsets while
    ``mma`` uses every lane's, and operands stay whole-warp arrays per thread (local
    memory). Running the pass until no warp buffer is left lowers them all; common
    subexpression elimination stays off, since it hides the lane term of the fragment
    offsets (``threadIdx.x * 8``) from that pass. A fragment indexed by a loop variable
    lives in local memory (the stack), not in registers: loops of up to
    ``UNROLL_STEPS`` steps and loops annotated with ``UNROLL`` are unrolled, after
    ``LowerWarpMemory`` (unrolled earlier, constant offsets hide the lane term from it
    too).

    A software-pipelined loop that commits several ``cp.async`` groups an iteration
    waits for each where it is first read (:mod:`.copy_waits`). On sm_90 and later, a
    function of several kernels has them launched as programmatic dependents
    (:mod:`.dependent_launch`).
    """
    target = tvm.target.Target(target)
    if target.kind.name != "cuda" and _has_warp_buffers(mod) and _uses_ptx(mod):
        raise ValueError(
            f"the module's tensor-core fragments are PTX (mma.sync, ldmatrix): CUDA targets only, "
            f"not {target.kind.name}; schedule it without tensor cores for this target"
        )
    if min_blocks is not None:
        mod = mod.with_attr(_MIN_BLOCKS, min_blocks)
    if dependent_launch.supported(target):
        mod = _launch_dependently(mod)
    with _register_usage_level(register_usage_level):
        if not _has_warp_buffers(mod):
            return tvm.compile(mod, target=target, tir_pipeline=_PLAIN_PIPELINE)
        with tvm.transform.PassContext(opt_level=3, config={"tirx.disable_cse_tir": True, "tirx.use_async_copy": True}):
            return tvm.compile(mod, target=target, tir_pipeline=_PIPELINE)


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvm_cascade.LaunchDependently")
def _launch_dependently(func, _mod, _ctx):
    """Functions of several kernels launched as programmatic dependents
    (:mod:`.dependent_launch`): the combine of a split-k decode starts as the chunks end."""
    return dependent_launch.enable(func) if dependent_launch.kernel_count(func) > 1 else func


@contextlib.contextmanager
def _register_usage_level(level):
    """TVM's CUDA compile callback reads the ptxas level from the environment."""
    if level is None or _REGISTER_LEVEL_ENV in os.environ:
        yield
        return
    os.environ[_REGISTER_LEVEL_ENV] = str(level)
    try:
        yield
    finally:
        del os.environ[_REGISTER_LEVEL_ENV]


_REGISTER_LEVEL_ENV = "TVM_CUDA_PTXAS_REG_LEVEL"


#: A module attribute: the kernels' thread blocks per multiprocessor (:func:`build`).
_MIN_BLOCKS = "tvm_cascade.min_blocks_per_multiprocessor"


@tvm.transform.module_pass(opt_level=0, name="tvm_cascade.LaunchBounds")
def _launch_bounds(mod, _ctx):
    """The device functions of a module with :data:`_MIN_BLOCKS` get TVM's attribute for
    ``__launch_bounds__``' minimum blocks (set on the host function, it does not reach
    the kernels)."""
    if mod.attrs is None or _MIN_BLOCKS not in mod.attrs:
        return mod
    blocks = int(mod.attrs[_MIN_BLOCKS])
    functions = {
        gvar: func.with_attr("tirx.launch_bounds_min_blocks_per_sm", blocks) if isinstance(func, tvm.tirx.PrimFunc) else func
        for gvar, func in mod.functions.items()
    }
    return tvm.IRModule(functions, attrs=mod.attrs)


_PIPELINE = "tvm_cascade_warp_lowered"
#: TVM's default pipeline, and the waits of kernels launched as programmatic dependents.
_PLAIN_PIPELINE = "tvm_cascade_s_tir"
UNROLL_STEPS = 128
#: A loop annotation: unroll the loop in full once fragments are in registers (a loop
#: too long for ``UNROLL_STEPS`` whose iterations index fragments, e.g. passes over an
#: accumulator).
UNROLL = "tvm_cascade.unroll_after_warp_lowering"
#: :func:`build` as a global function returning the runtime module, for MetaSchedule's builder
#: processes.
BUILD_FUNC = "tvm_cascade.build"


def _has_warp_buffers(mod):
    return _any_node(mod, lambda n: isinstance(n, SBlock) and any(b.scope() == "warp" for b in n.alloc_buffers))


def _uses_ptx(mod) -> bool:
    """Whether a function of ``mod`` calls a PTX instruction (``tirx.ptx_*``)."""
    return _any_node(mod, lambda n: isinstance(n, tvm.ir.expr.Call) and getattr(n.op, "name", "").startswith("tirx.ptx"))


def _any_node(mod, predicate) -> bool:
    """Whether a node of a PrimFunc of ``mod`` satisfies ``predicate``."""
    return any(ir.contains(f.body, predicate) for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc))


def _warp_allocations(func) -> int:
    found = [0]

    def visit(node):
        if isinstance(node, tvm.tirx.AllocBuffer) and node.buffer.scope() == "warp":
            found[0] += 1

    tvm_ffi.structural_walk(func.body, visit)
    return found[0]


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvm_cascade.UnaliasWarpBuffers")
def _unalias_warp_buffers(func, _mod, _ctx):
    """Replace each warp-scope buffer that TVM's storage planner declared over another
    one's allocation (an elementwise stage computed in place of its input, e.g. a tile's
    scores in place of its Q·Kᵀ accumulator) by the allocated buffer: ``LowerWarpMemory``
    rejects such a declaration as an access to a warp buffer's address."""
    allocated = set()
    declared = {}

    def visit(node):
        if isinstance(node, tvm.tirx.AllocBuffer) and node.buffer.scope() == "warp":
            allocated.add(node.buffer)
        elif isinstance(node, tvm.tirx.DeclBuffer) and node.buffer.scope() == "warp":
            # (Its storage: ``buffer_data(<allocated buffer>)``.)
            declared[node.buffer] = node.data.args[0]

    tvm_ffi.structural_walk(func.body, visit)
    aliases = {
        buffer: own
        for buffer, own in declared.items()
        if own in allocated and buffer.dtype == own.dtype and tvm_ffi.structural_equal(buffer.shape, own.shape)
    }
    if not aliases:
        return func

    def declaration(node):
        return tvm.tirx.Evaluate(0) if node.buffer in aliases else node

    body = ir.replace_buffers(tvm_ffi.structural_map(func.body, (tvm.tirx.DeclBuffer, declaration)), aliases)
    return func.with_body(body)


@tvm.transform.module_pass(opt_level=0, name="tvm_cascade.LowerAllWarpMemory")
def _lower_all_warp_memory(mod, _ctx):
    lower = tvm.tirx.transform.LowerWarpMemory()
    while any(_warp_allocations(f) for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)):
        before = mod
        mod = lower(mod)
        if tvm_ffi.structural_equal(before, mod):
            raise RuntimeError("LowerWarpMemory left warp-scope buffers it cannot lower")
    return mod


def _mark_unrolled(loop):
    if UNROLL not in loop.annotations:
        return loop
    annotations = {k: v for k, v in loop.annotations.items() if k != UNROLL}
    return ir.copy_loop(loop, kind=tvm.tirx.ForKind.UNROLLED, annotations=annotations)


@tvm.transform.module_pass(opt_level=0, name="tvm_cascade.UnrollFragmentLoops")
def _unroll_fragment_loops(mod, _ctx):
    marked = {
        gvar: func.with_body(tvm_ffi.structural_map(func.body, (tvm.tirx.For, _mark_unrolled)))
        if isinstance(func, tvm.tirx.PrimFunc) else func
        for gvar, func in mod.functions.items()
    }
    mod = tvm.IRModule(marked, attrs=mod.attrs)
    config = {"tirx.disable_cse_tir": True, "tirx.UnrollLoop": {"explicit_unroll": True, "auto_max_step": UNROLL_STEPS}}
    with tvm.transform.PassContext(opt_level=3, config=config):
        return tvm.tirx.transform.UnrollLoop()(mod)


def _pipeline_factory():
    from tvm.s_tir.pipeline import default_s_tir_pipeline

    pipeline, finalize_host, finalize_device = default_s_tir_pipeline()

    def finalize():
        return tvm.transform.Sequential(
            [
                _launch_bounds,
                defer_copy_waits,
                wgmma_batches.sync_batches,
                _unalias_warp_buffers,
                _lower_all_warp_memory,
                _unroll_fragment_loops,
                hoist_cast_offsets,
                finalize_device(),
                dependent_launch.wait_first,
            ]
        )

    return pipeline, finalize_host, finalize


def _plain_pipeline_factory():
    from tvm.s_tir.pipeline import default_s_tir_pipeline

    pipeline, finalize_host, finalize_device = default_s_tir_pipeline()
    return pipeline, finalize_host, lambda: tvm.transform.Sequential(
        [_launch_bounds, finalize_device(), dependent_launch.wait_first]
    )


tvm.tirx.compilation_pipeline.register_tir_pipeline(_PIPELINE, _pipeline_factory)
tvm.tirx.compilation_pipeline.register_tir_pipeline(_PLAIN_PIPELINE, _plain_pipeline_factory)
tvm_ffi.register_global_func(BUILD_FUNC, lambda mod, target, _params: build(mod, target).mod, override=True)
