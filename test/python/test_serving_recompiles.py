"""No recompiles in serving: after warming a bucket grid, fresh tables of random shapes inside it
reuse the compiled graphs (whole-model ``fullgraph`` compile and regional compile), one-shot and
KV-cached, on CPU.

Dynamo's counters decide; the ``eager`` compile backend keeps the test fast (recompiles are
Dynamo's business, code generation is not under test here). The served model is a copy: regional
compile compiles the blocks of the model it is given in place.
"""

from __future__ import annotations

import copy
import gc
import inspect
import random

import pytest
import torch
from tabicl_helpers import our_model, random_table
from tabserve.buckets import BucketGrid
from tabserve.models.tabicl.serving import options
from tabserve.models.tabicl.serving.options import ServingOptions
from tabserve.models.tabicl.serving.served import ServedTabICL
from torch._dynamo.utils import counters

#: Whole-model compile with dynamic shapes, flash attention first, fp16.
DYNAMIC_FLASH = ServingOptions(
    precision="fp16",
    compile="default",
    dynamic=True,
    attention={"col": "flash", "row": "flash", "icl": "flash"},
)

GRID = BucketGrid(train_rows=(8, 16), test_rows=(8,), features=(6,))
TABLES = 2  # ensemble members per call: the batch is a shape too


def _stream(count: int, seed: int):
    """Fresh tables of random shapes inside GRID: (n_train, X, y_train)."""
    rng = random.Random(seed)
    for i in range(count):
        n_train, n_test, n_features = rng.randint(3, 16), rng.randint(1, 8), rng.randint(1, 6)
        yield n_train, *random_table(seed * 100 + i, TABLES, n_train, n_test, n_features, 3)


def _graphs() -> int:
    return counters["stats"].get("unique_graphs", 0)


def _assert_padding_exact(padded: torch.Tensor, unpadded: torch.Tensor) -> None:
    """The bucketed-inference issue's fp32 bound, as test_padded_inference.py holds the eager
    padded path to it: 1e-6 relative to the largest logit (a few fp32 ulp: GEMMs of other row
    counts sum in another order), the same argmax. The ``eager`` backend runs the traced graphs'
    own operations, so whole-model and regional compile are held to it too."""
    assert padded.shape == unpadded.shape
    assert (padded - unpadded).abs().max() <= 1e-6 * max(1.0, unpadded.abs().max().item())
    assert torch.equal(padded.argmax(-1), unpadded.argmax(-1))


@pytest.mark.parametrize("compile_mode", ["default", "regional"])
def test_fresh_tables_trigger_no_recompiles(compile_mode):
    torch._dynamo.reset()
    counters.clear()
    served = ServedTabICL(
        copy.deepcopy(our_model("clf", "tiny")),
        ServingOptions(buckets=True, compile=compile_mode, compile_backend="eager"),
        GRID,
    )
    assert served.warm_up(tables=TABLES, kv_cache=True) == len(GRID.buckets())
    warm = _graphs()
    assert warm > 0
    reference = our_model("clf", "tiny")
    for _, X, y in _stream(20, seed=1):
        _assert_padding_exact(served(X, y), reference(X, y))
    assert _graphs() == warm, "a fresh table in a warm bucket recompiled"
    for n_train, X, y in _stream(4, seed=2):
        cache = served.build_cache(X[:, :n_train], y)
        _assert_padding_exact(served.forward_with_cache(X[:, n_train:], cache), reference(X, y))
    assert _graphs() == warm, "a fresh KV cache in a warm bucket recompiled"
    assert counters["graph_break"] == {}


def test_dynamic_recipe_serves_fresh_unpadded_shapes_without_recompiles():
    # fp16-dynamic-flash's compile, in fp32 on CPU (no flash here): one dynamic graph per frame of
    # the unpadded model from the first table on; later tables of new shapes (every size >= 2,
    # since Dynamo specialises 0 and 1, and the same class count, a Python int) reuse them.
    torch._dynamo.reset()
    counters.clear()
    recipe = DYNAMIC_FLASH.replace(
        precision="fp32", attention={}, compile_backend="eager"
    )
    served = ServedTabICL(copy.deepcopy(our_model("clf", "tiny")), recipe)
    reference = our_model("clf", "tiny")
    rng = random.Random(5)
    # The first table's sizes all differ (from each other, the 2 tables and the 3 classes):
    # Dynamo's duck sizing would otherwise tie equal sizes into one symbol and compile again when
    # a later table breaks the tie.
    shapes = [(29, 7, 5)] + [(rng.randint(3, 40), rng.randint(2, 12), rng.randint(2, 9)) for _ in range(7)]
    for i, (n_train, n_test, n_features) in enumerate(shapes):
        X, y = random_table(500 + i, TABLES, n_train, n_test, n_features, 3)
        assert (served(X, y) - reference(X, y)).abs().max() <= 1e-5
        if i == 0:
            first = _graphs()
            assert first > 0
    assert _graphs() == first, "a new table shape recompiled under dynamic=True"


def test_dynamic_recipe_traces_the_network_once_with_floats_specialised():
    """The dynamic-shape recipe specialises floats while it traces (``specialized_floats``):
    otherwise Dynamo traces each module's float attribute (every LayerNorm's eps) as a
    symbolic float, pins it when the graph is lowered (AOTAutograd's pass over Python
    scalars, so not with the ``eager`` backend) and traces the whole network again, which
    lengthened the cold call of a dynamic-shape flash compile past its timeout on the H200's large
    workload. The operations captured must stay near the static compile's (without the
    setting: 2.3x), the outputs those of the eager model, and the setting the caller's."""
    captured = {}
    for dynamic in (False, True):
        torch._dynamo.reset()
        counters.clear()
        recipe = DYNAMIC_FLASH.replace(
            precision="fp32", attention={}, compile_backend="aot_eager", dynamic=dynamic
        )
        served = ServedTabICL(copy.deepcopy(our_model("clf", "tiny")), recipe)
        X, y = random_table(7, TABLES, 29, 7, 5, 3)
        assert (served(X, y) - our_model("clf", "tiny")(X, y)).abs().max() <= 1e-5
        captured[dynamic] = counters["stats"]["calls_captured"]
        assert torch._dynamo.config.specialize_float is False  # restored after the call
    assert captured[True] <= 1.25 * captured[False], captured


def test_dynamic_recipe_reads_the_checks_verdict_outside_its_graphs():
    """The checks' verdict is read on the host and Dynamo does not trace past the read: under
    ``dynamic=True`` the verdict's ints were symbols and the rest of the read became a graph
    of integer inputs only (``K > max_classes``), which torch 2.11's Inductor compiled into
    code naming an unbound symbol (a NameError on the H200). Every graph the recipe
    captures must take a tensor, and the outputs stay the eager model's."""
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append([n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"])
        return gm.forward

    torch._dynamo.reset()
    recipe = DYNAMIC_FLASH.replace(
        precision="fp32", attention={}, compile_backend=recording_backend
    )
    served = ServedTabICL(copy.deepcopy(our_model("clf", "tiny")), recipe)
    for seed, (n, m, f, k) in enumerate([(29, 7, 5, 3), (33, 9, 6, 4)]):
        X, y = random_table(70 + seed, TABLES, n, m, f, k)
        assert (served(X, y) - our_model("clf", "tiny")(X, y)).abs().max() <= 1e-5
    assert graphs, "the recipe captured nothing"
    for inputs in graphs:
        assert any(isinstance(v, torch.Tensor) for v in inputs), f"a graph of {inputs} alone"


@pytest.mark.parametrize("defer", [True, False])
def test_a_new_class_count_recaptures_only_the_logits_slice(defer):
    """The unpadded compiled model (whole-model compile): with the checks' verdict read after
    the network (``defer_checks``), the network's graph does not depend on K, so a table of
    another class count recaptures only the few operations after the read; read first, K was a
    Python int inside the network's frame and the whole network was traced again."""
    torch._dynamo.reset()
    counters.clear()
    model = copy.deepcopy(our_model("clf", "tiny"))
    model.defer_checks = defer
    model.compile(backend="eager")
    for seed, classes in ((1, 3), (2, 4)):
        X, y = random_table(600 + seed, TABLES, 30, 6, 5, classes)
        out = model(X, y)
        assert out.shape == (TABLES, 6, classes)
        if seed == 1:
            first = counters["stats"]["calls_captured"]
    again = counters["stats"]["calls_captured"] - first
    if defer:
        assert again <= 5, f"another class count retraced {again} operations"
    else:
        assert again > first / 2  # what deferring saves: the whole network again


def test_frozen_recipe_keeps_the_weights_it_compiled_with():
    """``Recipe.freeze`` (Inductor's freezing, code generation on): the feed-forward weights'
    fp16 casts are folded into the graph as constants, so the served answers stay those of the
    weights it compiled with, and they match fp32 as the unfrozen recipe does."""
    torch._dynamo.reset()
    model = copy.deepcopy(our_model("clf", "tiny"))
    X, y = random_table(3, TABLES, 12, 5, 4, 3)
    reference = model(X, y, return_logits=False)
    frozen = ServedTabICL(model, ServingOptions(precision="fp16", buckets=True, compile="default").replace(freeze=True), GRID)
    before = frozen(X, y, return_logits=False)
    assert (before.float() - reference).abs().max() <= 2e-2  # the reduced-precision gate
    assert torch.equal(before.argmax(-1), reference.argmax(-1))
    with torch.no_grad():
        for block in model.modules():
            if isinstance(getattr(block, "linear1", None), torch.nn.Linear):
                block.linear1.weight.mul_(-3)
    assert (model(X, y, return_logits=False) - reference).abs().max() > 1e-2  # the change shows
    assert torch.equal(frozen(X, y, return_logits=False), before)  # ... not in the frozen graph
    assert torch._inductor.config.freezing is False  # only on around the served calls


def _tensor_bytes(t: torch.Tensor) -> int:
    """A tensor's bytes: its storage's, or for a tensor without storage (oneDNN's packed
    weights, which Inductor's freezing makes on CPUs with fp16 matrix units such as AMX) its
    elements'."""
    if t.layout == torch.strided:
        return t.untyped_storage().nbytes()
    return t.numel() * t.element_size()


def _live_tensor_bytes() -> int:
    """Bytes of every real tensor the garbage collector can reach (fake and meta ones aside)."""
    from torch._subclasses.fake_tensor import FakeTensor

    gc.collect()
    return sum(
        _tensor_bytes(t)
        for t in gc.get_objects()
        if issubclass(type(t), torch.Tensor)  # type(): lazy modules' __getattr__ would warn
        and not issubclass(type(t), FakeTensor)
        and t.device.type != "meta"
    )


def test_tensor_bytes_counts_tensors_without_storage():
    dense = torch.zeros(6, 4)
    assert _tensor_bytes(dense) == 96
    assert _tensor_bytes(dense[:2]) == 96  # a view counts its whole storage
    if torch.backends.mkldnn.is_available():
        packed = dense.to_mkldnn()
        with pytest.raises(NotImplementedError):
            packed.untyped_storage()
        assert _tensor_bytes(packed) == 96


@pytest.mark.parametrize("buckets", [True, False], ids=["buckets", "whole-model"])
def test_dropped_frozen_served_models_leave_no_graphs_behind(buckets):
    """Frozen graphs hold their model's weights as constants. Served models built and dropped
    one after another (the estimators' model cache evicts them) must take their graphs with
    them, from Dynamo's caches and Inductor's module cache alike, while a served model still
    held keeps answering from its own graphs."""
    from tabserve.models.tabicl.network.model import TabICLv2
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._inductor.codecache import PyCodeCache

    torch._dynamo.reset()
    options = ServingOptions(precision="fp16", buckets=buckets, compile="default")
    options = options.replace(freeze=True)
    X, y = random_table(3, TABLES, 12, 5, 4, 3)

    def served():
        model = copy.deepcopy(our_model("clf", "tiny"))
        return ServedTabICL(model, options, GRID if buckets else None)

    kept = served()
    expected = kept(X, y, return_logits=False)
    footprints = []
    for _ in range(3):
        dropped = served()
        assert (dropped(X, y, return_logits=False) - expected).abs().max() <= 1e-3
        del dropped
        footprints.append((_live_tensor_bytes(), len(PyCodeCache.modules)))
    assert footprints[2] == footprints[1] == footprints[0], footprints
    shared = TabICLv2.padded_forward if buckets else inspect.unwrap(TabICLv2.forward)
    assert _debug_get_cache_entry_list(shared.__code__) == []  # each compiled its own code
    assert torch.equal(kept(X, y, return_logits=False), expected)


def test_freeze_needs_an_inductor_compile():
    fp16 = ServingOptions(precision="fp16")
    with pytest.raises(ValueError, match="freeze is Inductor's freezing"):
        fp16.replace(freeze=True)
    with pytest.raises(ValueError, match="freeze is Inductor's freezing"):
        ServingOptions(precision="fp16", buckets=True, compile="default", compile_backend="eager").replace(freeze=True)
    assert ServingOptions.from_dict({"precision": "fp16", "compile": "default", "freeze": True}).freeze


def test_cuda_graph_recipes_freeze_while_capturing_only(monkeypatch):
    """With CUDA graphs only the captures trace: serving turns freezing on around them, and a
    replay runs with the flag as the caller left it (a CPU stand-in records both)."""
    from tabserve.models.tabicl.serving import served as serving

    flags = []

    class Recorder:
        def __init__(self, fn, inputs, static=(), pool=None):
            flags.append(("capture", torch._inductor.config.freezing))
            self.output = fn(*inputs, *static)

        def __call__(self, *inputs):
            flags.append(("replay", torch._inductor.config.freezing))
            return self.output

    monkeypatch.setattr(serving, "_BucketGraph", Recorder)
    torch._dynamo.reset()
    model = copy.deepcopy(our_model("clf", "tiny"))
    recipe = ServingOptions(precision="fp16", buckets=True, compile="default").replace(freeze=True)
    served = ServedTabICL(model, recipe, GRID)
    served.options = recipe.replace(cuda_graphs=True)  # the CUDA check passed: CPU stand-in
    X, y = random_table(4, TABLES, 12, 5, 4, 3)
    first = served(X, y, return_logits=False)
    again = served(X, y, return_logits=False)
    assert flags == [("capture", True), ("replay", False), ("replay", False)]
    assert torch.equal(first, again)
    assert (first.float() - model(X, y, return_logits=False)).abs().max() <= 2e-2


def test_freezing_stays_on_while_any_caller_is_inside():
    """Host threads share a served model: one caller leaving must not turn freezing off under
    another that may be tracing; the last one out restores the setting it found."""
    config = torch._inductor.config
    assert config.freezing is False
    first, second = options.freezing(), options.freezing()
    first.__enter__()
    second.__enter__()
    with options.freezing(False):  # a caller without freeze changes nothing
        assert config.freezing is True
    first.__exit__(None, None, None)
    assert config.freezing is True  # the second caller is still inside
    second.__exit__(None, None, None)
    assert config.freezing is False
    with pytest.raises(RuntimeError, match="boom"), options.freezing():
        raise RuntimeError("boom")
    assert config.freezing is False  # restored on an exception too
