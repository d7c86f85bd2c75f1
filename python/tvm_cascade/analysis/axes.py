"""Which iterators of different blocks walk the same logical axis.

Blocks of a chain talk through buffers: if one block writes ``X[vb, vi]`` and another reads
``X[wb, wi]``, then ``vb``/``wb`` and ``vi``/``wi`` walk the same axis. Union-find over all
plain-variable indices of every buffer access gives the axis classes. An index that is an
expression (``X[vi, c * 32 + vk]``, as ``split_k_update`` leaves the reads of a chunk's
partial) relates the iterators of two accesses where the expressions are the same up to
renaming: the iterators in the same places walk the same axes.
"""
import tvm_ffi
from tvm.ir import expr as ir_expr

from .scope import buffer_accesses, vars_in


class AxisClasses:
    def __init__(self, sites):
        self._parent = {}
        iter_vars = {}
        for site in sites:
            for iv in site.block.iter_vars:
                iter_vars[iv.var] = iv
                self._parent.setdefault(iv.var, iv.var)
        first_access, first_expr = {}, {}
        for site in sites:
            stmts = [site.block.body] + ([site.block.init] if site.block.init is not None else [])
            for stmt in stmts:
                for buffer, indices in buffer_accesses(stmt):
                    for dim, idx in enumerate(indices):
                        if not isinstance(idx, ir_expr.Var):
                            self._union_renamed(first_expr.setdefault((buffer, dim), idx), idx, iter_vars)
                    plain = [
                        idx if isinstance(idx, ir_expr.Var) and idx in iter_vars else None
                        for idx in indices
                    ]
                    if buffer not in first_access:
                        first_access[buffer] = plain
                        continue
                    for a, b in zip(first_access[buffer], plain):
                        if a is not None and b is not None:
                            self._union(a, b)
                    first_access[buffer] = [
                        a if a is not None else b for a, b in zip(first_access[buffer], plain)
                    ]

    def _union_renamed(self, a, b, iter_vars):
        if a.same_as(b) or not tvm_ffi.structural_equal(a, b, map_free_vars=True):
            return
        for va, vb in zip(vars_in(a), vars_in(b)):
            if va in iter_vars and vb in iter_vars:
                self._union(va, vb)

    def _find(self, var):
        root = var
        while not self._parent[root].same_as(root):
            root = self._parent[root]
        return root

    def _union(self, a, b):
        ra, rb = self._find(a), self._find(b)
        if not ra.same_as(rb):
            self._parent[ra] = rb

    def same(self, a, b) -> bool:
        return self._find(a).same_as(self._find(b))
