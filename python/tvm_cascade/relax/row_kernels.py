"""A Relax model's row chains on the one-block-per-row GPU kernel.

:func:`schedule_row_chains` runs in the ``"cascade"`` pipeline on CUDA and ROCm targets
between TVM's legalisation (``FuseTIR``) and dlight's default schedules: each PrimFunc
that holds one cascaded reduction folding each row to values of its own (what
``R.nn.softmax`` and ``R.nn.log_softmax`` legalise to, with what the fusion put around
them) over rows of at most :data:`LONGEST_ROW` elements is scheduled by
:func:`~tvm_cascade.schedules.rows.schedule_rows` with
:func:`~tvm_cascade.schedules.rows.plan_chain`'s plan and marked scheduled, so dlight
leaves it. A function the schedule does not serve (a row length known only at run time
or longer, a refusal of the schedule) is left to dlight, the reason logged on the
``tvm_cascade.relax`` logger.
"""
from __future__ import annotations

import logging

import tvm
from tvm.s_tir.schedule import ScheduleError

from ..errors import FusionError
from ..schedules.rows import plan_chain, row_chains, schedule_rows
from .gpu_schedule import UnsupportedOnGpu

logger = logging.getLogger("tvm_cascade.relax")

SCHEDULED = "tirx.is_scheduled"
#: The longest rows given the row kernel. Up to 4096 (an MoE router's softmax over its
#: experts, with or without top-k) it measured as fast as dlight's or faster on an H200;
#: a log-softmax over a 128k vocabulary, whose output is as large as its input, 7-19%
#: slower (benchmarks/RESULTS.md, "Cascades beyond attention").
LONGEST_ROW = 4096


@tvm.transform.module_pass(opt_level=0, name="tvm_cascade.ScheduleRowChains")
def schedule_row_chains(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Every unscheduled PrimFunc of ``mod`` that :func:`row_kernel` serves, replaced by
    its row kernel (module docstring)."""
    scheduled = {}
    for gvar, func in mod.functions.items():
        if isinstance(func, tvm.tirx.PrimFunc) and not (func.attrs and func.attrs.get(SCHEDULED, False)):
            kernel = row_kernel(func, gvar.name_hint)
            if kernel is not None:
                scheduled[gvar] = kernel
    if not scheduled:
        return mod
    mod = mod.clone()
    for gvar, kernel in scheduled.items():
        mod.update_func(gvar, kernel)
    return mod


def row_kernel(func: tvm.tirx.PrimFunc, name: str = "main"):
    """``func`` scheduled as one block per row and marked scheduled, or None where it
    holds no single chain folding each row or the schedule does not serve it (logged)."""
    chains = row_chains(func)
    if len(chains) != 1:
        if chains:
            logger.info("'%s' left to the default schedules: %d row chains in one function", name, len(chains))
        return None
    (chain,) = chains
    if chain.length is None:
        logger.info("'%s' left to the default schedules: its rows' length is known only at run time", name)
        return None
    if chain.length > LONGEST_ROW:
        logger.info("'%s' left to the default schedules: rows of %d elements, longer than %d", name, chain.length,
                    LONGEST_ROW)
        return None
    sch = tvm.s_tir.Schedule(func)
    try:
        schedule_rows(sch, **plan_chain(func, chain))
    except (UnsupportedOnGpu, FusionError, ScheduleError) as err:
        logger.info("'%s' left to the default schedules: %s", name, str(err).strip().splitlines()[-1])
        return None
    return sch.mod["main"].with_attr(SCHEDULED, True)
