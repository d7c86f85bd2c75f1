"""A Llama-style decoder block built with ``tvm.relax.frontend.nn``, compiled with TVM's
default Relax pipeline and with ``relax_pipeline="cascade"``.

The block: RMSNorm, grouped-query attention over a KV cache (the new token's keys and
values are appended to ``past_k``/``past_v``, whose length is symbolic) with an additive
causal mask, RMSNorm and a SwiGLU MLP, both with residuals. The attention is written by
hand (``matmul -> scale -> mask -> softmax -> matmul`` with the K/V heads repeated over
each GQA group), which the cascade pipeline fuses into one kernel.

    python examples/llama_block.py                 # CPU: numerics vs numpy
    python examples/llama_block.py --target cuda   # GPU: numerics, then both timed
    python examples/llama_block.py --tune 16       # CPU: MetaSchedule finds the fusion

``--shapes`` lists steps as ``NEWxPAST`` (one sequence) or ``BATCHxNEWxPAST`` (a batch of
sequences of one length, the mask shared).

With ``--tune N`` the block is exported with the first shape static, its attention
grouped into one unfused PrimFunc (``FuseAttention(fuse=False)``), and
``tvm_cascade.meta_schedule.tune_relax`` searches its fused schedules (``cascade_space(unfused=False)``: rolling
and split-k updates, tile and chunk sizes sampled; with ``--with-unfused`` the default
rules' schedules too) for ``N`` trials; the records (a JSON database under
``--work-dir``) are applied with ``MetaScheduleApplyDatabase`` and the block is checked
against numpy, with what was measured and what won printed.
"""

import math

import numpy as np
import tvm
from tvm.relax.frontend import nn

import tvm_cascade  # noqa: F401  (registers relax_pipeline="cascade")
from compare import block_arguments, compile_both, count_attention_kernels, report, report_attention, run_both


class Attention(nn.Module):
    def __init__(self, hidden, heads_q, heads_kv, dtype):
        self.heads_q, self.heads_kv, self.head_dim = heads_q, heads_kv, hidden // heads_q
        self.q_proj = nn.Linear(hidden, heads_q * self.head_dim, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(hidden, heads_kv * self.head_dim, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(hidden, heads_kv * self.head_dim, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(heads_q * self.head_dim, hidden, bias=False, dtype=dtype)

    def forward(self, x, past_k, past_v, mask):
        b, s, _ = x.shape
        d = self.head_dim

        def heads(t, count):
            return nn.op.permute_dims(nn.op.reshape(t, [b, s, count, d]), [0, 2, 1, 3])

        q = heads(self.q_proj(x), self.heads_q)
        k = nn.op.concat([past_k, heads(self.k_proj(x), self.heads_kv)], dim=2)
        v = nn.op.concat([past_v, heads(self.v_proj(x), self.heads_kv)], dim=2)
        group = self.heads_q // self.heads_kv
        k = nn.op.repeat(k, group, axis=1)
        v = nn.op.repeat(v, group, axis=1)
        scores = nn.op.matmul(q, nn.op.permute_dims(k, [0, 1, 3, 2]))
        # The mask comes with its own symbolic key count: name it past + s.
        mask = nn.op.reshape(mask, [1, 1, s, k.shape[2]])
        scores = scores * (1.0 / math.sqrt(d)) + mask
        probs = nn.op.astype(nn.op.softmax(nn.op.astype(scores, "float32"), axis=-1), x.dtype)
        out = nn.op.matmul(probs, v)
        out = nn.op.reshape(nn.op.permute_dims(out, [0, 2, 1, 3]), [b, s, self.heads_q * d])
        return self.o_proj(out)


class DecoderBlock(nn.Module):
    def __init__(self, hidden, heads_q, heads_kv, intermediate, dtype):
        self.input_norm = nn.RMSNorm(hidden, -1, 1e-5, bias=False, dtype=dtype)
        self.attn = Attention(hidden, heads_q, heads_kv, dtype)
        self.post_norm = nn.RMSNorm(hidden, -1, 1e-5, bias=False, dtype=dtype)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)

    def forward(self, x, past_k, past_v, mask):
        h = x + self.attn(self.input_norm(x), past_k, past_v, mask)
        y = self.post_norm(h)
        return h + self.down_proj(nn.op.silu(self.gate_proj(y)) * self.up_proj(y))


def build(args, seq="s", past="past", batch=1):
    """The exported Relax module and its parameters (random, seeded); ``seq`` and
    ``past`` are ints for static shapes or names for symbolic ones; ``batch`` sequences."""
    block = DecoderBlock(args.hidden, args.heads_q, args.heads_kv, args.intermediate, args.dtype)
    d = args.hidden // args.heads_q
    spec = {
        "forward": {
            "x": nn.spec.Tensor([batch, seq, args.hidden], args.dtype),
            "past_k": nn.spec.Tensor([batch, args.heads_kv, past, d], args.dtype),
            "past_v": nn.spec.Tensor([batch, args.heads_kv, past, d], args.dtype),
            "mask": nn.spec.Tensor([1, 1, seq, past + seq if isinstance(past, int) else "kv"], args.dtype),
        }
    }
    mod, named_params = block.export_tvm(spec=spec)
    rng = np.random.default_rng(0)
    params = {}
    for name, param in named_params:
        shape = [int(x) for x in param.shape]
        scale = 1.0 if name.endswith("norm.weight") else 1.0 / math.sqrt(shape[-1])
        params[name] = (rng.standard_normal(shape) * scale).astype(args.dtype)
        if name.endswith("norm.weight"):
            params[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(args.dtype)
    return mod, params


def inputs(args, seq, past, batch=1):
    """x, past_k, past_v and the additive causal mask for ``seq`` new tokens of ``batch``
    sequences."""
    rng = np.random.default_rng(1)
    d = args.hidden // args.heads_q
    kv = past + seq
    x = rng.standard_normal((batch, seq, args.hidden)).astype(args.dtype)
    past_k = rng.standard_normal((batch, args.heads_kv, past, d)).astype(args.dtype)
    past_v = rng.standard_normal((batch, args.heads_kv, past, d)).astype(args.dtype)
    visible = np.arange(kv)[None, :] <= (past + np.arange(seq))[:, None]
    mask = np.where(visible, 0.0, -1e4).astype(args.dtype)[None, None]
    return [x, past_k, past_v, mask]


def reference(args, params, x, past_k, past_v, mask):
    """The block in float64 numpy."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    x, past_k, past_v, mask = (t.astype(np.float64) for t in (x, past_k, past_v, mask))
    (b, s), d, group = x.shape[:2], args.hidden // args.heads_q, args.heads_q // args.heads_kv

    def norm(t, w):
        return t / np.sqrt(np.mean(t * t, axis=-1, keepdims=True) + 1e-5) * w

    def heads(t, count):
        return t.reshape(b, s, count, d).transpose(0, 2, 1, 3)

    h = norm(x, p["input_norm.weight"])
    q = heads(h @ p["attn.q_proj.weight"].T, args.heads_q)
    k = np.concatenate([past_k, heads(h @ p["attn.k_proj.weight"].T, args.heads_kv)], axis=2)
    v = np.concatenate([past_v, heads(h @ p["attn.v_proj.weight"].T, args.heads_kv)], axis=2)
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d) + mask
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attn = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, -1) @ p["attn.o_proj.weight"].T
    h = x + attn
    y = norm(h, p["post_norm.weight"])
    gate = y @ p["gate_proj.weight"].T
    mlp = (gate / (1 + np.exp(-gate)) * (y @ p["up_proj.weight"].T)) @ p["down_proj.weight"].T
    return h + mlp


def _step(batch, seq, past):
    """A step's label in the output."""
    return f"{f'batch {batch}, ' if batch > 1 else ''}seq {seq}, past {past}"


def tune(args, batch, seq, past):
    """Tune the block's attention with MetaSchedule (``--tune``), apply the records and
    check the block against numpy."""
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    from tvm_cascade.meta_schedule import cascade_space, tune_relax
    from tvm_cascade.relax import FuseAttention

    target = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    mod, params = build(args, seq, past, batch)
    with target:
        grouped = FuseAttention(fuse=False)(mod)
    # The attention's task only: the block's other operators keep their default schedules.
    database = tune_relax(
        grouped, {}, target, args.work_dir, args.tune,
        num_trials_per_iter=min(args.tune, 8), op_names=["softmax"], space=cascade_space(unfused=args.with_unfused),
        seed=0,
        strategy=ms.search_strategy.EvolutionarySearch(population_size=16, init_min_unmeasured=8),
        # A fresh worker imports TVM and tvm_cascade before its first build.
        builder=ms.builder.LocalBuilder(max_workers=1, timeout_sec=300), runner=ms.runner.LocalRunner(timeout_sec=300),
    )

    def fused(record):
        return any(f"sch.{p}(" in str(record.trace) for p in ("rolling_update", "split_k_update"))

    for task in ms.relax_integration.extract_tasks(grouped, target):
        if "softmax" in task.task_name:
            records = database.get_top_k(database.commit_workload(task.dispatched[0]), args.tune)
            print(f"attention: {len(records)} schedules measured, {sum(map(fused, records))} of them fused; "
                  f"the best {'fused' if records and fused(records[0]) else 'unfused'}", flush=True)
    with target, database, tvm.transform.PassContext(opt_level=3):
        applied = relax.transform.MetaScheduleApplyDatabase()(grouped)
    vm = relax.VirtualMachine(tvm.compile(applied, target), tvm.cpu())
    data = inputs(args, seq, past, batch)
    out = vm["forward"](*(tvm.runtime.tensor(x) for x in data + list(params.values()))).numpy()
    expected = reference(args, params, *data)
    err = np.abs(out - expected).max()
    print(f"tuned, {_step(batch, seq, past)}: max |tuned - ref| {err:.2e}", flush=True)
    if err > 2e-4:
        raise SystemExit(f"the tuned block differs from numpy by {err:.2e}")


def _standalone_kernel(args):
    """The kernel library's kernel for the block's attention (its mask an input)."""
    from tvm_cascade.kernels import attention_kernel
    from tvm_cascade.library import MaskTensor

    mask = MaskTensor(args.dtype, batch=False, heads=False, queries=True)
    return attention_kernel(args.heads_q, args.heads_kv, args.hidden // args.heads_q, dtype=args.dtype, mask=mask)


def _standalone_tensors(args, seq, past, mask, batch):
    """Random torch tensors of the shapes the block's attention has at ``seq`` new tokens
    over ``past`` of ``batch`` sequences (q, k, v), and the block's ``mask`` (numpy) on
    the GPU."""
    import torch

    d, dtype = args.hidden // args.heads_q, getattr(torch, args.dtype)
    q = torch.randn(batch, args.heads_q, seq, d, dtype=dtype, device="cuda")
    k, v = (torch.randn(batch, args.heads_kv, past + seq, d, dtype=dtype, device="cuda") for _ in "kv")
    return q, k, v, torch.from_numpy(mask.astype(np.float32)).to(device="cuda", dtype=dtype)


def main():
    parser = block_arguments(__doc__)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--dtype", default=None, help="float32 on CPU, float16 on CUDA")
    parser.add_argument("--shapes", default="1x63,16x112",
                        help="new tokens x past tokens (or batch x new x past), ...")
    parser.add_argument(
        "--static-past", action="store_true", help="CUDA: export decode shapes with a static past"
    )
    parser.add_argument("--tune", type=int, default=0, help="CPU: MetaSchedule trials for the attention")
    parser.add_argument("--work-dir", default="llama_block_tuning", help="--tune: where the records go")
    parser.add_argument("--with-unfused", action="store_true",
                        help="--tune: the default rules' unfused schedules too (far more trials to find a fusion)")
    args = parser.parse_args()
    args.dtype = args.dtype or ("float16" if args.target == "cuda" else "float32")
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    shapes = [shape if len(shape) == 3 else (1, *shape) for shape in shapes]  # (batch, new, past)
    if args.tune:
        tune(args, *shapes[0])
        return
    # On CUDA, decode steps (1 new token) share one export whose past is symbolic unless
    # --static-past; with more new tokens TVM's default GPU pipeline fails on a symbolic
    # past (DLight's schedule of the K/V concatenation), so each such shape is exported
    # static.
    exports = {}
    for batch, seq, past in shapes:
        key = (batch,) if args.target == "llvm" else (batch, seq, "past" if seq == 1 and not args.static_past else past)
        exports.setdefault(key, []).append((batch, seq, past))
    # bfloat16 keeps 3 fewer mantissa bits than float16: the same block's bound, 8x.
    tol = {"float16": 2e-2, "bfloat16": 8 * 2e-2}.get(args.dtype, 2e-4)
    alone = _standalone_kernel(args) if args.time and args.target == "cuda" else None
    for export, run in exports.items():
        mod, params = build(args, *export[1:], batch=export[0])
        default, cascade, target = compile_both(mod, args.target)
        print(f"attention kernels: {count_attention_kernels(cascade.mod)}", flush=True)
        for batch, seq, past in run:
            data = inputs(args, seq, past, batch)
            expected = reference(args, params, *data)
            outs, times = run_both(
                default, cascade, target, data + list(params.values()), "forward", args.time
            )
            report(_step(batch, seq, past), outs, expected, tol, times)
            if alone is not None:
                report_attention(cascade, data + list(params.values()), "forward", alone,
                                 _standalone_tensors(args, seq, past, data[3], batch))


if __name__ == "__main__":
    main()
