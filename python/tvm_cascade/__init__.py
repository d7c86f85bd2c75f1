"""tvm-cascade: fusion of cascaded reductions for Apache TVM.

Importing the package loads its C++ core (the instruction kinds that put the primitives
into schedule traces) and adds the primitives to ``tvm.s_tir.Schedule``:

* ``sch.rolling_update(block, loop)``: FlashAttention-style running state plus repair.
"""
from . import _core  # noqa: F401  (registers the instruction kinds)
from . import primitives
from .errors import FusionError
from . import relax  # noqa: F401  (registers relax_pipeline="cascade")

__version__ = "0.1.0"

primitives.install()

__all__ = ["FusionError", "__version__"]
