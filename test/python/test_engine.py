"""The engine interface: the plain network, the served model and the compiling model implement
it, and the estimators use nothing of their engine beyond it."""

from __future__ import annotations

import ast
import inspect

import torch
from tabicl_helpers import our_model, random_table
from tabserve.models.tabicl.network.engine import Engine
from tabserve.models.tabicl.network.offload import host_store
from tabserve.models.tabicl.serving.background import CompilingTabICL
from tabserve.models.tabicl.serving.options import ServingOptions
from tabserve.models.tabicl.serving.served import SKIP_VALUE, ServedTabICL
from tabserve.models.tabicl.sklearn import estimators, many

MEMBERS = {name for name in vars(Engine) if not name.startswith("_")} | {"__call__"}


def test_every_way_of_running_the_model_is_an_engine_and_answers_alike():
    model = our_model("clf", "tiny")
    served = ServedTabICL(model, "exact")
    compiling = CompilingTabICL(ServedTabICL(model, "exact"), ServedTabICL(model, "exact"))
    X, y = random_table(0, 2, 12, 5, 4, 3)
    expected = model(X, y)
    for engine in (model, served, compiling):
        assert isinstance(engine, Engine)
        assert engine.config is model.config and engine.is_regressor is False
        torch.testing.assert_close(engine(X, y), expected, rtol=0, atol=1e-6)
        cache = engine.build_cache(X[:, :12], y)
        torch.testing.assert_close(engine.forward_with_cache(X[:, 12:], cache), expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(
            engine.forward_offloaded(X, y, host_store), expected, rtol=0, atol=1e-6
        )
        # Two tables of other sizes on one bucket: a count per table.
        padded = torch.full((2, 16 + 8, 6), SKIP_VALUE)
        padded[:, :12, :4], padded[:, 16:21, :4] = X[:, :12], X[:, 12:]
        labels = torch.zeros(2, 16)
        labels[:, :12] = y
        counts = torch.tensor([12, 12]), torch.tensor([4, 4])
        with torch.no_grad():
            raw = engine.padded_forward(padded, labels, *counts)
        torch.testing.assert_close(torch.log_softmax(raw[:, :5, :3], -1), torch.log_softmax(expected, -1), rtol=0, atol=1e-5)
    assert not isinstance(object(), Engine)


def test_the_estimators_use_only_the_engine_interface():
    used = set()
    for module in (estimators, many):
        used |= _engine_members_used(module)
    assert used and used <= MEMBERS, used - MEMBERS


def _engine_members_used(module) -> set:
    """What ``module`` reads of an estimator's ``model_``, or of a variable named ``engine``."""
    tree = ast.parse(inspect.getsource(module))
    used = set()
    for node in ast.walk(tree):
        target = node.func if isinstance(node, ast.Call) else node
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute):
            if target.value.attr == "model_" and isinstance(target.value.value, ast.Name):
                used.add(target.attr)
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            if target.value.id == "engine":
                used.add(target.attr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "model_":
            used.add("__call__")
    return used
