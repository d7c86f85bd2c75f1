"""The IR rewrite of ``Schedule.hoist_independent`` (the public method documents it)."""
from __future__ import annotations

from .._core import refresh_sblock_flags
from ..analysis.scope import collect_sites
from ..errors import FusionError
from ..root_order import reorder_root_blocks
from .rolling_update import scope_of


def hoist_independent(sch, block_rv) -> None:
    func, root_sref = scope_of(sch, block_rv)
    name = sch.get(block_rv).name_hint
    sites = collect_sites(func.body.block)
    writer = {buf: site for site in sites for buf in site.write_buffers()}
    dependent = set()
    for site in sites:
        if site.name == name or any(writer.get(b) in dependent for b in site.read_buffers()):
            dependent.add(site)
    order = [s.name for s in sites if s not in dependent] + [s.name for s in sites if s in dependent]
    try:
        reordered = reorder_root_blocks(func, order)
    except ValueError as err:
        raise FusionError(f"hoist_independent: block '{name}': {err}") from None
    if reordered.same_as(func):
        return
    old_root, new_root = func.body.block, reordered.body.block
    sch.state.replace(root_sref, new_root, {old_root: new_root})
    refresh_sblock_flags(sch.state)
