"""ROCm code generation (no AMD GPU here: builds only): the generic fused kernels of the
transform and Relax paths, the non-attention cascades (also as one block per row, and
RMSNorm + GEMM as one kernel on the matrix cores), and the CUDA-core split-k decode
schedule build code objects for MI300 (gfx942) and MI200 (gfx90a).

TVM links an AMDGPU code object with ``ld.lld-<its LLVM major>``, else ``ld.lld``, and
the ROCm device bitcode under ``$ROCM_PATH/amdgcn/bitcode``. Debian's ``lld`` (14) is
too old for the objects of TVM's LLVM; ``lld-19`` and ``rocm-device-libs`` (which
``.ci/run`` installs) serve, the linker offered under the name TVM looks for.
"""
import os
import shutil
from pathlib import Path

import pytest
import tvm
from relax_row_cases import row_model

import tvm_cascade  # noqa: F401
from tvm_cascade import ops
from tvm_cascade.ops import cascades
from tvm_cascade.relax import FuseAttention
from tvm_cascade.relax.gpu_schedule import schedule_fused_for_gpu
from tvm_cascade.relax.testing import chain_module
from tvm_cascade.schedules.decode import schedule_decode
from tvm_cascade.transform import fuse_cascaded_reductions

ARCHS = ("gfx942", "gfx90a")
#: Where the device bitcode may be: ROCm's own install, Debian's rocm-device-libs.
ROCM_ROOTS = ("/opt/rocm", "/usr/lib/x86_64-linux-gnu")
#: The oldest lld that links the objects of TVM's LLVM.
OLDEST_LLD = 17


def _linker():
    major = tvm.target.codegen.llvm_version_major(allow_none=True) or OLDEST_LLD
    for version in range(max(major, OLDEST_LLD) + 8, OLDEST_LLD - 1, -1):
        found = shutil.which(f"ld.lld-{version}")
        if found:
            return major, found
    return major, None


def _rocm_root():
    roots = [os.environ["ROCM_PATH"]] if "ROCM_PATH" in os.environ else list(ROCM_ROOTS)
    return next((r for r in roots if (Path(r) / "amdgcn" / "bitcode" / "ocml.bc").exists()), None)


@pytest.fixture(scope="module", autouse=True)
def rocm_toolchain(tmp_path_factory):
    major, linker = _linker()
    root = _rocm_root()
    if linker is None or root is None:
        pytest.skip(f"needs ld.lld {OLDEST_LLD}+ and ROCm device bitcode (lld-19, rocm-device-libs: .ci/run installs them)")
    shims = tmp_path_factory.mktemp("lld")
    (shims / f"ld.lld-{major}").symlink_to(linker)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", f"{shims}{os.pathsep}{os.environ['PATH']}")
        patch.setenv("ROCM_PATH", root)
        yield


def _asm(module):
    """The assembly of the AMDGPU code object in runtime module ``module`` or its imports."""
    modules = [module]
    while modules:
        module = modules.pop()
        if module.kind == "hip":
            return module.inspect_source("asm")
        modules += list(module.imports)
    raise AssertionError("no AMDGPU module")


def _kernels(executable):
    """The kernels of the AMDGPU code object built into ``executable``."""
    return [line.split()[-1] for line in _asm(executable.mod).splitlines() if ".amdhsa_kernel " in line]


def _fused(func, method):
    sch = tvm.s_tir.Schedule(func)
    chains = fuse_cascaded_reductions(sch, tile=64, method=method, chunks=4)
    assert chains
    schedule_fused_for_gpu(sch, chains)
    return sch.mod


FUSED = {
    "attention-split-k": lambda: _fused(ops.attention(1, 4, 1, 1, 256, 64, variant="causal"), "split_k"),
    "attention-rolling": lambda: _fused(ops.attention(1, 4, 1, 64, 256, 64, variant="causal"), "rolling"),
    "logsumexp": lambda: _fused(cascades.logsumexp(4, 1000), "auto"),
    "cross-entropy": lambda: _fused(cascades.cross_entropy(4, 1000), "auto"),
    "rmsnorm-gemm": lambda: _fused(cascades.rmsnorm_gemm(4, 64, 256), "auto"),
    "absmax-quant-gemm": lambda: _fused(cascades.absmax_quant_gemm(4, 64, 256), "auto"),
    "moe-routing": lambda: _fused(cascades.moe_routing(16, 64, 2, with_topk=False), "auto"),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", list(FUSED))
def test_fused_kernels_build_code_objects(kind, arch):
    """Every fused cascade (scheduled as for any GPU) links into a code object holding
    its kernels: the split-k chunks, rolling rows and combines."""
    executable = tvm.compile(FUSED[kind](), target=tvm.target.Target({"kind": "rocm", "mcpu": arch}))
    assert _kernels(executable)[:2] == ["main_kernel", "main_kernel_1"]


ROWS = {
    "cross-entropy": (lambda: cascades.cross_entropy(8, 4096, "float16"), 4096),
    "log-sum-exp, chunks past the row": (lambda: cascades.logsumexp(8, 1001, "float16"), 1001),
    "moe-routing-top-k": (lambda: cascades.moe_routing(16, 64, 2, "float16"), 64),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", list(ROWS))
def test_one_block_per_row_schedule_builds(kind, arch):
    """``schedules.rows`` (cross-thread reductions over a row's threads, on AMD's
    64-wide wavefronts) links into a code object of one kernel."""
    from tvm_cascade.schedules.rows import plan_rows, schedule_rows

    build, length = ROWS[kind]
    sch = tvm.s_tir.Schedule(build())
    schedule_rows(sch, **plan_rows(length, "float16"))
    assert _kernels(tvm.compile(sch.mod, target=tvm.target.Target({"kind": "rocm", "mcpu": arch}))) == ["main_kernel"]


@pytest.mark.parametrize("arch", ARCHS)
def test_relax_fused_attention_builds(arch):
    """A hand-written attention layer fused by ``FuseAttention`` on a ROCm target,
    through the default pipeline."""
    target = tvm.target.Target({"kind": "rocm", "mcpu": arch})
    with target:
        mod = FuseAttention()(chain_module(1, 64, 256, 8, 2, 64))
    fused = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert fused, "nothing fused"
    assert _kernels(tvm.compile(mod, target=target, relax_pipeline="default"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind, kernel", [("softmax", "softmax_kernel"),
                                          ("exported_cross_entropy", "cross_entropy_4096_float16_int64_kernel")])
def test_relax_row_kernels_build(kind, kernel, arch):
    """A Relax softmax and a cross-entropy through the cascade pipeline: the row kernel
    (after legalisation; the dispatched fused one) in the code object."""
    target = tvm.target.Target({"kind": "rocm", "mcpu": arch})
    executable = tvm.compile(row_model(kind, 64, 4096, "float16"), target=target, relax_pipeline="cascade")
    assert kernel in _kernels(executable)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa4"])
def test_split_k_decode_schedule_builds(heads, arch):
    """The CUDA-core form of the split-k decode schedule (the tensor-core form, GQA
    groups of 8, is PTX's ``mma.sync``: CUDA only): chunk and combine kernels."""
    func = ops.attention(1, *heads, 1, 1024, 128, variant="causal", dtype="float16")
    sch = schedule_decode(func, *heads, 128, multiprocessors=104)
    kernels = _kernels(tvm.compile(sch.mod, target=tvm.target.Target({"kind": "rocm", "mcpu": arch})))
    assert len(kernels) >= 2


SCALED_GEMMS = {
    "rmsnorm-nk": lambda: cascades.rmsnorm_gemm(256, 256, 256, dtype="float16", weight_layout="nk"),
    "rmsnorm-kn": lambda: cascades.rmsnorm_gemm(256, 256, 256, dtype="float16"),
    "rmsnorm-tokens": lambda: cascades.rmsnorm_gemm(
        tvm.tirx.Var("m", "int32"), 256, 256, dtype="float16", pad_rows=128, out_dtype="float32"
    ),
    "absmax": lambda: cascades.absmax_quant_gemm(128, 256, 256, dtype="float16"),
}


@pytest.mark.parametrize("arch, kind", [("gfx942", "rmsnorm-nk"), ("gfx90a", "rmsnorm-kn"), ("gfx942", "rmsnorm-tokens"), ("gfx942", "absmax")])
def test_scaled_gemm_builds_on_matrix_cores(arch, kind):
    """RMSNorm + GEMM (W as [N, K] or [K, N]; any number of rows, padded; a float32
    output) and the abs-max-scaled GEMM as one kernel with the GEMM on MFMA
    (``ScaledGemmConfig(mfma=True)``: wavefronts of 64 whole rows, TVM's ROCm
    intrinsics): one kernel, a tile's 128 MFMA instructions, and no lane shuffles (each
    lane reads the accumulators it holds in the epilogue)."""
    from tvm_cascade.cuda import tensor_cores
    from tvm_cascade.schedules.scaled_gemm import ScaledGemmConfig, schedule_scaled_gemm

    sch = schedule_scaled_gemm(SCALED_GEMMS[kind](), ScaledGemmConfig(mfma=True))
    executable = tensor_cores.build(sch.mod, tvm.target.Target({"kind": "rocm", "mcpu": arch}))
    assert _kernels(executable) == ["main_kernel"]
    asm = _asm(executable.mod)
    assert asm.count("v_mfma_f32_16x16x16") == 128 and "ds_bpermute" not in asm


def test_relax_norm_and_linear_build_on_the_matrix_core_kernel():
    """``relax_pipeline="cascade"`` for ROCm puts ``matmul(rms_norm(x), permute_dims(w))``
    on the MFMA kernel (64-row tiles, a symbolic token count padded to 128) and builds."""
    from test_relax_scaled_gemm import norm_then_linear
    from tvm import relax
    from tvm_cascade.relax.scaled_gemm_dispatch import DispatchScaledGemm

    target = tvm.target.Target({"kind": "rocm", "mcpu": "gfx942"})
    tokens = tvm.tirx.Var("tokens", "int64")
    for rows, symbol in (((2, 32), "tvm_cascade_rmsnorm_gemm_64_128_256_nk"), ((1, tokens), "tvm_cascade_rmsnorm_gemm_m_128_256_nk")):
        with target:
            out = DispatchScaledGemm()(norm_then_linear(rows, 256, 128, True))
        (packed,) = [
            b.value for blk in out["main"].body.blocks for b in blk.bindings
            if isinstance(b.value, relax.Call) and b.value.op.name == "relax.call_dps_packed"
        ]
        assert packed.args[0].global_symbol == symbol
        (library,) = out.attrs["external_mods"]
        assert "v_mfma" in _asm(library)
    assert tvm.compile(norm_then_linear((2, 32), 256, 128, True), target=target, relax_pipeline="cascade")


def test_cuda_only_kernels_are_refused_for_rocm():
    """The tensor-core decode form (GQA groups of 8: PTX ``mma.sync``) and
    ``compile_attention`` (CUDA kernels) refuse a ROCm target with a clear error."""
    from tvm_cascade.cuda import tensor_cores
    from tvm_cascade.kernels import compile_attention

    rocm = tvm.target.Target({"kind": "rocm", "mcpu": "gfx942"})
    func = ops.attention(1, 8, 1, 1, 1024, 128, variant="causal", dtype="float16")
    sch = schedule_decode(func, 8, 1, 128, multiprocessors=104)
    with pytest.raises(ValueError, match="tensor-core fragments are PTX .*CUDA targets only, not rocm"):
        tensor_cores.build(sch.mod, rocm)
    with pytest.raises(ValueError, match="compile_attention builds CUDA kernels .* not rocm"):
        compile_attention(1, 8, 1, 1, 1024, 128, target=rocm)
