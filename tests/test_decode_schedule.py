"""The CUDA decode schedule, its MetaSchedule design space and the tuned-record reload path.

No GPU here: the kernels are compiled with TVM's CUDA codegen and the schedules checked for
what they must hold; the GPU numbers are in benchmarks/RESULTS.md."""
import itertools
import re

import pytest
import tvm
import tvm_ffi
import tvm_cascade  # noqa: F401

from tvm_cascade import kernels, ops
from tvm_cascade.bench import VARIANTS
from tvm_cascade.cuda import tensor_cores
from tvm_cascade.library.split_k import sm_count
from tvm_cascade.schedules.decode import (
    DecodeConfig,
    choose_chunks,
    decode_design_space,
    lanes_for,
    longest_chunk,
    packs_queries,
    qk_form,
    query_rows,
    rows_per_chunk,
    v_tiles,
    schedule_decode,
)

from tuning_records import write_records
from ahead import in_a_process_ahead

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})


def _source(mod):
    return tensor_cores.build(mod, CUDA).mod.imports[0].inspect_source()


def _kernels(source):
    return re.findall(r'extern "C" __global__ void __launch_bounds__\(\d+\) (\w+)\(.*\{', source)


def _kernel_body(source, name):
    start = re.search(rf"void __launch_bounds__\(\d+\) {name}\(.*\{{", source).end()
    return source[start : source.index("\n}\n", start)]


#: The tiled scores kernel for groups of 8 and their packed query rows (tensor cores by default).
TILED = DecodeConfig(mma_from_group=128)


def _form(heads_q, heads_kv, seq_q, head_dim=128, config=DecodeConfig()):
    group = heads_q // heads_kv
    return qk_form(group, config, rows_per_chunk(group, seq_q, head_dim, config))


def _kernel_count(form):
    """Scores and chunks are one kernel on tensor cores and fused; the combine is another."""
    return 2 if form in ("mma", "fused") else 3


@pytest.mark.parametrize(
    "heads_q, heads_kv, form, head_dim, seq_q, dtype",
    [
        (32, 32, "fused", 128, 1, "float16"),
        (32, 16, "fused", 128, 1, "float16"),
        (32, 8, "tiled", 128, 1, "float16"),
        (64, 8, "mma", 128, 1, "float16"),
        (32, 32, "fused", 64, 1, "bfloat16"),
        (32, 16, "mma", 128, 4, "bfloat16"),
        (32, 16, "fused", 128, 3, "bfloat16"),
        (32, 32, "lanes", 128, 4, "float16"),
        (32, 32, "mma", 128, 8, "float16"),
        (32, 32, "mma", 64, 8, "bfloat16"),
        (64, 8, "mma", 64, 8, "float16"),
        (32, 2, "mma", 128, 4, "bfloat16"),
    ],
)
def test_heuristic_schedule_compiles_to_kernels_with_128_bit_loads(heads_q, heads_kv, form, head_dim, seq_q, dtype):
    """Three kernels (scores, chunks, combine), or two on tensor cores and fused (scores
    and chunks in one), loading K and V 128 bits at a time."""
    func = ops.attention(
        2, heads_q, heads_kv, seq_q, 1024, head_dim, dtype=dtype, variant=VARIANTS["causal"]
    )
    sch = schedule_decode(func, heads_q, heads_kv, head_dim)
    assert str(sch.trace).count("sch.split_k_update(") == 3
    assert _form(heads_q, heads_kv, seq_q, head_dim) == form
    source = _source(sch.mod)
    kernels_ = [_kernel_body(source, k) for k in _kernels(source)]
    assert len(kernels_) == _kernel_count(form)
    combine = kernels_[-1]  # the combine is a single kernel
    assert "out_ptr" in combine and "__shfl" not in combine
    if form == "mma":
        (chunks,) = kernels_[:-1]
        # K and V staged in padded shared rows by coalesced 128-bit loads, the scores kept
        # in shared memory; Q·Kᵀ products of 16 keys x 8 heads, P·V products of 16 dims x
        # 8 heads, operands by ldmatrix (K x4, Q x2, V x4 transposed, exps x2).
        for operand in ("K", "V"):
            assert re.search(rf"_shared_ptr\W.* = \*\(uint4\*\)\({operand}_ptr", chunks)
        assert "qk_ptr" not in chunks
        precision = {"float16": "f16", "bfloat16": "bf16"}[dtype]
        # (The loops over products are unrolled, once the fragments are in registers.)
        assert chunks.count(f"mma.sync.aligned.m16n8k16.row.col.f32.{precision}.{precision}.f32") >= 2
        for load in ("x4", "x2", "x4.trans"):
            assert f"ldmatrix.sync.aligned.m8n8.{load}.shared.b16" in chunks
        warps = min(DecodeConfig().mma_warps, head_dim // 16)
        # 4 floats per 16 dims (a warp's share of the head dimension) and 8 rows.
        rows = rows_per_chunk(heads_q // heads_kv, seq_q, head_dim, DecodeConfig())
        assert f"float pv_partial_warp_ptr[{rows // 8 * head_dim // warps // 4}]" in chunks
        return
    if form == "fused":
        # Each chunk's scores: K rows by 128-bit loads into registers, reduced by the
        # lanes' shuffles, kept in shared memory for the softmax and P·V.
        (chunks,) = kernels_[:-1]
        assert "*(uint4*)(K_local_ptr" in chunks and "__shfl_down_sync" in chunks
        assert "qk_ptr" not in chunks and "qk_shared_ptr" in chunks
        assert "*(uint4*)(V_local_ptr" in chunks
        return
    qk, chunks = kernels_[:-1]
    if form == "tiled":
        # K staged in padded shared rows by coalesced 128-bit loads; no shuffles.
        assert re.search(r"K_shared_ptr\W.* = \*\(uint4\*\)\(K_ptr", qk)
        assert "__shfl" not in qk
        assert "K_shared_local_ptr" in qk
    else:
        assert "*(uint4*)(K_local_ptr" in qk and "__shfl_down_sync" in qk
    assert "exp_shared_ptr" in chunks and "*(uint4*)(V_local_ptr" in chunks


@pytest.mark.parametrize(
    "heads_q, heads_kv, seq_q, seq_kv", [(32, 32, 1, 4100), (64, 8, 1, 1000), (32, 16, 3, 37), (64, 8, 1, 100), (4, 4, 3, 700)]
)
def test_key_lengths_the_chunks_do_not_split_are_padded(heads_q, heads_kv, seq_q, seq_kv):
    """``compile_attention`` pads keys to a multiple of ``PAD_KEYS`` (masked); the loads
    of K and V read zeros past the keys' end."""
    compiled = kernels.compile_attention(
        2, heads_q, heads_kv, seq_q, seq_kv, 128, variant=VARIANTS["causal"], target=CUDA, records="/none"
    )
    source = compiled.mod.imports[0].inspect_source()
    padded = query_rows(heads_q // heads_kv, seq_q, 128, DecodeConfig())
    assert len(_kernels(source)) == _kernel_count(_form(heads_q, heads_kv, padded))
    for operand in ("K", "V"):
        assert re.search(rf"if \(.*\) {{\n\s*condval\w* = \*\(uint4\*\)\({operand}_ptr", source), operand
    with pytest.raises(ValueError, match="divisible by 16"):
        choose_chunks(2, heads_kv, heads_q // heads_kv, 4100, DecodeConfig(), 132)


def test_chunks_of_few_query_rows_compute_their_scores_themselves():
    """Chunks of at most ``fuse_rows`` query rows compute their own scores (one kernel
    fewer); packed chunks of more rows, whose lanes would reduce every row's dot
    products, keep kernel 1. The z threads of a chunk split its rows for the scores too:
    each keeps only its own rows' slices of Q."""
    assert _form(32, 32, 1) == _form(32, 16, 1) == _form(32, 32, 2) == "fused"
    assert _form(32, 16, 3) == "fused"  # 6 rows fill no tile: blocks per query row
    assert _form(32, 32, 4) == "lanes"  # 4 packed query rows
    assert _form(32, 32, 1, config=DecodeConfig(fuse_rows=0)) == "lanes"

    def scores(heads_per_thread):
        func = ops.attention(2, 32, 16, 1, 1024, 128, dtype="float16", variant=VARIANTS["softcap"])
        config = DecodeConfig(heads_per_thread=heads_per_thread)
        source = _source(schedule_decode(func, 32, 16, 128, config=config).mod)
        chunks = _kernel_body(source, _kernels(source)[0])
        return re.findall(r"half Q_local_ptr\[(\d+)\]", chunks), "threadIdx.z" in chunks

    assert scores(2) == (["16"], False)  # a thread's lanes hold both heads
    assert scores(1) == (["8"], True)  # two z threads, a head each


def test_tiled_scores_give_each_query_row_blocks_of_its_own():
    """With several query rows, a thread of the tiled scores kernel holds what it holds
    for one row (its keys x the group's heads), not that times the rows, which went to
    local memory."""

    def registers(seq_q):
        func = ops.attention(2, 64, 8, seq_q, 1024, 128, dtype="float16", variant=VARIANTS["causal"])
        source = _source(schedule_decode(func, 64, 8, 128, config=TILED).mod)
        qk = _kernel_body(source, _kernels(source)[0])
        return sorted(re.findall(r"alignas\(64\) (?:float|half) (\w+_local_ptr)\[(\d+)\]", qk))

    assert registers(8) == registers(1)
    assert ("qk_local_ptr", "32") in registers(8)


@pytest.mark.parametrize("heads_q, heads_kv, seq_q, packed", [(4, 4, 4, True), (8, 4, 3, False)])
def test_chunk_threads_serve_every_query_row_of_a_head(heads_q, heads_kv, seq_q, packed):
    """Several query rows of one head per K/V head: each thread of kernel 2 accumulates
    all of them (its V loads serve them all) instead of each row having blocks of its
    own; with GQA groups whose rows fill no tensor-core tile the query rows keep blocks
    of their own."""

    def chunk_kernel(seq_q):
        func = ops.attention(2, heads_q, heads_kv, seq_q, 1024, 128, dtype="float16", variant=VARIANTS["causal"])
        source = _source(schedule_decode(func, heads_q, heads_kv, 128).mod)
        kernel = _kernel_body(source, _kernels(source)[-2])
        return re.findall(r"float pv_partial_local_ptr\[(\d+)\]", kernel)

    one, several = chunk_kernel(1), chunk_kernel(seq_q)
    assert packs_queries(heads_q // heads_kv, seq_q, 128, DecodeConfig()) == packed
    assert one == ["8" if heads_q == heads_kv else "16"]
    assert several == ([str(8 * seq_q)] if packed else one)


@pytest.mark.parametrize(
    "heads_q, seq_q, tiles",
    # (group, query rows): rows (query, head) of a K/V head in tiles of 8 columns
    [(16, 1, 1), (16, 4, 4), (4, 4, 1), (4, 8, 2), (8, 2, 1), (32, 2, 4)],
)
def test_tensor_core_products_serve_every_query_row_of_a_group(heads_q, seq_q, tiles):
    """On tensor cores the rows (query, head) of a K/V head are the columns of the same
    products, 8 a tile, in as many tiles as they fill, tiles spanning several query rows
    for groups of fewer than 8: a warp accumulates them all, each K and V tile loaded
    once for all rows."""
    func = ops.attention(2, heads_q, 2, seq_q, 1024, 128, dtype="float16", variant=VARIANTS["gqa"])
    assert _form(heads_q, 2, seq_q) == "mma"
    source = _source(schedule_decode(func, heads_q, 2, 128).mod)
    assert len(_kernels(source)) == 2
    kernel = _kernel_body(source, _kernels(source)[0])
    # 4 floats per tile and thread (16 keys or dims x 8 columns over a warp).
    expected = [("qk_shared_warp_ptr", str(4 * tiles)), ("pv_partial_warp_ptr", str(4 * tiles))]
    assert re.findall(r"float (qk_shared_warp_ptr|pv_partial_warp_ptr)\[(\d+)\]", kernel) == expected


def test_query_rows_are_padded_to_fill_tensor_core_tiles():
    """Speculative decoding that would not run on tensor cores computes over as many
    query rows as fill tiles of 8 (query, head) rows there; ``compile_attention`` pads
    them (their outputs are dropped)."""
    config = DecodeConfig()
    for group, lengths in {
        1: [1, 8, 8, 8, 8, 8, 8, 8],
        2: [1, 4, 4, 4, 8, 8, 8, 8],
        4: [1, 2, 4, 4, 6, 6, 8, 8],  # one query row stays tiled
        8: [1, 2, 3, 4, 5, 6, 7, 8],  # on tensor cores already
    }.items():
        assert [query_rows(group, seq_q, 128, config) for seq_q in range(1, 9)] == lengths, group
    assert kernels.padding("decode", 4, 4, 3, 128) == (8, 128)
    assert kernels.padding("decode", 4, 4, 3, 128, DecodeConfig(mma_from_group=16)) == (3, 128)
    compiled = kernels.compile_attention(1, 4, 4, 3, 700, 128, variant=VARIANTS["alibi"], target=CUDA, records="/none")
    source = compiled.mod.imports[0].inspect_source()
    assert len(_kernels(source)) == 2 and "mma.sync" in source


def test_query_rows_pack_where_they_fill_tiles_and_the_v_tiles_fit():
    config = DecodeConfig()
    assert packs_queries(8, 4, 128, config) and packs_queries(8, 8, 128, config)
    assert packs_queries(2, 4, 128, config) and packs_queries(16, 2, 128, config)
    # 3 queries of a group of 2 fill no tile: blocks per query row, scores in the chunk.
    assert not packs_queries(2, 3, 128, config) and _form(4, 2, 3) == "fused"
    # The shortest chunk's scores (64 rows) would outgrow every V tile of 64 dims.
    assert not packs_queries(8, 8, 64, config)


def test_eight_query_rows_of_one_head_are_the_columns_of_tensor_core_products():
    """With one query head per K/V head, 8 packed query rows fill the 8 columns of a
    product as a GQA group's 8 heads do: one tile, K and V loaded once for all rows;
    fewer rows keep the lanes. A config whose chunk scores no V tile outgrows is refused."""
    assert [_form(32, 32, seq_q) for seq_q in (1, 2, 4, 8)] == ["fused", "fused", "lanes", "mma"]
    assert [_form(32, 16, seq_q) for seq_q in (1, 2, 4, 8)] == ["fused", "fused", "mma", "mma"]
    func = ops.attention(2, 4, 4, 8, 1024, 128, dtype="float16", variant=VARIANTS["alibi"])
    source = _source(schedule_decode(func, 4, 4, 128).mod)
    assert len(_kernels(source)) == 2
    chunks = _kernel_body(source, _kernels(source)[0])
    assert re.findall(r"float (qk_shared_warp_ptr|pv_partial_warp_ptr)\[(\d+)\]", chunks) == [
        ("qk_shared_warp_ptr", "4"),
        ("pv_partial_warp_ptr", "4"),
    ]
    with pytest.raises(ValueError, match="mma_score_bytes=40000: no V tile of head_dim 128"):
        schedule_decode(func, 4, 4, 128, config=DecodeConfig(mma_score_bytes=40000))


def test_combine_splits_the_chunks_over_thread_rows():
    """Kernel 3: ``combine_slices`` thread rows each combine a slice of a query row's
    chunks; the slices meet in shared memory and one of them stores the output."""
    func = ops.attention(2, 8, 8, 1, 1024, 128, dtype="float16", variant=VARIANTS["causal"])
    for slices in (1, 2):
        source = _source(schedule_decode(func, 8, 8, 128, config=DecodeConfig(combine_slices=slices)).mod)
        combine = _kernel_body(source, _kernels(source)[-1])
        assert ("threadIdx.y" in combine) == (slices > 1)
        assert ("if (((int)threadIdx.y) == 0) {\n    out_ptr[" in combine) == (slices > 1)


def test_tiled_key_rows_are_padded_by_128_bits():
    func = ops.attention(1, 8, 1, 1, 512, 128, dtype="float16", variant=VARIANTS["gqa"])
    config = DecodeConfig(tile_threads=64, tile_keys=2, tile_stages=2, mma_from_group=16)
    source = _source(schedule_decode(func, 8, 1, 128, config=config).mod)
    # 64 threads x 2 keys, each row 64 dims + 8 halves of padding: 128 x 9 uint4.
    assert re.search(r"__shared__ alignas\(\d+\) uint4 K_shared_ptr\[1152\]", source)


def test_chunk_count_fills_the_gpu_divides_the_keys_and_fits_shared_memory():
    config = DecodeConfig()
    for batch, heads_kv, group, seq in itertools.product((1, 8), (8, 32), (1, 2, 8), (4096, 32768)):
        chunks = choose_chunks(batch, heads_kv, group, seq, config, 132)
        keys = seq // chunks
        assert (seq // lanes_for(128)) % chunks == 0 and chunks % config.rows == 0
        assert keys <= longest_chunk(group, config.rows, config)
        assert 4 * keys * group * config.rows <= config.exp_bytes
    # More work per (batch, kv head) row needs fewer chunks to fill the same GPU ...
    assert choose_chunks(8, 32, 1, 32768, config, 132) < choose_chunks(1, 32, 1, 32768, config, 132)
    # ... but chunks stay long enough that their partial outputs stay small.
    assert 4096 // choose_chunks(1, 8, 8, 4096, config, 132) >= config.keys_per_head * 8
    assert 4096 // choose_chunks(1, 8, 1, 4096, config, 132) >= config.min_chunk


def test_chunk_count_refuses_keys_that_do_not_split():
    with pytest.raises(ValueError, match="divisible by 16"):
        choose_chunks(8, 8, 1, 4100, DecodeConfig(), 132)
    with pytest.raises(ValueError, match="divisible by 8"):
        choose_chunks(8, 8, 1, 4100, DecodeConfig(), 132, lanes=lanes_for(64))


def test_tensor_core_v_tiles_outgrow_the_scores():
    """The tensor-core form stages V tiles larger than a chunk's scores (or TVM's storage
    planner may put the tile in their place): smaller choices take the smallest such tile,
    others are refused."""
    scores = DecodeConfig().mma_score_bytes
    assert v_tiles(128, scores) == [64, 128] and v_tiles(64, scores) == [128]
    for head_dim in (64, 128):
        assert all(keys * (head_dim + 8) * 2 > scores for keys in v_tiles(head_dim, scores))
    wide = ops.attention(1, 16, 2, 1, 512, 128, dtype="float16", variant=VARIANTS["gqa"])
    for keys in (96, 256):
        with pytest.raises(ValueError, match=f"mma_pv_keys={keys} with head_dim 128"):
            schedule_decode(wide, 16, 2, 128, config=DecodeConfig(mma_pv_keys=keys))
    func = ops.attention(1, 16, 2, 1, 512, 64, dtype="float16", variant=VARIANTS["gqa"])
    # Smaller tiles than the first that outgrows the scores become that one.
    staged = schedule_decode(func, 16, 2, 64, config=DecodeConfig(mma_pv_keys=32))
    assert tvm_ffi.structural_equal(staged.mod, schedule_decode(func, 16, 2, 64, config=DecodeConfig(mma_pv_keys=128)).mod)


def test_lanes_follow_the_head_dimension():
    assert (lanes_for(64), lanes_for(128)) == (8, 16)
    for bad in (80, 96, 8):
        with pytest.raises(ValueError, match="head_dim"):
            lanes_for(bad)


@pytest.mark.parametrize("heads_q, heads_kv, seq_q", [(8, 2, 1), (8, 8, 1), (8, 4, 1), (4, 4, 4), (4, 4, 8), (8, 1, 2), (8, 4, 4)])
@in_a_process_ahead
def test_design_space_replays_under_every_decision(heads_q, heads_kv, seq_q):
    func = ops.attention(1, heads_q, heads_kv, seq_q, 512, 128, dtype="float16", variant=VARIANTS["gqa"])
    sch = tvm.s_tir.Schedule(func, seed=1)
    decode_design_space(heads_q, heads_kv, 128)(sch)
    samples = [i for i in sch.trace.insts if i.kind.name == "SampleCategorical"]
    sizes = [len(i.attrs[0]) for i in samples]
    # mma: chunks, warps, V tile, combine slices; the others also chunks per block, z
    # threads and the scores' choices (3 tiled, 2 lanes, 1 fused). A choice of one
    # option is a constant (MetaSchedule's mutators need another option to pick).
    form = _form(heads_q, heads_kv, seq_q)
    assert len(samples) <= {"mma": 4, "tiled": 8, "lanes": 7, "fused": 6}[form]
    assert all(size > 1 for size in sizes)
    # MetaSchedule keeps traces as JSON: every instruction input is an RV or a constant.
    assert "SplitKUpdate" in str(sch.trace.as_json())
    for decisions in itertools.islice(itertools.product(*(range(n) for n in sizes)), 0, None, 23):
        trace = sch.trace
        for inst, decision in zip(samples, decisions):
            trace = trace.with_decision(inst, decision, remove_postproc=True)
        replayed = tvm.s_tir.Schedule(func)
        trace.apply_to_schedule(replayed, remove_postproc=True)
        assert len(_kernels(_source(replayed.mod))) == _kernel_count(form), decisions


def test_tuned_records_reload_into_schedules(tmp_path, monkeypatch):
    """``kernels.schedule`` returns the best record's schedule of the JSON database in the
    format ``python -m benchmarks.tune_decode`` writes (``TVM_CASCADE_TUNED`` names it),
    and the heuristic schedule for other workloads; ``compile_attention`` compiles it."""
    func = ops.attention(1, 8, 2, 1, 512, 128, dtype="float16", variant=VARIANTS["gqa"])
    traces = write_records(tmp_path, func, decode_design_space(8, 2, 128), CUDA, [(1, 2e-5), (2, 1e-5)])
    monkeypatch.setenv("TVM_CASCADE_TUNED", str(tmp_path))
    records = kernels.default_records("decode")
    assert records == tmp_path
    sch = kernels.schedule(func, CUDA, records)
    assert str(sch.trace).count("sch.split_k_update(") == 3
    expected = tvm.s_tir.Schedule(func)
    traces[1].apply_to_schedule(expected, remove_postproc=True)
    assert tvm_ffi.structural_equal(sch.mod, expected.mod)
    compiled = kernels.compile_attention(1, 8, 2, 1, 512, 128, variant=VARIANTS["gqa"], target=CUDA)
    assert compiled.mod.imports[0].inspect_source() == _source(expected.mod)
    other = ops.attention(1, 8, 2, 1, 1024, 128, dtype="float16", variant=VARIANTS["gqa"])
    assert kernels.tuned_schedule(other, CUDA, records) is None
    heuristic = schedule_decode(other, 8, 2, 128, sm_count(tvm.cuda(0)))
    assert tvm_ffi.structural_equal(kernels.schedule(other, CUDA, records).mod, heuristic.mod)


def test_checked_in_records_replay_into_the_fused_form(monkeypatch):
    """The record under ``tvm_cascade/tuned/decode`` (causal, batch 8, 32 heads, 4096 keys)
    replays with today's schedule: one kernel for scores and chunks, one combine."""
    monkeypatch.delenv("TVM_CASCADE_TUNED", raising=False)
    func = ops.attention(
        8, 32, 32, 1, 4096, 128, dtype="float16", variant=VARIANTS["causal"], pad_to=kernels.PAD_TO["decode"]
    )
    sch = kernels.tuned_schedule(func, CUDA, kernels.default_records("decode"))
    assert sch is not None and str(sch.trace).count("sch.split_k_update(") == 3
    assert len(_kernels(_source(sch.mod))) == _kernel_count("fused")


def test_tuning_needs_a_gpu():
    if tvm.cuda(0).exist:
        pytest.skip("a CUDA GPU is present")
    func = ops.attention(1, 8, 2, 1, 512, 128, dtype="float16", variant=VARIANTS["gqa"])
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        kernels.tune(func, CUDA, "unused", 8)
