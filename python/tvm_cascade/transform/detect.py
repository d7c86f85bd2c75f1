"""Find cascaded reductions in a PrimFunc: a reduction (the root) and the later reductions
over the same axis that read its result, directly or through other blocks."""
from dataclasses import dataclass
from typing import Optional, Tuple

import tvm
from tvm.ir import expr as ir_expr

from ..algebra.reducers import match_reducer
from ..analysis.axes import AxisClasses
from ..analysis.scope import REDUCE, accumulator_store, collect_sites


@dataclass(frozen=True)
class Candidate:
    """A root reduction and the reductions after it that may fuse into its key loop."""

    root: str
    dependents: Tuple[str, ...]
    rows: Optional[int]  # product of the root's spatial extents, None if symbolic
    length: Optional[int]  # extent of the reduced axis, None if symbolic


def find_candidates(func: tvm.tirx.PrimFunc) -> list:
    """The candidate chains of ``func``'s root scope, in program order; a block is the
    dependent of at most one root (the first one it reads)."""
    sites = collect_sites(func.body.block)
    axes = AxisClasses(sites)
    writer = {}
    for site in sites:
        for buf in site.write_buffers():
            writer[buf] = site
    upstream = {}  # site -> every site it reads from, transitively
    for site in sites:
        found = set()
        for buf in site.read_buffers():
            source = writer.get(buf)
            if source is not None and source is not site:
                found.add(source)
                found |= upstream.get(source, set())
        upstream[site] = found

    candidates, taken = [], set()
    for root in sites:
        axis = reduced_axis(root)
        if axis is None or root in taken or driving_loop(root, axis) is None:
            continue
        dependents = [
            site
            for site in sites[root.index + 1 :]
            if site not in taken
            and root in upstream[site]
            and (other := reduced_axis(site)) is not None
            and axes.same(other.var, axis.var)
        ]
        if not dependents:
            continue
        taken.update(dependents)
        rows = _static_product(iv.dom.extent for iv in root.block.iter_vars if iv.iter_type != REDUCE)
        length = _static_product([axis.dom.extent])
        candidates.append(Candidate(root.name, tuple(s.name for s in dependents), rows, length))
    return candidates


def reduced_axis(site):
    """The one reduction iterator of a supported reduction block (sum/prod/max/min), or
    None: blocks reducing over several axes (matmuls over the head dimension excepted,
    which have one) or with other update forms are no chain members."""
    if not site.is_reduction:
        return None
    reduce_ivs = [iv for iv in site.block.iter_vars if iv.iter_type == REDUCE]
    store = accumulator_store(site.block)
    if len(reduce_ivs) != 1 or not isinstance(store, tvm.tirx.BufferStore):
        return None
    if match_reducer(store) is None:
        return None
    return reduce_ivs[0]


def driving_loop(site, axis):
    """The loop whose variable alone binds ``axis`` in ``site``, or None."""
    value = site.binding(axis)
    if not isinstance(value, ir_expr.Var):
        return None
    for loop in site.loops:
        if loop.loop_var.same_as(value):
            return loop
    return None


def _static_product(extents):
    product = 1
    for extent in extents:
        if not isinstance(extent, tvm.tirx.IntImm):
            return None
        product *= extent.value
    return product
