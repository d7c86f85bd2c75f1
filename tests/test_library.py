"""tvm_cascade.kernels.attention_kernel on the CPU: one kernel per spec serving every
batch and length, in the bhsd, ragged and paged layouts, against float64 numpy."""
import re

import numpy as np
import pytest
import tvm

import tvm_cascade  # noqa: F401
from library_cases import LAYOUTS, MASKS, VARIANTS, check, check_lengths, masked_case, pack, reference, run
from ptxas import assembled, assembly, ptxas_report
from tvm_cascade.kernels import attention_kernel
from tvm_cascade.library import AttentionSpec, KernelArgumentError, MaskTensor
from tvm_cascade.library.spec import UNIFORM_LAYOUTS
from tvm_cascade.ops import AttentionVariant
from tvm_cascade.ops import testing as tt
from ahead import in_a_process_ahead


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TVM_CASCADE_CACHE", str(tmp_path / "cache"))


def _kernel(layout, heads_q=4, heads_kv=2, head_dim=16, variant="causal", dtype="float32", target="llvm", **kwargs):
    if layout == "paged":
        kwargs.setdefault("page_size", 4)  # short sequences over several pages
    return attention_kernel(heads_q, heads_kv, head_dim, variant=variant, dtype=dtype, layout=layout,
                            target=target, **kwargs)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
@in_a_process_ahead
def test_variants_every_layout(layout, variant):
    if layout in UNIFORM_LAYOUTS:
        lengths = [([5, 5], [12, 12]), ([1, 1, 1], [9, 9, 9]), ([13], [13])]
    else:  # ragged batches: lengths differ within a call, decode rows beside prefill
        lengths = [([5, 1, 8, 3], [12, 9, 8, 30]), ([2], [2]), ([1, 1], [17, 4])]
    check_lengths(_kernel(layout, variant=variant), lengths, seed=1)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2), (16, 1)], ids=["mha", "gqa2", "gqa4", "mqa16"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_groups_and_half_types(heads, dtype):
    check_lengths(_kernel("ragged", *heads, head_dim=8, dtype=dtype), [([3, 6], [10, 6])], seed=2)


@pytest.mark.parametrize("head_dim", [64, 128, 256, 72])
def test_head_dims(head_dim):
    check_lengths(_kernel("paged", 2, 1, head_dim, dtype="float16"), [([2, 4], [20, 5])], seed=3)


def test_chunked_prefill_and_speculative_decode():
    """New queries over cached keys: a chunk of 24 after 150 cached keys, and 1-8
    speculative queries per sequence, all through one paged kernel."""
    check_lengths(_kernel("paged", variant="causal"), [([24], [174]), ([1, 4, 8, 2], [40, 44, 9, 100])], seed=4)


def test_rows_that_see_no_key_are_zero():
    """More queries than keys under a causal mask, and a sequence without keys."""
    kernel = _kernel("ragged")
    sequences = tt.random_sequences([6, 2, 3], [3, 0, 5], 4, 2, 16, rng=np.random.default_rng(5))
    outs = run(kernel, sequences)
    refs = reference(sequences, "causal")
    assert not outs[0][:3].any() and not outs[1].any()
    check(outs[0][3:], refs[0][3:], "float32")
    check(outs[2], refs[2], "float32")


def test_scale():
    check_lengths(_kernel("bhsd", scale=0.5, variant="global"), [([4], [9])], seed=6)


def test_lengths_and_batch_are_symbolic():
    """One PrimFunc per kernel; no length or batch size is a constant of it."""
    for layout in LAYOUTS:
        mod = _kernel(layout).mod
        funcs = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
        assert len(funcs) == 1
        func = funcs[0]
        shapes = {p.name: list(p.ty.shape) for p in func.params if isinstance(p.ty, tvm.tirx.BufferType)}
        scalars = [p.name for p in func.params if not isinstance(p.ty, tvm.tirx.BufferType)]
        constant = {4, 2, 16}  # heads and head dim: the only static sizes
        for name, shape in shapes.items():
            static = [int(e) for e in shape if isinstance(e, tvm.tirx.IntImm)]
            assert set(static) <= constant | {2} and len(static) < len(shape), (layout, name, shape)
        assert scalars == ([] if layout in UNIFORM_LAYOUTS else ["max_q", "max_kv"])


def test_torch_style_dlpack_and_tvm_tensors():
    """numpy in, numpy out (through DLPack); TVM tensors in, the TVM ``out`` given back."""
    kernel = _kernel("ragged")
    sequences = tt.random_sequences([3, 2], [5, 7], 4, 2, 16, rng=np.random.default_rng(7))
    args = tt.pack_ragged(sequences)
    as_numpy = kernel(*args)
    assert isinstance(as_numpy, np.ndarray)
    out = tvm.runtime.empty(args[0].shape, "float32", tvm.cpu())
    returned = kernel(*(tvm.runtime.tensor(a) for a in args), out=out)
    assert returned is out
    np.testing.assert_array_equal(out.numpy(), as_numpy)


def _misaligned(array):
    """A copy of ``array`` whose data starts 4 bytes past a 64-byte boundary."""
    flat = np.empty(array.size + 64, array.dtype)
    offset = (-flat.ctypes.data % 64 + 4) // array.itemsize
    view = flat[offset : offset + array.size].reshape(array.shape)
    view[...] = array
    assert view.ctypes.data % 64 == 4
    return view


def test_unaligned_tensors_are_copied():
    kernel = _kernel("ragged")
    sequences = tt.random_sequences([3, 2], [5, 7], 4, 2, 16, rng=np.random.default_rng(10))
    args = tt.pack_ragged(sequences)
    out = _misaligned(np.zeros_like(args[0]))
    kernel(*(_misaligned(a) for a in args), out=out)
    np.testing.assert_array_equal(out, kernel(*args))


# -- refusals -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(heads_q=6, heads_kv=4), "multiple of heads_kv"),
        (dict(head_dim=320), "larger than the 256"),
        (dict(dtype="float64"), "dtype must be one of"),
        (dict(layout="sbhd"), "layout must be one of"),
        (dict(variant=AttentionVariant("w0", causal=True, window=0)), "at least one key"),
        (dict(variant="unknown"), "unknown attention variant"),
        (dict(page_size=16), "page_size is the paged layouts'; the bhsd layout has none"),
        (dict(layout="paged", page_size=0), "page_size must be a positive int"),
    ],
)
def test_spec_refusals(kwargs, message):
    args = dict(heads_q=4, heads_kv=2, head_dim=16)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        AttentionSpec.make(args.pop("heads_q"), args.pop("heads_kv"), args.pop("head_dim"), **args)


def _ragged_args():
    sequences = tt.random_sequences([3, 2], [5, 7], 4, 2, 16, rng=np.random.default_rng(8))
    return list(tt.pack_ragged(sequences))


def _paged_args():
    sequences = tt.random_sequences([3, 2], [5, 7], 4, 2, 16, rng=np.random.default_rng(9))
    return list(tt.pack_paged(sequences, 4))


def _with(args, position, value):
    args = list(args)
    args[position] = value
    return args


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda a: a[:4], r"takes \(q, k, v, q_indptr, kv_indptr\[, out\]\); got 4"),
        (lambda a: _with(a, 0, a[0].astype("float16")), "q: expected dtype float32, got float16"),
        (lambda a: _with(a, 1, a[1][:, :1].copy()), r"k: expected shape \[\*, 2, 16\], got \[12, 1, 16\]"),
        (lambda a: _with(a, 2, a[2][:-1]), r"v: expected shape \[12, 2, 16\], got \[11, 2, 16\]"),
        (lambda a: _with(a, 3, np.array([0, 4, 3], "int32")), "q_indptr decreases at 1: 4 > 3"),
        (lambda a: _with(a, 3, np.array([1, 3, 5], "int32")), r"q_indptr\[0\] = 1: offsets start at 0"),
        (lambda a: _with(a, 3, np.array([0, 3, 4], "int32")), r"q_indptr\[-1\] = 4 must equal the 5"),
        (lambda a: _with(a, 4, np.array([0, 5, 13], "int32")), r"kv_indptr\[-1\] = 13 must be at most the 12"),
        (lambda a: _with(a, 4, np.array([0, 5, 7, 12], "int32")), r"kv_indptr: expected shape \[3\]"),
        (lambda a: _with(a, 4, a[4].astype("int64")), "kv_indptr: expected dtype int32"),
        (lambda a: _with(a, 0, np.asfortranarray(a[0])), "strided"),
        (lambda a: _with(a, 0, a[0].tolist()), "expected a tensor"),
    ],
)
def test_ragged_call_refusals(make, message):
    kernel = _kernel("ragged")
    with pytest.raises(KernelArgumentError, match=message):
        kernel(*make(_ragged_args()))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda a: _with(a, 4, np.r_[a[4][:2], 99, a[4][3:]].astype("int32")), r"page_ids\[2\] = 99 is not a page of the pool's 7"),
        (lambda a: _with(a, 4, np.full_like(a[4], -1)), r"page_ids\[0\] = -1 is not a page"),
        (lambda a: _with(a, 5, np.array([0, 3], "int32")), r"last_page_len\[0\] = 0: a sequence's last page holds 1 to"),
        (lambda a: _with(a, 5, np.array([1, 5], "int32")), r"last_page_len\[1\] = 5"),
        (lambda a: _with(a, 3, np.array([0, 2, 9], "int32")), r"page_indptr\[-1\] = 9 must be at most the 4"),
        (lambda a: _with(a, 1, np.zeros((7, 2, 2, 8, 16), "float32")), r"pages: expected shape \[\*, 2, 2, 4, 16\], got \[7, 2, 2, 8, 16\]"),
        (lambda a: _with(a, 1, a[1][:, :1].copy()), r"pages: expected shape \[\*, 2, 2, 4, 16\]"),
    ],
)
def test_paged_call_refusals(make, message):
    kernel = _kernel("paged")
    with pytest.raises(KernelArgumentError, match=message):
        kernel(*make(_paged_args()))


@pytest.mark.parametrize("layout", LAYOUTS)
@in_a_process_ahead
def test_cuda_kernels_compile_and_refuse_host_tensors(layout, tmp_path):
    """The CUDA kernels of every layout (tensor-core decode for few query rows, generic
    otherwise: an sm_80 target has no warp-specialised prefill) go through TVM's CUDA
    code generation and nvcc here (no GPU needed); host tensors given to them are
    refused."""
    kernel = _kernel(layout, 8, 2, 64, dtype="float16", target={"kind": "cuda", "arch": "sm_80"})
    assert [f.name for f in kernel.families] == ["tensor_core_decode", "generic"]
    source = kernel.module.imports[0].inspect_source()
    assert "tensor_core_decode_kernel" in source and "generic_kernel" in source
    report = ptxas_report(source, tmp_path / "kernels.cu")
    assert "spill stores" in report and not re.search(r"[1-9]\d* bytes spill stores", report)
    sequences = tt.random_sequences([2], [5], 8, 2, 64, dtype="float16")
    args = pack(layout, sequences, 4)
    with pytest.raises(KernelArgumentError, match=r"q: on cpu:0, but the kernel runs on cuda:0"):
        kernel(*args)


def _split_k_decode_source(heads, head_dim, dtype):
    from tvm_cascade.library.split_k_decode import SplitKDecode, decode_kernel

    spec = AttentionSpec.make(*heads, head_dim, variant="causal", dtype=dtype, layout="paged",
                              target=tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    assert SplitKDecode().supports(spec) is None
    executable = tvm.compile(tvm.IRModule({"split_k_decode": decode_kernel(spec)}), target=spec.target)
    return executable.mod.imports[0].inspect_source()


@pytest.mark.parametrize("heads, head_dim, dtype", [((32, 4), 128, "float16"), ((16, 1), 256, "bfloat16"), ((28, 4), 128, "bfloat16")])
@assembled(_split_k_decode_source)
def test_split_k_decode_assembles_without_spills(heads, head_dim, dtype, runs_ahead, request):
    """The split-k decode's chunk kernel for GQA groups of 8 and 16 and of 7 (rows padded),
    head dims 128 and 256, through nvcc: no register spills."""
    _, report = assembly(runs_ahead, request)
    (chunks,) = [part for part in report.split("Compiling entry function ") if part.startswith("'split_k_decode_kernel'")]
    assert " 0 bytes spill stores" in chunks


def _tensor_core_decode_source(heads, head_dim, dtype, layout, variant):
    from tvm_cascade.library.tensor_core_decode import TensorCoreDecode, decode_kernel

    spec = AttentionSpec.make(*heads, head_dim, variant=variant, dtype=dtype, layout=layout,
                              target=tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    assert TensorCoreDecode().supports(spec) is None
    executable = tvm.compile(tvm.IRModule({"tensor_core_decode": decode_kernel(spec)}), target=spec.target)
    return executable.mod.imports[0].inspect_source()


@pytest.mark.parametrize(
    "heads, head_dim, dtype, layout, variant", [
        ((32, 8), 128, "bfloat16", "paged", "sliding_window"), ((28, 4), 128, "float16", "bhsd", "sliding_window"),
        ((16, 16), 64, "bfloat16", "ragged", "sliding_window"), ((8, 1), 128, "float16", "bshd", "sliding_window"),
        ((16, 16), 64, "float16", "paged", "sliding_window"), ((32, 8), 128, "float16", "paged", "causal"),
        ((16, 16), 64, "bfloat16", "paged", "causal"),
    ]
)
@assembled(_tensor_core_decode_source)
def test_tensor_core_decode_assembles_without_spills(heads, head_dim, dtype, layout, variant, runs_ahead, request):
    """The tensor-core decode's chunk kernel through nvcc: no register spills (its
    operands and accumulators stay in registers), its products on ``mma.sync``."""
    from tvm_cascade.library.tensor_core_decode import STEPS

    source, report = assembly(runs_ahead, request)
    # Per 16 keys of a step, QK: 2 tiles x d / 16 k-steps, PV: d / 8 tiles
    assert source.count("mma.sync.aligned.m16n8k16") == STEPS[head_dim] // 16 * 4 * head_dim // 16
    (chunks,) = [part for part in report.split("Compiling entry function ") if part.startswith("'tensor_core_decode_kernel'")]
    assert " 0 bytes spill stores" in chunks


def test_tensor_core_decode_plans_and_refuses():
    """Chunks of whole steps of every warp (16 keys a step, 32 at head dim 64) fill at most
    about two blocks per SM, none below 256 keys; a sliding window's chunks cover the
    window, not the keys before it. CUDA from sm_80, fp16/bf16, head dims from 64 to 128
    (multiples of 8) only."""
    from tvm_cascade.library.tensor_core_decode import TensorCoreDecode

    family = TensorCoreDecode()
    sm90 = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    spec = AttentionSpec.make(32, 8, 128, variant="causal", layout="paged", target=sm90)
    gpu = type("Device", (), {"exist": True, "multi_processor_count": 132})()
    assert family.plan(spec, 1, 1, 32768, gpu) == [1024]  # 8 blocks a chunk: 33 chunks
    assert family.plan(spec, 16, 1, 8000, gpu) == [4032]  # 128 blocks a chunk: 2 chunks (3 would be 1.5 waves)
    d64 = AttentionSpec.make(32, 8, 64, variant="causal", layout="paged", target=sm90)
    assert family.plan(d64, 16, 1, 8000, gpu) == [4096]  # steps of 32 keys: 4 warps' steps are 128 keys
    assert family.plan(spec, 64, 1, 4096, gpu) == [4096]  # 512 blocks: one chunk
    assert family.plan(spec, 1, 1, 4096, gpu) == [256]  # never below 256 keys
    assert family.plan(spec, 1, 8, 4096, gpu) == [256]  # 4 x 8 rows: 2 passes of 16 rows
    window = AttentionSpec.make(32, 8, 128, variant=AttentionVariant("w", causal=True, window=1000), target=sm90)
    assert family.plan(window, 1, 1, 32768, gpu) == [256]  # 1000 keys seen, not 32768
    assert family.supports(spec) is None
    assert family.supports(AttentionSpec.make(32, 32, 96, target=sm90)) is None
    for kwargs, reason in [(dict(target="llvm"), "CUDA only"), (dict(dtype="float32", target=sm90), "fp16 and bf16"),
                           (dict(head_dim=256, target=sm90), "head dim 256: a multiple of 8 from 64 to 128"),
                           (dict(head_dim=100, target=sm90), "head dim 100: a multiple of 8 from 64 to 128"),
                           (dict(head_dim=48, target=sm90), "head dim 48: a multiple of 8 from 64 to 128"),
                           (dict(target=tvm.target.Target({"kind": "cuda", "arch": "sm_75"})), "needs sm_80 or later")]:
        args = dict(head_dim=128) | kwargs
        assert reason in family.supports(AttentionSpec.make(32, 8, args.pop("head_dim"), **args))


def _hopper_kernels_source(layout, head_dim, mask):
    """The source of the sm_90a kernel of :func:`test_warp_specialized_prefill_assembles_for_hopper`,
    once its families and the prefill's parameters are checked."""
    pages = {"page_size": 16} if layout == "paged" else {}
    kernel = _kernel(layout, 16, 4, head_dim, dtype="bfloat16", target={"kind": "cuda", "arch": "sm_90a"}, mask=mask,
                     **pages)
    assert [f.name for f in kernel.families] == [_hopper_decode(head_dim), "warp_specialized_prefill"]
    func = kernel.mod["warp_specialized_prefill"]
    shapes = [list(p.ty.shape) for p in func.params if isinstance(p.ty, tvm.tirx.BufferType)]
    assert all(any(not isinstance(e, tvm.tirx.IntImm) for e in shape) for shape in shapes)
    assert ("mask" in [p.name for p in func.params]) == (mask is not None)
    return kernel.module.imports[0].inspect_source()


def _hopper_decode(head_dim):
    return "split_k_decode" if head_dim == 256 else "tensor_core_decode"


@pytest.mark.parametrize("layout, head_dim, mask", [("bhsd", 128, None), ("bshd", 128, MaskTensor("float16")),
                                                   ("ragged", 64, None), ("paged", 256, None), ("bhsd", 96, None),
                                                   ("paged", 80, None)])
@assembled(_hopper_kernels_source)
def test_warp_specialized_prefill_assembles_for_hopper(layout, head_dim, mask, runs_ahead, request):
    """On sm_90a the kernel holds a split-k decode (on tensor cores up to head dim 128)
    and the warp-specialised prefill (no generic function: the prefill serves any number
    of rows; head dims 80 and 96 in the head dim 128 kernels), storing 8 bytes a thread;
    through nvcc: neither spills, setmaxnreg honoured, wgmma not serialised; its lengths and batch are the PrimFunc's
    variables; a mask tensor is a parameter the prefill reads."""
    source, report = assembly(runs_ahead, request)
    # The prefill stores four output columns a thread at a time (whole 32-byte sectors a warp).
    body = source[source.rindex("warp_specialized_prefill_kernel("):]
    assert "*(nv_bfloat164*)(out_ptr" in body and "out_ptr[" not in body
    entries = {e.split("'")[1]: e for e in report.split("Compiling entry function ")[1:]}
    for name in ("warp_specialized_prefill_kernel", f"{_hopper_decode(head_dim)}_kernel"):
        assert " 0 bytes spill stores" in entries[name], report
    for remark in ("C7508", "C7511", "C7514", "C7519", "is injected"):
        assert remark not in report, report


def test_mask_key_tiles_serve_variants_without_terms_of_position():
    """The key tiles a mask tensor shows are found for variants with no term of a key's
    position (global, softcap): a causal mask, a window or ALiBi, which the scan of the
    mask does not see, keep their own tiles."""
    from tvm_cascade.library import mask_ranges

    for variant in VARIANTS + [AttentionVariant("alibi", alibi=True)]:
        spec = AttentionSpec.make(16, 4, 128, variant=variant, mask=MaskTensor("float16"))
        reason = mask_ranges.unsupported(spec)
        if variant.name in ("global", "softcap"):
            assert reason is None
        else:
            assert "own terms of a key's position" in reason
    assert mask_ranges.unsupported(AttentionSpec.make(16, 4, 128)) == "no mask tensor"


def _masked_prefill_source(variant):
    """The source of :func:`test_a_mask_tensors_key_tiles_are_found_first`'s kernel, once
    its prefill's first statement is checked."""
    found = variant == "global"
    kernel = _kernel("bhsd", 16, 4, 128, variant=variant, dtype="float16", target={"kind": "cuda", "arch": "sm_90a"},
                     mask=MaskTensor("float16"))
    first = kernel.mod["warp_specialized_prefill"].body.seq[0]
    assert isinstance(first, tvm.tirx.AllocBuffer) == found
    assert not found or first.buffer.name == "mask_key_tiles"
    return kernel.module.imports[0].inspect_source()


@pytest.mark.parametrize("variant", ["global", "causal"])
@assembled(_masked_prefill_source)
def test_a_mask_tensors_key_tiles_are_found_first(variant, runs_ahead, request):
    """With a mask tensor and a variant without terms of a key's position, the prefill's
    function first clears each row tile's range of key tiles, then scans the mask's rows
    (a warp each, the range widened by atomics), and its row tiles read only those (the
    GPU test file checks it); a causal one reads its own tiles. Through nvcc: no spills
    in the scan."""
    source, report = assembly(runs_ahead, request)
    assert ("atomicMin" in source and "atomicMax" in source) == (variant == "global")
    assert not re.search(r"[1-9]\d* bytes spill stores", report), report


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(head_dim=100), "head dim 100: a multiple of 8 from 64 to 256"),
        (dict(head_dim=48), "head dim 48: a multiple of 8 from 64 to 256"),
        (dict(head_dim=256, layout="paged", page_size=128), "pages of 128 keys: a multiple of 8 dividing 64"),
        (dict(target={"kind": "cuda", "arch": "sm_80"}), "needs sm_90a"),
        (dict(layout="paged", page_size=4), "pages of 4 keys: a multiple of 8 dividing 128"),
        (dict(dtype="float32"), "float32: fp16 and bf16 only"),
    ],
)
def test_warp_specialized_prefill_names_what_it_does_not_serve(kwargs, reason):
    from tvm_cascade.library.warp_specialized_prefill import WarpSpecializedPrefill

    args = dict(head_dim=128, dtype="float16", target={"kind": "cuda", "arch": "sm_90a"}, layout="bhsd") | kwargs
    args["target"] = tvm.target.Target(args["target"])
    spec = AttentionSpec.make(8, 2, args.pop("head_dim"), variant="causal", **args)
    assert reason in WarpSpecializedPrefill().supports(spec)


def test_out_refusals():
    kernel = _kernel("ragged")
    args = _ragged_args()
    with pytest.raises(KernelArgumentError, match=r"out: expected shape \[5, 4, 16\]"):
        kernel(*args, out=np.zeros((4, 4, 16), "float32"))
    with pytest.raises(KernelArgumentError, match="out: expected dtype float32"):
        kernel(*args, out=np.zeros((5, 4, 16), "float16"))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", ["global", "causal"])
def test_calls_without_queries_or_keys(layout, variant):
    """A call with no query rows returns its (empty) output and one whose sequences have
    no keys returns zeros, with no kernel launched (a grid of no blocks is no launch on a
    GPU); sequences without keys beside others with keys give zeros for their rows."""
    kernel = _kernel(layout, variant=variant)
    cases = [([0], [0]), ([0], [4]), ([3], [0]), ([2, 2], [0, 0])]
    cases += [] if layout in UNIFORM_LAYOUTS else [([0, 0], [5, 0]), ([3, 2], [0, 6])]
    for q_lens, kv_lens in cases:
        sequences = tt.random_sequences(q_lens, kv_lens, 4, 2, 16, rng=np.random.default_rng(4))
        args = [tvm.runtime.tensor(a) for a in pack(layout, sequences, 4)]
        assert (kernel.plan(*args).family is None) == (max(q_lens) == 0 or max(kv_lens) == 0)
        check_lengths(kernel, [(q_lens, kv_lens)], seed=4)


def test_plan_checks_once_and_is_reused():
    """A plan made once serves calls on the same tensors; other tensors are refused."""
    kernel = _kernel("paged")
    args = [tvm.runtime.tensor(a) for a in _paged_args()]
    plan = kernel.plan(*args)
    assert plan.family.name == "generic" and plan.scalars == (3, 7)
    np.testing.assert_array_equal(kernel(*args, plan=plan).numpy(), kernel(*args).numpy())
    other = list(args)
    other[2] = tvm.runtime.tensor(args[2].numpy())  # equal values, other memory
    with pytest.raises(KernelArgumentError, match="not those the plan was made for"):
        kernel(*other, plan=plan)
    with pytest.raises(KernelArgumentError, match="q: expected dtype float32"):
        kernel(tvm.runtime.tensor(args[0].numpy().astype("float16")), *args[1:], plan=plan)


def test_an_indptr_given_for_queries_and_keys_is_copied_to_the_host_once(monkeypatch):
    """Self-attention's ragged call passes one indptr for both: its checks read one host
    copy of it (a copy from a GPU synchronises), and still check it against each tensor;
    two arrays are each copied."""
    kernel = _kernel("ragged")
    q, k, v, q_indptr, _ = (tvm.runtime.tensor(a) for a in _ragged_args())
    other = tvm.runtime.tensor(q_indptr.numpy())
    few_k, few_v = (tvm.runtime.tensor(a.numpy()[:4]) for a in (k, v))
    copies = []
    numpy = tvm.runtime.Tensor.numpy
    monkeypatch.setattr(tvm.runtime.Tensor, "numpy", lambda self: copies.append(self) or numpy(self))
    kernel.plan(q, k, v, q_indptr, q_indptr)
    assert len(copies) == 1
    kernel.plan(q, k, v, q_indptr, other)
    assert len(copies) == 3
    with pytest.raises(KernelArgumentError, match=r"kv_indptr\[-1\] = 5 must be at most the 4 the tensor holds"):
        kernel.plan(q, few_k, few_v, q_indptr, q_indptr)


def test_split_k_decode_plans_its_chunks():
    """Chunks fill about four blocks per SM, whole steps of the block's subgroups, never
    more chunks than steps of keys; CUDA fp16/bf16 only."""
    from tvm_cascade.library.split_k_decode import SplitKDecode

    family = SplitKDecode()
    spec = AttentionSpec.make(32, 8, 128, variant="causal", layout="paged", target="cuda")
    gpu = type("Device", (), {"exist": True, "multi_processor_count": 132})()
    # A group of 4 heads: 4 rows a block, 2 keys a subgroup per step, 8 subgroups of 16
    # lanes: steps of 16 keys.
    assert family.plan(spec, 1, 1, 8000, gpu) == [128]  # 8 blocks a chunk: 63 chunks, ~4 x 132 blocks
    assert family.plan(spec, 64, 1, 8000, gpu) == [4000]  # 512 blocks a chunk: 2 chunks
    assert family.plan(spec, 64, 4, 8000, gpu) == [8000]  # 4 rows each: 2048 blocks, one chunk
    assert family.plan(spec, 1, 1, 5, gpu) == [16]  # never a chunk below a step
    assert family.supports(spec) is None
    assert "CUDA only" in family.supports(AttentionSpec.make(32, 8, 128, target="llvm"))
    assert "fp16 and bf16" in family.supports(AttentionSpec.make(32, 8, 128, dtype="float32", target="cuda"))
    assert "head dim 72" in family.supports(AttentionSpec.make(4, 4, 72, target="cuda"))


@pytest.mark.parametrize("layout", UNIFORM_LAYOUTS)
@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.describe())
def test_mask_tensor(layout, mask):
    """A mask tensor input: boolean or added to the scores, broadcast over the batch,
    the heads or the queries; a row the mask hides entirely gives zeros."""
    kernel = _kernel(layout, variant="global", mask=mask)
    (q, k, v, m), ref = masked_case(mask, 2, 4, 2, 5, 37, 16, "float32", np.random.default_rng(3))
    if layout == "bshd":
        q, k, v = (x.transpose(0, 2, 1, 3).copy() for x in (q, k, v))
    out = kernel(q, k, v, m)
    check(out if layout == "bhsd" else out.transpose(0, 2, 1, 3), ref, "float32")
    assert "mask" in kernel.spec.describe() and [p.name for p in kernel.mod["generic"].params][3] == "mask"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda a: a[:3], r"takes \(q, k, v, mask\[, out\]\); got 3"),
        (lambda a: _with(a, 3, a[3][:, :, :, :-1].copy()), r"mask: expected shape \[2, 1, 5, 37\], got \[2, 1, 5, 36\]"),
        (lambda a: _with(a, 3, np.repeat(a[3], 4, axis=1)), r"mask: expected shape \[2, 1, 5, 37\], got \[2, 4, 5, 37\]"),
        (lambda a: _with(a, 3, a[3].astype("float32")), "mask: expected dtype bool, got float32"),
    ],
)
def test_mask_tensor_call_refusals(make, message):
    kernel = _kernel("bhsd", variant="global", mask=MASKS[0])
    (q, k, v, m), _ = masked_case(MASKS[0], 2, 4, 2, 5, 37, 16, "float32", np.random.default_rng(4))
    with pytest.raises(KernelArgumentError, match=message):
        kernel(*make([q, k, v, m]))
    with pytest.raises(ValueError, match="a mask tensor is read by the .* layouts' kernels, not ragged's"):
        AttentionSpec.make(4, 2, 16, layout="ragged", mask=MASKS[0])
    with pytest.raises(ValueError, match="a mask tensor's dtype must be one of"):
        AttentionSpec.make(4, 2, 16, mask=MaskTensor("int8"))


@pytest.mark.parametrize("layout, variant, head_dim, page_size, reads", [
    ("paged", "causal", 128, 16, 3), ("paged", "causal", 64, 16, 6), ("paged", "global", 128, 32, 3),
    ("kv_decode", None, 128, 16, 3),
    ("paged", "sliding_window", 128, 16, 6),  # a window's first key lies anywhere in a page: two pages a group
    ("paged", "causal", 128, 8, 18),  # pages of 8 keys: a read a key
    ("kv_decode_window", None, 128, 16, 9),  # sinks and evicted keys: three pages a group
    ("kv_decode_window", "sliding_window", 128, 16, 18),  # and a window's first key anywhere: a read a key
])
def test_paged_decode_reads_the_page_table_once_a_group_of_keys(layout, variant, head_dim, page_size, reads):
    """The tensor-core decode reads the page table a step ahead at three places (the
    warps' first two steps, then in the loop): where pages hold a multiple of 16 keys in
    order, the page of each 16-key group of the step (one group a step at head dim 128,
    two at 64), or the pages of its first and last keys under a sliding window, or in a
    cache with sinks the pages of its first, first window and last keys; else the place
    of each of the six keys a lane loads a group."""
    from tvm_cascade.library.tensor_core_decode import decode_kernel

    spec = AttentionSpec.make(32, 8, head_dim, variant=variant, dtype="float16", layout=layout, page_size=page_size,
                              target=tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    source = tvm.compile(tvm.IRModule({"tensor_core_decode": decode_kernel(spec)}), target=spec.target).mod.imports[0].inspect_source()
    table = "page_ids_ptr[" if layout == "paged" else "page_indices_ptr["
    assert source.count(table) == reads
