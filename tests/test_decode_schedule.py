"""The CUDA decode schedule, its MetaSchedule design space and the tuned records.

No GPU here: the kernels are compiled with nvcc and the schedules checked for what they
must hold; the GPU numbers are in benchmarks/RESULTS.md."""
import itertools
from pathlib import Path

import pytest
import tvm
import tvm_cascade  # noqa: F401

from tvm_cascade import ops
from tvm_cascade.bench import VARIANTS, tuned_schedule
from tvm_cascade.schedules.decode import DecodeConfig, choose_chunks, decode_design_space, schedule_decode

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
TUNED = Path(__file__).resolve().parents[1] / "benchmarks" / "tuned" / "decode"


def _kernels(mod):
    source = tvm.compile(mod, target=CUDA).mod.imports[0].inspect_source()
    return source.count("extern \"C\" __global__") // 2, source


@pytest.mark.parametrize("heads_q, heads_kv", [(32, 32), (64, 8)])
def test_heuristic_schedule_compiles_with_128_bit_loads(heads_q, heads_kv):
    func = ops.attention(2, heads_q, heads_kv, 1, 1024, 128, dtype="float16", variant=VARIANTS["causal"])
    sch = schedule_decode(func, heads_q, heads_kv, 128)
    assert str(sch.trace).count("sch.split_k_update(") == 3
    kernels, source = _kernels(sch.mod)
    assert kernels == 6  # qk, chunk partials, three combines, epilogue
    assert "*(uint4*)(K_local_ptr" in source and "*(uint4*)(V_local_ptr" in source


def test_chunk_count_fills_the_gpu_and_divides_the_keys():
    config = DecodeConfig()
    for batch, heads_kv, group, seq in itertools.product((1, 8), (8, 32), (1, 8), (4096, 32768)):
        chunks = choose_chunks(batch, heads_kv, group, seq, config, 132)
        assert (seq // 16) % chunks == 0 and seq // chunks <= config.max_chunk
        assert chunks % max(1, config.rows // group) == 0
    # More work per (batch, kv head) row needs fewer chunks to fill the same GPU.
    assert choose_chunks(8, 32, 1, 32768, config, 132) <= choose_chunks(1, 32, 1, 32768, config, 132)


def test_design_space_replays_under_every_decision():
    func = ops.attention(1, 8, 2, 1, 512, 128, dtype="float16", variant=VARIANTS["gqa"])
    sch = tvm.s_tir.Schedule(func, seed=1)
    decode_design_space(8, 2, 128)(sch)
    samples = [i for i in sch.trace.insts if i.kind.name == "SampleCategorical"]
    sizes = [len(i.attrs[0]) for i in samples]
    assert len(samples) == 4
    for decisions in itertools.islice(itertools.product(*(range(n) for n in sizes)), 0, None, 7):
        trace = sch.trace
        for inst, decision in zip(samples, decisions):
            trace = trace.with_decision(inst, decision, remove_postproc=True)
        replayed = tvm.s_tir.Schedule(func)
        trace.apply_to_schedule(replayed, remove_postproc=True)
    _kernels(replayed.mod)


def test_tuned_records_reload_into_schedules():
    """The committed MetaSchedule database (written on the GPU by
    ``python -m benchmarks.tune_decode``) holds split_k_update traces that reload."""
    assert (TUNED / "database_tuning_record.json").exists()
    func = ops.attention(8, 64, 8, 1, 4096, 128, dtype="float16", variant=VARIANTS["gqa"])
    sch = tuned_schedule(func, CUDA)
    assert sch is not None
    assert str(sch.trace).count("sch.split_k_update(") == 3
    _kernels(sch.mod)
    untuned = ops.attention(8, 64, 8, 1, 2048, 128, dtype="float16", variant=VARIANTS["gqa"])
    assert tuned_schedule(untuned, CUDA) is None
