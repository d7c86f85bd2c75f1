"""Scenarios for TVM's paged KV cache, driven through the path a model takes.

A Relax module whose ``create_paged_kv_cache`` function builds the cache with
``TIRPagedKVCache`` (as the ``relax.frontend.nn.llm`` models do) is compiled with
``tvm.compile(mod, target, relax_pipeline=...)``; the cache it returns is then driven
with the runtime's ``vm.builtin.*`` functions, and every attention output is checked
against a float64 numpy reference kept per sequence.

Building blocks:

* :func:`build_paged_kv_cache_module` -- the uncompiled Relax module;
* :func:`compile_paged_kv_cache` -- the compiled module, as a :class:`CompiledKVCache`
  whose :meth:`CompiledKVCache.create` makes a runtime cache;
* :class:`KVCacheChecker` -- one runtime cache plus its numpy reference; every
  forward step (:meth:`KVCacheChecker.step`) compares all attention outputs and the
  cached K/V of every live sequence;
* the scenarios (:data:`SCENARIOS`), each ``scenario(compiled, cache_options=None,
  **checker_options) -> ScenarioReport``, on a cache of their own.

RoPE is either not applied (``RopeMode.NONE``) or applied to q/k before attention
(``RopeMode.NORMAL``, reproduced by the reference); attention kernels never see RoPE.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn.llm.kv_cache import RopeMode, TIRPagedKVCache

__all__ = [
    "CREATE_FUNCTION",
    "SCENARIOS",
    "SLIDING_WINDOW_SCENARIOS",
    "CacheSpec",
    "CompiledKVCache",
    "KVCacheChecker",
    "RopeMode",
    "ScenarioReport",
    "build_paged_kv_cache_module",
    "compile_paged_kv_cache",
    "reference_attention",
    "scenario_deep_fork_chain",
    "scenario_fork_sequence",
    "scenario_layer_sliding_window",
    "scenario_popn",
    "scenario_prefill_decode",
    "scenario_remove_sequence",
    "scenario_sliding_window",
    "scenario_sliding_window_fork",
]

CREATE_FUNCTION = "create_paged_kv_cache"
"""Name of the Relax function that creates the cache (the name models use)."""

_CREATE_ARGS = (
    "max_batch_size",
    "max_total_seq_len",
    "prefill_chunk_size",
    "page_size",
    "support_sliding_window",
)


# ----------------------------------------------------------------------------------------
# Building and compiling the module
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """The compile-time shape of a paged KV cache (what the model fixes)."""

    num_layers: int = 2
    num_qo_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "float16"
    rope_mode: RopeMode = RopeMode.NONE
    rope_scale: float = 1.0
    rope_theta: float = 10000.0
    #: Keys a layer of every other one (from the first, ``AttnKind.MHA_SLIDING``, as
    #: Gemma-2's) attends to, the query's own among them; 0: every layer attends to all.
    layer_window: int = 0

    def sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends within :attr:`layer_window` keys."""
        return self.layer_window > 0 and layer % 2 == 0

    def __post_init__(self):
        if self.rope_mode == RopeMode.INLINE and self.layer_window:
            raise ValueError("rope_mode RopeMode.INLINE with sliding layers: the reference does not model "
                             "their in-window positions")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError("num_qo_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE rotates the two halves)")


class _PagedKVCacheModel(nn.Module):
    """The part of an ``nn.llm`` model that creates its KV cache."""

    def __init__(self, spec: CacheSpec, target: tvm.target.Target):
        self.spec = spec
        self.target = target

    def create_paged_kv_cache(  # pylint: disable=too-many-arguments
        self,
        max_batch_size: tirx.Var,
        max_total_seq_len: tirx.Var,
        prefill_chunk_size: tirx.Var,
        page_size: tirx.Var,
        support_sliding_window: tirx.Var,
    ) -> TIRPagedKVCache:
        spec = self.spec
        kinds = ["mha_sliding" if spec.sliding(layer) else "mha" for layer in range(spec.num_layers)]
        windowed = {"layer_sliding_window_size": spec.layer_window} if spec.layer_window else {}
        return TIRPagedKVCache(
            attn_kind=kinds if spec.layer_window else "mha",
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            page_size=page_size,
            support_sliding_window=support_sliding_window,
            layer_partition=relax.ShapeExpr([0, spec.num_layers]),
            num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_qo_heads,
            num_key_value_heads=spec.num_kv_heads,
            qk_head_dim=spec.head_dim,
            v_head_dim=spec.head_dim,
            mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0,
            rope_mode=spec.rope_mode,
            rope_scale=spec.rope_scale,
            rope_theta=spec.rope_theta,
            rope_scaling={},
            # Not a tensor: the runtime reads "no long-RoPE extension factors".
            rope_ext_factors=relax.prim_value(0),
            rotary_dim=spec.head_dim,
            enable_disaggregation=False,
            dtype=spec.dtype,
            target=self.target,
            **windowed,
        )


def build_paged_kv_cache_module(spec: CacheSpec, target) -> tvm.IRModule:
    """The Relax module (not yet compiled) with :data:`CREATE_FUNCTION`, exported from an
    ``nn.Module`` the way models export theirs: the five run-time settings of the cache are symbolic
    ``int`` arguments, the attention kernels are TIR functions of the module chosen by
    ``TIRPagedKVCache`` for ``target`` (a ``tvm.target.Target``, string or dict)."""
    target = tvm.target.Target(target)
    method_spec = {name: int for name in _CREATE_ARGS}
    method_spec["$"] = {"param_mode": "none", "effect_mode": "none"}
    mod, _ = _PagedKVCacheModel(spec, target).export_tvm(spec={CREATE_FUNCTION: method_spec})
    return mod


@dataclasses.dataclass
class CompiledKVCache:
    """A compiled cache-creating module, loaded in a VM.

    ``support_sliding_window`` and ``page_size`` are only the defaults of :meth:`create`:
    the module takes both at run time, as a model's does."""

    spec: CacheSpec
    target: tvm.target.Target
    pipeline: object
    device: tvm.runtime.Device
    vm: relax.VirtualMachine
    create_function: Callable
    support_sliding_window: bool = False
    page_size: int = 16
    executable: object = None  # what the VM runs: ``export_library`` saves it

    def create(
        self,
        max_batch_size: int = 32,
        max_total_seq_len: int = 2048,
        prefill_chunk_size: int = 512,
        page_size: int | None = None,
        support_sliding_window: bool | None = None,
    ):
        """A new, empty runtime cache (``relax.vm.PagedAttentionKVCache``), created by
        calling the compiled :data:`CREATE_FUNCTION`."""
        page_size = self.page_size if page_size is None else page_size
        if support_sliding_window is None:
            support_sliding_window = self.support_sliding_window
        values = (max_batch_size, max_total_seq_len, prefill_chunk_size, page_size,
                  int(bool(support_sliding_window)))
        return self.create_function(*(tvm_ffi.Shape([int(v)]) for v in values))


def compile_paged_kv_cache(
    target="llvm",
    pipeline="default",
    *,
    num_layers: int = 2,
    num_qo_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    dtype: str = "float16",
    rope_mode: RopeMode = RopeMode.NONE,
    support_sliding_window: bool = False,
    page_size: int = 16,
    rope_scale: float = 1.0,
    rope_theta: float = 10000.0,
    layer_window: int = 0,
    executable=None,
) -> CompiledKVCache:
    """Build the module of :func:`build_paged_kv_cache_module` and compile it with
    ``tvm.compile(mod, target, relax_pipeline=pipeline)``, or load ``executable``, that
    module compiled already (an exported library, loaded).

    ``pipeline`` is anything ``relax_pipeline`` accepts: a registered name (a name
    registered by a package, such as ``"cascade"``, needs that package imported first)
    or a pass. ``support_sliding_window`` and ``page_size`` become the defaults of
    :meth:`CompiledKVCache.create`."""
    spec = CacheSpec(num_layers, num_qo_heads, num_kv_heads, head_dim, dtype,
                     RopeMode(rope_mode), rope_scale, rope_theta, layer_window)
    target = tvm.target.Target(target)
    if executable is None:
        executable = tvm.compile(build_paged_kv_cache_module(spec, target), target, relax_pipeline=pipeline)
    device = tvm.device(target.get_target_device_type(), 0)
    vm = relax.VirtualMachine(executable, device)
    return CompiledKVCache(spec, target, pipeline, device, vm, vm[CREATE_FUNCTION],
                           bool(support_sliding_window), page_size, executable)


# ----------------------------------------------------------------------------------------
# Runtime builtins and the numpy reference
# ----------------------------------------------------------------------------------------


class _Builtins:  # pylint: disable=too-few-public-methods
    """The runtime's KV-state functions (the optional ones are ``None`` when the
    installed runtime lacks them)."""

    _REQUIRED = {
        "add_sequence": "vm.builtin.kv_state_add_sequence",
        "remove_sequence": "vm.builtin.kv_state_remove_sequence",
        "fork_sequence": "vm.builtin.kv_state_fork_sequence",
        "popn": "vm.builtin.kv_state_popn",
        "clear": "vm.builtin.kv_state_clear",
        "begin_forward": "vm.builtin.kv_state_begin_forward",
        "end_forward": "vm.builtin.kv_state_end_forward",
        "attention_with_fused_qkv": "vm.builtin.attention_kv_cache_attention_with_fused_qkv",
        "enable_sliding_window": "vm.builtin.attention_kv_cache_enable_sliding_window_for_seq",
    }
    _OPTIONAL = {
        "debug_get_kv": "vm.builtin.attention_kv_cache_debug_get_kv",
        "empty": "vm.builtin.attention_kv_cache_empty",
        "sequence_length": "vm.builtin.attention_kv_cache_get_sequence_length",
    }

    def __init__(self):
        for attr, name in self._REQUIRED.items():
            setattr(self, attr, tvm.get_global_func(name))
        for attr, name in self._OPTIONAL.items():
            setattr(self, attr, tvm.get_global_func(name, allow_missing=True))


def _rotate(x: np.ndarray, positions: np.ndarray, scale: float, theta: float) -> np.ndarray:
    """Llama RoPE (rotate-half, all features) of ``x`` ``(tokens, heads, head_dim)`` at
    ``positions`` (the frequencies of ``llama_rope_with_position_map``)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-2.0 * np.arange(half) / x.shape[-1])
    angle = np.concatenate([np.outer(positions * scale, inv_freq)] * 2, axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(angle) + rotated * np.sin(angle)


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, sm_scale: float,
                        window: int = 0) -> np.ndarray:
    """Float64 causal attention of ``q`` ``(n, heads_q, d)`` over ``k, v``
    ``(m, heads_kv, d)``, ``m >= n``, queries aligned to the end of the keys (query ``i``
    sees keys ``0 .. m - n + i``, only the last ``window`` of those where ``window``);
    query head ``h`` reads key/value head ``h // (heads_q // heads_kv)``."""
    n, m = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k.astype(np.float64), group, axis=1)
    v = np.repeat(v.astype(np.float64), group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q.astype(np.float64), k) * sm_scale
    position = (m - n) + np.arange(n)[:, None]
    visible = np.arange(m)[None, :] <= position
    if window:
        visible &= np.arange(m)[None, :] > position - window
    scores = np.where(visible[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v)


def _numpy_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes  # pylint: disable=import-outside-toplevel

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


_DEFAULT_TOLERANCE = {"float16": (2e-3, 2e-3), "bfloat16": (1.6e-2, 1.6e-2), "float32": (1e-5, 1e-5)}


@dataclasses.dataclass
class ScenarioReport:
    """What a scenario checked: forward steps, query tokens whose attention outputs were
    compared (per layer), comparisons of the cached K/V of a sequence, and the largest
    absolute error of an attention output."""

    name: str = ""
    steps: int = 0
    tokens: int = 0
    kv_checks: int = 0
    max_abs_error: float = 0.0
    #: Without a reference (``KVCacheChecker(reference=False)``): each step's attention
    #: outputs, every layer's.
    outputs: list = dataclasses.field(default_factory=list)


class KVCacheChecker:
    """One runtime cache and its reference: the K/V of every live sequence, as the cache
    stores them (``dtype``; RoPE applied for ``RopeMode.NORMAL``).

    Each operation is applied to both and checked:

    * :meth:`step` runs one forward pass and compares the attention output of every
      layer with :func:`reference_attention`;
    * after every operation the cached K/V of each live sequence is read back with
      ``attention_kv_cache_debug_get_kv`` (when the runtime has it) and compared, as is
      its length (``attention_kv_cache_get_sequence_length``).

    K/V read back must equal the reference exactly when no RoPE is applied (the cache
    only copies them); otherwise ``rtol``/``atol`` apply, as to attention outputs
    (defaults per dtype).

    ``cache`` comes from ``compiled.create``; ``support_sliding_window`` says whether it
    was created with sliding window support (default: ``compiled``'s default), which
    the reference models only without RoPE. ``sm_scale`` (default ``head_dim ** -0.5``)
    is passed to the runtime and used by the reference; ``seed`` seeds the random
    q/k/v (uniform in [-1, 1)); ``name`` prefixes failure messages. Without
    ``reference``, nothing is compared but sequence lengths: each step's attention
    outputs are kept in the report, to compare one cache with another (a cache the
    reference does not model: RoPE with sliding window support).
    """

    def __init__(  # pylint: disable=too-many-arguments
        self,
        compiled: CompiledKVCache,
        cache,
        *,
        sm_scale: float | None = None,
        seed: int = 0,
        rtol: float | None = None,
        atol: float | None = None,
        support_sliding_window: bool | None = None,
        name: str = "",
        reference: bool = True,
    ):
        self.compiled = compiled
        self.spec = compiled.spec
        self.cache = cache
        self.device = compiled.device
        self.page_size = compiled.page_size
        self.sm_scale = self.spec.head_dim ** -0.5 if sm_scale is None else sm_scale
        default_rtol, default_atol = _DEFAULT_TOLERANCE.get(self.spec.dtype, (1e-3, 1e-3))
        self.rtol = default_rtol if rtol is None else rtol
        self.atol = default_atol if atol is None else atol
        if support_sliding_window is None:
            support_sliding_window = compiled.support_sliding_window
        self.reference = reference
        if reference and support_sliding_window and self.spec.rope_mode != RopeMode.NONE:
            # With sliding window support the runtime turns any RoPE into RoPE inside the
            # attention kernels, at in-window positions.
            raise ValueError("a cache with sliding window support needs RopeMode.NONE")
        self.rng = np.random.default_rng(seed)
        self.fn = _Builtins()
        self.keys: dict[int, np.ndarray] = {}
        self.values: dict[int, np.ndarray] = {}
        self.windows: dict[int, tuple[int, int]] = {}
        self.report = ScenarioReport(name=name)
        self._np_dtype = _numpy_dtype(self.spec.dtype)

    # -- sequence management -------------------------------------------------------------

    def _empty(self) -> np.ndarray:
        s = self.spec
        return np.zeros((s.num_layers, 0, s.num_kv_heads, s.head_dim), self._np_dtype)

    def add(self, *seq_ids: int) -> None:
        """Add empty sequences."""
        for seq_id in seq_ids:
            assert seq_id not in self.keys, f"sequence {seq_id} already exists"
            self.fn.add_sequence(self.cache, seq_id)
            self.keys[seq_id], self.values[seq_id] = self._empty(), self._empty()
        self.verify()

    def remove(self, *seq_ids: int) -> None:
        """Remove sequences; the others must keep their K/V."""
        for seq_id in seq_ids:
            self.fn.remove_sequence(self.cache, seq_id)
            del self.keys[seq_id], self.values[seq_id]
            self.windows.pop(seq_id, None)
        self.verify()

    def fork(self, parent: int, child: int, position: int = -1) -> None:
        """Fork ``child`` from the first ``position`` tokens of ``parent`` (all: -1)."""
        assert child not in self.keys, f"sequence {child} already exists"
        self.fn.fork_sequence(self.cache, parent, child, position)
        end = None if position == -1 else position
        self.keys[child] = self.keys[parent][:, :end].copy()
        self.values[child] = self.values[parent][:, :end].copy()
        self.verify()

    def popn(self, seq_id: int, n: int) -> None:
        """Drop the last ``n`` tokens of a sequence."""
        self.fn.popn(self.cache, seq_id, n)
        length = self.keys[seq_id].shape[1] - n
        self.keys[seq_id] = self.keys[seq_id][:, :length]
        self.values[seq_id] = self.values[seq_id][:, :length]
        self.verify()

    def enable_sliding_window(self, seq_id: int, window: int, sink: int) -> None:
        """Keep only the first ``sink`` and the last ``window - sink`` tokens of the
        sequence after each forward step. For a forked sequence ``sink`` must cover the
        pages it shares with its parent (the runtime keeps those as sink)."""
        self.fn.enable_sliding_window(self.cache, seq_id, window, sink)
        self.windows[seq_id] = (window, sink)

    def clear(self) -> None:
        """Drop all sequences."""
        self.fn.clear(self.cache)
        self.keys.clear()
        self.values.clear()
        self.windows.clear()
        self.assert_empty()

    def remove_all(self) -> None:
        """Remove every sequence (oldest first) and check that all pages came back."""
        for seq_id in list(self.keys):
            self.remove(seq_id)
        self.assert_empty()

    def assert_empty(self) -> None:
        """The cache holds no sequence and has every page free (when the runtime says)."""
        if self.fn.empty is not None:
            assert self.fn.empty(self.cache), "the KV cache is not empty (leaked pages or blocks)"

    # -- forward -------------------------------------------------------------------------

    def _random(self, *shape: int) -> np.ndarray:
        return self.rng.uniform(-1.0, 1.0, shape).astype(self._np_dtype)

    def step(self, batch: Sequence[tuple[int, int]]) -> None:
        """One forward pass appending ``length`` new tokens to each ``(seq_id, length)``
        of ``batch``: ``kv_state_begin_forward``, ``attention_with_fused_qkv`` per layer
        on random q/k/v, ``kv_state_end_forward``. Every layer's output for every
        sequence is compared with causal attention of the new queries over the
        sequence's cached keys followed by the new ones (the last ``layer_window`` of
        them on a sliding layer). Chunks are shorter than a sliding layer's window: the
        runtime keeps it exact only up to that many tokens (the new tokens among
        themselves are plain causal), and TVM's kernel over the cached keys gives NaN
        for a row that sees none of them (a chunk of ``layer_window`` tokens)."""
        s = self.spec
        seq_ids = [int(seq_id) for seq_id, _ in batch]
        lengths = [int(length) for _, length in batch]
        assert len(set(seq_ids)) == len(seq_ids), "a sequence appears twice in a batch"
        assert all(length > 0 for length in lengths), "append lengths must be positive"
        assert all(seq_id in self.keys for seq_id in seq_ids), "unknown sequence in batch"
        assert not s.layer_window or max(lengths) < s.layer_window, "a chunk as long as the layers' window"
        total = sum(lengths)
        heads = s.num_qo_heads + 2 * s.num_kv_heads
        qkv = self._random(s.num_layers, total, heads, s.head_dim)

        self.fn.begin_forward(self.cache, tvm_ffi.Shape(seq_ids), tvm_ffi.Shape(lengths), None)
        outputs = []
        for layer in range(s.num_layers):
            out = tvm.runtime.empty((total, s.num_qo_heads, s.head_dim), s.dtype, device=self.device)
            self.fn.attention_with_fused_qkv(self.cache, layer, self.sm_scale,
                                             tvm.runtime.tensor(qkv[layer], self.device), out)
            outputs.append(out.numpy())
        self.fn.end_forward(self.cache)
        if not self.reference:
            self.report.outputs.append(outputs)

        offset = 0
        for seq_id, length in zip(seq_ids, lengths):
            rows = slice(offset, offset + length)
            offset += length
            q, k, v = np.split(qkv[:, rows], [s.num_qo_heads, s.num_qo_heads + s.num_kv_heads], axis=2)
            positions = self.keys[seq_id].shape[1] + np.arange(length, dtype=np.float64)
            if s.rope_mode == RopeMode.NORMAL:
                q = np.stack([self._rope(q[layer], positions) for layer in range(s.num_layers)])
                k = np.stack([self._rope(k[layer], positions) for layer in range(s.num_layers)])
            keys = np.concatenate([self.keys[seq_id], k], axis=1)
            values = np.concatenate([self.values[seq_id], v], axis=1)
            seen = keys
            if s.rope_mode == RopeMode.INLINE:
                # The cache keeps keys as appended; attention rotates q and key j by j.
                q = np.stack([self._rope(q[layer], positions) for layer in range(s.num_layers)])
                every = np.arange(keys.shape[1], dtype=np.float64)
                seen = np.stack([self._rope(keys[layer], every) for layer in range(s.num_layers)])
            for layer in range(s.num_layers if self.reference else 0):
                window = s.layer_window if s.sliding(layer) else 0
                expected = reference_attention(q[layer], seen[layer], values[layer], self.sm_scale, window)
                actual = outputs[layer][rows].astype(np.float64)
                self._compare(actual, expected,
                              f"attention output of sequence {seq_id} (+{length} tokens, "
                              f"{keys.shape[1]} keys), layer {layer}, batch {batch}")
            self.keys[seq_id], self.values[seq_id] = keys, values
            self._slide(seq_id)
        self.report.steps += 1
        self.report.tokens += total
        self.verify()

    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        # The runtime rounds rotated q/k to the cache dtype before attention.
        rotated = _rotate(x.astype(np.float64), positions, self.spec.rope_scale, self.spec.rope_theta)
        return rotated.astype(self._np_dtype)

    def _slide(self, seq_id: int) -> None:
        if seq_id not in self.windows:
            return
        window, sink = self.windows[seq_id]
        length = self.keys[seq_id].shape[1]
        if length <= window:
            return
        keep = np.r_[0:sink, length - (window - sink):length]
        self.keys[seq_id] = self.keys[seq_id][:, keep]
        self.values[seq_id] = self.values[seq_id][:, keep]

    def _compare(self, actual: np.ndarray, expected: np.ndarray, what: str) -> None:
        if actual.size:
            error = float(np.max(np.abs(actual - expected)))
            self.report.max_abs_error = max(self.report.max_abs_error, error)
        np.testing.assert_allclose(actual, expected, rtol=self.rtol, atol=self.atol,
                                   err_msg=f"{self.report.name}: {what}")

    # -- cache contents ------------------------------------------------------------------

    def verify(self, seq_ids: Sequence[int] | None = None) -> None:
        """Compare the length and cached K/V of ``seq_ids`` (default: every live
        sequence) with the reference."""
        s = self.spec
        for seq_id in self.keys if seq_ids is None else seq_ids:
            length = self.keys[seq_id].shape[1]
            if self.fn.sequence_length is not None:
                got = self.fn.sequence_length(self.cache, seq_id)
                assert got == length, f"sequence {seq_id} has length {got}, expected {length}"
            # (the runtime reads back the K/V of caches of MHA layers only)
            if self.fn.debug_get_kv is None or length == 0 or s.layer_window or not self.reference:
                continue
            shape = (s.num_layers, length, s.num_kv_heads, s.head_dim)
            k = tvm.runtime.empty(shape, s.dtype, device=self.device)
            v = tvm.runtime.empty(shape, s.dtype, device=self.device)
            self.fn.debug_get_kv(self.cache, seq_id, 0, length, k, v)
            for name, got, want in (("keys", k.numpy(), self.keys[seq_id]),
                                    ("values", v.numpy(), self.values[seq_id])):
                what = f"{self.report.name}: cached {name} of sequence {seq_id}"
                if s.rope_mode != RopeMode.NORMAL or name == "values":
                    np.testing.assert_array_equal(got, want, err_msg=what)
                else:
                    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                               rtol=self.rtol, atol=self.atol, err_msg=what)
            self.report.kv_checks += 1


# ----------------------------------------------------------------------------------------
# Scenarios
# ----------------------------------------------------------------------------------------


def _checker(compiled: CompiledKVCache, name: str, cache_options: dict | None,
             support_sliding_window: bool | None = None, **options) -> KVCacheChecker:
    cache_options = dict(cache_options or {})
    if support_sliding_window is not None:
        cache_options["support_sliding_window"] = support_sliding_window
    sliding = cache_options.get("support_sliding_window", compiled.support_sliding_window)
    cache = compiled.create(**cache_options)
    return KVCacheChecker(compiled, cache, support_sliding_window=sliding, name=name, **options)


def _decode(checker: KVCacheChecker, seq_ids: Sequence[int], rounds: int) -> None:
    for _ in range(rounds):
        checker.step([(seq_id, 1) for seq_id in seq_ids])


def scenario_prefill_decode(compiled: CompiledKVCache, cache_options: dict | None = None,
                            **options) -> ScenarioReport:
    """Prefill and decode of eight sequences of different lengths, one at a time and
    batched: lengths below, at and just past page boundaries, a one-token prefill
    batched with a long one, prefill chunks continuing existing sequences, mixed
    prefill/decode batches and decode rounds crossing page boundaries. Ends with
    ``kv_state_clear`` and a reuse of the cleared cache.

    ``cache_options`` go to :meth:`CompiledKVCache.create`; ``options`` to
    :class:`KVCacheChecker` (``sm_scale``, ``seed``, ``rtol``, ``atol``)."""
    ck = _checker(compiled, "prefill_decode", cache_options, **options)
    ck.add(*range(8))
    ck.step([(0, 7)])
    ck.step([(1, 16)])
    ck.step([(2, 17), (3, 33)])
    ck.step([(4, 100), (5, 1)])
    ck.step([(0, 9), (2, 15), (6, 48)])
    ck.step([(1, 1), (3, 1), (5, 1)])
    _decode(ck, range(7), 4)
    ck.step([(4, 60), (7, 150)])
    ck.step([(0, 3), (1, 1), (2, 30), (7, 1)])
    _decode(ck, range(8), 3)
    ck.clear()
    ck.add(3, 9)
    ck.step([(3, 21), (9, 5)])
    _decode(ck, [3, 9], 2)
    ck.remove_all()
    return ck.report


def scenario_remove_sequence(compiled: CompiledKVCache, cache_options: dict | None = None,
                             **options) -> ScenarioReport:
    """Removing sequences one by one between forward steps: the remaining sequences keep
    their K/V and attend correctly, a removed id can be added again as a new sequence,
    and removing everything returns every page."""
    ck = _checker(compiled, "remove_sequence", cache_options, **options)
    ck.add(*range(5))
    ck.step([(0, 20), (1, 33), (2, 5), (3, 64), (4, 47)])
    _decode(ck, range(5), 1)
    ck.remove(2)
    _decode(ck, [0, 1, 3, 4], 2)
    ck.remove(0)
    ck.step([(1, 15), (3, 1), (4, 17)])
    ck.add(2)
    ck.step([(2, 40), (4, 1)])
    _decode(ck, [1, 2, 3, 4], 2)
    ck.remove(3, 1)
    _decode(ck, [2, 4], 2)
    ck.remove_all()
    return ck.report


def scenario_fork_sequence(compiled: CompiledKVCache, cache_options: dict | None = None,
                           **options) -> ScenarioReport:
    """Forks sharing prefixes: at the end of the parent (inside a page and on a page
    boundary, after which the parent keeps growing), at a page boundary inside the
    parent, inside a page, at position 0, forks of forks (more block levels than the
    runtime's attention depth) and a fork that splits a shared block. Parents and
    children then decode and prefill in mixed batches; removing parents first must
    leave the children intact."""
    ck = _checker(compiled, "fork_sequence", cache_options, **options)
    ck.add(0, 1, 2)
    ck.step([(0, 40), (1, 16), (2, 9)])
    ck.fork(0, 3)
    ck.step([(3, 5)])
    ck.fork(1, 4)
    ck.step([(4, 20)])
    ck.step([(1, 3)])
    ck.fork(0, 5, 32)
    ck.fork(0, 6, 17)
    ck.fork(0, 7, 0)
    ck.step([(5, 4), (6, 30), (7, 12)])
    ck.fork(3, 8)
    ck.step([(8, 7)])
    ck.fork(5, 9, 35)
    ck.fork(8, 10, 44)
    ck.step([(9, 25), (10, 2)])
    _decode(ck, range(11), 3)
    ck.step([(0, 1), (3, 10), (8, 1), (9, 25), (2, 1)])
    ck.remove(0, 5)
    _decode(ck, [1, 3, 4, 6, 8, 9, 10], 2)
    ck.remove_all()
    return ck.report


def scenario_deep_fork_chain(compiled: CompiledKVCache, cache_options: dict | None = None,
                             **options) -> ScenarioReport:
    """A chain of eleven nested forks with side branches, far deeper than the block
    depth the runtime's attention handles in one level each; decode at leaves and
    inner sequences, then remove them all."""
    ck = _checker(compiled, "deep_fork_chain", cache_options, **options)
    ck.add(0)
    ck.step([(0, 30)])
    chain = [(1, 0, 15), (2, 1, 5), (3, 2, 20), (4, 3, 26), (5, 3, 18), (6, 5, 22),
             (7, 5, 12), (8, 7, 29), (9, 7, 9), (10, 9, 31), (11, 9, 4)]
    for child, parent, length in chain:
        ck.fork(parent, child)
        ck.step([(child, length)])
    for batch in ([3, 6, 9], [4, 8, 10], [5, 7, 11]):
        _decode(ck, batch, 1)
    ck.step([(11, 17), (4, 1), (0, 2)])
    ck.remove_all()
    return ck.report


def scenario_popn(compiled: CompiledKVCache, cache_options: dict | None = None,
                  **options) -> ScenarioReport:
    """``kv_state_popn``: dropping a few tokens, whole pages, nothing, everything, and
    more than a forked child owns (reaching into the prefix it shares with its
    parent); the shortened sequences then prefill and decode again."""
    ck = _checker(compiled, "popn", cache_options, **options)
    ck.add(0, 1, 2, 3)
    ck.step([(0, 35), (1, 88), (2, 17), (3, 4)])
    ck.fork(3, 4)
    ck.step([(4, 35)])
    for seq_id, n in [(0, 17), (1, 57), (2, 16), (3, 0), (4, 37)]:
        ck.popn(seq_id, n)
    ck.step([(0, 5), (1, 1), (2, 20), (3, 1), (4, 3)])
    _decode(ck, range(5), 2)
    ck.popn(2, 22)
    ck.popn(1, 16)
    ck.step([(2, 9), (1, 4)])
    _decode(ck, range(5), 1)
    ck.remove_all()
    return ck.report


def scenario_sliding_window(compiled: CompiledKVCache, cache_options: dict | None = None,
                            **options) -> ScenarioReport:
    """Sequences with sliding windows and attention sinks (sink 0, inside a page, a whole
    page) next to a sequence without a window, in a cache created with sliding window
    support: prefill in chunks, one chunk longer than the window, then decode rounds
    that slide the windows across many pages; a fork within a sink."""
    ck = _checker(compiled, "sliding_window", cache_options, support_sliding_window=True, **options)
    windows = {0: (20, 6), 1: (25, 4), 2: (32, 16), 3: (35, 3), 4: (40, 0)}
    ck.add(*windows, 5)
    for seq_id, (window, sink) in windows.items():
        ck.enable_sliding_window(seq_id, window, sink)
    ck.step([(0, 4)])
    ck.step([(1, 6)])
    ck.step([(2, 6), (3, 7), (4, 7), (5, 11)])
    ck.step([(0, 20), (1, 19), (2, 30), (3, 35), (4, 40)])
    ck.step([(0, 6), (1, 5), (2, 4), (3, 3), (4, 2), (5, 20)])
    _decode(ck, range(6), 20)
    ck.fork(2, 6, 10)
    ck.step([(6, 12), (2, 1)])
    _decode(ck, range(7), 3)
    ck.remove_all()
    return ck.report


def scenario_sliding_window_fork(compiled: CompiledKVCache, cache_options: dict | None = None,
                                 **options) -> ScenarioReport:
    """Sliding windows together with forks: children forked (inside a page and at the
    end) from windowed parents before they slide, a child forked from a sequence
    without a window and then given a window whose sink covers the shared prefix."""
    ck = _checker(compiled, "sliding_window_fork", cache_options, support_sliding_window=True,
                  **options)
    windows = {0: (30, 15), 1: (35, 20), 2: (40, 25)}
    ck.add(*windows)
    for seq_id, (window, sink) in windows.items():
        ck.enable_sliding_window(seq_id, window, sink)
    ck.step([(0, 12), (1, 18), (2, 28)])
    ck.fork(0, 3, 10)
    ck.fork(1, 4)
    ck.fork(2, 5, 18)
    ck.step([(3, 8), (4, 20), (5, 18)])
    ck.step([(0, 9), (1, 15), (2, 4), (3, 10), (4, 3), (5, 7)])
    ck.fork(3, 6, 18)
    ck.enable_sliding_window(6, 25, 24)
    ck.step([(3, 10), (6, 12)])
    _decode(ck, range(7), 12)
    ck.remove_all()
    return ck.report


def scenario_layer_sliding_window(compiled: CompiledKVCache, cache_options: dict | None = None,
                                  **options) -> ScenarioReport:
    """Layers of sliding windows (``AttnKind.MHA_SLIDING``, ``compiled.spec.layer_window``
    keys) between layers that see every key, as Gemma-2's: sequences grow past the
    window in chunks of up to one token less (a chunk alone, batched, one token beside
    a chunk), then decode rounds slide the window across pages; a sequence removed and
    one added midway."""
    window = compiled.spec.layer_window
    if not window:
        raise ValueError("the cache has no sliding layers (compile it with layer_window)")
    longest = window - 1
    ck = _checker(compiled, "layer_sliding_window", cache_options, **options)
    ck.add(0, 1, 2, 3)
    ck.step([(0, longest)])
    ck.step([(1, longest), (2, 7)])
    ck.step([(0, longest), (1, 3), (3, 1)])
    ck.step([(2, longest), (3, window - 5), (0, 1)])
    _decode(ck, range(4), 3)
    ck.remove(1)
    ck.add(4)
    ck.step([(4, 17), (2, 9), (0, longest)])
    _decode(ck, [0, 2, 3, 4], window // 2)
    ck.step([(3, longest), (4, 1)])
    _decode(ck, [0, 2, 3, 4], 2)
    ck.remove_all()
    return ck.report


SCENARIOS: dict[str, Callable[..., ScenarioReport]] = {
    "prefill_decode": scenario_prefill_decode,
    "remove_sequence": scenario_remove_sequence,
    "fork_sequence": scenario_fork_sequence,
    "deep_fork_chain": scenario_deep_fork_chain,
    "popn": scenario_popn,
    "sliding_window": scenario_sliding_window,
    "sliding_window_fork": scenario_sliding_window_fork,
}
"""Every scenario by name: ``scenario(compiled, cache_options=None, **checker_options)``."""

SLIDING_WINDOW_SCENARIOS = ("sliding_window", "sliding_window_fork")
"""Scenarios that create their cache with sliding window support (``RopeMode.NONE`` only)."""
