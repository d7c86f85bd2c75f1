"""What a kernel family answers about schedules of static lengths.

:func:`tvm_cascade.kernels.compile_attention` compiles ``ops.attention`` of one static
configuration through the same families as the runtime-length kernels
(:data:`tvm_cascade.library.families.FAMILIES`). A family that has such a schedule has a
``kind`` (``"decode"`` or ``"prefill"``: the query rows it serves, and the tuning
database its records go to) and answers:

- ``schedule_supports(spec, seq_q, seq_kv) -> reason or None`` for a ``bhsd`` spec of
  ``seq_q`` queries and ``seq_kv`` keys;
- ``padding(group, seq_q, head_dim, config=None) -> (rows, keys)``: the multiples
  ``ops.attention(pad_to=...)`` pads the lengths to for the schedule (with ``config``'s
  choices, or those every choice of the design space takes);
- ``schedule(func, spec, config=None) -> Schedule``: the heuristic schedule, with
  ``config`` (of ``config_type``) setting its choices;
- ``design_space(spec) -> fn(sch)``: its MetaSchedule design space; ``space`` names it,
  ``verifies_gpu_code`` says whether MetaSchedule's ``VerifyGPUCode`` holds for it;
- ``scheduled(mod) -> bool``: whether a scheduled module (a tuning record's) is its own;
- ``prefers(spec) -> bool``: whether a configuration without a record takes it where it
  is supported;
- ``compile(mod, target)``, ``build_func`` (the same as a global function, for
  MetaSchedule's builder) and ``register_intrinsics()`` (the tensor intrinsics its
  records' instructions name);
- ``needs_variant``: whether the schedule is made from the variant (which an
  ``ops.attention`` function does not record) rather than from the function alone.

Families whose kernels take runtime lengths only mix in :class:`RuntimeLengthsOnly`; a
family with a schedule of static lengths only sets ``runtime = False``, and the
runtime-length kernels pass over it.
"""
from __future__ import annotations


class RuntimeLengthsOnly:
    """A family with no schedule of static lengths."""

    kind = None

    def schedule_supports(self, spec, seq_q, seq_kv):
        return "its kernel takes runtime lengths only (attention_kernel); it has no schedule of static ones"
