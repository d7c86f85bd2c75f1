"""Declarative FlexAttention-style variant descriptions (no TVM dependency).

The TE callables are produced by :func:`tvm_cascade.ops.flex_attention.variant_te_mods`
and the numpy ones by :func:`tvm_cascade.ops.reference.np_mods`; both
implement the semantics documented on :class:`AttentionVariant`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class AttentionVariant:
    """Declarative description of a FlexAttention-style variant.

    Parameters
    ----------
    name:
        Human readable name.
    causal:
        Mask keys "in the future".  Queries are aligned to the *end* of the key
        sequence: query ``i`` sees key ``j`` iff ``j <= i + (seq_kv - seq_q)``
        (so for decode the last query sees every key).
    window:
        Sliding window size (implies ``causal``): additionally require
        ``i + (seq_kv - seq_q) - j < window``.  ``window=0`` masks every key
        (every row fully masked) which is useful to test that path.
    alibi:
        Add the ALiBi bias ``slope_h * (j - (i + seq_kv - seq_q))`` with
        ``slope_h = 2 ** (-8 * (h + 1) / heads_q)`` to the (scaled) score.
    softcap:
        Apply ``softcap * tanh(score / softcap)`` (after the ALiBi bias).
    """

    name: str = "global"
    causal: bool = False
    window: Optional[int] = None
    alibi: bool = False
    softcap: Optional[float] = None

    @property
    def is_causal(self) -> bool:
        return self.causal or self.window is not None

    @property
    def has_mask(self) -> bool:
        return self.is_causal

    @property
    def has_score_mod(self) -> bool:
        return self.alibi or self.softcap is not None


#: Ready-made variants.  GQA / MQA are not variants of the score computation:
#: they are selected by ``heads_kv`` (``heads_q % heads_kv == 0``; MQA is
#: ``heads_kv == 1``) and combine with any of these.
VARIANTS = {
    "global": AttentionVariant("global"),
    "causal": AttentionVariant("causal", causal=True),
    "alibi": AttentionVariant("alibi", causal=True, alibi=True),
    "softcap": AttentionVariant("softcap", softcap=20.0),
    "sliding_window": AttentionVariant("sliding_window", causal=True, window=8),
}


def get_variant(variant) -> AttentionVariant:
    """Accept a name from :data:`VARIANTS`, an :class:`AttentionVariant` or None."""
    if variant is None:
        return VARIANTS["global"]
    if isinstance(variant, AttentionVariant):
        return variant
    if isinstance(variant, str):
        try:
            return VARIANTS[variant]
        except KeyError as err:
            raise ValueError(f"unknown attention variant {variant!r}; known: {sorted(VARIANTS)}") from err
    raise TypeError(f"cannot interpret {variant!r} as an attention variant")
