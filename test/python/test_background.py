"""Serving while compiling (tabserve.models.tabicl.serving.background): which served model answers each
call, before and after its background warm-up, and what happens when a warm-up fails or the
interpreter exits during one."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time

import pytest
import torch
from tabicl_helpers import our_model, random_table, requires_cuda
from tabserve.models.tabicl import TabICLv2
from tabserve.models.tabicl.serving import background
from tabserve.models.tabicl.serving.background import (
    CompilingTabICL,
    TieredCache,
    background_compiles,
    wait_for_compiles,
)
from tabserve.models.tabicl.serving.options import ServingOptions
from tabserve.models.tabicl.serving.served import ServedTabICL

# Dynamo traces, nothing is generated: a compiled served model in seconds on the CPU.
TRACED = ServingOptions(compile="default", compile_backend="eager")


@pytest.fixture(autouse=True)
def _every_call_warms_up(monkeypatch):
    """The tiers' mechanics, apart from the policy: a call's warm-up is queued at its first call
    and its compiled model takes over once warmed up (the policy's own tests set it back)."""
    monkeypatch.setattr(background, "COMPILE_AFTER_CALLS", 1)
    monkeypatch.setattr(background, "COMPILE_AFTER_MS", 0.0)
    monkeypatch.setattr(background, "PAY_RUNS", 0)


def test_the_ready_preset_compiles_nothing_at_first_use():
    """What answers a kind of call before its compile (and every packed call) must not compile
    at first use: no torch.compile and no Triton kernels (compiled by Triton at their first
    call); tabserve's own CUDA attention kernel is built with the extension."""
    from tabserve.models.tabicl.serving.options import PRESETS

    ready = PRESETS[background.READY_PRESET].options
    assert not ready.compiled and not ready.triton_kernels
    assert ready.stage_kernels("row").small_heads and ready.stage_kernels("col").small_heads


class _HeldWorker:
    """Holds the background worker on a job of its own until :meth:`release`: what a test
    checks before the warm-ups run cannot race them."""

    def __init__(self):
        self._gate = threading.Event()
        assert background._worker.submit(lambda: self._gate.wait(120))

    def release(self) -> None:
        self._gate.set()


def _model() -> TabICLv2:
    return TabICLv2.from_checkpoint(_checkpoint())


def _checkpoint():
    from tabicl_helpers import reference_checkpoint

    return reference_checkpoint("clf", "tiny")


class _Counting:
    """Counts the calls of one served model's entry points (wrapped on the instance)."""

    def __init__(self, served, entries=("forward", "build_cache", "forward_with_cache")):
        self.calls: list[str] = []
        for entry in entries:
            method = getattr(served, entry)

            def counted(*args, __entry=entry, __method=method, **kwargs):
                self.calls.append(__entry)
                return __method(*args, **kwargs)

            setattr(served, entry, counted)


def _pair(target_options=TRACED):
    ready = ServedTabICL(_model(), "exact")
    target = ServedTabICL(_model(), target_options)
    return CompilingTabICL(ready, target), _Counting(ready), _Counting(target)


def test_each_call_is_answered_by_the_ready_model_until_its_warm_up_has_run():
    tiered, ready, target = _pair()
    X, y = random_table(0, 2, 40, 10, 5, n_classes=3)
    held = _HeldWorker()
    first = tiered(X, y)
    assert ready.calls == ["forward"] and target.calls == []
    assert not tiered.compiled("forward", X, y) and background_compiles() == 2
    held.release()
    assert wait_for_compiles(timeout=120)
    assert target.calls == ["forward"]  # the warm-up, on copies of the inputs
    assert tiered.compiled("forward", X, y)
    second = tiered(X, y)
    assert ready.calls == ["forward"] and target.calls == ["forward", "forward"]
    # Both are fp32 eager / traced fp32 of the same weights: the same answers.
    torch.testing.assert_close(second, first, atol=1e-5, rtol=0)
    torch.testing.assert_close(first, our_model("clf", "tiny")(X, y), atol=1e-5, rtol=0)
    # Another shape is a call of its own: the ready model again, and one more warm-up.
    X2, y2 = random_table(1, 2, 30, 10, 5, n_classes=3)
    tiered(X2, y2)
    assert ready.calls == ["forward", "forward"]
    assert wait_for_compiles(timeout=120) and background_compiles() == 0
    assert target.calls == ["forward", "forward", "forward"]


def test_no_other_thread_captures_while_a_warm_up_runs():
    from tabserve.models.tabicl.serving import served as serving

    tiered, ready, target = _pair()
    free_during_warm_up = []
    forward = tiered.target.forward

    def probing(*args, **kwargs):
        probe = threading.Thread(  # another thread tries to take the captures
            target=lambda: free_during_warm_up.append(serving._CAPTURES.acquire(blocking=False))
        )
        probe.start()
        probe.join()
        return forward(*args, **kwargs)

    tiered.target.forward = probing
    X, y = random_table(3, 2, 40, 10, 5, n_classes=3)
    tiered(X, y)
    assert wait_for_compiles(120)
    assert free_during_warm_up == [False] and tiered.compiled("forward", X, y)
    assert serving._CAPTURES.acquire(blocking=False)  # released once the warm-up ended
    serving._CAPTURES.release()


class _CaptureOnCPU:
    """Stands in for ``served._BucketGraph`` on the CPU, noting the thread of each capture."""

    threads: list = []

    def __init__(self, fn, inputs, static=(), pool=None):
        type(self).threads.append(threading.current_thread().name)
        self.fn, self.static = fn, static

    def __call__(self, *inputs):
        return self.fn(*inputs, *self.static)


def test_a_warm_up_leaves_the_graph_captures_to_the_calling_thread(monkeypatch):
    """A capture on the worker fails whenever the caller synchronises the whole device meanwhile,
    so the worker compiles uncaptured and the caller's next call of that shape captures."""
    from tabserve.buckets import BucketGrid
    from tabserve.models.tabicl.serving import served as serving

    monkeypatch.setattr(serving, "_BucketGraph", _CaptureOnCPU)
    monkeypatch.setattr(_CaptureOnCPU, "threads", [])
    graphed = TRACED.replace(buckets=True)
    target = ServedTabICL(_model(), graphed, BucketGrid((16, 64), (8, 32), (8, 16)))
    target.options = target.options.replace(cuda_graphs=True)  # replayed by the stand-in
    tiered = CompilingTabICL(ServedTabICL(_model(), "exact"), target)
    X, y = random_table(4, 2, 40, 10, 5, n_classes=3)
    expected = tiered(X, y)
    assert wait_for_compiles(timeout=120) and tiered.compiled("forward", X, y)
    assert _CaptureOnCPU.threads == [] and target.uncaptured == 0
    torch.testing.assert_close(tiered(X, y), expected, atol=1e-5, rtol=0)
    assert _CaptureOnCPU.threads == [threading.current_thread().name] and target.captures == 1


def test_a_timing_replays_what_the_callers_captured_and_captures_nothing(monkeypatch):
    from tabserve.buckets import BucketGrid
    from tabserve.models.tabicl.serving import served as serving

    replays = []

    class Replaying(_CaptureOnCPU):
        def __call__(self, *inputs):
            replays.append(threading.current_thread().name)
            return super().__call__(*inputs)

    monkeypatch.setattr(serving, "_BucketGraph", Replaying)
    served = ServedTabICL(_model(), ServingOptions(buckets=True), BucketGrid((16, 64), (8, 32), (8, 16)))
    served.options = served.options.replace(cuda_graphs=True)
    X, y = random_table(9, 2, 40, 10, 5, n_classes=3)
    expected = served(X, y)  # this thread captures the bucket's graph
    assert served.captures == 1 and replays == ["MainThread"]
    X2, y2 = random_table(10, 2, 12, 4, 5, n_classes=3)  # another bucket, never captured
    got = []

    def timing():
        with serving.without_captures(replay=True):
            got.extend([served(X, y), served(X2, y2)])

    worker = threading.Thread(target=timing, name="timing")
    worker.start()
    worker.join(60)
    assert replays == ["MainThread", "timing"]  # the captured bucket replayed, the other run
    assert served.captures == 1 and served.uncaptured == 0  # ... uncaptured, capturing nothing
    torch.testing.assert_close(got[0], expected, atol=0, rtol=0)
    torch.testing.assert_close(got[1], our_model("clf", "tiny")(X2, y2), atol=1e-5, rtol=0)


def test_replays_of_compiled_shapes_do_not_wait_for_a_warm_up_of_another(monkeypatch):
    """While the worker compiles one shape of the target, the caller's calls of a shape the
    target serves already go on (they waited for the whole compile on the graphs' lock)."""
    from tabserve.buckets import BucketGrid
    from tabserve.models.tabicl.serving import served as serving

    monkeypatch.setattr(serving, "_BucketGraph", _CaptureOnCPU)
    target = ServedTabICL(_model(), TRACED.replace(buckets=True), BucketGrid((16, 64), (8, 32), (8, 16)))
    target.options = target.options.replace(cuda_graphs=True)
    tiered = CompilingTabICL(ServedTabICL(_model(), "exact"), target)
    X, y = random_table(5, 2, 40, 10, 5, n_classes=3)
    expected = tiered(X, y)
    assert wait_for_compiles(timeout=120)
    tiered(X, y)  # the target's, captured by this thread
    compiling, release = threading.Event(), threading.Event()
    forward = target._forward

    def slow_compile(*args):  # the worker's warm-up of the other shape, held
        if threading.current_thread().name == "tabserve-compile":
            compiling.set()
            release.wait(60)
        return forward(*args)

    monkeypatch.setattr(target, "_forward", slow_compile)
    X2, y2 = random_table(6, 2, 12, 4, 5, n_classes=3)  # another bucket
    tiered(X2, y2)
    assert compiling.wait(60)
    answered = []
    caller = threading.Thread(target=lambda: answered.append(tiered(X, y)))
    caller.start()
    caller.join(30)
    release.set()
    assert answered, "the caller waited for the warm-up"
    torch.testing.assert_close(answered[0], expected, atol=1e-5, rtol=0)
    assert wait_for_compiles(timeout=120)


def test_a_failed_warm_up_leaves_the_call_on_the_ready_model():
    tiered, ready, target = _pair()

    def broken(*args, **kwargs):
        raise RuntimeError("compiler crashed")

    tiered.target.forward = broken
    X, y = random_table(2, 1, 20, 5, 4, n_classes=2)
    with pytest.warns(UserWarning, match="failed; serving it with exact: RuntimeError: compiler"):
        expected = tiered(X, y)
        assert wait_for_compiles(timeout=60)
    torch.testing.assert_close(tiered(X, y), expected, atol=0, rtol=0)
    assert ready.calls == ["forward", "forward"]
    assert not tiered.compiled("forward", X, y)


def test_kv_predictions_move_to_the_target_once_its_cache_and_graphs_are_built():
    tiered, ready, target = _pair()
    X, y = random_table(3, 2, 40, 12, 5, n_classes=3)
    train, test = X[:, :40], X[:, 40:]
    held = _HeldWorker()
    cache = tiered.build_cache(train, y)
    assert isinstance(cache, TieredCache) and cache.target is None
    before = tiered.forward_with_cache(test, cache)
    assert ready.calls == ["build_cache", "forward_with_cache"] and target.calls == []
    held.release()
    assert wait_for_compiles(timeout=120)
    assert target.calls == ["build_cache"] and cache.target is not None  # built in the background
    # the prediction's own warm-up, then the target answers
    tiered.forward_with_cache(test, cache)
    assert wait_for_compiles(timeout=120)
    assert target.calls == ["build_cache", "forward_with_cache"]
    after = tiered.forward_with_cache(test, cache)
    assert ready.calls == ["build_cache", "forward_with_cache", "forward_with_cache"]
    assert target.calls == ["build_cache", "forward_with_cache", "forward_with_cache"]
    torch.testing.assert_close(after, before, atol=1e-5, rtol=0)
    # a later cache of the same train shapes is built by both at once
    again = tiered.build_cache(train, y)
    assert again.target is not None and target.calls[-1] == "build_cache"


def test_a_target_given_as_a_function_is_built_by_the_first_warm_up_in_the_background():
    threads = []

    def build():
        threads.append(threading.current_thread().name)
        return ServedTabICL(_model(), TRACED)

    tiered = CompilingTabICL(ServedTabICL(_model(), "exact"), build_target=build, options=TRACED)
    assert tiered.options == TRACED
    X, y = random_table(4, 1, 30, 6, 4, n_classes=2)
    held = _HeldWorker()
    tiered(X, y)
    assert threads == []  # the caller's thread neither built nor waited for it
    held.release()
    assert wait_for_compiles(timeout=120)
    assert threads == ["tabserve-compile"] and tiered.compiled("forward", X, y)
    with pytest.raises(ValueError, match="give target, or build_target and its options"):
        CompilingTabICL(ServedTabICL(_model(), "exact"), build_target=build)


# Packs on the CPU: bf16 autocast, where the fused operators run their composites.
PACKS_READY = ServingOptions(precision="bf16")


def _packed_tiers(build_packs=None):
    """A CompilingTabICL whose packs model is built by the first packs warm-up, and counters
    of the packed calls each served model answers."""
    from tabserve.models.tabicl.serving.options import packs_options

    built: list = []

    def build():
        packs = ServedTabICL(_model(), packs_options(PACKS_READY))
        built.append((threading.current_thread().name, _Counting(packs, ("padded_forward",))))
        return packs

    ready = ServedTabICL(_model(), PACKS_READY)
    tiered = CompilingTabICL(
        ready, ServedTabICL(_model(), TRACED), build_packs=build_packs or build
    )
    return tiered, _Counting(ready, ("padded_forward",)), built


def _pack(seed: int):
    """Three tables of two shapes padded onto one bucket, with their real counts."""
    from tabserve import ops

    tables, labels = [], []
    for i, (n_train, n_features) in enumerate([(30, 5), (24, 7), (30, 7)]):
        X, y = random_table(seed + i, 1, n_train, 6, n_features, n_classes=3)
        tables.append(ops.pad_to_bucket(X, n_train, 32, 8, 8, -100.0))
        labels.append(ops.pad_labels(y, 32))
    n_train = torch.tensor([30, 24, 30])
    n_features = torch.tensor([5, 7, 7])
    return torch.cat(tables), torch.cat(labels), n_train, n_features


def test_packs_move_to_the_fused_kernels_once_a_background_warm_up_has_built_them():
    pytest.importorskip("triton.knobs")
    tiered, ready, built = _packed_tiers()
    args = _pack(0)
    expected = ServedTabICL(_model(), PACKS_READY).padded_forward(*args)
    held = _HeldWorker()
    first = tiered.padded_forward(*args)
    assert ready.calls == ["padded_forward"] and built == []  # queued, not built by the caller
    held.release()
    assert wait_for_compiles(timeout=120)
    ((thread, packs),) = built
    assert thread == "tabserve-compile" and packs.calls == ["padded_forward"]
    assert tiered.packs_tier() == {
        "state": "compiled", "ready_ms": None, "packs_ms": None, "precompiled": 0
    }  # the CPU runs the fused operators' composites: no Triton kernel to compile
    second = tiered.padded_forward(*_pack(0))
    assert ready.calls == ["padded_forward"] and packs.calls == ["padded_forward"] * 2
    torch.testing.assert_close(first, expected, atol=0, rtol=0)
    # the fused operators' composites on the CPU: the ready model's roundings under bf16
    torch.testing.assert_close(second, expected, atol=2e-2, rtol=0)
    # every later pack, whatever its shapes: one kind of call, no further warm-up
    tiered.padded_forward(*_pack(5)[:2], None, None)
    assert packs.calls == ["padded_forward"] * 3 and background_compiles() == 0


@pytest.mark.parametrize("children", ["compile", "fail"])
def test_a_packs_warm_up_lists_its_kernels_and_has_children_compile_them_first(
    monkeypatch, children
):
    """On a device where the fused operators launch Triton kernels, the packs' warm-up first
    runs the pack listing what it would compile (:func:`collect_compiles`), has child processes
    compile that (:func:`compile_elsewhere`), then runs the pack it times; where the children
    fail it compiles in its own call, with a warning. (The CPU stands in for that device here:
    the listing is the hook's, tested with a real kernel in test_precompile.)"""
    pytest.importorskip("triton.knobs")
    from tabserve.kernels import _common, precompile

    monkeypatch.setattr(background, "TRITON_DEVICE_TYPES", ("cpu",))
    kernel = _common.Specialization("tabserve.kernels.feed_forward", "_feed_forward_kernel", "{}")
    events = []
    collect = precompile.collect_compiles

    @contextlib.contextmanager
    def listing():
        with collect() as found:
            events.append(("listing", threading.current_thread().name))
            found.append(kernel)
            yield found

    def compile_elsewhere(found):
        events.append(("children", list(found)))
        if children == "fail":
            raise RuntimeError("a child compiling Triton kernels exited with 1")

    monkeypatch.setattr(precompile, "collect_compiles", listing)
    monkeypatch.setattr(precompile, "compile_elsewhere", compile_elsewhere)
    tiered, _, built = _packed_tiers()
    args = _pack(0)
    expected = ServedTabICL(_model(), PACKS_READY).padded_forward(*args)
    with contextlib.ExitStack() as stack:
        if children == "fail":
            stack.enter_context(pytest.warns(UserWarning, match="in child processes failed"))
        tiered.padded_forward(*args)
        assert wait_for_compiles(timeout=120)
    ((_, packs),) = built
    assert events == [("listing", "tabserve-compile"), ("children", [kernel])]
    assert packs.calls == ["padded_forward"] * 2  # the listing pass, then the warm-up's own
    assert tiered.packs_tier()["state"] == "compiled"
    assert tiered.packs_tier()["precompiled"] == (1 if children == "compile" else 0)
    answer = tiered.padded_forward(*_pack(0))
    torch.testing.assert_close(answer, expected, atol=2e-2, rtol=0)


def test_a_pack_that_would_compile_in_the_callers_thread_is_answered_by_the_ready_model():
    pytest.importorskip("triton.knobs")
    from tabserve.kernels._common import WouldCompile

    tiered, ready, built = _packed_tiers()
    tiered.padded_forward(*_pack(0))
    assert wait_for_compiles(timeout=120)
    ((_, packs),) = built
    packs_call = tiered.packs.padded_forward
    refused, warmed = [], []

    def uncompiled(*args):  # a Triton launch of a new specialization: refused until compiled
        if threading.current_thread().name == "tabserve-compile":
            warmed.append(True)
        elif not warmed:
            refused.append(threading.current_thread().name)
            raise WouldCompile("_feed_forward_kernel[...] is not compiled yet")
        return packs_call(*args)

    tiered.packs.padded_forward = uncompiled
    args = _pack(3)
    expected = ServedTabICL(_model(), PACKS_READY).padded_forward(*args)
    held = _HeldWorker()
    answer = tiered.padded_forward(*args)
    torch.testing.assert_close(answer, expected, atol=0, rtol=0)  # the ready model's answer
    assert ready.calls == ["padded_forward"] * 2 and background_compiles() == 2
    tiered.padded_forward(*args)  # one compile warm-up at a time: none more queued
    assert background_compiles() == 2 and ready.calls == ["padded_forward"] * 3
    held.release()
    assert wait_for_compiles(timeout=120)
    assert refused == ["MainThread"] * 2 and packs.calls == ["padded_forward"] * 2
    tiered.padded_forward(*args)  # compiled by the warm-up: the packs model again
    assert ready.calls == ["padded_forward"] * 3 and packs.calls == ["padded_forward"] * 3


def test_packs_stay_on_the_ready_model_where_the_fused_kernels_fail_or_are_slower(monkeypatch):
    pytest.importorskip("triton.knobs")

    def broken():
        raise RuntimeError("ptxas crashed")

    tiered, ready, _ = _packed_tiers(build_packs=broken)
    args = _pack(1)
    with pytest.warns(UserWarning, match="fused kernels for packed calls failed; serving them"):
        tiered.padded_forward(*args)
        assert wait_for_compiles(timeout=60)
    tiered.padded_forward(*args)
    assert ready.calls == ["padded_forward"] * 2 and tiered._packs_state == "failed"

    clock = {"now": 0.0}
    monkeypatch.setattr(background, "_clock", lambda: clock["now"])
    monkeypatch.setattr(background, "PAY_RUNS", 3)
    tiered, ready, built = _packed_tiers()
    build = tiered._build_packs

    def slower():
        packs = build()
        _costing(packs, clock, 9.0, "padded_forward")
        return packs

    tiered._build_packs = slower
    _costing(tiered.ready, clock, 5.0, "padded_forward")
    tiered.padded_forward(*args)
    assert wait_for_compiles(timeout=120)
    tier = tiered.packs_tier()
    assert tier["state"] == "declined"
    assert (tier["ready_ms"], tier["packs_ms"]) == pytest.approx((5.0, 9.0))
    ((_, packs),) = built
    assert len(packs.calls) == 4 and len(ready.calls) == 4  # the warm-up, 3 timed calls each
    tiered.padded_forward(*args)
    assert len(ready.calls) == 5 and len(packs.calls) == 4


def test_packs_keep_to_the_compile_policy(monkeypatch):
    """A packed call's warm-up is queued once packs have recurred and taken their time, as any
    kind of call; the packs model is never built on a device without Triton's compile guard."""
    pytest.importorskip("triton.knobs")
    monkeypatch.setattr(background, "COMPILE_AFTER_CALLS", 3)
    tiered, ready, built = _packed_tiers()
    args = _pack(2)
    tiered.padded_forward(*args)
    tiered.padded_forward(*args)
    assert background_compiles() == 0 and tiered._packs_state == 2
    tiered.padded_forward(*args)
    assert wait_for_compiles(timeout=120) and len(built) == 1
    from tabserve.kernels import _common

    monkeypatch.setattr(_common, "guards_compiles", lambda: False)
    tiered, ready, built = _packed_tiers()
    for _ in range(4):
        tiered.padded_forward(*args)
    assert wait_for_compiles(timeout=60) and built == [] and len(ready.calls) == 4
    assert tiered.packs_tier()["state"] == "off"


def test_a_kind_of_call_is_compiled_once_it_recurs_and_a_cache_build_at_once(monkeypatch):
    monkeypatch.setattr(background, "COMPILE_AFTER_CALLS", 2)
    tiered, ready, target = _pair()
    X, y = random_table(7, 2, 30, 8, 5, n_classes=3)
    tiered(X, y)
    assert background_compiles() == 0 and not tiered.compiled("forward", X, y)  # a one-off
    tiered(X, y)
    assert wait_for_compiles(timeout=120) and tiered.compiled("forward", X, y)
    assert target.calls == ["forward"] and ready.calls == ["forward", "forward"]
    held = _HeldWorker()
    cache = tiered.build_cache(X[:, :30], y)
    assert background_compiles() == 2  # the predictions that follow a cache recur by design
    held.release()
    assert wait_for_compiles(timeout=120) and cache.target is not None


@pytest.mark.parametrize("call_ms, queued_at", [(300.0, 5), (1500.0, 2), (5.0, None)])
def test_a_kind_of_call_is_compiled_once_its_calls_have_taken_their_time(
    monkeypatch, call_ms, queued_at
):
    """Queued at the call after the ready model's calls of that kind reach COMPILE_AFTER_MS
    (1,000 ms): short calls that recur a few times compile nothing."""
    clock = {"now": 0.0}
    monkeypatch.setattr(background, "_clock", lambda: clock["now"])
    monkeypatch.setattr(background, "COMPILE_AFTER_CALLS", 2)
    monkeypatch.setattr(background, "COMPILE_AFTER_MS", 1000.0)
    tiered, ready, target = _pair()
    _costing(tiered.ready, clock, call_ms)
    X, y = random_table(12, 2, 30, 8, 5, n_classes=3)
    held = _HeldWorker()
    for call in range(1, 7):
        tiered(X, y)
        assert background_compiles() == 1 + (queued_at is not None and call >= queued_at), call
    held.release()
    assert wait_for_compiles(timeout=120)
    assert tiered.compiled("forward", X, y) == (queued_at is not None)
    counted = dict(tiered._spent._ms)
    tiered(X, y)  # once queued, a kind's calls are no longer clocked (nor kept)
    assert (tiered._spent._ms == counted) == (queued_at is not None)


def test_at_most_max_queued_warm_ups_wait_and_a_call_left_out_is_queued_when_it_recurs(monkeypatch):
    monkeypatch.setattr(background, "MAX_QUEUED", 2)
    tiered, ready, target = _pair()
    first, second = (random_table(10 + i, 1, 20 + 4 * i, 5, 4, n_classes=2) for i in range(2))
    held = _HeldWorker()  # one of the two places
    tiered(*first)
    tiered(*second)
    assert background_compiles() == 2  # the held job and the first call's warm-up
    held.release()
    assert wait_for_compiles(timeout=120)
    assert tiered.compiled("forward", *first) and not tiered.compiled("forward", *second)
    tiered(*second)
    assert wait_for_compiles(timeout=120) and tiered.compiled("forward", *second)


def test_cache_builds_keep_to_the_queue_bound_too(monkeypatch):
    monkeypatch.setattr(background, "MAX_QUEUED", 2)
    tiered, ready, target = _pair()
    X, y = random_table(11, 1, 30, 6, 4, n_classes=2)
    held = _HeldWorker()
    first = tiered.build_cache(X[:, :30], y)  # the held job and this build fill the queue
    second = tiered.build_cache(X[:, :30], y)
    assert background_compiles() == 2
    held.release()
    assert wait_for_compiles(timeout=120)
    assert first.target is not None and second.target is None  # read by the ready model
    torch.testing.assert_close(
        tiered.forward_with_cache(X[:, 30:], second), tiered.forward_with_cache(X[:, 30:], first),
        atol=1e-5, rtol=0,
    )  # fmt: skip


def _costing(served, clock: dict, ms: float, entry: str = "forward"):
    """``served``'s ``entry`` advances the fake ``clock`` by ``ms`` per call."""
    method = getattr(served, entry)

    def costed(*args, **kwargs):
        clock["now"] += ms / 1e3
        return method(*args, **kwargs)

    setattr(served, entry, costed)


@pytest.mark.parametrize("ready_ms, target_ms, state", [(5.0, 9.0, "declined"), (9.0, 5.0, "compiled")])
def test_a_compiled_model_takes_a_call_over_only_where_it_answered_faster(
    monkeypatch, ready_ms, target_ms, state
):
    clock = {"now": 0.0}
    monkeypatch.setattr(background, "_clock", lambda: clock["now"])
    monkeypatch.setattr(background, "PAY_RUNS", 3)
    tiered, ready, target = _pair()
    _costing(tiered.ready, clock, ready_ms)
    _costing(tiered.target, clock, target_ms)
    X, y = random_table(8, 2, 30, 8, 5, n_classes=3)
    expected = tiered(X, y)
    assert wait_for_compiles(timeout=120)
    (key,) = tiered.timings
    assert tiered._state[key] == state
    assert tiered.timings[key] == pytest.approx((ready_ms, target_ms))
    # the warm-up, then three timed calls of each, interleaved
    assert target.calls == ["forward"] * 4 and ready.calls == ["forward"] * 4
    torch.testing.assert_close(tiered(X, y), expected, atol=1e-5, rtol=0)
    served_by = "target" if state == "compiled" else "ready"
    assert {"ready": ready, "target": target}[served_by].calls[-1] == "forward"
    assert len((target if state == "compiled" else ready).calls) == 5
    assert tiered.compiled("forward", X, y) == (state == "compiled")


class _Spinning:
    """A warm-up stand-in that calls a Python function in a loop (as a compiler does), counting,
    until :meth:`stop`; ``hold_captures``: inside ``exclusive_captures()``, as a warm-up runs."""

    def __init__(self, hold_captures: bool = False, pausable: bool = True):
        self.count = 0
        self._stop = threading.Event()
        self.hold_captures, self.pausable = hold_captures, pausable
        assert background._worker.submit(self)

    def _step(self) -> None:
        self.count += 1

    def __call__(self) -> None:
        from tabserve.models.tabicl.serving.served import exclusive_captures

        holding = exclusive_captures() if self.hold_captures else contextlib.nullcontext()
        pausing = contextlib.nullcontext() if self.pausable else background.no_pause()
        with holding, pausing:
            while not self._stop.is_set():
                self._step()

    def running(self) -> int:
        deadline = time.monotonic() + 30
        start = self.count
        while self.count == start and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.count

    def stop(self) -> None:
        self._stop.set()
        assert wait_for_compiles(30)


def test_a_running_warm_up_pauses_while_an_estimator_call_is_in_progress():
    from tabserve.models.tabicl.serving import served as serving

    spinning = _Spinning(hold_captures=True)
    assert spinning.running() > 0
    assert not serving._CAPTURES.acquire(blocking=False)  # held by the warm-up
    with background.foreground():
        time.sleep(0.05)  # the warm-up reaches its next function call
        paused_at = spinning.count
        time.sleep(0.3)
        assert spinning.count == paused_at  # no Python of the warm-up's runs beside the call
        assert serving._CAPTURES.acquire(blocking=False)  # released while it waits
        serving._CAPTURES.release()
    assert spinning.running() > paused_at  # it goes on once the call has ended ...
    assert not serving._CAPTURES.acquire(blocking=False)  # ... with the lock taken back
    spinning.stop()


@pytest.mark.parametrize("pausable", [True, False])
def test_a_call_captures_its_graph_once_a_running_warm_up_has_paused(monkeypatch, pausable):
    """A call of a shape not captured yet, made while a warm-up holds the captures, waits for the
    warm-up to pause and captures on the caller's thread; beside a warm-up that cannot pause it
    runs uncaptured after at most CAPTURE_WAIT_S, with the same answer."""
    from tabserve.buckets import BucketGrid
    from tabserve.models.tabicl.serving import served as serving

    monkeypatch.setattr(serving, "_BucketGraph", _CaptureOnCPU)
    monkeypatch.setattr(_CaptureOnCPU, "threads", [])
    grid = BucketGrid((16, 64), (8, 32), (8, 16))
    served = ServedTabICL(_model(), ServingOptions(buckets=True), grid)
    served.options = served.options.replace(cuda_graphs=True)  # replayed by the stand-in
    X, y = random_table(11, 2, 40, 10, 5, n_classes=3)
    spinning = _Spinning(hold_captures=True, pausable=pausable)
    assert spinning.running() > 0
    try:
        with background.foreground():
            start = time.monotonic()
            got = served(X, y)
            waited = time.monotonic() - start
    finally:
        spinning.stop()
    torch.testing.assert_close(got, our_model("clf", "tiny")(X, y), atol=1e-5, rtol=0)
    if pausable:
        assert (served.captures, served.uncaptured) == (1, 0)
        assert _CaptureOnCPU.threads == [threading.current_thread().name]
    else:
        assert (served.captures, served.uncaptured) == (0, 1) and _CaptureOnCPU.threads == []
        assert waited >= serving.CAPTURE_WAIT_S


def test_a_warm_up_holding_what_calls_need_does_not_pause_nor_past_max_pause(monkeypatch):
    spinning = _Spinning(pausable=False)  # inside no_pause(): a lock the calls take is held
    assert spinning.running() > 0
    with background.foreground():
        first = spinning.count
        time.sleep(0.3)
        assert spinning.count > first
    spinning.stop()
    monkeypatch.setattr(background, "MAX_PAUSE_S", 0.2)
    spinning = _Spinning()
    assert spinning.running() > 0
    with background.foreground():  # one call that lasts past MAX_PAUSE_S
        time.sleep(0.05)
        paused_at = spinning.count
        time.sleep(1.0)
        assert spinning.count > paused_at  # it went on beside the call
    spinning.stop()


def test_a_running_warm_up_waits_for_a_quiet_moment_after_a_call(monkeypatch):
    """The caller's own Python between two calls does not share the interpreter with a warm-up
    either: it goes on only once no call has run for QUIET_S."""
    monkeypatch.setattr(background, "QUIET_S", 0.5)
    spinning = _Spinning()
    assert spinning.running() > 0
    with background.foreground():
        time.sleep(0.05)
    ended = time.monotonic()
    paused_at = spinning.count
    time.sleep(0.2)
    assert spinning.count == paused_at  # the gap after the call is not quiet yet
    assert spinning.running() > paused_at
    assert time.monotonic() - ended >= 0.5
    spinning.stop()


def test_calls_that_never_leave_a_quiet_moment_let_a_warm_up_run_in_their_gaps(monkeypatch):
    monkeypatch.setattr(background, "MAX_DEFER_S", 0.5)
    spinning = _Spinning()
    assert spinning.running() > 0
    during_calls, seen = [], []  # the warm-up's progress during each call, and at its start
    start = ended = time.monotonic()
    quiet = False  # whether a gap so far was long enough to count as a quiet moment
    while time.monotonic() - start < 2.0:  # calls of 20 ms, 10 ms apart
        with background.foreground():
            now = time.monotonic()
            # A loaded machine can stretch a 10 ms sleep past QUIET_S: the warm-up may then run
            # in that gap by design, so only the calls before any such gap judge the waiting.
            quiet = quiet or now - ended >= background.QUIET_S
            before = spinning.count
            seen.append((now - start, before, quiet))
            time.sleep(0.02)
            during_calls.append(spinning.count - before)
        ended = time.monotonic()
        time.sleep(0.01)
    spinning.stop()
    assert max(during_calls) <= 1  # (at most the step it was in when the call began)
    early = [count for at, count, quiet in seen if at < 0.4 and not quiet]
    late = [count for at, count, _ in seen if at > 1.0]
    # The first call may begin inside a step, which the warm-up then finishes (as above).
    assert early and early[-1] - early[0] <= 1 and len(set(early[1:])) <= 1  # it waited ...
    assert late[-1] > late[0] > early[-1]  # ... in the first gaps, then ran in them


def test_a_warm_up_waits_until_the_estimator_calls_pause():
    started = threading.Event()
    with background.foreground():
        assert background._worker.submit(started.set)
        assert not started.wait(4 * background.QUIET_S)  # a call is in progress
    ended = time.monotonic()
    assert started.wait(30)
    assert time.monotonic() - ended >= 0.5 * background.QUIET_S
    assert wait_for_compiles(30)


def test_calls_that_never_pause_delay_a_warm_up_by_a_bounded_time(monkeypatch):
    monkeypatch.setattr(background, "MAX_DEFER_S", 0.5)
    started = threading.Event()
    with background.foreground():
        assert background._worker.submit(started.set)
        assert started.wait(30)  # ran while the call was still in progress
    assert wait_for_compiles(30)


def test_the_ready_model_must_not_compile():
    with pytest.raises(ValueError, match="must not compile"):
        CompilingTabICL(ServedTabICL(_model(), TRACED), ServedTabICL(_model(), TRACED))


def test_the_interpreter_exits_without_waiting_for_a_warm_up():
    """A warm-up still running at exit is interrupted: the process ends at once, cleanly."""
    code = """
import time
from tabserve.models.tabicl.serving import background
def slow():
    end = time.monotonic() + 600
    while time.monotonic() < end:
        sum(range(1000))
background._worker.submit(slow)
time.sleep(0.5)
print("submitted", background.background_compiles())
"""
    started = time.monotonic()
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert "submitted 1" in child.stdout
    assert time.monotonic() - started < 60
    assert "Traceback" not in child.stderr


@pytest.mark.cuda
@requires_cuda
def test_cuda_script_that_predicts_once_exits_cleanly_during_its_compile():
    """The estimator's default on CUDA: the first answer while the preset compiles in the
    background, then the interpreter exits mid-compile without an error or abort."""
    from tabicl_helpers import reference_checkpoint

    code = """
import sys
import numpy as np
from tabserve.models.tabicl import TabICLClassifier
from tabserve.models.tabicl.serving.background import background_compiles
rng = np.random.default_rng(0)
X, y = rng.standard_normal((400, 8)), rng.integers(0, 3, 400)
clf = TabICLClassifier(model_path=sys.argv[1], device="cuda").fit(X[:300], y[:300])
proba = clf.predict_proba(X[300:])
print("answered", proba.shape, type(clf.model_).__name__, background_compiles())
"""
    path = reference_checkpoint("clf", "full")
    child = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    assert "answered (100, 3)" in child.stdout
    assert "Traceback" not in child.stderr and "terminate" not in child.stderr


@requires_cuda
def test_the_clock_of_a_kind_reads_the_time_of_its_work_on_the_device():
    spent = background._Spent(torch.device("cuda"))
    a = torch.randn(2048, 2048, device="cuda")
    with spent.clock("matmuls"):
        for _ in range(20):
            a = a @ a.T / 2048
    with spent.clock(None):  # not counted
        a = a @ a
    torch.cuda.synchronize()
    assert spent.ms("matmuls") > 0 and spent.ms(None) == 0.0 and spent._running == []
