"""The scope-level bookkeeping both fusion primitives share: new and dead buffers,
replaced and moved blocks, sref reuse, and the final ``ScheduleState.replace``."""
from . import ir
from .placement import Placement


class ScopeRewrite:
    """Collects the edits of one primitive to a root scope and applies them at once."""

    def __init__(self, chain, params, root):
        self.chain = chain
        self.params = params
        self.root = root
        self.new_buffers, self.dead_buffers = [], []
        self.replaced, self.reuse = {}, {}
        self.appended = []
        self.after = {}
        self.placement = Placement(chain)

    def add_buffer(self, buf):
        self.new_buffers.append(buf)
        return buf

    def regions(self, block):
        return ir.with_regions(block, self.params + list(self.root.alloc_buffers) + self.new_buffers)

    def update(self, site, block):
        """``site`` keeps its place and loops but runs ``block``."""
        self.replaced[site.realize] = ir.realize(site.realize.iter_values, site.realize.predicate, block)
        self.reuse[site.block] = block

    def keep_complete_copies(self):
        """Intermediates that move but also feed blocks left outside the loop leave a copy
        ``<block>_complete`` in their place, and those blocks read the copy."""
        chain = self.chain
        complete = {}
        for site in chain.complete_copies:
            buf = site.write_buffers()[0]
            complete[buf] = self.add_buffer(ir.like_buffer(buf, f"{buf.name}_complete"))
        for site in chain.complete_copies:
            copy = ir.copy_block(ir.with_fresh_iter_vars(site.block), name_hint=f"{site.name}_complete")
            copy = ir.copy_block(copy, body=ir.replace_buffers(copy.body, complete))
            self.replaced[site.realize] = ir.realize(
                site.realize.iter_values, site.realize.predicate, self.regions(copy)
            )
        movers = set(chain.movers)
        for site in chain.sites:
            if site in movers or site.realize in self.replaced:
                continue
            if any(buf in complete for buf in site.read_buffers()):
                block = ir.copy_block(site.block, body=ir.replace_buffers(site.block.body, complete))
                self.update(site, self.regions(block))

    def drop_dead_twins(self):
        """Blocks outside the loop whose twin runs under it, and that only movers read."""
        chain = self.chain
        movers = set(chain.movers)
        for old_buf in chain.redirects:
            twin = chain.writer[old_buf]
            readers = [r for r in chain.readers.get(old_buf, []) if r not in movers]
            if not readers and not any(p.same_as(old_buf) for p in self.params):
                self.replaced[twin.realize] = None
                self.dead_buffers.append(old_buf)

    def move_under_loop(self, site, block):
        """Run ``block`` (which replaces ``site``'s block) under the loop, for each tile."""
        self.reuse[site.block] = block
        self.replaced.setdefault(site.realize, None)
        self.appended.append(self.placement.place(block))

    def insert_after(self, sites, stmt):
        """Put ``stmt`` right after the last root-level statement that holds one of ``sites``."""
        body = self.root.body
        top_level = list(body) if hasattr(body, "seq") else [body]

        def position(site):
            top = site.loops[0] if site.loops else site.realize
            return next(k for k, item in enumerate(top_level) if item.same_as(top))

        last = top_level[max(position(site) for site in sites)]
        self.after.setdefault(last, []).append(stmt)

    def commit(self, sch, root_sref):
        root = self.root
        body = ir.rebuild_scope(root.body, self.replaced, self.chain.loop, self.appended, self.after)
        allocs = [b for b in root.alloc_buffers if not any(b.same_as(d) for d in self.dead_buffers)]
        new_root = ir.copy_block(root, body=body, alloc_buffers=allocs + self.new_buffers)
        ir.replace_root(sch, root_sref, new_root, self.reuse)
