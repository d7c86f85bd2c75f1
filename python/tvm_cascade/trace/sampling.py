"""Sampling decisions of the project's design spaces."""
from typing import Optional, Sequence

from tvm.s_tir import Schedule


def sample_uniform(sch: Schedule, options: Sequence[int], first: Optional[int] = None):
    """A ``sample_categorical`` over ``options`` with equal probabilities, or the option
    itself when there is one: MetaSchedule's mutators (thread binding, unroll) re-sample
    a categorical decision among its *other* options and fail the whole search on one
    with none (``Check failed: (!weights.empty())``). ``first``, one of the options, is
    the decision a design space made now carries (a schedule's own choice, which
    :class:`~tvm_cascade.meta_schedule.SpacesFirst` measures before searching); by
    default the decision is sampled."""
    options = list(options)
    if not options:
        raise ValueError("nothing to sample from")
    if len(options) == 1:
        return options[0]
    decision = None if first is None else options.index(first)
    return sch.sample_categorical(options, [1.0 / len(options)] * len(options), decision=decision)
