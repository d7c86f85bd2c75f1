"""A MetaSchedule search strategy that measures every design space before it searches.

MetaSchedule's evolutionary search samples its first population evenly over the design
spaces, then ranks it with the cost model, mutations included, and measures the best.
A space of a few decisions (one CUDA block per row: a chunk count, a tile, rows per
block) has a few distinct schedules, where a default rule's tiled space has thousands:
after deduplication and mutation it is a handful in a population of hundreds, and an
untrained cost model (or a random one) seldom picks any of them. MoE routing's
one-block-per-row space, the fastest by 8x, went unmeasured in 32 trials of 7 spaces.

:class:`SpacesFirst` measures each design space once, as generated (where a rule made
its own choice the decision it carries, e.g. :class:`~tvm_cascade.meta_schedule.
CascadeFusion`'s hand plans), then hands the rest of the trials to the evolutionary
search, which finds those measurements in the database among the best it evolves from,
and whose cost model has learnt from them.
"""
from __future__ import annotations

import tvm
import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms


@derived_object
class SpacesFirst(ms.search_strategy.PySearchStrategy):
    """Measure every design space (its schedule as generated, post-processed) in the first
    round (as many as the trials allow, those of the fewest decisions first), then search
    with ``search`` (default MetaSchedule's
    :class:`~tvm.s_tir.meta_schedule.search_strategy.EvolutionarySearch` with
    ``evolutionary``'s options) for the trials left, none of its candidates measured
    again where it proposes a space's module (it counts it among its trials)."""

    def __init__(self, search=None, **evolutionary):
        self.search = ms.search_strategy.EvolutionarySearch(**evolutionary) if search is None else search
        self.context = None
        self.waiting = []  # the design spaces' schedules, until handed out
        self.measuring_spaces = False
        self.searches = False  # whether trials are left to the search
        self.measured = {}  # the spaces' modules, by structural hash
        self.handed = ([], [])  # the search's last candidates, and which went to be measured

    def _initialize_with_tune_context(self, context) -> None:
        self.context = context
        self.search._initialize_with_tune_context(context)

    def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None) -> None:
        self.waiting, self.measured = [], {}
        for candidate in self._spaces(design_spaces):
            if len(self.waiting) == max_trials:
                break
            if not self._measured(candidate.sch.mod):  # (two spaces may give one module)
                self.measured.setdefault(tvm_ffi.structural_hash(candidate.sch.mod), []).append(candidate.sch.mod)
                self.waiting.append(candidate)
        self.searches = max_trials > len(self.waiting)
        if self.searches:
            self.search.pre_tuning(max_trials - len(self.waiting), num_trials_per_iter, design_spaces, database,
                                   cost_model)

    def post_tuning(self) -> None:
        if self.searches:
            self.search.post_tuning()

    def generate_measure_candidates(self):
        if self.waiting:
            candidates, self.waiting = self.waiting, []
            self.measuring_spaces = True
            return candidates
        candidates = self.search.generate_measure_candidates() if self.searches else None
        if candidates is None:
            return None
        # The search does not know the spaces' modules measured (MetaSchedule's does not
        # read them from the database): those it proposes again are not measured twice.
        kept = [not self._measured(candidate.sch.mod) for candidate in candidates]
        self.handed = (list(candidates), kept)
        return [candidate for candidate, keep in zip(candidates, kept) if keep]

    def notify_runner_results(self, measure_candidates, results) -> None:
        # (the search counts the trials it handed out only, and all of those)
        if self.measuring_spaces:
            self.measuring_spaces = False
            return
        candidates, kept = self.handed
        given = iter(results)
        self.search.notify_runner_results(candidates, [
            next(given) if keep else ms.runner.RunnerResult(None, "measured as a design space") for keep in kept
        ])

    def _measured(self, mod) -> bool:
        return any(tvm_ffi.structural_equal(mod, seen) for seen in self.measured.get(tvm_ffi.structural_hash(mod), ()))

    def clone(self):
        return SpacesFirst(self.search.clone())

    def _spaces(self, design_spaces):
        """Each design space's schedule with its decisions, post-processed, those of the
        fewest decisions first (the search's population holds least of them); those that
        fail to replay or that the postprocessors reject left out."""
        postprocs = list(self.context.space_generator.postprocs)
        for space in sorted(design_spaces, key=lambda space: len(space.trace.decisions)):
            sch = tvm.s_tir.Schedule(self.context.mod, debug_mask=0)
            try:
                space.trace.apply_to_schedule(sch, remove_postproc=True)
            except (RuntimeError, ValueError):  # (a replay failure: the search passes over those too)
                continue
            # (as the search marks it: a record's replay leaves what follows to the
            # postprocessors, which would otherwise apply twice)
            sch.enter_postproc()
            if all(postproc.apply(sch) for postproc in postprocs):
                yield ms.MeasureCandidate(sch, ms.arg_info.ArgInfo.from_entry_func(sch.mod, True))
