"""The loop the one-argument forms of the fusion primitives fuse across.

``sch.rolling_update(block)`` and ``sch.split_k_update(block)`` fuse across the outermost
split of the key loop of the chain's first reduction: of the loops around the reductions
``block`` reads (directly or through other blocks; around ``block`` itself where it reads
none, as the first reduction of a split-k chain does), those the primitive
accepts (its own analysis, :class:`~tvm_cascade.analysis.chain.Chain` or
:class:`~tvm_cascade.analysis.split_chain.SplitKChain`, decides), the one around all the
others. The primitive takes a loop only if the block's inputs are computed before it or
under it, so the loops it takes are of one nest; were none around all the others, the
choice would be ambiguous and is refused, naming them. A key loop that was not split (no
loop below it iterates the key axis) has no tiles or chunks: refused too.
"""
from __future__ import annotations

import contextlib

from ..analysis.chain import Chain
from ..analysis.scope import buffer_params, collect_sites
from ..analysis.split_chain import SplitKChain
from ..errors import FusionError
from .rolling_update import scope_of

_CHAINS = {"rolling_update": Chain, "split_k_update": SplitKChain}


def fusion_loop(sch, block_rv, primitive: str):
    """A LoopRV of the loop ``primitive`` fuses ``block_rv`` across (module docstring).
    Raises :class:`FusionError` naming the block when there is none or it is ambiguous;
    the IR is not changed."""
    func, root_sref = scope_of(sch, block_rv)
    params = buffer_params(func)
    sites = collect_sites(root_sref.stmt)
    block = sch.get(block_rv)
    target = next(s for s in sites if s.block.same_as(block))
    accepted = []  # (loop, chain, site whose nest holds it)
    # The chain's first reduction is among those the block reads, or the block itself.
    for site in _reductions_read(sites, target) or [target]:
        for loop in site.loops:
            if any(loop.same_as(other) for other, _, _ in accepted):
                continue
            try:
                chain = _CHAINS[primitive](root_sref.stmt, params, block, loop, primitive)
            except FusionError:
                continue
            accepted.append((loop, chain, site))
    what = f"{primitive}: block '{target.name}'"
    if not accepted:
        raise FusionError(
            f"{what}: no loop around the reductions it reads (or around it, if none) can be fused across; "
            f"split the key loop of its chain's first reduction (j0, j1 = sch.split(j, [None, tile])) "
            f"and call {primitive}(block, j0), which says why a loop is refused"
        )
    outermost = _outermost([loop for loop, _, _ in accepted], sites)
    if outermost is None:
        names = ", ".join(f"'{loop.loop_var.name}' (around '{site.name}')" for loop, _, site in accepted)
        raise FusionError(f"{what}: the loop is ambiguous: no one of these encloses the others: {names}; pass one")
    loop, chain, site = next(entry for entry in accepted if entry[0].same_as(outermost))
    if not chain.inner_loops:
        raise FusionError(
            f"{what}: the key loop '{loop.loop_var.name}' around '{site.name}' is not split: split it "
            f"(sch.split(loop, [None, tile])) and call {primitive} again"
        )
    func_name = next(gv.name_hint for gv, f in sch.mod.functions.items() if f.same_as(func))
    return sch.get_loops(sch.get_sblock(site.name, func_name=func_name))[_position(site.loops, loop)]


@contextlib.contextmanager
def trace_kept_on_failure(sch):
    """Undo what the block leaves on ``sch``'s trace (the lookups of an inferred loop) if
    it raises: a refused primitive leaves the trace as it was."""
    trace = sch.trace
    length = None if trace is None else len(trace.insts)
    try:
        yield
    except Exception:
        while trace is not None and len(trace.insts) > length:
            trace.pop()
        raise


def _reductions_read(sites, target):
    """The reduction sites ``target`` reads, directly or through other blocks, nearest first."""
    writer = {buf: site for site in sites for buf in site.write_buffers()}
    found, seen, frontier = [], {target.index}, [target]
    while frontier:
        site = frontier.pop(0)
        for buf in site.read_buffers():
            source = writer.get(buf)
            if source is None or source.index in seen:
                continue
            seen.add(source.index)
            frontier.append(source)
            if source.is_reduction:
                found.append(source)
    return found


def _outermost(loops, sites):
    """The loop of ``loops`` around every other (by the sites' nests), or None."""
    def encloses(outer, inner):
        return outer.same_as(inner) or any(
            _position(s.loops, outer) is not None and _position(s.loops, inner) is not None
            and _position(s.loops, outer) < _position(s.loops, inner)
            for s in sites
        )

    return next((loop for loop in loops if all(encloses(loop, other) for other in loops)), None)


def _position(loops, loop):
    return next((k for k, other in enumerate(loops) if other.same_as(loop)), None)
