"""The Triton operators' shared rules (python/tabserve/kernels): what Inductor needs of a kernel
to compile it into a graph.

Under ``torch.compile`` Inductor does not call a ``triton_op``'s kernel object: it copies the
kernel's source and the source of every ``@triton.jit`` helper it calls into its own generated
module, each helper under the name of its ``def``. A helper imported under another name
(``from ._common import round_to as _round``) then fails there with ``NameError`` while eager
calls work (on the H200 every compiled model with a fused operator fails so). So every jit
function a kernel calls must be called by its own name.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import pkgutil

import pytest
from tabicl_helpers import interpreter_child

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed"
)

#: Every module of the package, each walked for its jit functions (``_resident``, ``layout`` and
#: ``precompile`` have none).
KERNEL_MODULES = (
    "feed_forward", "norm_linear", "flash_attention", "_common", "_resident", "layout", "precompile"
)
#: The jit helpers each operator's kernel reaches (Inductor's copy must define them).
KERNEL_HELPERS = {
    "feed_forward._feed_forward_kernel": {"round_to", "layer_norm_rows"},
    "norm_linear._norm_linear_kernel": {"round_to", "layer_norm_rows"},
    "flash_attention._flash_attention_kernel": {"round_to", "_load_keys", "_key_block"},
    "flash_attention._quantize_kernel": set(),
}


def _jit_functions():
    from triton.runtime.jit import JITFunction

    for name in KERNEL_MODULES:
        module = importlib.import_module(f"tabserve.kernels.{name}")
        for attribute, value in vars(module).items():
            if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__:
                yield f"{name}.{attribute}", value


def _called_jit_names(kernel):
    """``{name in the kernel's source: the jit function it resolves to}``."""
    from triton.runtime.jit import JITFunction

    called = {}
    for node in ast.walk(ast.parse(kernel.src)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            value = kernel.fn.__globals__.get(node.func.id)
            if isinstance(value, JITFunction):
                called[node.func.id] = value
    return called


def test_every_kernel_module_is_listed():
    import tabserve.kernels as package

    found = {m.name for m in pkgutil.iter_modules(package.__path__)}
    assert found == set(KERNEL_MODULES)


def test_kernels_call_their_jit_helpers_by_their_own_names():
    kernels = dict(_jit_functions())
    assert set(KERNEL_HELPERS) <= set(kernels)
    helpers_seen = set()
    for where, kernel in kernels.items():
        for name, helper in _called_jit_names(kernel).items():
            helpers_seen.add(helper.fn.__name__)
            assert name == helper.fn.__name__, (
                f"{where} calls the jit function {helper.fn.__name__} as {name}: Inductor's "
                f"generated module defines it as {helper.fn.__name__} only"
            )
    assert set().union(*KERNEL_HELPERS.values()) <= helpers_seen  # the walk reached them


def test_inductors_copy_of_each_kernel_defines_every_function_it_calls():
    # Inductor's own gathering of a user kernel's source (a private API: skipped if it moves).
    wrapper = pytest.importorskip("torch._inductor.codegen.wrapper")
    gather = getattr(wrapper, "user_defined_triton_kernel_transitive_closure_source_code", None)
    if gather is None:
        pytest.skip("this torch gathers user kernels' source differently")
    kernels = {w: k for w, k in _jit_functions() if w.endswith("_kernel")}
    assert set(kernels) == set(KERNEL_HELPERS)
    for where, kernel in kernels.items():
        tree = ast.parse(gather(kernel))
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        called = {
            n.func.id
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        }
        assert called - defined - set(dir(builtins)) == set(), where
        assert KERNEL_HELPERS[where] <= defined, where


def test_weights_cast_on_the_host_give_the_kernels_own_bits():
    """Both kernels take their weight matrices already in the matmul dtype
    (``_common.matmul_operand``): the same round-to-nearest as the kernels' own ``round_to`` of
    fp32 weights, so the outputs are the bits the kernels gave with fp32 weights. Checked in a
    child under ``TRITON_INTERPRET=1`` (fp16: the interpreter has no bf16) on every interpreter
    case of both operators."""
    code = """
import json, torch, test_feed_forward as tf, test_norm_linear as tn
from tabicl_helpers import interpreter_child
from tabserve.kernels import feed_forward as ff, norm_linear as nl
def both(module, run):
    cast = run()
    original = module.matmul_operand
    module.matmul_operand = lambda w, dtype: w.contiguous()  # fp32 into the kernel, as before
    try:
        return torch.equal(cast, run())
    finally:
        module.matmul_operand = original
out = []
for _, leading, dim, hidden, x_dtype, bias, update in tf.KERNEL_CASES:
    args = tf.make_inputs(leading, dim, hidden, x_dtype, bias, update)
    out.append(both(ff, lambda: ff.run_kernel(*args, 1e-5, torch.float16)))
for case in tn.KERNEL_CASES:
    args = tn.make_inputs(*case)
    out.append(both(nl, lambda: nl.run_kernel(*args, 1e-5, torch.float16)))
print(json.dumps(out))
"""
    results = interpreter_child(code, timeout=600)
    assert len(results) >= 10 and all(results), results


@pytest.mark.parametrize("limit", [16, 100, 256])
def test_register_limit_takes_what_ptxas_takes_only(limit):
    from tabserve.kernels import _common

    with pytest.raises(ValueError, match="register limit must be a multiple of 8"):
        with _common.register_limit_override(limit):
            pass
    assert _common.launch_limits() == {}


def test_a_register_limit_reaches_the_launch_and_changes_no_result():
    """Under ``register_limit_override`` every launch of both kernels carries ``maxnreg`` (the
    compiled graphs never see it: outside, no launch option is added) and computes the same
    bits (under ``TRITON_INTERPRET=1``, which takes the option and ignores it; on the GPU the
    benchmarks' ``--max-registers`` check each limited kernel against the composite)."""
    code = """
import json, torch, test_feed_forward as tf, test_norm_linear as tn
from tabserve.kernels import _common, feed_forward as ff, norm_linear as nl
seen = []
original = _common.launch_limits
def recording():
    seen.append(original())
    return seen[-1]
ff.launch_limits = nl.launch_limits = recording
_, leading, dim, hidden, x_dtype, bias, update = tf.KERNEL_CASES[0]
ff_args = tf.make_inputs(leading, dim, hidden, x_dtype, bias, update)
nl_args = tn.make_inputs(*tn.KERNEL_CASES[0])
runs = (lambda: ff.run_kernel(*ff_args, 1e-5, torch.float16),
        lambda: nl.run_kernel(*nl_args, 1e-5, torch.float16))
plain = [run() for run in runs]
with _common.register_limit_override(128):
    limited = [run() for run in runs]
print(json.dumps({"equal": [torch.equal(a, b) for a, b in zip(plain, limited)], "seen": seen}))
"""
    result = interpreter_child(code, timeout=600)
    assert result["equal"] == [True, True]
    assert result["seen"] == [{}, {}, {"maxnreg": 128}, {"maxnreg": 128}]


def test_no_triton_compiles_refuses_a_compile_in_its_own_thread_only(monkeypatch):
    """Triton calls ``knobs.runtime.jit_cache_hook`` before it compiles a specialization that
    is not in the process's kernel cache: inside ``no_triton_compiles`` that call raises, in
    the guarded thread only; elsewhere the hook found before ours is still called."""
    import threading

    knobs = pytest.importorskip("triton.knobs")
    from tabserve.kernels import _common

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(kw["repr"]))
    monkeypatch.setattr(_common, "_chained_hook", [None])
    assert _common.guards_compiles()
    with _common.no_triton_compiles():
        hook = knobs.runtime.jit_cache_hook
        with pytest.raises(_common.WouldCompile, match=r"k\[1\] is not compiled yet"):
            hook(repr="k[1]")
        # nested: still refused, and once left still guarded
        with _common.no_triton_compiles(), pytest.raises(_common.WouldCompile):
            hook(repr="k[2]")
        with pytest.raises(_common.WouldCompile):
            hook(repr="k[3]")
        other = threading.Thread(target=lambda: hook(repr="k[4]"))
        other.start()
        other.join()
    hook(repr="k[5]")
    assert seen == ["k[4]", "k[5]"]
    assert knobs.runtime.jit_cache_hook is hook  # installed once, kept


def test_a_hook_installed_after_ours_that_chains_to_ours_is_called_once(monkeypatch):
    knobs = pytest.importorskip("triton.knobs")
    from tabserve.kernels import _common

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(_common, "_chained_hook", [None])
    with _common.no_triton_compiles():
        pass
    ours, calls = knobs.runtime.jit_cache_hook, []

    def theirs(**kw):  # a user's hook, chaining to the one it found (ours)
        calls.append(kw["repr"])
        return ours(**kw)

    knobs.runtime.jit_cache_hook = theirs
    with _common.no_triton_compiles(), pytest.raises(_common.WouldCompile):  # ours, chaining theirs
        knobs.runtime.jit_cache_hook(repr="k[1]")
    assert knobs.runtime.jit_cache_hook is ours
    assert ours(repr="k[2]") is None  # what Triton calls: ours, theirs once, no recursion
    assert calls == ["k[2]"]


def test_no_triton_compiles_needs_the_runtime_hooks(monkeypatch):
    from tabserve.kernels import _common

    monkeypatch.setattr(_common, "triton", None)
    assert not _common.guards_compiles()
    with pytest.raises(RuntimeError, match="needs Triton 3.4 or later"), _common.no_triton_compiles():
        pass
