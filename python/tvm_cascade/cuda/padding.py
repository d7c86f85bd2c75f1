"""Inputs padded to whole tiles by ``ops.attention(pad_to=...)``: the GPU schedules inline
its pad blocks into their loads, which then read zeros past the inputs' ends."""
import tvm_ffi
from tvm.s_tir.stmt import SBlockRealize

PADS = ("Q_pad", "K_pad", "V_pad")


def padded_inputs(sch):
    """The pad blocks of the scheduled function, by name."""
    names = []
    tvm_ffi.structural_walk(
        sch.mod["main"].body,
        lambda n: names.append(n.block.name_hint) if isinstance(n, SBlockRealize) else None,
    )
    return [name for name in PADS if name in names]


def inline_padding(sch):
    """Inline every pad block into its consumers (the loads of the schedule's caches)."""
    for name in padded_inputs(sch):
        sch.compute_inline(sch.get_sblock(name))
