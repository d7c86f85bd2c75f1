"""Fuse every cascaded reduction of a PrimFunc with the traced primitives, no schedule needed."""
import logging
from dataclasses import dataclass
from typing import Tuple

import tvm
from tvm.s_tir.schedule import ScheduleError

from ..errors import FusionError
from ..analysis.axes import AxisClasses
from ..analysis.scope import collect_sites
from .detect import Candidate, driving_loop, find_candidates, reduced_axis

logger = logging.getLogger("tvm_cascade.transform")

METHODS = ("auto", "rolling", "split_k")


@dataclass(frozen=True)
class FusedChain:
    """One chain the pass fused: ``blocks`` now share the key loop ``loop`` of ``root``."""

    root: str
    blocks: Tuple[str, ...]
    method: str  # "rolling" or "split_k"
    loop: object  # LoopRV of the key loop: the tile loop (rolling) or the chunk loop (split_k)


def fuse_cascaded_reductions(sch, tile: int = 64, method: str = "auto", chunks: int = 8) -> list:
    """Fuse the cascaded reductions of the one PrimFunc in ``sch.mod``; returns the
    :class:`FusedChain` list.

    For each reduction (the root) with later reductions over the same axis that read it:
    the blocks that do not depend on the root move before it (a legalised Relax function
    transforms V's layout after the softmax); the root's key loop is split (``[None,
    tile]`` keys for ``rolling``, ``[chunks, None]`` for ``split_k``); each later
    reduction is fused with ``rolling_update`` or ``split_k_update``. With ``rolling`` the
    blocks that produce the root's input along the key axis (scores, Q·Kᵀ) are computed
    inside the key loop where ``compute_at`` allows, one tile at a time, so the chain
    reads its input once; a split-k chunk is read three times (max, sum, P·V) and is too
    long to keep in fast memory, so its scores stay a pass of their own, as
    FlashDecoding's are. A reduction whose repair does not exist is left where it is and
    the reason is logged at DEBUG level on the ``tvm_cascade.transform`` logger; a root
    none of whose dependents fuse leaves the schedule unchanged. ``auto`` picks
    ``split_k`` when the root has fewer rows (spatial iterations) than keys and both are
    static, as decode attention does.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if tile < 1 or chunks < 1:
        raise ValueError(f"tile and chunks must be positive, got {tile} and {chunks}")
    fused = []
    for candidate in find_candidates(only_func(sch)):
        how = _method(candidate, method)
        _, accepted = _apply(sch.copy(), candidate, how, tile, chunks, candidate.dependents)
        if not accepted:
            logger.debug("'%s': no later reduction fuses into its loop; left unchanged", candidate.root)
            continue
        # Read before fusion rewrites the root's indices.
        along_keys = blocks_along_key_axis(sch, candidate.root) if how == "rolling" else None
        loop, _ = _apply(sch, candidate, how, tile, chunks, accepted)
        if along_keys is not None:
            compute_producers_at(sch, loop, along_keys)
        fused.append(FusedChain(candidate.root, tuple(accepted), how, loop))
    return fused


def fusing_dependents(func, candidate: Candidate, how: str) -> tuple:
    """The dependents of ``candidate`` (a structural chain of ``func``) that ``how``
    (``"rolling"`` or ``"split_k"``) fuses into its root's key loop: those with a
    proven repair. Tried on a schedule of its own."""
    return tuple(_apply(tvm.s_tir.Schedule(func), candidate, how, 64, 8, candidate.dependents)[1])


def _apply(sch, candidate: Candidate, how: str, tile: int, chunks: int, names):
    """Split the root's key loop and fuse the dependents ``names`` into it; returns the
    key loop and the names that fused (those refused are logged)."""
    try:
        sch.hoist_independent(sch.get_sblock(candidate.root))
    except FusionError as err:
        logger.debug("blocks stay in place around '%s': %s", candidate.root, err)
    root = sch.get_sblock(candidate.root)
    loop_rv = key_loop(sch, candidate.root)
    if candidate.length is not None:
        tile = min(tile, candidate.length)
        chunks = min(chunks, candidate.length)
    factors = [None, tile] if how == "rolling" else [chunks, None]
    tiles = sch.split(loop_rv, factors, preserve_unit_iters=True)[0]
    primitive = sch.rolling_update if how == "rolling" else sch.split_k_update
    if how == "split_k":
        primitive(root, tiles)
    fused = []
    for name in names:
        try:
            primitive(sch.get_sblock(name), tiles)
            fused.append(name)
        except ScheduleError as err:
            logger.debug("'%s' not fused into '%s': %s", name, candidate.root, reason(err))
    return tiles, fused


def blocks_along_key_axis(sch, root_name: str) -> set:
    """Names of the blocks with an iterator on the root's reduced axis (before fusion,
    while every index is still a plain iterator)."""
    sites = collect_sites(only_func(sch).body.block)
    axes = AxisClasses(sites)
    key = reduced_axis(next(s for s in sites if s.name == root_name)).var
    return {s.name for s in sites if any(axes.same(iv.var, key) for iv in s.block.iter_vars)}


def compute_producers_at(sch, loop, along_keys: set) -> None:
    """Compute the blocks feeding the fused chain (scores, Q·Kᵀ) inside its key loop,
    nearest first. Only blocks in ``along_keys`` go in, each computing one tile or chunk
    of keys; a row-level block (the query's layout) would be recomputed for every tile.
    A branch stops where ``compute_at`` refuses."""
    loop_stmt = sch.get(loop)
    pending = [s.name for s in collect_sites(only_func(sch).body.block) if s.under(loop_stmt)]
    seen = set(pending)
    while pending:
        block = sch.get_sblock(pending.pop())
        for producer in sch.get_producers(block):
            name = sch.get(producer).name_hint
            if name in seen or name not in along_keys:
                continue
            seen.add(name)
            if not named_site(sch, name).under(sch.get(loop)):
                try:
                    sch.compute_at(producer, loop, preserve_unit_loops=True)
                except ScheduleError as err:
                    logger.debug("'%s' stays outside the key loop: %s", name, reason(err))
                    continue
            pending.append(name)


def reason(err: Exception) -> str:
    """The last line of a schedule error: the reason without the rendered IR."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def _method(candidate: Candidate, method: str) -> str:
    if method != "auto":
        return method
    few_rows = (
        candidate.rows is not None
        and candidate.length is not None
        and candidate.rows < candidate.length
    )
    return "split_k" if few_rows else "rolling"


def only_func(sch) -> tvm.tirx.PrimFunc:
    funcs = [f for _, f in sch.mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    if len(funcs) != 1:
        raise ValueError(f"expected a schedule of one PrimFunc, got {len(funcs)}")
    return funcs[0]


def named_site(sch, name: str):
    """The site of the block ``name`` in the one PrimFunc of ``sch``."""
    for site in collect_sites(only_func(sch).body.block):
        if site.name == name:
            return site
    raise KeyError(name)


def key_loop(sch, root_name: str):
    """A LoopRV of the loop that drives the reduced axis of the reduction ``root_name``."""
    site = named_site(sch, root_name)
    loop = driving_loop(site, reduced_axis(site))
    for loop_rv in sch.get_loops(sch.get_sblock(root_name)):
        if sch.get(loop_rv).same_as(loop):
            return loop_rv
    raise KeyError(loop.loop_var.name)
