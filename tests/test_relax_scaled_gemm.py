"""``DispatchScaledGemm`` (the cascade pipeline's RMSNorm + GEMM pass) on the CPU: on
CUDA a norm feeding a matmul, with the weight as ``[K, N]`` or as a linear layer's
transposed ``[N, K]``, becomes one call of the tensor-core kernel (the warp-specialised
one on sm_90, the mma.sync one before), built and attached as an external library; what
the kernel does not serve is left; through the whole pipeline the module builds. GPU
numerics: test_scaled_gemm_gpu.py."""
import pytest
import tvm
import tvm_ffi
from relax_attention_cases import SM90A
from tvm import relax
from tvm.relax import op as R

import tvm_cascade  # noqa: F401  (registers the "cascade" pipeline)
from tvm_cascade.relax.scaled_gemm_dispatch import DispatchScaledGemm

SM80 = {"kind": "cuda", "arch": "sm_80"}
#: What each target's kernel source holds: TMA and wgmma on sm_90, mma.sync before.
KERNEL_MARKS = {"sm_90a": ("cp.async.bulk.tensor.2d", "wgmma.mma_async"), "sm_80": ("mma.sync",)}


def _kernel_source(library, target):
    source = library.imports[0].inspect_source()
    assert all(mark in source for mark in KERNEL_MARKS[target["arch"]])
    return source


def norm_then_linear(rows, k, n, transposed, dtype="float16"):
    """``matmul(rms_norm(x, gamma), w)``, ``w`` as ``permute_dims`` of an ``[n, k]``
    weight where ``transposed`` (``relax.frontend.nn.Linear``'s form)."""
    rows = rows if isinstance(rows, tuple) else (rows,)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(rows + (k,), dtype))
    gamma = relax.Var("gamma", relax.TensorType((k,), dtype))
    w = relax.Var("w", relax.TensorType((n, k) if transposed else (k, n), dtype))
    with bb.function("main", [x, gamma, w]):
        with bb.dataflow():
            normed = bb.emit(R.nn.rms_norm(x, gamma, axes=[-1], epsilon=1e-5))
            weight = bb.emit(R.permute_dims(w)) if transposed else w
            out = bb.emit_output(bb.emit(R.matmul(normed, weight)))
        bb.emit_func_output(out)
    return bb.get()


def _dispatch(mod, target=SM90A):
    with tvm.target.Target(target):
        return DispatchScaledGemm()(mod)


def _calls(mod):
    return [b.value for blk in mod["main"].body.blocks for b in blk.bindings if isinstance(b.value, relax.Call)]


@pytest.mark.parametrize("target", [SM90A, SM80])
@pytest.mark.parametrize("rows, transposed, layout", [(64, False, "kn"), ((2, 32), True, "nk")])
def test_norm_and_matmul_become_one_kernel_call(rows, transposed, layout, target):
    out = _dispatch(norm_then_linear(rows, 256, 128, transposed), target)
    packed = [c for c in _calls(out) if c.op.name == "relax.call_dps_packed"]
    assert len(packed) == 1 and packed[0].args[0].global_symbol == f"tvm_cascade_rmsnorm_gemm_64_128_256_{layout}"
    assert not any(getattr(c.op, "name", "") in ("relax.nn.rms_norm", "relax.matmul") for c in _calls(out))
    (library,) = out.attrs["external_mods"]
    _kernel_source(library, target)


def test_columns_that_are_no_whole_tile_take_the_warp_specialised_kernel():
    """96 columns: the sm_90 kernel's TMA boxes read zeros past them (the mma.sync
    kernel's 128-column tiles refuse them: below)."""
    out = _dispatch(norm_then_linear(64, 256, 96, False))
    (library,) = out.attrs["external_mods"]
    _kernel_source(library, SM90A)


def test_bfloat16_takes_the_warp_specialised_kernel():
    """bfloat16 inputs: sm_90's kernel (wgmma on bf16) serves them; sm_80's mma.sync
    kernel is float16 only, so there they are left."""
    model = norm_then_linear(64, 256, 128, True, "bfloat16")
    out = _dispatch(model)
    (packed,) = [c for c in _calls(out) if c.op.name == "relax.call_dps_packed"]
    assert packed.args[0].global_symbol == "tvm_cascade_rmsnorm_gemm_64_128_256_nk_bf16"
    (library,) = out.attrs["external_mods"]
    assert "m64n256k16_f32_bf16_bf16" in _kernel_source(library, SM90A)
    assert tvm_ffi.structural_equal(_dispatch(model, SM80), model)


@pytest.mark.parametrize("model, target", [
    (norm_then_linear(16, 256, 128, False), SM80),  # a decode step's few rows: a GEMV's work for mma.sync
    (norm_then_linear(64, 256, 128, False, "float32"), SM90A),
    (norm_then_linear(64, 256, 100, False), SM90A),  # rows of W of 200 bytes: no TMA copy
    (norm_then_linear(64, 256, 96, False), SM80),  # N not whole 128-column tiles
    (norm_then_linear(64, 256, 128, False), "llvm"),
])
def test_what_the_kernel_does_not_serve_is_left(model, target):
    out = _dispatch(model, target)
    assert tvm_ffi.structural_equal(out, model)


@pytest.mark.parametrize("target", [SM90A, SM80])
def test_any_number_of_rows_is_one_kernel(target):
    """A symbolic token count (a prompt) and a static count that is no whole tile both
    get one function: sm_80's kernel pads the rows to whole tiles in its copy of X,
    sm_90's TMA copies read zeros past the last row; for a symbolic count sm_90's
    function holds the kernel for few rows beside it, launched up to 16 rows."""
    tokens = tvm.tirx.Var("tokens", "int64")
    for rows, symbol in (((1, tokens), "tvm_cascade_rmsnorm_gemm_m_128_256_nk"), (48, "tvm_cascade_rmsnorm_gemm_48_128_256_nk")):
        out = _dispatch(norm_then_linear(rows, 256, 128, True), target)
        (packed,) = [c for c in _calls(out) if c.op.name == "relax.call_dps_packed"]
        assert packed.args[0].global_symbol == symbol
        (library,) = out.attrs["external_mods"]
        # Kernels declared and defined, none a padding pass of its own.
        kernels = 2 if target == SM90A and rows != 48 else 1
        assert _kernel_source(library, target).count("__global__") == 2 * kernels


def test_a_decode_steps_few_rows_take_the_kernel_for_few_rows():
    """16 rows on sm_90: the kernel for few rows (W's columns as wgmma's M, the rows its
    N of 16)."""
    out = _dispatch(norm_then_linear(16, 256, 128, False))
    (packed,) = [c for c in _calls(out) if c.op.name == "relax.call_dps_packed"]
    assert packed.args[0].global_symbol == "tvm_cascade_rmsnorm_gemm_16_128_256_kn"
    (library,) = out.attrs["external_mods"]
    assert "m64n16k16_f32_f16_f16" in _kernel_source(library, SM90A)


def test_the_cascade_pipeline_builds_it():
    """The executable links the kernel's library (its host code defines the symbol)."""
    executable = tvm.compile(norm_then_linear((2, 32), 256, 128, True), target=tvm.target.Target(SM90A),
                             relax_pipeline="cascade")
    hosts = [m.inspect_source() for m in executable.mod.imports if m.kind == "llvm"]
    assert sum("tvm_cascade_rmsnorm_gemm_64_128_256_nk" in source for source in hosts) == 1


def decomposed_norm_then_linear(gamma_after_cast):
    """The Relax TVM's torch frontend gives ``linear(rms_norm(x))`` (a hand-written
    RMSNorm: gamma times the cast-back product; ``torch.nn.RMSNorm``: the product times
    gamma cast to float32, then cast back), rows reshaped to 2-d, a float32 output."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 64, 256), "float16"))
    gamma = relax.Var("gamma", relax.TensorType((256,), "float16"))
    w = relax.Var("w", relax.TensorType((128, 256), "float16"))
    with bb.function("main", [x, gamma, w]):
        with bb.dataflow():
            xf = bb.emit(R.astype(x, "float32"))
            mean = bb.emit(R.mean(bb.emit(R.power(xf, relax.const(2.0, "float32"))), axis=[-1], keepdims=True))
            normed = bb.emit(R.multiply(xf, bb.emit(R.rsqrt(bb.emit(R.add(mean, relax.const(1e-5, "float32")))))))
            if gamma_after_cast:
                h = bb.emit(R.multiply(gamma, bb.emit(R.astype(normed, "float16"))))
            else:
                h = bb.emit(R.astype(bb.emit(R.multiply(normed, bb.emit(R.astype(gamma, "float32")))), "float16"))
            rows = bb.emit(R.reshape(h, [128, 256]))
            out = bb.emit(R.matmul(rows, bb.emit(R.permute_dims(w, [1, 0])), out_dtype="float32"))
            out = bb.emit_output(bb.emit(R.reshape(out, [2, 64, 128])))
        bb.emit_func_output(out)
    return bb.get()


def _one_float32_kernel_call(out):
    (packed,) = [c for c in _calls(out) if c.op.name == "relax.call_dps_packed"]
    assert packed.args[0].global_symbol == "tvm_cascade_rmsnorm_gemm_128_128_256_nk_f32"
    assert str(packed.ty.dtype) == "float32"
    assert not any(getattr(c.op, "name", "") in ("relax.rsqrt", "relax.matmul") for c in _calls(out))


@pytest.mark.parametrize("gamma_after_cast", [True, False])
def test_the_torch_frontends_norm_and_linear_become_one_kernel_call(gamma_after_cast):
    """The decomposed RMSNorm feeding a float32-output linear layer: one call of the
    kernel with a float32 output."""
    _one_float32_kernel_call(_dispatch(decomposed_norm_then_linear(gamma_after_cast)))


@pytest.mark.parametrize("norm", ["hand-written", "torch.nn"])
def test_torch_exported_norm_and_linear_become_one_kernel_call(norm):
    """The same from ``torch.export`` through TVM's torch frontend."""
    torch = pytest.importorskip("torch")
    from torch.export import export
    from tvm.relax.frontend.torch import from_exported_program

    class NormLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(256, dtype=torch.float16))
            self.norm = torch.nn.RMSNorm(256, eps=1e-5, dtype=torch.float16)
            self.proj = torch.nn.Linear(256, 128, bias=False, dtype=torch.float16)

        def forward(self, x):
            if norm == "torch.nn":
                return self.proj(self.norm(x))
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
            return self.proj(self.weight * h.to(torch.float16))

    model = from_exported_program(export(NormLinear(), (torch.randn(2, 64, 256, dtype=torch.float16),)),
                                  keep_params_as_input=True)
    _one_float32_kernel_call(_dispatch(model))
