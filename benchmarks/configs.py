"""The Neptune ten-operator attention suite (fp16, head dim 128); no torch/TVM import.

Semantics shared by every implementation and by :mod:`benchmarks.reference`:

* scale ``1/sqrt(head_dim)``;
* causal alignment to the end of the keys: query ``i`` sees key ``j`` iff
  ``j <= i + (seq_kv - seq_q)``; the sliding window additionally requires
  ``i + (seq_kv - seq_q) - j < window``;
* ALiBi adds ``slope_h * (j - (i + seq_kv - seq_q))`` with
  ``slope_h = 2 ** (-8 (h + 1) / heads_q)``.  For ``seq_q == seq_kv`` this is
  ``slope_h * (j - i)``; otherwise it differs from that by a per-row constant,
  to which softmax is invariant;
* softcap replaces the (biased) score ``s`` by ``cap * tanh(s / cap)``;
* GQA: query head ``h`` reads kv head ``h // (heads_q // heads_kv)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

HEAD_DIM = 128
DTYPE = "float16"
SOFTCAP = 50.0
WINDOW = 256

#: (batch, seq) shapes; the first one of each suite is the ``--quick`` subset.
PREFILL_SHAPES = ((8, 1024), (8, 4096), (1, 16384))
DECODE_SHAPES = ((8, 4096), (8, 32768))


@dataclass(frozen=True)
class Operator:
    """One of the ten operators: masking/score semantics plus head counts."""

    kind: str  # "prefill" | "decode"
    name: str  # global, causal, alibi, gqa, softcap, window
    heads_q: int
    heads_kv: int
    variant: str  # global | causal | alibi | softcap | window (passed to build_attention)

    @property
    def causal(self) -> bool:
        return self.variant in ("causal", "alibi", "window")

    @property
    def alibi(self) -> bool:
        return self.variant == "alibi"

    @property
    def softcap(self) -> Optional[float]:
        return SOFTCAP if self.variant == "softcap" else None

    @property
    def window(self) -> Optional[int]:
        return WINDOW if self.variant == "window" else None


OPERATORS = (
    Operator("prefill", "global", 32, 32, "global"),
    Operator("prefill", "causal", 32, 32, "causal"),
    Operator("prefill", "alibi", 32, 32, "alibi"),
    Operator("prefill", "gqa", 32, 8, "causal"),
    Operator("prefill", "softcap", 32, 32, "softcap"),
    Operator("prefill", "window", 32, 32, "window"),
    Operator("decode", "causal", 32, 32, "causal"),
    Operator("decode", "alibi", 32, 32, "alibi"),
    Operator("decode", "gqa", 64, 8, "causal"),
    Operator("decode", "softcap", 32, 16, "softcap"),
)


@dataclass(frozen=True)
class Config:
    """One benchmark cell row: an operator at one shape."""

    op: Operator
    batch: int
    seq_q: int
    seq_kv: int
    head_dim: int = HEAD_DIM
    dtype: str = DTYPE

    @property
    def name(self) -> str:
        seq = f"s{self.seq_kv}" if self.op.kind == "prefill" else f"kv{self.seq_kv}"
        name = f"{self.op.kind}-{self.op.name}-b{self.batch}-{seq}"
        if self.op.kind == "decode" and self.seq_q > 1:
            name += f"-q{self.seq_q}"
        if self.head_dim != HEAD_DIM:
            name += f"-d{self.head_dim}"
        if self.dtype != DTYPE:
            name += f"-{self.dtype}"
        return name

    @property
    def offset(self) -> int:
        return self.seq_kv - self.seq_q

    @property
    def masked(self) -> bool:
        """Whether any (query, key) pair is invisible (decode causal sees every key)."""
        windowed = self.op.window is not None and self.op.window < self.seq_kv
        return windowed or (self.op.causal and self.seq_q > 1)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def flops(self) -> float:
        """``4 b hq sq skv d``; halved for causal prefill.

        The sliding window counts its visible (query, key) pairs instead, since
        halving would overstate its work by ``seq_kv / (2 window)``.
        """
        pairs = self.seq_q * self.seq_kv
        if self.op.window is not None:
            pairs = sum(min(i + 1 + self.offset, self.op.window) for i in range(self.seq_q))
        elif self.op.causal and self.op.kind == "prefill":
            pairs = pairs / 2
        return 4.0 * self.batch * self.op.heads_q * self.head_dim * pairs

    def kv_bytes(self) -> int:
        """Bytes of K and V read once (2 bytes per fp16 element)."""
        return 2 * self.batch * self.op.heads_kv * self.seq_kv * self.head_dim * 2


def suite(
    which: str = "all",
    quick: bool = False,
    only: Sequence[str] = (),
    head_dim: int = HEAD_DIM,
    dtype: str = DTYPE,
    decode_queries: int = 1,
    trim: int = 0,
) -> List[Config]:
    """Configurations of ``which`` ("prefill" | "decode" | "all").

    ``quick`` keeps the first shape of each suite; ``only`` keeps the configs whose
    name contains one of the given substrings; ``decode_queries`` is the query length of
    the decode configurations (1 to 8: speculative decoding, several new tokens);
    ``trim`` shortens every sequence of the shapes by that many tokens (lengths that
    are not multiples of the kernels' tiles).
    """
    if which not in ("prefill", "decode", "all"):
        raise ValueError(f"unknown suite {which!r}")
    configs = []
    for op in OPERATORS:
        if which not in ("all", op.kind):
            continue
        shapes = PREFILL_SHAPES if op.kind == "prefill" else DECODE_SHAPES
        for batch, seq in shapes[:1] if quick else shapes:
            seq -= trim
            seq_q = seq if op.kind == "prefill" else decode_queries
            configs.append(Config(op, batch, seq_q, seq, head_dim, dtype))
    if only:
        configs = [c for c in configs if any(s in c.name for s in only)]
    return configs
