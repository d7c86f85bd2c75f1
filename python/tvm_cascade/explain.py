"""Look at the repair a fusion would use, without changing the schedule."""
from .analysis.chain import Chain
from .analysis.scope import buffer_params
from .primitives.fusion import Fusion, derive
from .primitives.rolling_update import scope_of


def explain_repair(sch, block, loop, primitive: str = "rolling_update") -> Fusion:
    """The proven repair that ``primitive`` would apply to ``block`` across ``loop``.

    Raises :class:`tvm_cascade.FusionError` where the primitive would. ``describe()`` of
    the result renders the repair with buffer names (``sum * exp(max_prev - max)``), and
    ``repair.proofs`` lists the identities SymPy proved.
    """
    func, root_sref = scope_of(sch, block)
    chain = Chain(root_sref.stmt, buffer_params(func), sch.get(block), sch.get(loop), primitive)
    return derive(chain)
