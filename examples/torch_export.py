"""A PyTorch transformer block exported with ``torch.export``, imported with
``tvm.relax.frontend.torch.from_exported_program`` and compiled with TVM's default Relax
pipeline and with ``relax_pipeline="cascade"``; both are checked against PyTorch.

Its causal GQA attention is ``F.scaled_dot_product_attention(..., enable_gqa=True)``,
which ``torch.export`` decomposes into matmuls, a causal mask and PyTorch's safe softmax
(zeros for a fully masked row); ``--attention manual`` writes it out instead
(``q @ k^T / sqrt(d)``, causal ``masked_fill``, ``softmax``, ``@ v``, K and V repeated
with ``repeat_interleave``). Either way the cascade pipeline fuses it into one kernel.

    python examples/torch_export.py                 # CPU
    python examples/torch_export.py --target cuda --time --dtype float16 --seq 512,2048

``--dynamic`` exports the sequence length as a dynamic dimension (``torch.export.Dim``,
up to ``--max-seq``: TVM plans the mask's memory for the largest length): one compiled
module serves every length. On a CUDA target the cascade pipeline still runs the attention as
one kernel (its causal mask, a graph over the length, checked at several lengths); on
the CPU ``FuseAttention`` cannot lower its group (the GQA broadcast to a symbolic shape)
and leaves it to the default lowering.

``--dtype float16`` / ``bfloat16`` exports the block in that type. TVM's torch frontend
makes every matmul's product float32 (``out_dtype="float32"``) and then cannot add a
16-bit bias to it, so :data:`HALF_PRECISION_MATMULS` converts them as PyTorch computes
them: accumulated in float32, cast to the operands' type; and TVM's ``layer_norm`` takes
no bfloat16, so :data:`BFLOAT16_LAYER_NORMS` computes it in float32 (as PyTorch does),
cast back.
"""

import copy
import math

import numpy as np
import torch
import torch.nn.functional as F
from tvm import relax
from tvm.relax.frontend.torch import from_exported_program

import tvm_cascade  # noqa: F401  (registers relax_pipeline="cascade")
from compare import block_arguments, compile_both, count_attention_kernels, report, report_attention, run_both
from tvm_cascade.kernels import attention_kernel


class Block(torch.nn.Module):
    def __init__(self, hidden, heads_q, heads_kv, attention="sdpa"):
        super().__init__()
        self.attention = attention
        self.heads_q, self.heads_kv, self.head_dim = heads_q, heads_kv, hidden // heads_q
        self.norm1 = torch.nn.LayerNorm(hidden)
        self.q = torch.nn.Linear(hidden, hidden)
        self.kv = torch.nn.Linear(hidden, 2 * heads_kv * self.head_dim)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.norm2 = torch.nn.LayerNorm(hidden)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(hidden, 4 * hidden),
            torch.nn.GELU(),
            torch.nn.Linear(4 * hidden, hidden),
        )

    def forward(self, x):
        b, s, h = x.shape
        y = self.norm1(x)
        q = self.q(y).reshape(b, s, self.heads_q, self.head_dim).transpose(1, 2)
        k, v = self.kv(y).reshape(b, s, 2, self.heads_kv, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.attention == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            group = self.heads_q // self.heads_kv
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
            out = torch.matmul(probs, v)
        attn = out.transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(attn)
        return x + self.mlp(self.norm2(x))


def _matmul(importer, a, b, bias=None):
    """``a @ b (+ bias)`` accumulated in float32 and cast to ``a``'s type."""
    emit = importer.block_builder.emit
    product = emit(relax.op.matmul(a, b, out_dtype="float32"))
    if bias is not None:
        product = emit(relax.op.add(product, relax.op.astype(bias, "float32")))
    return emit(relax.op.astype(product, a.ty.dtype))


def _addmm(node, importer):
    if node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("beta", 1) != 1:
        raise NotImplementedError("addmm with alpha or beta other than 1")
    bias, a, b = (importer.env[arg] for arg in node.args[:3])
    return _matmul(importer, a, b, bias)


def _mm(node, importer):
    return _matmul(importer, importer.env[node.args[0]], importer.env[node.args[1]])


# ``custom_convert_map`` of ``from_exported_program`` for a 16-bit model.
HALF_PRECISION_MATMULS = {"addmm.default": _addmm, "mm.default": _mm, "bmm.default": _mm}


def _layer_norm_in_float32(node, importer):
    """``native_layer_norm(x, shape, weight, bias, eps)``'s output in float32, cast to
    ``x``'s type (no weight: ones; no bias: zeros)."""
    emit = importer.block_builder.emit
    x, shape = importer.env[node.args[0]], [int(n) for n in node.args[1]]
    wide = [emit(relax.op.astype(x, "float32"))]
    for arg, fill in zip(node.args[2:4], (np.ones, np.zeros)):
        wide.append(relax.const(fill(shape, "float32")) if arg is None else emit(relax.op.astype(importer.env[arg], "float32")))
    normed = emit(relax.op.nn.layer_norm(*wide, axes=list(range(-len(shape), 0)), epsilon=node.args[4]))
    return emit(relax.op.astype(normed, x.ty.dtype))


# ... and for a bfloat16 one, besides.
BFLOAT16_LAYER_NORMS = {"native_layer_norm.default": _layer_norm_in_float32}


def _numpy(tensor):
    """A torch tensor as numpy (bfloat16 as ``ml_dtypes.bfloat16``)."""
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def export(args, seq):
    """The block of ``args`` exported at length ``seq`` and imported: (Relax module, its
    weights, the torch module)."""
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = Block(args.hidden, args.heads_q, args.heads_kv, args.attention).eval().to(dtype)
    x = torch.zeros(1, seq, args.hidden, dtype=dtype)
    shapes = ({1: torch.export.Dim("seq", min=2, max=args.max_seq)},) if args.dynamic else None
    with torch.no_grad():
        program = torch.export.export(model, (x,), dynamic_shapes=shapes)
    convert = {
        torch.float32: None, torch.float16: HALF_PRECISION_MATMULS,
        torch.bfloat16: {**HALF_PRECISION_MATMULS, **BFLOAT16_LAYER_NORMS},
    }[dtype]
    mod = from_exported_program(program, keep_params_as_input=True, custom_convert_map=convert)
    mod, params = relax.frontend.detach_params(mod)
    return mod, [p.numpy() for p in params["main"]], model


def example_input(model, seq, device):
    """A random input of length ``seq`` (numpy) and the block's output on it in float64
    on the model's (rounded) weights, computed on ``device``."""
    dtype = next(model.parameters()).dtype
    x = torch.randn(1, seq, model.proj.in_features, generator=torch.Generator().manual_seed(seq)).to(dtype)
    with torch.no_grad():
        expected = copy.deepcopy(model).double().to(device)(x.double().to(device)).cpu().numpy()
    return _numpy(x), expected


def main():
    parser = block_arguments(__doc__)
    parser.add_argument("--seq", default="128", help="lengths, comma-separated")
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "manual"])
    parser.add_argument("--dynamic", action="store_true", help="export the sequence length as a dynamic dimension")
    parser.add_argument("--max-seq", type=int, default=4096, help="the dynamic length's upper bound")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args()
    seqs = [int(s) for s in args.seq.split(",")]
    device = "cuda" if args.target == "cuda" else "cpu"
    tol = {"float32": 1e-3, "float16": 3e-2}.get(args.dtype, 1e-1)
    d = args.hidden // args.heads_q
    # (the kernel alone, in the layout the module's reads: the projections' own, bshd)
    alone = attention_kernel(args.heads_q, args.heads_kv, d, variant="causal", dtype=args.dtype, layout="bshd") \
        if args.time and args.target == "cuda" else None
    for seq in seqs:
        # A dynamic length is compiled once for every length; a static one for each.
        if seq == seqs[0] or not args.dynamic:
            mod, weights, model = export(args, seq)
            default, cascade, target = compile_both(mod, args.target)
            print(f"attention kernels: {count_attention_kernels(cascade.mod)}", flush=True)
        x, expected = example_input(model, seq, device)
        outs, times = run_both(default, cascade, target, [x] + weights, "main", args.time)
        label = f"seq {seq}{' (dynamic)' if args.dynamic else ''}, {args.attention}, {args.dtype}"
        report(label, [np.asarray(o) for o in outs], expected, tol, times)
        if alone is not None:
            q = torch.randn(1, seq, args.heads_q, d, dtype=getattr(torch, args.dtype), device="cuda")
            k, v = (torch.randn(1, seq, args.heads_kv, d, dtype=q.dtype, device="cuda") for _ in "kv")
            report_attention(cascade, [x] + weights, "main", alone, (q, k, v))


if __name__ == "__main__":
    main()
