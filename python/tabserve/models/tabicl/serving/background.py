"""Serving at once, compiling in the background.

A compiled preset's first call of a shape compiles (Dynamo, Inductor, autotuning) and captures
its CUDA graphs: 25-155 s on the H200 for the fastest presets, a wait no first answer should
have. :class:`CompilingTabICL` pairs the compiled served model (``target``) with one that
compiles nothing (``ready``, the :data:`READY_PRESET`): each kind of call (entry point and
input shapes) is served by ``ready`` until a background thread has run the same call on
``target``, with copies of the inputs, and found it faster; from then on ``target`` serves it.

What is compiled, and when: a kind of call is queued for a warm-up once it has recurred
(:data:`COMPILE_AFTER_CALLS` calls) and its calls have taken :data:`COMPILE_AFTER_MS` on
``ready`` in all (a shape that never recurs, a one-off script's, is never compiled, nor is one
of a stream of varied small tables, whose compiles would cost minutes to save milliseconds),
except a KV-cache build, queued at once (the predictions that follow it recur by design). At
most :data:`MAX_QUEUED` warm-ups wait at once: a recurring call that finds the queue full is
queued at a later call. A warm-up then times both
served models on its inputs (:data:`PAY_RUNS` calls each, interleaved) and ``target`` takes the
call over only if it answered faster: a call is never moved to a slower model. A call whose
warm-up failed stays on ``ready`` (with a warning), as does one whose compiled model did not
pay: the answer is never lost to a compile.

Packed calls (many tables padded together: :meth:`CompilingTabICL.padded_forward`) are one kind
of call whatever their shapes: nothing is compiled for them, but once they have recurred and
taken their time a warm-up builds ``packs``, ``ready``'s options with tabserve's fused Triton
kernels (:func:`~.options.packs_options`), its kernels compiled in child processes (in this
process Triton's native passes keep the interpreter lock, and its Python pauses for the calls: a
compile took twice as long there), and it answers them if it was faster; a pack that would
compile a kernel in the caller's thread is refused before launching and answered by ``ready``.

A KV cache (:class:`TieredCache`) is built by ``ready`` at once and by ``target`` in the
background (its warm-up keeps what it built); a prediction against it runs on ``target`` once
``target`` has both its cache and a warm-up of that prediction's shapes, on ``ready`` until then.

One worker thread per process runs the warm-ups in order, on its own CUDA stream. A warm-up
compiles and runs its call without capturing CUDA graphs (``served.without_captures``): the
caller's thread captures them at its next call of that kind, so a ``torch.cuda.synchronize()``
of the caller's between two calls never meets a capture of ours. While a warm-up runs, no other
thread captures a CUDA graph (``served.exclusive_captures``: Inductor's autotuning synchronises)
except while it is paused (below): a call of a shape not captured yet waits for that pause
(``served.CAPTURE_WAIT_S`` at most) and captures, else it is served uncaptured and captured at a
later call. (Served uncaptured until the warm-ups ended, a loop of fresh estimators on an H100
answered 7.5 tables/s; waiting for the pause, 31.)
Compiling is mostly Python, which shares the interpreter lock with the caller's thread: a
Python-busy thread beside a model call made the call 21x slower (1,670 ms against 79.5 ms, the
tiny model on a 2-core CPU, CPython's 5 ms switch interval), and a loop of fresh estimators on an
H100 fell from 29 to 2 tables/s while compiles ran. So a warm-up runs only in quiet moments,
once no estimator call (:func:`foreground`) has run for :data:`QUIET_S`: it starts in one, and
once started it pauses at its next Python function call whenever it is not in one, until the
next (:func:`_pause_for_callers`), the graph-capture lock released meanwhile. An estimator call
never shares the interpreter with a compile (the same call beside a Python-busy warm-up: 82.2 ms,
alone 84.7 ms), nor does the caller's own Python between calls (pausing only during calls, a loop
of fresh estimators on an H100 answered 21 tables/s beside unfinished compiles, against 31 before
them). Two bounds: calls that never leave a quiet moment for :data:`MAX_DEFER_S` let the warm-up
run in the gaps between them, and calls in progress without a break for :data:`MAX_PAUSE_S` let
it run beside them (a call waiting on something the warm-up holds would otherwise wait for
ever). The pause is a trace function on the warm-up's thread, which makes compiles about half
as long again (tiny model, ``aot_eager``, 2-core CPU: 4.0 s against 2.7 s): they run in the
background, and only calls that recur and take their time are compiled.
:func:`wait_for_compiles` waits until the worker is idle (benchmarks use it to time the steady
state).
At interpreter exit a warm-up still running is interrupted, so a short script that fitted and
predicted once exits at once rather than after its compile.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import queue
import sys
import threading
import time
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from .options import describe
from .served import (  # noqa: F401  (foreground: the estimators' import)
    _CAPTURES,
    _foreground,
    exclusive_captures,
    foreground,
    without_captures,
)

#: What serves while a compiled preset compiles: fp16 on padded buckets replayed from CUDA
#: graphs, nothing compiled (its captures take milliseconds per bucket).
READY_PRESET = "medium"
#: Device types where the fused operators launch Triton kernels (elsewhere they run their
#: composites: nothing to compile).
TRITON_DEVICE_TYPES = ("cuda",)
#: The call of a kind (entry point and shapes) at which its warm-up may be queued at the
#: earliest ...
COMPILE_AFTER_CALLS = 2
#: ... once its calls have taken this many milliseconds on ``ready`` in all (on the device's
#: stream: CUDA events). A compile costs minutes of background work (25-155 s a kind on the
#: H200) and saves at most part of each later call: a loop of fresh estimators over 60 varied
#: small tables on an H100 (calls of 10-30 ms, each kind recurring a few times) queued compiles
#: that had not finished after 100 s and answered 21 tables/s beside them, against 31 before.
COMPILE_AFTER_MS = 1000.0
#: Warm-ups queued or running at once in the process.
MAX_QUEUED = 4
#: Timed calls of each served model that decide whether ``target`` takes a call over (0: it
#: does whenever its warm-up succeeded).
PAY_RUNS = 3
#: The signature of every packed call (one kind, whatever its shapes: see
#: :meth:`CompilingTabICL.padded_forward`).
PACKED = ("padded_forward",)
#: Seconds the interpreter's exit waits for an interrupted warm-up to unwind.
EXIT_WAIT_S = 5.0
#: A warm-up runs once no estimator call has run for this many seconds (a quiet moment) ...
QUIET_S = 0.25
#: ... or, where calls leave no quiet moment, this many seconds after it began to wait for one
#: (then it runs in the gaps between calls).
MAX_DEFER_S = 10.0
#: The longest a warm-up waits while calls are in progress without a break (then it runs beside
#: them): a call that waited on something the paused warm-up held would otherwise wait for ever.
MAX_PAUSE_S = 10.0


class _WarmUpInterrupted(BaseException):
    """Raised inside the worker at interpreter exit (BaseException: compilers catch Exception)."""


#: Per thread: whether a warm-up may pause here (no lock an estimator call needs is held).
_PAUSING = threading.local()
#: When the warm-up began to wait for a quiet moment (None: it ran in one since).
_deferred: list = [None]


def _pause_for_callers(frame, event, arg):
    """The warm-up thread's trace function (called at each Python function call): it goes on in
    a quiet moment (no estimator call for :data:`QUIET_S`); else it waits for one, the
    graph-capture lock released meanwhile (the warm-up issues no GPU work while it waits, and
    takes the lock back before it goes on). Two bounds: calls in progress without a break for
    :data:`MAX_PAUSE_S` (one waiting on something the warm-up holds would wait for ever), and
    :data:`MAX_DEFER_S` of calls that never leave a quiet moment, after which it runs in the gaps
    between them."""
    if getattr(_PAUSING, "off", 0):
        return None
    calls, now = _foreground, time.monotonic()
    if not calls._active and now - calls._last_end >= QUIET_S:
        _deferred[0] = None
        return None
    if calls._active and now - calls._busy_since > MAX_PAUSE_S:
        return None  # a call that lasts past the bound: run beside it
    if _deferred[0] is None:
        _deferred[0] = now
    if not calls._active and now - _deferred[0] > MAX_DEFER_S:
        return None  # calls that never leave a quiet moment: run in their gaps
    held = _CAPTURES._is_owned()  # threading.Condition's own use of the RLock's private API
    state = _CAPTURES._release_save() if held else None
    try:
        calls.wait_to_run(QUIET_S, MAX_PAUSE_S, _deferred[0] + MAX_DEFER_S)
    finally:
        if held:
            _CAPTURES._acquire_restore(state)
    return None


@contextlib.contextmanager
def no_pause():
    """``with no_pause():`` the warm-up on this thread does not pause inside (it holds a lock
    that estimator calls take)."""
    _PAUSING.off = getattr(_PAUSING, "off", 0) + 1
    try:
        yield
    finally:
        _PAUSING.off -= 1


class _Worker:
    """The process's warm-up thread: a queue of jobs, run one at a time, in submission order."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._closing = False

    def submit(self, job) -> bool:
        with self._lock:
            if self._closing:
                return False
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="tabserve-compile", daemon=True
                )
                self._thread.start()
        self._jobs.put(job)
        return True

    def _loop(self) -> None:
        try:
            while True:
                job = self._jobs.get()
                try:
                    _foreground.wait_until_quiet(QUIET_S, MAX_DEFER_S)
                    if not self._closing:
                        sys.settrace(_pause_for_callers)
                        try:
                            job()
                        finally:
                            sys.settrace(None)
                            _deferred[0] = None
                finally:
                    with self._lock:
                        self._pending -= 1
                        self._idle.notify_all()
        except _WarmUpInterrupted:  # interpreter exit (close)
            return

    def pending(self) -> int:
        with self._lock:
            return self._pending

    def wait(self, timeout: float | None) -> bool:
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        with self._lock:
            self._closing = True
            thread, busy = self._thread, self._pending > 0
        _foreground.close()  # a worker waiting for a pause goes on (to skip its jobs) at once
        if thread is None or not busy or not thread.is_alive():
            return
        # The exception is raised at the worker's next Python instruction: compiling is mostly
        # Python, so the warm-up unwinds well before the interpreter stops daemon threads (a
        # thread stopped there inside native code can abort the process).
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(_WarmUpInterrupted)
        )
        thread.join(EXIT_WAIT_S)


_worker = _Worker()
atexit.register(_worker.close)
#: The clock the warm-ups time both served models with (seconds).
_clock = time.perf_counter


def background_compiles() -> int:
    """Warm-ups queued or running in this process."""
    return _worker.pending()


def wait_for_compiles(timeout: float | None = None) -> bool:
    """Waits until every queued warm-up has finished; False if ``timeout`` seconds passed first."""
    return _worker.wait(timeout)


class _Spent:
    """The milliseconds each kind of call (its signature) has taken on one device: host time
    on the CPU, the stream's time between two events on CUDA (read once they have passed, so
    a call never waits for its own clock)."""

    def __init__(self, device: torch.device):
        self._device = torch.device(device)
        self._cuda = self._device.type == "cuda"
        self._lock = threading.Lock()
        self._ms: dict = {}
        self._running: list = []  # (signature, start event, end event) not yet read

    @contextlib.contextmanager
    def clock(self, key):
        """Adds the time of what runs inside to ``key`` (None: nothing is counted)."""
        if key is None:
            yield
            return
        if not self._cuda:
            start = _clock()
            yield
            with self._lock:
                self._ms[key] = self._ms.get(key, 0.0) + (_clock() - start) * 1e3
            return
        # on the model's device's stream, whichever device is current in the calling thread
        stream = torch.cuda.current_stream(self._device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(torch.cuda.current_stream(self._device))
        with self._lock:
            self._running.append((key, start, end))

    def ms(self, key) -> float:
        """What calls of ``key`` have taken so far (those still running: not yet)."""
        with self._lock:
            running = []
            for one, start, end in self._running:
                if end.query():
                    self._ms[one] = self._ms.get(one, 0.0) + start.elapsed_time(end)
                else:
                    running.append((one, start, end))
            self._running = running
            return self._ms.get(key, 0.0)


@dataclass
class TieredCache:
    """The KV caches of one train block: ``ready``'s, and ``target``'s once its background
    build has finished (None until then). Each is read only by the served model that built it."""

    ready: object
    target: object | None = None


def _describe(value):
    """``value`` as a compiled graph sees it: tensors by shape and dtype (caches and other
    dataclasses field by field), everything else by value."""
    if isinstance(value, Tensor):
        return tuple(value.shape), value.dtype
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return type(value).__name__, tuple(_describe(getattr(value, f.name)) for f in fields)
    if isinstance(value, (list, tuple)):
        return type(value).__name__, tuple(_describe(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _describe(v)) for k, v in sorted(value.items()))
    return repr(value)


def _signature(entry: str, args: tuple, kwargs: dict) -> tuple:
    """What decides whether a call reuses a compiled graph: the entry point, every tensor's
    shape and dtype, every other argument's value."""
    return entry, _describe(args), _describe(kwargs)


class CompilingTabICL:
    """A compiled served model and a ready one (see the module docstring); it has the served
    models' inference API, so the estimators use it in their place.

    Args:
        ready: a :class:`~.served.ServedTabICL` whose options compile nothing.
        target: the compiled one; both serve the same checkpoint on the same device.
        build_target: instead of ``target``, a function that builds it, and its ``options``:
            the first warm-up builds it, in the background (loading the kernels and the
            weights a second time takes seconds).
        build_packs: a function that builds the served model of packed calls from
            :func:`packs_options` of ``ready``'s options (see :meth:`padded_forward`), called
            by the first packs warm-up in the background; None: ``ready`` answers every pack.
    """

    def __init__(self, ready, target=None, *, build_target=None, options=None, build_packs=None):
        if ready.options.compiled:
            raise ValueError("CompilingTabICL: the ready served model must not compile")
        if (target is None) == (build_target is None) or (build_target and options is None):
            raise ValueError("CompilingTabICL: give target, or build_target and its options")
        self.ready = ready
        self._target, self._build_target = target, build_target
        self._build_lock = threading.Lock()  # never taken by a caller's call: see ``target``
        #: The compiled served model's options (what the estimator asked for).
        self.options = target.options if target is not None else options
        self._lock = threading.Lock()
        # signature -> calls seen (an int, before its warm-up is queued) | "queued" |
        # "compiled" | "declined" (slower than ready) | "failed"
        self._state: dict = {}
        #: signature -> (ready's, target's) median ms on the warm-up's inputs
        self.timings: dict = {}
        self._spent = _Spent(ready.device)
        from tabserve.kernels._common import guards_compiles  # imports Triton

        self._build_packs = build_packs if guards_compiles() else None
        self._packs = None
        # packed calls seen (an int, before the first warm-up is queued) | "queued" |
        # "compiled" | "declined" | "failed"; _compiling: a warm-up of a pack that would have
        # compiled a kernel in its caller's thread is queued
        self._packs_state: int | str = 0
        self._compiling = False
        self._precompiled = 0  # kernel specializations the packs' warm-ups compiled in children

    @property
    def target(self):
        """The compiled served model (built here if it was given as a function: by the first
        warm-up, under a lock of its own, so that callers' calls, which take ``_lock``, never
        wait for the build)."""
        if self._target is None:
            with self._build_lock, no_pause():  # the build reads the model cache's locks
                if self._target is None:
                    self._target = self._build_target()
        return self._target

    # ------------------------------------------------------------------ model API
    @property
    def config(self):
        return self.ready.config

    @property
    def is_regressor(self) -> bool:
        return self.ready.is_regressor


    def __call__(self, *args, **kwargs):
        return self._serve("forward", args, kwargs)

    def forward(self, *args, **kwargs):
        return self._serve("forward", args, kwargs)

    def predict_stats(self, *args, **kwargs):
        return self._serve("predict_stats", args, kwargs)

    def forward_offloaded(self, *args, **kwargs):
        """The ready model's: offloaded calls compile nothing (see ``ServedTabICL``)."""
        return self.ready.forward_offloaded(*args, **kwargs)

    @property
    def packs(self):
        """The served model of packed calls (built here by the first packs warm-up)."""
        if self._packs is None:
            with self._build_lock, no_pause():
                if self._packs is None:
                    self._packs = self._build_packs()
        return self._packs

    def padded_forward(self, *args):
        """Packed tables of many sizes (their shapes rarely recur: nothing is compiled for
        them nor captured). ``ready`` answers until ``packs`` (ready's options with tabserve's
        fused Triton kernels, :func:`packs_options`) has run a pack in the background and
        answered it faster (:meth:`_pays`), as a kind of call moves to ``target``; from then on
        ``packs`` answers, except a pack that would compile a Triton kernel in the caller's
        thread (a specialization not launched yet: seconds of ptxas and Triton's passes),
        which ``ready`` answers while a warm-up compiles it."""
        if self._build_packs is None:
            return self.ready.padded_forward(*args)
        with self._lock:
            state = self._packs_state
            queue = compile_now = False
            if state == "compiled":
                pass
            elif isinstance(state, int):
                seen = state + 1
                queue = (
                    seen >= COMPILE_AFTER_CALLS
                    and self._spent.ms(PACKED) >= COMPILE_AFTER_MS
                    and _worker.pending() < MAX_QUEUED
                )
                self._packs_state = "queued" if queue else seen
        if state == "compiled":
            from tabserve.kernels._common import WouldCompile, no_triton_compiles

            try:
                with no_triton_compiles():
                    return self._packs.padded_forward(*args)
            except WouldCompile:
                with self._lock:
                    compile_now = not self._compiling and _worker.pending() < MAX_QUEUED
                    self._compiling = self._compiling or compile_now
        if queue or compile_now:
            self._queue_packs(args, judged=queue)
        with self._spent.clock(PACKED if isinstance(state, int) and not queue else None):
            return self.ready.padded_forward(*args)

    def build_cache(self, *args, mode: str = "kv", **kwargs):
        if mode != "kv":  # representation caches: unpadded and uncompiled on either model
            return self.ready.build_cache(*args, mode=mode, **kwargs)
        cache = TieredCache(self.ready.build_cache(*args, **kwargs))
        if self._choose("build_cache", args, kwargs, keep=cache)[0] is not self.ready:
            cache.target = self.target.build_cache(*args, **kwargs)
        return cache

    def forward_with_cache(self, X: Tensor, cache: TieredCache, **kwargs):
        return self._serve_cached("forward_with_cache", X, cache, (), kwargs)

    def predict_stats_with_cache(self, X: Tensor, cache: TieredCache, *args):
        return self._serve_cached("predict_stats_with_cache", X, cache, args, {})

    # ------------------------------------------------------------------ tiers
    def compiled(self, entry: str, *args, **kwargs) -> bool:
        """Whether ``target`` serves this call already."""
        with self._lock:
            return self._state.get(_signature(entry, args, kwargs)) == "compiled"

    def _serve(self, entry: str, args: tuple, kwargs: dict):
        served, key = self._choose(entry, args, kwargs)
        with self._spent.clock(key):
            return getattr(served, entry)(*args, **kwargs)

    def _serve_cached(self, entry: str, X: Tensor, cache, args: tuple, kwargs):
        if not isinstance(cache, TieredCache):  # a representation cache: the ready model's
            return getattr(self.ready, entry)(X, cache, *args, **kwargs)
        if cache.target is None:  # counted once target has a cache to be compiled against
            return getattr(self.ready, entry)(X, cache.ready, *args, **kwargs)
        served, key = self._choose(entry, (X, cache.target, *args), kwargs)
        if served is not self.ready:
            return getattr(served, entry)(X, cache.target, *args, **kwargs)
        with self._spent.clock(key):
            return getattr(self.ready, entry)(X, cache.ready, *args, **kwargs)

    def _choose(self, entry: str, args: tuple, kwargs: dict, keep: TieredCache | None = None):
        """(``target`` where this call has warmed up and paid, else ``ready``; the call's
        signature while its time on ``ready`` still counts, else None), queueing its warm-up
        once it recurs and has taken its time (see the module docstring; ``keep``: the cache
        whose ``target`` half that warm-up builds, queued at once)."""
        key = _signature(entry, args, kwargs)
        with self._lock:
            state = self._state.get(key, 0)
            if state == "compiled":
                return self.target, None
            queue = False
            if isinstance(state, int):
                seen = state + 1
                due = keep is not None or (
                    seen >= COMPILE_AFTER_CALLS and self._spent.ms(key) >= COMPILE_AFTER_MS
                )
                queue = due and _worker.pending() < MAX_QUEUED
                self._state[key] = "queued" if queue else seen
        if queue or (keep is not None and state == "queued" and _worker.pending() < MAX_QUEUED):
            # a cache build is queued for every cache (each needs its own target half), within
            # the queue's bound: a cache left out is read by ready
            self._queue(key, entry, args, kwargs, keep, mark=queue)
        counting = isinstance(state, int) and not queue
        return self.ready, key if counting else None

    def _queue(self, key, entry: str, args: tuple, kwargs: dict, keep=None, mark=True) -> None:
        def judge(args, kwargs, built, stream) -> str:
            if keep is not None:
                keep.target = built
                return "compiled"  # the predictions on the cache decide for themselves
            return self._pays(key, entry, args, kwargs, stream)

        def settle(state: str) -> None:
            if mark:
                with self._lock:
                    self._state[key] = state

        failure = f"compiling {entry} for {describe(self.options)} failed; serving it with"
        if not self._submit("target", entry, args, kwargs, judge, settle, failure) and mark:
            with self._lock:
                self._state[key] = "failed"

    def _submit(
        self, contender: str, entry: str, args, kwargs, judge, settle, failure, before=None
    ) -> bool:
        """Queues a warm-up on the worker (False where it refused it): ``before(args, kwargs)``
        where given, then ``entry`` of ``contender`` (``target`` or ``packs``) on private copies
        of the call's inputs, then ``settle(judge(args, kwargs, what it built, its stream))``,
        or ``settle("failed")`` with a warning starting with ``failure`` where one raised."""
        # Private copies: the caller may overwrite its tensors before the warm-up runs. On CUDA
        # the worker's stream waits for the copies.
        args, kwargs = tree_map(_copy, (args, kwargs))
        copied = torch.cuda.Event() if self.ready.device.type == "cuda" else None
        if copied is not None:
            copied.record()

        def warm_up() -> None:
            try:
                stream = torch.cuda.Stream(self.ready.device) if copied is not None else None
                with exclusive_captures(), without_captures(), (
                    torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
                ):
                    if stream is not None:
                        stream.wait_event(copied)
                    if before is not None:
                        before(args, kwargs)
                    built = getattr(getattr(self, contender), entry)(*args, **kwargs)
                    if stream is not None:
                        stream.synchronize()
                state = judge(args, kwargs, built, stream)
            except Exception as error:  # the call stays on the ready model
                warnings.warn(
                    f"{failure} {describe(self.ready.options)}: {type(error).__name__}: {error}",
                    stacklevel=1,
                )
                state = "failed"
            settle(state)

        return _worker.submit(warm_up)

    def packs_tier(self) -> dict:
        """Where packed calls go: ``state`` (packed calls seen, ``"queued"``, ``"compiled"``:
        the fused kernels answer, ``"declined"``: ``ready`` was faster, ``"failed"``,
        ``"off"``: no packs model), the judging pack's ``ready_ms`` / ``packs_ms``, and
        ``precompiled``: the kernel specializations its warm-ups compiled in child processes."""
        with self._lock:
            state = self._packs_state if self._build_packs is not None else "off"
            precompiled = self._precompiled
        ready_ms, packs_ms = self.timings.get(PACKED, (None, None))
        return {
            "state": state, "ready_ms": ready_ms, "packs_ms": packs_ms, "precompiled": precompiled
        }

    def _queue_packs(self, args: tuple, judged: bool) -> None:
        """Queues a warm-up of ``packs`` on copies of a packed call's ``args``: it compiles the
        call's Triton kernels and, where ``judged``, decides whether ``packs`` answers packs from
        now on (else it only compiled what a pack served by ``packs`` lacked).

        The kernels compile in child processes (:meth:`_precompile_packs`): in this process
        Triton's native passes keep the interpreter lock, which the warm-up's pauses
        (:func:`_pause_for_callers`) cannot take from them (see
        :mod:`tabserve.kernels.precompile`)."""

        def judge(args, kwargs, built, stream) -> str:
            if not judged:
                return "compiled"
            return self._pays(PACKED, "padded_forward", args, kwargs, stream, "packs")

        def settle(state: str) -> None:
            with self._lock:
                self._compiling = False
                if judged or state == "failed":
                    self._packs_state = state

        failure = "tabserve's fused kernels for packed calls failed; serving them with"
        before = lambda args, kwargs: self._precompile_packs(args)
        if not self._submit("packs", "padded_forward", args, {}, judge, settle, failure, before):
            with self._lock:
                self._compiling = False
                if judged:
                    self._packs_state = "failed"

    def _precompile_packs(self, args: tuple) -> None:
        """Runs the pack on ``packs`` with each Triton launch that would compile skipped and
        listed (its outputs are not an answer), then compiles what it listed in child processes
        into Triton's cache (:mod:`tabserve.kernels.precompile`), so the warm-up's own call reads
        the kernels back instead of compiling them beside the callers. Where that fails, the
        warm-up compiles them itself, as before, with a warning."""
        if self.ready.device.type not in TRITON_DEVICE_TYPES:
            return
        from tabserve.kernels.precompile import collect_compiles, compile_elsewhere

        # The skipped launches' outputs are garbage: what was listed stands if the call fails
        with collect_compiles() as found, contextlib.suppress(Exception):
            self.packs.padded_forward(*args)
        try:
            compile_elsewhere(found)
        except Exception as error:  # noqa: BLE001  (the warm-up compiles them here instead)
            warnings.warn(
                f"compiling tabserve's fused kernels in child processes failed, compiling them "
                f"in this process: {type(error).__name__}: {error}",
                stacklevel=1,
            )
            return
        with self._lock:
            self._precompiled += len(found)

    def _pays(self, key, entry: str, args: tuple, kwargs: dict, stream, contender="target") -> str:
        """``"compiled"`` if ``contender`` (``target`` or ``packs``) answers this call faster
        than ``ready`` (medians of :data:`PAY_RUNS` interleaved calls on the warm-up's inputs,
        on its stream), else ``"declined"``; the figures go to :attr:`timings`."""
        if PAY_RUNS < 1:
            return "compiled"
        times: dict = {"ready": [], contender: []}
        # ready replays the graphs its callers captured, as it serves them; target has none yet
        # and runs uncaptured, at most its served time: it takes over only where surely faster.
        # no_pause: a replay holds the ready model's graph lock, which its callers take
        with exclusive_captures(), without_captures(replay=True), no_pause(), (
            torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        ):
            for _ in range(PAY_RUNS):
                for name in ("ready", contender):
                    start = _clock()
                    getattr(getattr(self, name), entry)(*args, **kwargs)
                    if stream is not None:
                        stream.synchronize()
                    times[name].append((_clock() - start) * 1e3)
        ready_ms, target_ms = (sorted(times[n])[len(times[n]) // 2] for n in ("ready", contender))
        self.timings[key] = (ready_ms, target_ms)
        return "compiled" if target_ms < ready_ms else "declined"


def _copy(value):
    return value.clone() if isinstance(value, Tensor) else value
