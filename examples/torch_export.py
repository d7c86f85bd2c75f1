"""A PyTorch transformer block exported with ``torch.export``, imported with
``tvm.relax.frontend.torch.from_exported_program`` and compiled with TVM's default Relax
pipeline and with ``relax_pipeline="cascade"``; both are checked against PyTorch.

Its causal GQA attention is ``F.scaled_dot_product_attention(..., enable_gqa=True)``,
which ``torch.export`` decomposes into matmuls, a causal mask and PyTorch's safe softmax
(zeros for a fully masked row); ``--attention manual`` writes it out instead
(``q @ k^T / sqrt(d)``, causal ``masked_fill``, ``softmax``, ``@ v``, K and V repeated
with ``repeat_interleave``). Either way the cascade pipeline fuses it into one kernel.

    python examples/torch_export.py                 # CPU
    python examples/torch_export.py --target cuda   # GPU: numerics, then both timed

``--dynamic`` exports the sequence length as a dynamic dimension (``torch.export.Dim``,
up to 4096: TVM plans the mask's memory for the largest length): one compiled module
serves every length. On a CUDA target the cascade pipeline still runs the attention as
one kernel (its causal mask, a graph over the length, checked at several lengths); on
the CPU ``FuseAttention`` cannot lower its group (the GQA broadcast to a symbolic shape)
and leaves it to the default lowering.
"""

import math

import numpy as np
import torch
import torch.nn.functional as F
import tvm
from tvm.relax.frontend.torch import from_exported_program

import tvm_cascade  # noqa: F401  (registers relax_pipeline="cascade")
from compare import block_arguments, compile_both, count_attention_kernels, report, run_both


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


def main():
    parser = block_arguments(__doc__)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "manual"])
    parser.add_argument("--dynamic", action="store_true", help="export the sequence length as a dynamic dimension")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Block(args.hidden, args.heads_q, args.heads_kv, args.attention).eval()
    x = torch.randn(1, args.seq, args.hidden)
    shapes = ({1: torch.export.Dim("seq", min=2, max=4096)},) if args.dynamic else None
    with torch.no_grad():
        expected = model(x).double().numpy()
        program = torch.export.export(model, (x,), dynamic_shapes=shapes)
    mod = from_exported_program(program, keep_params_as_input=True)
    mod, params = tvm.relax.frontend.detach_params(mod)
    default, cascade, target = compile_both(mod, args.target)
    print(f"attention kernels: {count_attention_kernels(cascade.mod)}", flush=True)
    weights = [p.numpy() for p in params["main"]]
    outs, times = run_both(default, cascade, target, [x.numpy()] + weights, "main", args.time)
    label = f"seq {args.seq}{' (dynamic)' if args.dynamic else ''}, {args.attention}"
    report(label, [np.asarray(o) for o in outs], expected, 1e-3, times)


if __name__ == "__main__":
    main()
