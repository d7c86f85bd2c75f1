"""The kernels with TVM's paged KV cache's calling convention
(:mod:`tvm_cascade.library.kv_cache`) on the CPU: their parameters are the cache's, and
their outputs and log-sum-exps those of numpy's attention, over ragged batches, pages
in any order, index arrays at element offsets and sequences without keys."""
import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm.ir.expr import TensorLoad

from tvm_cascade.analysis.scope import buffer_params
from tvm_cascade.library import rope_inside
from tvm_cascade.library.kv_cache import cache_kernel
from kv_cache_cases import OUTPUT_AT, arguments, both_modes_runs, expected, rope_inside_runs, tvm_kernel
from ahead import in_a_process_ahead

#: The parameter names of TVM's own kernels (``relax.frontend.nn.llm``), by kind.
CONVENTION = {
    "ragged": ["q", "qo_indptr", "k", "v", "kv_indptr", "q_rope_position", "k_rope_pos_offset", "out", "lse",
               "causal", "rotary_mode", "rope_scale", "rope_theta", "sm_scale"],
    "prefill": ["q", "qo_indptr", "pages", "page_indptr", "page_indices", "length_info", "k_rope_pos_offset",
                "q_rope_position", "out", "lse", "causal", "rotary_mode", "rope_scale", "rope_theta", "sm_scale"],
    "decode": ["q", "pages", "page_indptr", "page_indices", "length_info", "k_rope_pos_offset", "q_rope_position",
               "out", "lse", "rotary_mode", "rope_scale", "rope_theta", "sm_scale"],
}
CONVENTION["prefill_window"] = CONVENTION["prefill"]
CONVENTION["decode_window"] = CONVENTION["decode"]
#: (kind, query lengths, key lengths): ragged batches with lengths off the tiles, a
#: sequence without cached keys, decode over partly filled last pages, and over a
#: sliding-window cache's sinks and windows (evicted keys between them).
CASES = [
    ("ragged", [5, 17, 1], [5, 17, 1]),
    ("prefill", [3, 20, 7], [40, 1, 0]),
    ("prefill_window", [3, 20, 7, 2], [40, 1, 0, 50]),
    ("decode", [1, 1, 1, 1], [1, 16, 33, 70]),
    ("decode_window", [1, 1, 1, 1], [1, 16, 33, 70]),
]


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(kind, heads_q, heads_kv, head_dim):
        key = (kind, heads_q, heads_kv, head_dim)
        if key not in cache:
            kernel, why = cache_kernel(kind, heads_q, heads_kv, head_dim, "float16", "llvm")
            assert kernel is not None, why
            cache[key] = (kernel, tvm.compile(tvm.IRModule({"main": kernel.func}), target="llvm")["main"])
        return cache[key]

    return get


@pytest.mark.parametrize("kind", sorted(CONVENTION))
def test_parameters_are_the_caches(built, kind):
    kernel, _ = built(kind, 4, 2, 32)
    assert [p.name for p in kernel.func.params] == CONVENTION[kind]
    assert kernel.family.name == "generic"
    indices = [p for p in buffer_params(kernel.func) if p.dtype == "int32"]
    assert indices and all(isinstance(p.elem_offset, tvm.tirx.Var) for p in indices)


@pytest.mark.parametrize("kind, q_lens, kv_lens", CASES)
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)])
def test_outputs_and_lse_match_numpy(built, kind, q_lens, kv_lens, heads):
    heads_q, heads_kv = heads
    head_dim = 32
    _, func = built(kind, heads_q, heads_kv, head_dim)
    args, reference, causal = arguments(kind, q_lens, kv_lens, heads_q, heads_kv, head_dim, tvm.cpu())
    func(*args)
    out, lse = expected(q_lens, reference, causal, args[-1])
    at = OUTPUT_AT[kind]
    np.testing.assert_allclose(args[at].numpy().astype("float64"), out, atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(args[at + 1].numpy(), lse, atol=1e-3, rtol=1e-4)


def test_a_kernel_refuses_the_other_mask_and_inline_rope(built):
    _, func = built("ragged", 4, 2, 32)
    args, _, _ = arguments("ragged", [3], [3], 4, 2, 32, tvm.cpu())
    at = OUTPUT_AT["ragged"] + 2
    with pytest.raises(RuntimeError, match="built for causal=1"):
        func(*args[:at], 0, *args[at + 1:])
    with pytest.raises(RuntimeError, match="RoPE inside attention"):
        func(*args[:at + 1], 1, *args[at + 2:])


def test_attention_kernel_refuses_the_cache_layouts():
    from tvm_cascade.library import attention_kernel  # pylint: disable=import-outside-toplevel

    with pytest.raises(ValueError, match="kv_decode layout is TVM's paged KV cache's calling convention"):
        attention_kernel(4, 2, 32, layout="kv_decode", target="llvm")


@pytest.mark.parametrize("kind", ["ragged", "prefill"])
def test_calls_it_does_not_serve_run_the_fallback(kind):
    """With TVM's kernel as the fallback, RoPE inside attention and the other mask run
    TVM's code (its outputs, bit for bit); other calls run the library's."""
    theirs = tvm_kernel(kind, 4, 2, 32)
    kernel, why = cache_kernel(kind, 4, 2, 32, "float16", "llvm", fallback=theirs)
    assert kernel is not None, why
    ours = tvm.compile(tvm.IRModule({"main": kernel.func}), target="llvm")["main"]
    tvm_func = tvm.compile(tvm.IRModule({"main": theirs}), target="llvm")["main"]
    at = OUTPUT_AT[kind]
    causal = at + 2
    q_lens, kv_lens = [5, 17, 1], ([5, 17, 1] if kind == "ragged" else [40, 3, 20])
    for flag, rotary in ((1 - CONVENTION_MASK[kind], 0), (CONVENTION_MASK[kind], 1)):
        runs = []
        for func in (ours, tvm_func):
            args, _, _ = arguments(kind, q_lens, kv_lens, 4, 2, 32, tvm.cpu(), seed=4)
            args[causal], args[causal + 1] = flag, rotary
            # RoPE at positions other than 0, where rotation changes the scores.
            positions = [a for a in args[:at] if isinstance(a, tvm.runtime.Tensor) and a.dtype == "int32"]
            rope = positions[-1] if kind == "ragged" else positions[-2]
            rope.copyfrom(np.arange(3, 3 + rope.shape[0], dtype="int32"))
            func(*args)
            runs.append((args[at].numpy(), args[at + 1].numpy()))
        np.testing.assert_array_equal(runs[0][0], runs[1][0])
        np.testing.assert_array_equal(runs[0][1], runs[1][1])
        if rotary:  # the rotation changed the outputs: TVM's RoPE ran
            args, reference, causal_flag = arguments(kind, q_lens, kv_lens, 4, 2, 32, tvm.cpu(), seed=4)
            assert np.abs(runs[0][0] - expected(q_lens, reference, causal_flag, args[-1])[0]).max() > 1e-2
    # The branch: the library's body where the call is served, TVM's elsewhere.
    flags = {p.name: p for p in kernel.func.params}
    assert isinstance(kernel.func.body, tvm.tirx.IfThenElse)
    tvm.ir.assert_structural_equal(
        kernel.func.body.condition,
        tvm.tirx.op.tvm_thread_invariant(tvm.tirx.And(flags["rotary_mode"] != 1, flags["causal"] == CONVENTION_MASK[kind])))


#: The window of the sliding layers in the tests of the sliding-window prefill.
WINDOW = 24


def _tvm_cpu_kernel(kind, scaling=None):
    """TVM's CPU kernel of ``kind`` for 4/2 heads of 32 (the sliding-window prefill's
    layers' window :data:`WINDOW`), its RoPE scaled as ``scaling`` says."""
    return tvm_kernel(kind, 4, 2, 32, window=WINDOW if kind == "prefill_window" else 0, scaling=scaling)


def test_the_sliding_window_prefill_serves_both_masks():
    """Given the layers' window, the kernel attends over every cached key with
    ``causal=0`` (a cache of sliding windows and sinks) and within the window with
    ``causal=1`` (a sliding layer: new token ``i`` sees the last ``W - 1 - i`` cached
    keys, none from ``i = W - 1`` on: zeros and lse -5e4), as TVM's kernel does where a
    row sees a key; RoPE inside attention is refused."""
    kernel, why = cache_kernel("prefill_window", 4, 2, 32, "float16", "llvm", window=WINDOW)
    assert kernel is not None, why
    ours = tvm.compile(tvm.IRModule({"main": kernel.func}), target="llvm")["main"]
    theirs = tvm.compile(tvm.IRModule({"main": _tvm_cpu_kernel("prefill_window")}), target="llvm")["main"]
    at = OUTPUT_AT["prefill_window"]
    q_lens, kv_lens = [5, 30, 1, 12], [40, 60, 7, 0]
    for causal in (0, 1):
        args, reference, _ = arguments("prefill_window", q_lens, kv_lens, 4, 2, 32, tvm.cpu(), seed=6)
        args[at + 2] = causal
        ours(*args)
        out, lse = expected(q_lens, reference, False, args[-1], window=WINDOW * causal)
        np.testing.assert_allclose(args[at].numpy().astype("float64"), out, atol=2e-3, rtol=2e-3)
        np.testing.assert_allclose(args[at + 1].numpy(), lse, atol=1e-3, rtol=1e-4)
        mine = args[at].numpy()
        args, _, _ = arguments("prefill_window", q_lens, kv_lens, 4, 2, 32, tvm.cpu(), seed=6)
        args[at + 2] = causal
        theirs(*args)
        seen = lse > -5e4
        np.testing.assert_allclose(mine[seen], args[at].numpy()[seen], atol=2e-3, rtol=2e-3)
    assert not seen.all()  # rows past the window's cached keys were checked too
    args[at + 3] = 1
    with pytest.raises(RuntimeError, match="RoPE inside attention"):
        ours(*args)


def test_the_sliding_window_prefill_without_a_window_gives_sliding_layers_to_the_fallback():
    """Built without the layers' window (a cache of no sliding layers), the kernel gives
    a ``causal=1`` call to TVM's kernel."""
    kernel, why = cache_kernel("prefill_window", 4, 2, 32, "float16", "llvm",
                               fallback=_tvm_cpu_kernel("prefill_window"))
    assert kernel is not None, why
    flags = {p.name: p for p in kernel.func.params}
    tvm.ir.assert_structural_equal(
        kernel.func.body.condition,
        tvm.tirx.op.tvm_thread_invariant(tvm.tirx.And(flags["rotary_mode"] != 1, flags["causal"] == 0)))
    with pytest.raises(ValueError, match="the sliding-window prefill's"):
        cache_kernel("prefill", 4, 2, 32, "float16", "llvm", window=WINDOW)


#: The mask each kind's kernel is built for (``causal``).
CONVENTION_MASK = {"ragged": 1, "prefill": 0}


@pytest.mark.parametrize("kind", sorted(CONVENTION))
@in_a_process_ahead
def test_the_fast_families_functions_are_well_formed(kind):
    """The sm_90a families' functions (built here, run by the GPU tests) use no variable
    they do not define: their plans are of the cache's own shapes."""
    window = {"window": 300} if kind == "prefill_window" else {}
    kernel, why = cache_kernel(kind, 32, 8, 128, "float16", {"kind": "cuda", "arch": "sm_90a"}, **window)
    assert kernel is not None, why
    assert kernel.family.name != "generic"
    assert tvm.tirx.analysis.verify_well_formed(kernel.func)


@pytest.mark.parametrize("kind", ["ragged", "decode"])
def test_the_fast_families_rotating_functions_are_well_formed(kind):
    """Built for RoPE inside attention on sm_90a (run by the GPU tests), the fast
    families' functions launch the rotation pass's kernels first, then their own, on
    the copies: well-formed, the copies allocated in the function (the tensor-core
    decode rotates keys in its registers: rotated queries only)."""
    hopper = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    theirs = tvm_kernel(kind, 32, 8, 128, hopper)
    kernel, why = cache_kernel(kind, 32, 8, 128, "float16", hopper, fallback=theirs, rotate_inside=True)
    assert kernel is not None, why
    assert kernel.family.name != "generic"
    ours = kernel.func.body.then_case  # (the else case: TVM's kernel)
    assert tvm.tirx.analysis.verify_well_formed(kernel.func.with_body(ours))
    allocated = []
    tvm_ffi.structural_walk(ours, lambda n: allocated.append(n.buffer.name) if isinstance(n, tvm.tirx.AllocBuffer)
                            and n.buffer.scope() == "global" else None)
    copies = {"ragged": ["q_rotated", "k_rotated"], "decode": ["q_rotated"]}
    assert [name for name in allocated if name.endswith("_rotated")] == copies[kind]


@pytest.mark.parametrize("kind, head_dim, launched", [
    ("ragged", 128, {"q": (128, 32), "k": (128, 8)}),  # threads, the loop over the heads
    ("ragged", 64, {"q": (64, 32), "k": (64, 8)}),
    ("prefill", 128, {"q": (128, 32), "pages": (1024, 8)}),
])
def test_the_rotation_pass_runs_a_thread_an_element_looping_over_heads(kind, head_dim, launched):
    """On a GPU the rotation pass takes a token (a page) a block, its threads (up to
    ``rope_inside.THREADS``) over a row's elements (a page's: 16 rows of 128), each
    looping over the heads: 32 query heads, 8 key heads."""
    hopper = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    theirs = tvm_kernel(kind, 32, 8, head_dim, hopper)
    kernel, why = cache_kernel(kind, 32, 8, head_dim, "float16", hopper, fallback=theirs, rotate_inside=True)
    assert kernel is not None, why
    passes = []

    def visit(node):
        if isinstance(node, tvm.tirx.AttrStmt) and node.attr_key == "thread_extent" and node.node.thread_tag == "threadIdx.x":
            heads = []
            tvm_ffi.structural_walk(node.body, lambda n: heads.append(int(n.extent)) if isinstance(n, tvm.tirx.For)
                                    and n.loop_var.name == "i0" else None)
            if heads:
                passes.append((int(node.value), heads[0]))

    tvm_ffi.structural_walk(kernel.func.body.then_case, visit)
    assert passes == list(launched.values())


def _interleaved(rotation):
    """``rotation`` pairing adjacent elements (GPT-J's interleaved RoPE) in place of
    elements half a row apart."""
    x, row = rotation.x, rotation.row
    neighbour = tvm.tirx.if_then_else(x % 2 == 0, row[x + 1] * tvm.tirx.const(-1, row.dtype), row[x - 1])

    def swap(node):
        return neighbour if node.op.name.endswith("if_then_else") else node

    return rope_inside.Rotation(tvm_ffi.structural_map(rotation.expr, (tvm.ir.expr.Call, swap)), row,
                                rotation.position, x, rotation.scalars)


def test_the_tensor_core_decode_rotates_keys_whose_pairs_its_lanes_hold():
    """The tensor-core decode rotates keys in its registers where rotating element ``x``
    reads elements a multiple of 32 from it (its lanes hold a quarter of a row in pieces
    32 apart): TVM's rotation (``x`` and ``x ± d / 2``) at head dims 64 and 128; not an
    interleaved one, nor a head dim its kernel pads (96: the pairs 48 apart)."""
    from tvm_cascade.library.spec import AttentionSpec
    from tvm_cascade.library.tensor_core_decode import TensorCoreDecode

    hopper = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    for head_dim, rotates in ((64, True), (128, True), (96, False)):
        rotation, _ = rope_inside.rotation_of(tvm_kernel("decode", 32, 8, head_dim, hopper))
        assert rotation.reads(3) == [3, 3 + head_dim // 2] and rotation.reads(head_dim - 1) == [head_dim - 1,
                                                                                             head_dim // 2 - 1]
        spec = AttentionSpec.make(32, 8, head_dim, layout="kv_decode", target=hopper, page_size=16)
        assert TensorCoreDecode().rotates_keys(spec, rotation) == rotates
        assert rotation.reads(3) != _interleaved(rotation).reads(3) == [3, 2]
        assert not TensorCoreDecode().rotates_keys(spec, _interleaved(rotation))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_tensor_core_decode_rotates_keys_in_registers(head_dim):
    """Built for RoPE inside attention on sm_90a, the tensor-core decode's CUDA rotates
    each key where its registers hold it: its key registers are indexed by constants
    only (an index known at run time would put them in local memory), and the angle's
    cosine and sine are taken in the kernel (not in a pass over the pages), its
    frequencies once per element."""
    import re  # pylint: disable=import-outside-toplevel

    hopper = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    theirs = tvm_kernel("decode", 32, 8, head_dim, hopper)
    kernel, why = cache_kernel("decode", 32, 8, head_dim, "float16", hopper, fallback=theirs, rotate_inside=True)
    assert kernel is not None and kernel.family.name == "tensor_core_decode", why
    source = tvm.compile(tvm.IRModule({"main": kernel.func}), target=kernel.func.attrs["target"]).mod.imports[0] \
        .inspect_source()
    decode = next(body for body in source.split("extern \"C\" __global__")
                  if "k_reg_ptr" in body and "{" in body and "mma" in body)
    indices = re.findall(r"\b(?:k_reg|k_next)_ptr\[([^\]]*)\]", decode)
    assert indices and all(index.isdigit() for index in indices), sorted(set(indices))
    assert "cosf(" in decode and "sinf(" in decode
    # The frequencies (a pow per element) once, into a table: a lane's quarter of a key
    # reads half its elements' entries (a pair shares one).
    assert decode.count("powf(") == 1
    assert len(set(re.findall(r"/ per_element_ptr\[([^\]]*)\]", decode))) == head_dim // 8


def _row_tiles_from_their_sequences_last(func):
    """Whether ``func`` (a warp-specialised kernel) checks that a row tile (from ``r0``)
    lies after its sequence's first row: counted back from the sequence's own last, a
    shorter sequence's count runs past its first."""
    found = []

    def visit(node):
        if isinstance(node, tvm.tirx.IfThenElse) and isinstance(node.condition, tvm.tirx.And):
            lower = node.condition.a
            if isinstance(lower, tvm.tirx.GE) and isinstance(lower.a, TensorLoad) and lower.a.source.name == "r0":
                found.append(lower)

    tvm_ffi.structural_walk(func.body, visit)
    return bool(found)


@in_a_process_ahead
def test_a_causal_ragged_kernel_counts_row_tiles_from_each_sequences_last():
    """Under a causal mask the longest row tiles come first: in the cache's ragged prefill
    and the runtime-length ragged kernel (sequences of different lengths) those of each
    sequence, counted from its own last; where every sequence has the call's rows (bhsd)
    or nothing is masked (the cache's paged prefill) the order is the call's."""
    from tvm_cascade.library.spec import AttentionSpec
    from tvm_cascade.library.warp_specialized_prefill import WarpSpecializedPrefill

    hopper = {"kind": "cuda", "arch": "sm_90a"}
    for kind, own in (("ragged", True), ("prefill", False)):
        kernel, why = cache_kernel(kind, 32, 8, 128, "float16", hopper)
        assert kernel.family.name == "warp_specialized_prefill", why
        assert _row_tiles_from_their_sequences_last(kernel.func) == own
    for layout, own in (("ragged", True), ("bhsd", False)):
        spec = AttentionSpec.make(32, 8, 128, variant="causal", layout=layout, target=tvm.target.Target(hopper))
        assert _row_tiles_from_their_sequences_last(WarpSpecializedPrefill().build(spec)) == own


#: Llama-3.1's RoPE scaling, as TVM's ``rope_scaling`` (the factors shrunk to the tests'
#: positions: the bands fall inside a head dim of 32).
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


@pytest.mark.parametrize("head_dim, scaling", [(64, None), (128, None), (32, LLAMA3_SCALING)])
def test_a_key_rotation_takes_its_part_per_element_from_a_table(head_dim, scaling):
    """A kernel rotating keys itself computes the rotation's part that no key changes
    (TVM's frequency: ``rope_theta`` to the power ``2 (x mod d/2) / d``) once per element,
    half the head dim of them (the two of a pair share one), into a table: the table
    holds numpy's frequencies, and every element rotated with it equals the rotation
    without it, at positions up to 8192."""
    from types import SimpleNamespace

    from tvm.script import tirx as T

    from tvm_cascade.library.rope_inside import key_rotation

    rotation, _ = rope_inside.rotation_of(tvm_kernel("decode", 4, 2, head_dim, scaling=scaling))
    half = head_dim // 2

    def rotated(rotate, row, offset, x, table=None):
        return rotate(SimpleNamespace(inputs=[offset]), lambda delta: row[x + delta], 0, 0, x, table)

    @T.prim_func(s_tir=True)
    def rotations(row: T.Buffer((head_dim,), "float16"), k_rope_pos_offset: T.Buffer((1,), "int32"),
                  scalars: T.Buffer((2,), "float32"), table: T.Buffer((half,), "float32"),
                  plain: T.Buffer((head_dim,), "float16"), tabled: T.Buffer((head_dim,), "float16")):
        rotate = T.meta_var(key_rotation(rotation, {"rope_theta": scalars[0], "rope_scale": scalars[1]}))
        for y in range(half):
            with T.sblock("table"):
                vy = T.axis.spatial(half, y)
                table[vy] = rotate.per_element(vy)
        for x in range(head_dim):
            with T.sblock("rotate"):
                vx = T.axis.spatial(head_dim, x)
                plain[vx] = rotated(rotate, row, k_rope_pos_offset, vx)
                tabled[vx] = rotated(rotate, row, k_rope_pos_offset, vx, table)

    rotate = key_rotation(rotation, {"rope_theta": T.float32(1), "rope_scale": T.float32(1)})
    assert rotate.table_dtype == "float32" and rotate.period == half
    func = tvm.compile(tvm.IRModule({"main": rotations}), target="llvm")["main"]
    rng = np.random.default_rng(5)
    theta = 500000.0
    for position in (0, 7, 1000, 8191):
        arrays = [rng.standard_normal(head_dim).astype("float16"), np.array([position], "int32"),
                  np.array([theta, 1.0], "float32"), np.zeros(half, "float32"),
                  np.zeros(head_dim, "float16"), np.zeros(head_dim, "float16")]
        tensors = [tvm.runtime.tensor(a) for a in arrays]
        func(*tensors)
        if scaling is None:
            expected = theta ** (2 * np.arange(head_dim // 2) / head_dim)
            np.testing.assert_allclose(tensors[3].numpy(), expected, rtol=1e-5)
        np.testing.assert_array_equal(tensors[5].numpy(), tensors[4].numpy())


@pytest.mark.parametrize("kind, q_lens, kv_lens", [CASES[0], CASES[3]])
def test_rope_inside_attention_rotates_with_the_caches_rope_scaling(kind, q_lens, kv_lens):
    """TVM's rotation read from its kernel carries the cache's RoPE scaling (Llama-3's
    here): numpy's attention over numpy's Llama-3-rotated Q and K, and TVM's kernel."""
    theirs = _tvm_cpu_kernel(kind, LLAMA3_SCALING)
    kernel, why = cache_kernel(kind, 4, 2, 32, "float16", "llvm", fallback=theirs, rotate_inside=True)
    assert kernel is not None, why
    funcs = [tvm.compile(tvm.IRModule({"main": f}), target="llvm")["main"] for f in (kernel.func, theirs)]
    outputs, (out, lse) = rope_inside_runs(kind, funcs, q_lens, kv_lens, 4, 2, 32, tvm.cpu(), seed=3,
                                           scaling=LLAMA3_SCALING)
    np.testing.assert_allclose(outputs[0][0], out, atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(outputs[0][0], outputs[1][0], atol=2e-3, rtol=2e-3)
    # The scaling matters at these positions: unscaled rotation is another output.
    _, (unscaled, _) = rope_inside_runs(kind, [], q_lens, kv_lens, 4, 2, 32, tvm.cpu(), seed=3)
    assert np.abs(unscaled - out).max() > 1e-2


@pytest.mark.parametrize("kind, q_lens, kv_lens, copied", [
    case + (copied,) for case in CASES for copied in ("keys", "pages")
    if case[0] in {"keys": ("ragged", "prefill", "decode"), "pages": ("prefill", "decode", "prefill_window",
                                                                       "decode_window")}[copied]])
def test_rope_inside_attention_rotates_q_and_k_as_tvms_kernel_does(kind, q_lens, kv_lens, copied, monkeypatch):
    """Built for RoPE inside attention (a cache of ``RopeMode.INLINE``), the kernel
    rotates query ``t`` by ``q_rope_position[t]`` and key ``j`` of sequence ``b`` by
    ``k_rope_pos_offset[b] + j`` (a sliding window's keys counted sink first), the
    rotation read from TVM's kernel: numpy's attention over numpy's rotated Q and K, and
    TVM's kernel's outputs; calls without RoPE inside attention run TVM's kernel. Both
    forms of the copies: rotated keys at the pool's page ids (a kernel that reads the
    pages element by element, as this one does, outside sliding windows) and the listed
    pages in the table's order (one that copies whole boxes of them, as the
    warp-specialised prefill does, and under sliding windows)."""
    if copied == "pages":
        monkeypatch.setattr(rope_inside, "_reads_elements", lambda body, pages: False)
    theirs = _tvm_cpu_kernel(kind)
    kernel, why = cache_kernel(kind, 4, 2, 32, "float16", "llvm", fallback=theirs, rotate_inside=True,
                               window=WINDOW if kind == "prefill_window" else 0)
    assert kernel is not None, why
    funcs = [tvm.compile(tvm.IRModule({"main": f}), target="llvm")["main"] for f in (kernel.func, theirs)]
    outputs, (out, lse) = rope_inside_runs(kind, funcs, q_lens, kv_lens, 4, 2, 32, tvm.cpu(), seed=8)
    np.testing.assert_allclose(outputs[0][0], out, atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(outputs[0][1], lse, atol=1e-3, rtol=1e-4)
    seen = lse > -5e4  # (TVM's kernel gives NaN for a row that sees no key)
    np.testing.assert_allclose(outputs[0][0][seen], outputs[1][0][seen], atol=2e-3, rtol=2e-3)
    flags = {p.name: p for p in kernel.func.params}
    assert isinstance(kernel.func.body, tvm.tirx.IfThenElse)
    condition = tvm.tirx.EQ(flags["rotary_mode"], 1)
    if kind in CONVENTION_MASK:  # (the sliding-window prefill serves both masks)
        condition = tvm.tirx.And(condition, flags["causal"] == CONVENTION_MASK[kind])
    tvm.ir.assert_structural_equal(kernel.func.body.condition, tvm.tirx.op.tvm_thread_invariant(condition))


def test_a_kernel_for_both_rotary_modes_serves_each_with_its_own(monkeypatch):
    """With ``unrotated_too`` (a cache whose sliding-window support the runtime decides
    calls its ragged prefill with either mode) the function rotates where ``rotary_mode``
    is 1 and attends as it is where 0: numpy's attention in both, no call left to TVM's
    kernel (the fallback of a call neither serves, here one that computes nothing, its
    rotation read from TVM's: any call reaching it fails the check)."""
    from tvm_cascade.library import kv_cache  # pylint: disable=import-outside-toplevel

    kind, q_lens, kv_lens = CASES[0]
    theirs = _tvm_cpu_kernel(kind)
    silent = theirs.with_body(tvm.tirx.Evaluate(0))
    monkeypatch.setattr(kv_cache, "rotation_of", lambda fallback: rope_inside.rotation_of(theirs))
    kernel, why = cache_kernel(kind, 4, 2, 32, "float16", "llvm", fallback=silent, rotate_inside=True,
                               unrotated_too=True)
    assert kernel is not None, why
    func = tvm.compile(tvm.IRModule({"main": kernel.func}), target="llvm")["main"]
    for (out, lse), (want, want_lse) in both_modes_runs(kind, func, q_lens, kv_lens, 4, 2, 32, tvm.cpu(), seed=4):
        np.testing.assert_allclose(out, want, atol=2e-3, rtol=2e-3)
        np.testing.assert_allclose(lse, want_lse, atol=1e-3, rtol=1e-4)
    with pytest.raises(ValueError, match="unrotated_too"):
        cache_kernel(kind, 4, 2, 32, "float16", "llvm", fallback=theirs, unrotated_too=True)


def test_rope_inside_attention_is_refused_without_tvms_rotation_or_a_rotation_pass():
    kernel, why = cache_kernel("decode", 4, 2, 32, "float16", "llvm", rotate_inside=True)
    assert kernel is None and "rotates as TVM's kernel does" in why
    kernel, why = cache_kernel("decode", 4, 2, 32, "float16", "rocm", fallback=_tvm_cpu_kernel("decode"),
                               rotate_inside=True)
    assert kernel is None and "no rotation pass for rocm targets" in why
