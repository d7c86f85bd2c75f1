"""Errors raised by tvm-cascade's schedule primitives."""
from tvm.s_tir.schedule import ScheduleError


class FusionError(ScheduleError, ValueError):
    """A cascaded reduction cannot be fused as asked.

    Raised before the schedule is touched, so ``sch.mod`` is unchanged. The message names
    the block, the reducer and the sub-expression or structure that blocks the fusion.
    """
