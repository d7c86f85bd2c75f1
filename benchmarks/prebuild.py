"""Build the kernels a benchmark will time, in parallel processes, before timing them.

Building a kernel (TVM's lowering, then nvcc) takes seconds to tens of seconds and one
core; a run over many shapes spends most of its time there, one kernel after another.
:func:`prebuild` builds each distinct ``attention_kernel`` configuration in its own
process first; each stores its kernel in the kernel cache
(:mod:`tvm_cascade.library.cache`, safe to write from several processes), from which
the timing process then loads it in under a second.
"""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Dict, Iterable, List, Optional


def _build(config: Dict) -> Optional[str]:
    """Build one kernel into the cache; why not, if it fails (the timing process then
    builds it itself and reports the failure where it belongs)."""
    from tvm_cascade.kernels import attention_kernel

    try:
        attention_kernel(**config)
    except Exception as err:  # pylint: disable=broad-except
        return f"{type(err).__name__}: {err}"
    return None


def prebuild(configs: Iterable[Dict], workers: Optional[int] = None) -> List[Dict]:
    """Build ``attention_kernel(**config)`` for each distinct one of ``configs`` in up to
    ``workers`` processes (default: one per core), into the kernel cache; returns the
    distinct configurations built."""
    distinct = list({repr(sorted(c.items())): c for c in configs}.values())
    if distinct:
        workers = min(len(distinct), workers or os.cpu_count() or 1)
        # spawn: a forked child of a process holding a CUDA context cannot use CUDA
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for config, failure in zip(distinct, pool.map(_build, distinct)):
                if failure:
                    print(f"prebuild: {config} not built ({failure.splitlines()[0]})", flush=True)
    return distinct
