"""Serving a :class:`TabICLv2` with :class:`ServingOptions`: kernels, padded buckets, compiled
graphs, CUDA graphs.

:class:`ServedTabICL` is the one serving path: the estimators serve every preset and options
through it, and the benchmark driver measures every tabserve cell through it. It wraps a model
and implements the :class:`~..network.engine.Engine` interface (``__call__`` / ``forward``,
``predict_stats``, ``build_cache``, ``forward_with_cache``, ``predict_stats_with_cache``), so the
estimators use it in place of the model; the wrapped network is ``.model`` (its weights, its
``state_dict``), and the served model calls only the network's public methods. With ``buckets`` every table is padded onto the
smallest bucket of a :class:`~tabserve.buckets.BucketGrid` that holds it:

* train rows at ``[0, n_train)`` of a ``train_rows`` block, test rows in their own
  ``test_rows`` block, features at ``[0, n_features)`` of ``features`` columns
  (:func:`tabserve.ops.pad_to_bucket`, padded with the skip sentinel ``-100``);
* the real train-row and feature counts travel as 0-d device tensors into
  :meth:`TabICLv2.padded_forward` and friends: column-stage inducing points and ICL attend to the
  real train rows only and QASSMax uses ln(real n) (:func:`tabserve.ops.prefix_attention`,
  :func:`tabserve.ops.qassmax_scale`); feature groups take their +1/+2/+4 offsets modulo the real
  feature count and the row stage masks padded feature tokens as keys;
* padded test rows are dropped from the output.

So one compiled graph (or CUDA graph) per bucket serves every table that fits it, and the
predictions equal the unpadded ones (fp32 CPU: within 1e-6, ``test_padded_inference.py``).
Tables past the grid run unpadded; test rows past the largest test bucket are split. More than
``max_classes`` classes: the column and row stages run padded (replayed from their own CUDA graphs
with ``cuda_graphs``), the class hierarchy runs eagerly on the real rows (its tree's row counts
are data).

Threads: a served model may be shared by host threads, each on its own CUDA stream. CUDA-graph
replays share their input and output buffers, so they are serialised (a lock on the host, an
event between the callers' streams on the device); captures use the thread-local capture mode,
so another thread's work cannot invalidate them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import sys
import threading
import time
import types
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from tabserve.buckets import Bucket, BucketGrid

from ..network.layers import SKIP_VALUE, AttentionBlock, load_kernels
from ..network.learning import HIERARCHY_LOG_EPS
from ..network.model import (
    TabICLv2,
    TabICLv2Cache,
    TabICLv2ReprCache,
    eager_host_checks,
    padded_counts,
)
from ..network.quantiles import quantile_stats
from ..network.stage_kernels import STAGES, use_stage_kernels
from . import aot
from .options import ServingOptions, describe, freezing, resolve_options, sdpa_context

#: Compiled variants one transformer block needs per bucket under regional compile (attention
#: with / without cached K/V, self-attention, CLS-only queries, ...), with margin.
REGIONAL_VARIANTS_PER_BUCKET = 16
#: Batch sizes (tables per call: ensemble members) one bucket is expected to see; the batch is a
#: shape too, so each is one more compiled graph per bucket.
BATCH_SIZES_PER_BUCKET = 4
#: CUDA graphs of KV-cached prediction kept per served model (each holds its cache alive).
MAX_CACHED_GRAPHS = 32
#: CUDA graphs of unpadded one-shot calls (``shape_graphs``) kept per served model, the least
#: recently replayed dropped first (their memory stays in the shared pool for later captures).
MAX_SHAPE_GRAPHS = 16

#: Held by a thread capturing a CUDA graph, and by the background warm-up for its whole run
#: (:func:`exclusive_captures`). A capture registers the process's CUDA generator and, without
#: a stream of its own, uses torch's one default capture stream: compiling on another thread
#: during a capture (Inductor's autotuning draws random inputs and synchronises) failed the
#: compile and invalidated the capture (H200, fresh estimators served while one compiled). A
#: warm-up releases it while it pauses for an estimator call, which waits for that
#: (:func:`_take_captures`); a thread that cannot take it serves the call uncaptured (the same
#: kernels) and captures later.
_CAPTURES = threading.RLock()
#: Set on a thread whose calls never capture (the background warm-ups): a capture outside the
#: caller's thread fails and is invalidated whenever the caller synchronises the whole device
#: meanwhile (``torch.cuda.synchronize()`` between two calls, as timing code does: "operation
#: not permitted when stream is capturing", H100, fresh estimators served while one compiled),
#: whatever the capture's error mode. Such a thread compiles and runs the graph's function; the
#: caller's next call of that shape captures it.
_NO_CAPTURES = threading.local()


#: The longest a call of a shape not captured yet waits for a running warm-up to pause and
#: release :data:`_CAPTURES` (it pauses at its next Python function call once an estimator call
#: is in progress); past it the call runs uncaptured, as it would beside a warm-up that cannot
#: pause (one timing its models).
CAPTURE_WAIT_S = 0.5


class _Foreground:
    """The estimator calls in progress and when the last one ended (what a background warm-up
    waits on, :mod:`.background`)."""

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._active = 0
        self._busy_since = self._last_end = time.monotonic()
        self._closing = False

    @contextlib.contextmanager
    def call(self):
        with self._changed:
            if not self._active:
                self._busy_since = time.monotonic()
            self._active += 1
        try:
            yield
        finally:
            with self._changed:
                self._active -= 1
                self._last_end = time.monotonic()
                self._changed.notify_all()

    def wait_until_quiet(self, quiet: float, limit: float) -> None:
        """Returns once no call has run for ``quiet`` seconds, after ``limit`` seconds, or at
        interpreter exit."""
        deadline = time.monotonic() + limit
        with self._changed:
            while not self._closing:
                now = time.monotonic()
                if now >= deadline:
                    return
                quiet_for = now - self._last_end
                if self._active == 0 and quiet_for >= quiet:
                    return
                wait = deadline - now if self._active else quiet - quiet_for
                self._changed.wait(min(wait, deadline - now))

    def wait_to_run(self, quiet: float, max_busy: float, defer_until: float) -> None:
        """Returns once no call has run for ``quiet`` seconds, once calls have been in progress
        without a break for ``max_busy`` seconds, at the ``time.monotonic()`` ``defer_until``
        while no call is in progress, or at interpreter exit."""
        with self._changed:
            while not self._closing:
                now = time.monotonic()
                if self._active:
                    left = self._busy_since + max_busy - now
                    if left <= 0:
                        return
                    self._changed.wait(left)
                    continue
                left = min(self._last_end + quiet, defer_until) - now
                if left <= 0:
                    return
                self._changed.wait(left)

    def close(self) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify_all()


_foreground = _Foreground()


def foreground():
    """``with foreground():`` marks an estimator call: background warm-ups pause for it
    (:mod:`.background`), and its captures wait for them to (:func:`_take_captures`)."""
    return _foreground.call()


def _take_captures() -> bool:
    """Takes :data:`_CAPTURES` for a capture: at once, or, while an estimator call is in
    progress (a warm-up holding it pauses then), within :data:`CAPTURE_WAIT_S`; False if not
    (the call runs uncaptured)."""
    if _CAPTURES.acquire(blocking=False):
        return True
    return _foreground._active > 0 and _CAPTURES.acquire(timeout=CAPTURE_WAIT_S)


def exclusive_captures():
    """``with exclusive_captures():`` no other thread captures a CUDA graph meanwhile (their
    calls run uncaptured); this thread's own captures go ahead."""
    return _CAPTURES


@contextlib.contextmanager
def without_captures(replay: bool = False):
    """``with without_captures():`` this thread's calls run their graphs' functions uncaptured
    (compiling them as a capture would), leaving the captures to the calling threads;
    ``replay=True``: a graph a calling thread has captured already is replayed (as that thread's
    next call would be), the others still run uncaptured."""
    before = getattr(_NO_CAPTURES, "active", False)
    _NO_CAPTURES.active = "replay" if replay else True
    try:
        yield
    finally:
        _NO_CAPTURES.active = before


def raise_recompile_limit(entries: int) -> None:
    """Lets every compiled code object hold at least ``entries`` graphs (Dynamo's per-frame
    ``recompile_limit``, default 8, and the global ``accumulated_recompile_limit``); never lowers
    them."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, entries)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, entries)


def own_code(fn):
    """``(callable, copy)``: ``fn`` (a function or a bound method) running ``copy``, a function
    over a private copy of its code object and globals, for :meth:`ServedTabICL._own`.

    A decorated function (the model's ``forward`` and ``forward_with_cache`` are
    ``torch.no_grad()``'s) is copied beneath its decorator and the copy decorated with
    ``torch.no_grad()`` again: Dynamo skips the decorator's frame, which is torch's, and compiles
    the frame beneath it, so that is the one that must be private.
    """
    func = getattr(fn, "__func__", fn)
    inner = inspect.unwrap(func)
    copy = types.FunctionType(
        inner.__code__.replace(), dict(inner.__globals__), inner.__name__, inner.__defaults__,
        inner.__closure__,
    )  # fmt: skip
    copy.__kwdefaults__ = inner.__kwdefaults__
    copy.__qualname__, copy.__doc__ = inner.__qualname__, inner.__doc__
    wrapped = torch.no_grad()(copy) if inner is not func else copy
    return (types.MethodType(wrapped, fn.__self__) if hasattr(fn, "__func__") else wrapped), copy


def _release_compiled(codes: list) -> None:
    """Drops what torch keeps of a collected served model's frozen graphs: Dynamo's caches of
    its own code objects (``codes``: each with its private globals and the names those held
    before anything compiled) and of the resume functions Dynamo made of them at graph breaks
    (the unpadded forward's host checks), the graphs Dynamo installed in those globals, and
    Inductor's references to the generated modules that hold frozen constants and that no
    graph uses any more."""
    if not codes:  # nothing frozen compiled: nothing to release (and no heap scan below)
        return
    from torch._dynamo.resume_execution import ContinueExecutionCache
    from torch._inductor.codecache import PyCodeCache

    while codes:
        code, namespace, names = codes.pop()
        resumed = ContinueExecutionCache.cache.get(code, {}).values()
        codes.extend((c, namespace, names) for c in resumed)
        torch._dynamo.reset_code(code)
        # What Dynamo installed in the private globals (the compiled graphs, resume functions),
        # dropped by value: the name stays, for the cleanup hook Dynamo registered on it, which
        # deletes it by key when the code object goes (torch 2.11 raises KeyError if it is gone).
        for name in namespace.keys() - names:
            namespace[name] = None
    # Inductor keeps every module it loaded with constants attached (frozen weights) in a list
    # it never prunes, and in sys.modules under the hash of its source. A compiled graph holds
    # its module's entry point, `call`: a module whose `call` only its own namespace refers to
    # serves no graph any more. (Where freezing packs weights for oneDNN, on CPUs with fp16
    # matrix units such as AMX, each model's source differs, so sys.modules would keep every
    # model's packed weights; elsewhere one source is shared and its entry replaced.)
    cached = set(map(id, PyCodeCache.modules_no_attr.values()))
    frozen = [m for m in PyCodeCache.modules if id(m) not in cached and "call" in vars(m)]
    if not frozen:
        return
    calls = {id(m.call): m for m in frozen}
    namespaces = {id(vars(m)) for m in frozen}
    used = set()
    for holder in gc.get_referrers(*(m.call for m in frozen)):
        if id(holder) not in namespaces:
            used.update(calls.keys() & set(map(id, gc.get_referents(holder))))
    # One removal at a time (each atomic): another thread's compile may append meanwhile. A
    # module forgotten while a graph still used it would only lose its file's purge: the graph
    # holds the module itself.
    for key, module in calls.items():
        if key not in used:
            with contextlib.suppress(ValueError):  # another release removed it first
                PyCodeCache.modules.remove(module)
            if sys.modules.get(module.__name__) is module:
                sys.modules.pop(module.__name__, None)


@dataclass
class PaddedCache(TabICLv2Cache):
    """A KV cache built on a padded train block (:meth:`ServedTabICL.build_cache`).

    ``col`` / ``icl`` have the bucket's shapes (``features`` columns, ``train_rows`` keys);
    ``n_train`` / ``n_features`` are the real counts, ``n_train_t`` / ``n_features_t`` the same
    as 0-d device tensors.
    """

    bucket: Bucket | None = None
    n_train_t: Tensor | None = None
    n_features_t: Tensor | None = None

    def to(self, device=None, dtype=None) -> PaddedCache:
        moved = super().to(device, dtype)
        return dataclasses.replace(
            moved, n_train_t=self.n_train_t.to(device), n_features_t=self.n_features_t.to(device)
        )


class _BucketGraph:
    """One CUDA graph of ``fn`` at fixed input buffers; inputs are copied in before a replay.

    Warmed up on a side stream (lazy initialisation must not be captured), captured into the
    shared ``pool``. ``static`` inputs are used in place (not copied): the KV cache.

    Captured at a key's first call. Where an estimator's predict called each key twice (a call
    per normalisation group), capturing at the second call instead ran one more pass and made a
    fresh process's first predict slower (H100, small table, ``medium``: 0.54 s against 0.40 s;
    DataFrame table 0.61 s against 0.48 s). A one-shot predict on a GPU calls each key once
    (its members span the groups), and fresh estimators of one shape share the served model
    and so its graphs; capturing at a later call is unmeasured there.
    """

    def __init__(self, fn, inputs: Sequence[Tensor], static: Sequence = (), pool=None):
        self.inputs = [t.clone() for t in inputs]
        self.static = static
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn(*self.inputs, *static)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: another host thread's CUDA calls (its eager work, its allocations) during
        # this capture neither fail nor invalidate it.
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.output = fn(*self.inputs, *static)

    def __call__(self, *inputs: Tensor) -> Tensor:
        for buffer, value in zip(self.inputs, inputs):
            buffer.copy_(value)
        self.graph.replay()
        return self.output


class _RecentGraphs(OrderedDict):
    """Captured graphs by key, at most ``limit``: :meth:`used` marks one as the most recently
    replayed and drops the least recently replayed past the limit."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def used(self, key) -> None:
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


class ServedTabICL:
    """A :class:`TabICLv2` served with :class:`ServingOptions` (see the module docstring).

    Args:
        model: the network; its stage modules get the options' kernel choices, and compiles
            happen in place (give each served instance its own model).
        options: a preset name (:func:`~.options.serving_presets`), a :class:`ServingOptions`,
            or None (``exact``: fp32 eager).
        grid: the bucket grid of bucketed options (default ``BucketGrid()``).

    Raises:
        ValueError for CUDA graphs on a model not on CUDA, or an unknown preset.
    """

    def __init__(self, model: TabICLv2, options=None, grid: BucketGrid | None = None):
        if grid is not None and not isinstance(grid, BucketGrid):
            raise TypeError(f"grid must be a BucketGrid or None, got {type(grid).__name__}")
        self.model = model
        self.options: ServingOptions = resolve_options(options)
        self.grid = grid or BucketGrid()
        self.device = model.icl_predictor.ln.weight.device
        if self.options.graphs and self.device.type != "cuda":
            raise ValueError(
                f"{describe(self.options)} captures CUDA graphs; the model is on {self.device}"
            )
        self.captures = 0
        self.uncaptured = 0  # calls served without their graph while another thread held _CAPTURES
        # Graph buffers are shared by every caller: one caller at a time copies in, replays and
        # copies out (host side), and each caller's stream waits for the previous caller's
        # replay (device side), so host threads on their own streams can share a served model.
        self._graph_lock = threading.Lock()
        self._graph_done: torch.cuda.Event | None = None
        self._graphs: dict = {}
        self._cached_graphs = _RecentGraphs(MAX_CACHED_GRAPHS)
        self._shape_graphs = _RecentGraphs(MAX_SHAPE_GRAPHS)
        self._hierarchy_graphs = _RecentGraphs(MAX_SHAPE_GRAPHS)
        self._pool = torch.cuda.graph_pool_handle() if self.options.graphs else None
        # Ahead-of-time bucket packages (load_buckets): kind -> {(bucket, batch): runner}.
        self._aot: dict = {"forward": {}, "build_cache": {}, "forward_cached": {}}
        self.aot_calls = 0
        self._own_codes: list = []  # see _own
        weakref.finalize(self, _release_compiled, self._own_codes).atexit = False
        if self.options.triton_kernels:
            load_kernels()
        if self.options.compiled:
            eager_host_checks()
        for stage, module in STAGES.items():
            use_stage_kernels(getattr(model, module), self.options.stage_kernels(stage))
        self._pin_stage_attention()
        self._forward, self._build_cache, self._forward_cached = self._core_callables()
        self._unpadded_forward_cached = self._unpadded_cached_callable()
        self._raw_forward_cached = (
            self._graph_core(model.forward_cached_raw) if self.options.kv_graphs else None
        )
        self._raw_forward = (
            self._graph_core(_one_shot_core(model)) if self.options.shape_graphs else None
        )

    # ------------------------------------------------------------------ options -> callables
    def _compile_options(self) -> dict:
        mode = self.options.compile
        return {
            # The unpadded model's forward checks its inputs on the host (graph breaks); the
            # padded cores and the blocks have no host work.
            "fullgraph": self.options.buckets or mode == "regional",
            # Buckets: static shapes. Unpadded: Dynamo's default (static, then dynamic at the
            # first new shape) unless the options ask for dynamic shapes from the start.
            "dynamic": False if self.options.buckets else (True if self.options.dynamic else None),
            "mode": None if mode in ("default", "regional") else mode,
            "backend": self.options.compile_backend,
        }

    def _own(self, fn):
        """``fn`` on a code object of this served model's own, under freezing (else ``fn``).

        Dynamo keeps what it compiles in a cache on the code object of the frame it compiled
        (freed only with that code object, which its entries keep alive) and in the globals of
        that frame; Inductor keeps each module it generated with constants. Frozen graphs hold
        one model's weights as constants and guard on that model, so they can serve no other:
        on the code and globals every served model shares, each model built and dropped (the
        estimators' model cache builds and evicts them) left its graphs and weights behind for
        the life of the process (a tiny model on CPU: 1.5 MB per model; on the H200 the
        estimator soak's allocated memory grew at every window, 58-132 MiB per 500 fits).
        What compiled on private copies is released when this served model is collected
        (:func:`_release_compiled`).
        """
        if not self.options.freeze:
            return fn
        own, copy = own_code(fn)
        self._own_codes.append((copy.__code__, copy.__globals__, frozenset(copy.__globals__)))
        return own

    def _compile(self, fn, **changes):
        """``torch.compile(fn)`` with the options' settings (and ``changes``), on a code object
        of its own under freezing (:meth:`_own`)."""
        return torch.compile(self._own(fn), **{**self._compile_options(), **changes})

    def _unpadded_cached_callable(self):
        """The KV-cached prediction of unpadded caches: compiled like the model under a
        whole-model compile (its own frame: the model's compile covers ``forward`` only)."""
        forward_cached = self.model.forward_with_cache
        if self.options.compile in ("none", "regional"):
            return forward_cached
        return self._compile(forward_cached)

    def _core_callables(self):
        model, options = self.model, self.options
        cores = (model.padded_forward, model.padded_build_cache, model.padded_forward_cached)
        if options.compile == "regional":
            buckets = len(self.grid.buckets()) if options.buckets else 8
            raise_recompile_limit(REGIONAL_VARIANTS_PER_BUCKET * BATCH_SIZES_PER_BUCKET * buckets)
            own = {}  # under freezing: one code object of this model's per block class
            for block in model.modules():
                if not isinstance(block, AttentionBlock):
                    continue
                if options.freeze:
                    kind = type(block)
                    if kind not in own:
                        own[kind] = self._own(kind.forward)
                    block.forward = torch.compile(
                        types.MethodType(own[kind], block), **self._compile_options()
                    )
                else:
                    block.compile(**self._compile_options())
        elif options.compiled:
            if options.buckets:
                raise_recompile_limit(BATCH_SIZES_PER_BUCKET * len(self.grid.buckets()))
                cores = tuple(self._compile(fn) for fn in cores)
            elif options.freeze:  # the model's compile would use the shared Module._call_impl
                model.forward = self._compile(model.forward)
            else:
                model.compile(**self._compile_options())
        return cores

    def _graph_core(self, core):
        """What ``kv_graphs`` / ``shape_graphs`` capture (``core``: the model's
        :meth:`TabICLv2.forward_cached_raw` / :meth:`TabICLv2.forward_raw`), compiled like the
        served model (static shapes: one graph per cache shape and test bucket, or per table
        shape; under regional compile its blocks are compiled already)."""
        if not self.options.compiled or self.options.compile == "regional":
            return core
        raise_recompile_limit(MAX_CACHED_GRAPHS + MAX_SHAPE_GRAPHS)
        return self._compile(core, fullgraph=True, dynamic=False)

    def _pin_stage_attention(self) -> None:
        """Per-stage SDPA backends: each stage module runs under its ``sdpa_kernel``, and its
        padded attention uses the matching ``prefix_attention`` kernel."""
        for stage, backend in self.options.attention.items():
            module = getattr(self.model, STAGES[stage])
            for name in ("forward", "build_cache", "forward_cached", "hierarchical_probs"):
                method = getattr(module, name, None)
                if method is None:
                    continue

                @functools.wraps(method)
                def pinned(*args, __method=method, __backend=backend, **kwargs):
                    with sdpa_context(__backend):
                        return __method(*args, **kwargs)

                setattr(module, name, pinned)

    def _run(
        self, key, fn, inputs: Sequence[Tensor], static: Sequence = (), graphed=None, store=None
    ):
        """``fn(*inputs, *static)``, replayed from a per-``key`` CUDA graph with CUDA graphs
        (``graphed``: whether to; default the options' ``cuda_graphs``).

        ``key`` must pin every input shape (bucket and batch size). A replay's outputs are the
        graph's own buffers, overwritten by the next replay: they are returned as copies.
        ``store``: the graphs' dictionary (default: the buckets' graphs, or the cached
        predictions' with ``static`` inputs); all but the buckets' keep their
        :data:`MAX_CACHED_GRAPHS` / :data:`MAX_SHAPE_GRAPHS` most recently replayed graphs.
        """
        if not (self.options.cuda_graphs if graphed is None else graphed):
            return fn(*inputs, *static)
        no_captures = getattr(_NO_CAPTURES, "active", False)
        graphs = store if store is not None else self._cached_graphs if static else self._graphs
        if no_captures and not (no_captures == "replay" and key in graphs):
            # Outside the graphs' lock: a background warm-up compiles here for tens of seconds
            # (25-155 s on the H200), and a caller's replay of a shape already captured must not
            # wait for it.
            with freezing(self.options.freeze):
                return fn(*inputs, *static)
        with self._graph_lock:
            on_cuda = self.device.type == "cuda"  # (a CPU stand-in replays in the tests)
            stream = torch.cuda.current_stream(self.device) if on_cuda else None
            if stream is not None and self._graph_done is not None:
                stream.wait_event(self._graph_done)
            graph = graphs.get(key)
            if graph is None and no_captures:  # evicted meanwhile: uncaptured, as above
                return fn(*inputs, *static)
            if graph is None:
                with freezing(self.options.freeze):  # the capture is where compiled cores trace
                    if not _take_captures():  # see _CAPTURES
                        self.uncaptured += 1
                        return fn(*inputs, *static)
                    try:
                        graph = _BucketGraph(fn, inputs, static, self._pool)
                    finally:
                        _CAPTURES.release()
                graphs[key] = graph
                self.captures += 1
            if isinstance(graphs, _RecentGraphs):
                graphs.used(key)
            outputs = tree_map(torch.clone, graph(*inputs))
            if stream is not None:
                self._graph_done = torch.cuda.Event()
                self._graph_done.record(stream)
            return outputs

    # ------------------------------------------------------------------ model API
    @property
    def config(self):
        return self.model.config

    @property
    def is_regressor(self) -> bool:
        return self.model.is_regressor

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def _finish(self, raw: Tensor, num_classes: int, return_logits: bool, temperature: float):
        if self.is_regressor:
            return raw
        return self.model.classify(raw, num_classes, return_logits, temperature)

    @torch.no_grad()
    def forward(
        self,
        X: Tensor,
        y_train: Tensor,
        return_logits: bool = True,
        softmax_temperature: float = 0.9,
    ) -> Tensor:
        """As :meth:`TabICLv2.forward` (same checks, same output), served with the options."""
        model = self.model
        if self.options.shape_graphs:
            return self._graphed_forward(X, y_train, return_logits, softmax_temperature)
        if not self.options.buckets:
            with self.options.context(self.device):
                return model(X, y_train, return_logits, softmax_temperature)
        X, num_classes = model.check_inputs(X, y_train)
        y_train = y_train.to(X.dtype)
        n_train, n_features = y_train.shape[1], X.shape[2]
        n_test = X.shape[1] - n_train
        if n_test == 0:
            return model.no_predictions(X, num_classes)
        chunks = self.grid.plan(n_train, n_test, n_features)
        if chunks[0].bucket is None:  # past the grid: unpadded
            with self.options.context(self.device):
                return model(X, y_train, return_logits, softmax_temperature)
        counts = padded_counts(X.device, n_train, n_features)
        with self.options.context(self.device):
            if num_classes > self.config.max_classes:
                return self._many_classes(
                    X,
                    y_train,
                    counts,
                    chunks[0].bucket,
                    num_classes,
                    return_logits,
                    softmax_temperature,
                )
            outputs = []
            for chunk in chunks:
                table = X if len(chunks) == 1 else _train_and_test(X, n_train, chunk)
                padded, labels = self._pad(table, y_train, chunk.bucket)
                key = (chunk.bucket, padded.shape[0])
                forward = self._packaged("forward", key, self._forward)
                raw = self._run(key, forward, (padded, labels, *counts))
                outputs.append(raw[:, : chunk.stop - chunk.start])
        return self._finish(torch.cat(outputs, 1), num_classes, return_logits, softmax_temperature)

    def _graphed_forward(self, X, y_train, return_logits, softmax_temperature):
        """``shape_graphs``: the unpadded table's one-shot call, its test rows padded onto the
        grid's test-row buckets (split past the largest), each chunk replayed from the CUDA
        graph of its (tables, train rows, test bucket, features); the train rows and features
        stay as they are. Where every chunk's graph exists, the checks are queued before the
        replays and read after them, as :meth:`TabICLv2.forward`'s; a shape still to capture
        reads them first (so no table that raises, nor one of more classes than one output
        holds, leaves a graph behind)."""
        model = self.model
        given = model.check_table_shape(X, "X")
        model.check_label_shape(given, y_train)
        n_train = y_train.shape[1]
        captured = given.shape[1] > n_train and all(
            key in self._shape_graphs for key, _ in self._shape_chunks(given, n_train)
        )
        queued = model.queue_checks(given, y_train) if captured else None
        if queued is not None:
            raw = self._replay_shape_graphs(queued[0], queued[1])
            num_classes = model.settle_checks(given, y_train, queued[2])
            if num_classes <= self.config.max_classes:
                return self._finish(raw, num_classes, return_logits, softmax_temperature)
        X, num_classes = model.check_inputs(given, y_train)
        if X.shape[1] == y_train.shape[1]:
            return model.no_predictions(X, num_classes)
        if num_classes > self.config.max_classes:  # the class hierarchy: not capturable
            with self.options.context(self.device):
                return model(X, y_train, return_logits, softmax_temperature)
        raw = self._replay_shape_graphs(X, y_train.to(X.dtype))
        return self._finish(raw, num_classes, return_logits, softmax_temperature)

    def _replay_shape_graphs(self, X: Tensor, y_train: Tensor) -> Tensor:
        """The raw output of ``X``'s test rows (``y_train`` in X's dtype), chunk by chunk."""
        n_train, n_features = y_train.shape[1], X.shape[2]
        outputs = []
        with self.options.context(self.device):
            for key, chunk in self._shape_chunks(X, n_train):
                rows = chunk.bucket.test_rows
                test = X[:, n_train + chunk.start : n_train + chunk.stop]
                raw = self._run(
                    key,
                    self._raw_forward,
                    (X[:, :n_train], _pad_test(test, rows, n_features), y_train),
                    graphed=True,
                    store=self._shape_graphs,
                )
                outputs.append(raw[:, : chunk.stop - chunk.start])
        return torch.cat(outputs, 1)

    def _shape_chunks(self, X: Tensor, n_train: int) -> list:
        """``(graph key, chunk)`` of each test-row chunk of ``X``: its rows on the grid's
        test-row buckets (split past the largest), the key (tables, train rows, test bucket,
        features)."""
        plan = self.grid.plan(1, X.shape[1] - n_train, 1)  # test-row buckets only
        return [((X.shape[0], n_train, c.bucket.test_rows, X.shape[2]), c) for c in plan]

    def _pad(self, X: Tensor, y_train: Tensor, bucket: Bucket) -> tuple[Tensor, Tensor]:
        from tabserve import ops

        padded = ops.pad_to_bucket(
            X, y_train.shape[1], bucket.train_rows, bucket.test_rows, bucket.features, SKIP_VALUE
        )
        # Contiguous: strides are guarded like shapes (a table already on its bucket comes back
        # as it was given).
        return padded.contiguous(), ops.pad_labels(y_train, bucket.train_rows).contiguous()

    def _many_classes(self, X, y_train, counts, bucket, num_classes, return_logits, temperature):
        """Padded column and row stages (a CUDA graph with ``cuda_graphs``), then the class
        hierarchy on the real rows (eager: its tree's row counts are data)."""
        n_train, n_test = y_train.shape[1], X.shape[1] - y_train.shape[1]
        padded, labels = self._pad(X, y_train, bucket)
        # Eager, the column and row stages are most of a many-class call's kernel launches:
        # replayed from a graph per (bucket, tables, classes), as the buckets' own.
        represent = functools.partial(self.model.padded_representations, num_classes=num_classes)
        key = (bucket, padded.shape[0], num_classes)
        R = self._run(key, represent, (padded, labels, *counts), store=self._hierarchy_graphs)
        R = torch.cat([R[:, :n_train], R[:, bucket.train_rows : bucket.train_rows + n_test]], dim=1)
        probs = self.model.icl_predictor.hierarchical_probs(R, y_train)
        return temperature * torch.log(probs + HIERARCHY_LOG_EPS) if return_logits else probs

    @torch.no_grad()
    def forward_offloaded(self, X, y_train, store, return_logits=True, softmax_temperature=0.9):
        """As :meth:`TabICLv2.forward_offloaded`, under the options' precision, unpadded and
        uncompiled: a call that needs the column stage off the device is one large table."""
        with self.options.context(self.device):
            return self.model.forward_offloaded(
                X, y_train, store, return_logits, softmax_temperature
            )

    @torch.no_grad()
    def padded_forward(self, X, y_train, n_train, n_features):
        """As :meth:`TabICLv2.padded_forward`, under the options' precision, uncompiled and
        uncaptured: its callers pack tables of many sizes, whose batch and bucket rarely
        recur."""
        with self.options.context(self.device):
            return self.model.padded_forward(X, y_train, n_train, n_features)

    @torch.no_grad()
    def predict_stats(self, X, y_train, output_type="mean", alphas=None):
        """As :meth:`TabICLv2.predict_stats`."""
        self.model.require_regressor()
        return quantile_stats(self(X, y_train), output_type, alphas)

    # ------------------------------------------------------------------ KV cache
    @torch.no_grad()
    def build_cache(self, X_train: Tensor, y_train: Tensor, mode: str = "kv"):
        """As :meth:`TabICLv2.build_cache`; bucketed options return a :class:`PaddedCache` on the
        train-row and feature buckets (a plain cache past the grid). ``mode="repr"``: the
        model's representation cache, built and read under the options' precision (unpadded,
        no graphs)."""
        model = self.model
        if mode != "kv" or not self.options.buckets:
            with self.options.context(self.device):
                return model.build_cache(X_train, y_train, mode)
        if not self.options.buckets:
            with self.options.context(self.device):
                return model.build_cache(X_train, y_train)
        X_train, num_classes = model.check_inputs(X_train, y_train, "X_train")
        n_train, n_features = X_train.shape[1], X_train.shape[2]
        if y_train.shape[1] != n_train or num_classes > self.config.max_classes:
            return model.build_cache(X_train, y_train)  # raises the model's error
        bucket = self.grid.bucket_for(n_train, 0, n_features)
        if bucket is None:  # past the grid: unpadded
            with self.options.context(self.device):
                return model.build_cache(X_train, y_train)
        bucket = Bucket(bucket.train_rows, 0, bucket.features)
        padded, labels = self._pad(X_train, y_train.to(X_train.dtype), bucket)
        counts = padded_counts(X_train.device, n_train, n_features)
        with self.options.context(self.device):
            build = self._packaged("build_cache", (bucket, padded.shape[0]), self._build_cache)
            key = ("cache", bucket, padded.shape[0])
            col, icl = self._run(key, build, (padded, labels, *counts))
        return PaddedCache(col, icl, n_train, n_features, num_classes, bucket, *counts)

    @torch.no_grad()
    def forward_with_cache(
        self,
        X_test: Tensor,
        cache: TabICLv2Cache,
        return_logits: bool = True,
        softmax_temperature: float = 0.9,
    ) -> Tensor:
        """As :meth:`TabICLv2.forward_with_cache`, for plain, padded and representation
        caches."""
        model = self.model
        if isinstance(cache, TabICLv2ReprCache):
            with self.options.context(self.device):
                return model.forward_with_cache(X_test, cache, return_logits, softmax_temperature)
        if not isinstance(cache, PaddedCache):
            if self.options.kv_graphs:
                return self._graphed_forward_cached(
                    X_test, cache, return_logits, softmax_temperature
                )
            with self.options.context(self.device):
                return self._unpadded_forward_cached(
                    X_test, cache, return_logits, softmax_temperature
                )
        X_test, finite = model.check_test_rows_later(X_test, cache)  # read after the replays
        bucket = cache.bucket
        chunks = self.grid.plan(cache.n_train, X_test.shape[1], cache.n_features)
        outputs = []
        with self.options.context(self.device):
            for chunk in chunks:
                test_bucket = chunk.bucket.test_rows if chunk.bucket else X_test.shape[1]
                key = (test_bucket, *_storage_key(cache))
                table = _pad_test(X_test[:, chunk.start : chunk.stop], test_bucket, bucket.features)
                full = Bucket(bucket.train_rows, test_bucket, bucket.features)
                forward = self._packaged(
                    "forward_cached", (full, table.shape[0]), self._forward_cached
                )
                raw = self._run(
                    key,
                    forward,
                    (table,),
                    (cache.col, cache.icl, cache.n_train_t, cache.n_features_t),
                )
                outputs.append(raw[:, : chunk.stop - chunk.start])
        out = self._finish(
            torch.cat(outputs, 1), cache.num_classes, return_logits, softmax_temperature
        )
        model.raise_unless_all_finite(finite, "X_test")
        return out

    def _graphed_forward_cached(self, X_test, cache, return_logits, softmax_temperature):
        """``kv_graphs``: an unpadded cache's prediction, its test rows padded onto the grid's
        test-row buckets (split past the largest), each chunk replayed from the CUDA graph of
        its (cache, test bucket); the train rows and features stay as they are."""
        model = self.model
        X_test, finite = model.check_test_rows_later(X_test, cache)  # read after the replays
        if X_test.shape[1] == 0:
            model.raise_unless_all_finite(finite, "X_test")
            return model.no_predictions(X_test, cache.num_classes)
        outputs = []
        with self.options.context(self.device):
            for chunk in self.grid.plan(1, X_test.shape[1], 1):  # test-row buckets only
                rows = chunk.bucket.test_rows
                table = _pad_test(X_test[:, chunk.start : chunk.stop], rows, cache.n_features)
                key = ("unpadded cache", rows, *_storage_key(cache))
                raw = self._run(
                    key, self._raw_forward_cached, (table,), (cache.col, cache.icl), graphed=True
                )
                outputs.append(raw[:, : chunk.stop - chunk.start])
        out = self._finish(
            torch.cat(outputs, 1), cache.num_classes, return_logits, softmax_temperature
        )
        model.raise_unless_all_finite(finite, "X_test")
        return out

    @torch.no_grad()
    def predict_stats_with_cache(self, X_test, cache, output_type="mean", alphas=None):
        """As :meth:`TabICLv2.predict_stats_with_cache`."""
        self.model.require_regressor()
        return quantile_stats(self.forward_with_cache(X_test, cache), output_type, alphas)

    # ------------------------------------------------------------------ warm-up
    @torch.no_grad()
    def warm_up(
        self, buckets: Sequence[Bucket] | None = None, tables: int = 1, kv_cache: bool = False
    ) -> int:
        """Runs (compiles / captures) each bucket once on random data with ``tables`` tables
        (the batch is a shape too: use the serving batch, e.g. the estimator's members per call)
        and 2 classes (random targets for regression); with ``kv_cache`` also builds a cache on
        the bucket and predicts from it. Returns the number of buckets warmed."""
        buckets = self.grid.buckets() if buckets is None else buckets
        generator = torch.Generator().manual_seed(0)
        for bucket in buckets:
            rows = bucket.train_rows + bucket.test_rows
            X = torch.randn(tables, rows, bucket.features, generator=generator).to(self.device)
            y = torch.arange(bucket.train_rows).remainder(2).float().repeat(tables, 1)
            if self.is_regressor:
                y = torch.randn(tables, bucket.train_rows, generator=generator)
            y = y.to(self.device)
            self.forward(X, y)
            if kv_cache:
                cache = self.build_cache(X[:, : bucket.train_rows], y)
                self.forward_with_cache(X[:, bucket.train_rows :], cache)
        return len(buckets)

    def export_buckets(
        self, directory, buckets: Sequence[Bucket], tables: int = 1, kv_cache: bool = False
    ) -> dict:
        """Compiles the one-shot forward of each of ``buckets`` for batches of ``tables`` tables
        ahead of time (AOTInductor) into ``directory`` and returns the manifest
        (:mod:`tabserve.models.tabicl.serving.aot`); with ``kv_cache`` also the bucket's cache build and
        cached forward. About half a minute (CPU, tiny model) to minutes per package: export the
        buckets your tables use (``grid.plan(...)`` of the expected shapes), not a whole default
        grid (tens of thousands of buckets)."""
        self._require_buckets("export_buckets")
        return aot.export(self, directory, buckets, tables, kv_cache)

    def load_buckets(self, directory) -> int:
        """Loads the bucket packages of ``directory`` (made by :meth:`export_buckets` for this
        options, grid and environment): tables of those buckets and batch sizes then run the
        packages, with no tracing or compiling. Returns how many were loaded. Load only
        directories your own deployment wrote: packages are compiled code."""
        self._require_buckets("load_buckets")
        runners = aot.load(self, directory)
        for kind, loaded in runners.items():
            self._aot[kind].update(loaded)
        with self._graph_lock:  # graphs captured before the packages came would keep replaying
            for key in runners["forward"]:
                self._graphs.pop(key, None)
            for key in runners["build_cache"]:
                self._graphs.pop(("cache", *key), None)
            self._cached_graphs.clear()
        return sum(len(loaded) for loaded in runners.values())

    def _packaged(self, kind: str, key: tuple, fallback):
        """The loaded package of ``kind`` for ``key`` = (bucket, batch), else ``fallback``."""
        runner = self._aot[kind].get(key)
        if runner is None:
            return fallback
        self.aot_calls += 1
        return runner

    def _require_buckets(self, what: str) -> None:
        if not self.options.buckets:
            raise ValueError(f"{what}: {describe(self.options)} does not pad onto buckets")

    def save_compile_cache(self, path) -> dict:
        """Saves this process's compile-cache artifacts (call it after :meth:`warm_up`), tagged
        with the options and the grid (:func:`tabserve.compile_cache.save`)."""
        from tabserve import compile_cache

        return compile_cache.save(
            path, options=self.options.to_dict(), grid=dataclasses.asdict(self.grid)
        )

    @staticmethod
    def load_compile_cache(path) -> dict:
        """Loads artifacts saved by :meth:`save_compile_cache` (in a restarted process, before
        the first call or :meth:`warm_up`); returns the file's header. Load only files your own
        deployment wrote: artifacts are code (:mod:`tabserve.compile_cache`)."""
        from tabserve import compile_cache

        return compile_cache.load(path)


def _one_shot_core(model: TabICLv2):
    """:meth:`TabICLv2.forward_raw` of a table given as its train rows and its (padded) test
    rows: what a ``shape_graphs`` graph captures (the rows are joined inside it)."""

    def one_shot(X_train: Tensor, X_test: Tensor, y_train: Tensor) -> Tensor:
        return model.forward_raw(torch.cat([X_train, X_test], dim=1), y_train)

    return one_shot


def _train_and_test(X: Tensor, n_train: int, chunk) -> Tensor:
    return torch.cat([X[:, :n_train], X[:, n_train + chunk.start : n_train + chunk.stop]], dim=1)


def _pad_test(X_test: Tensor, test_rows: int, features: int) -> Tensor:
    from tabserve import ops

    return ops.pad_to_bucket(X_test, 0, 0, test_rows, features, SKIP_VALUE).contiguous()


def _storage_key(cache: TabICLv2Cache) -> tuple:
    """Identifies the memory a cache lives in (a captured graph reads it in place)."""
    tensors = [t for kv in cache.col + cache.icl for t in kv]
    return tuple((t.data_ptr(), tuple(t.shape), t.stride()) for t in tensors)


def serve(model: TabICLv2, options=None, grid: BucketGrid | None = None) -> ServedTabICL:
    """``model`` served with ``options`` (a preset name, a :class:`ServingOptions` or None:
    ``exact``): every configuration runs through :class:`ServedTabICL`."""
    return ServedTabICL(model, options, grid)
