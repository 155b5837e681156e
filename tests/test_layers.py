"""The core package's layers: imports run one way (tools -> integrations -> dispatch -> ops -> runtime),
no module takes part in an import circle, no import inside a function hides one, every module imports,
and the diagram of the layers in docs/architecture.md is the one the sources give."""

import importlib

import pytest

from . import import_graph


@pytest.fixture(scope="module")
def imports():
    return import_graph.package_imports()


def test_the_graph_sees_the_package(imports):
    # A walker that found nothing would pass every rule below.
    importers = {imp.importer for imp in imports}
    assert {"rdna_flash_attn", "rdna_flash_attn.dispatch.router", "rdna_flash_attn.ops.attention",
            "rdna_flash_attn.runtime.loader", "rdna_flash_attn.tools.benchmark"} <= importers
    assert len(imports) > 60


def test_no_import_circles(imports):
    assert import_graph.cycles(imports) == []


def test_imports_run_down_the_layers(imports):
    assert import_graph.layer_violations(imports) == []


def test_no_imports_hidden_in_functions(imports):
    assert import_graph.hidden_imports(imports) == []


def test_every_module_has_a_layer():
    for name in import_graph.modules():
        assert import_graph.part(name) in import_graph.LAYERS, name


@pytest.mark.parametrize("name", sorted(set(import_graph.modules()) - {"rdna_flash_attn.__main__"}))
def test_every_module_imports(name):
    # __main__ runs the CLI when imported; test_cli runs it.
    assert importlib.import_module(name).__name__ == name


def test_architecture_page_diagram_is_current(imports):
    page = import_graph.DIAGRAM_PAGE.read_text(encoding="utf-8")
    assert import_graph.page_diagram(page) == import_graph.layer_diagram(imports), (
        "the layers changed: python -m tests.import_graph --write")


@pytest.mark.parametrize("source, expected", [
    ("from ..runtime import loader\n", "rdna_flash_attn.runtime.loader"),
    ("from ..runtime.loader import KernelUnavailable\n", "rdna_flash_attn.runtime.loader"),
    ("from . import selftest\n", "rdna_flash_attn.dispatch.selftest"),
    ("import rdna_flash_attn.tools.cli\n", "rdna_flash_attn.tools.cli"),
])
def test_walker_resolves_relative_and_absolute_imports(tmp_path, monkeypatch, source, expected):
    module = tmp_path / "router.py"
    module.write_text(source)
    known = set(import_graph.modules())
    found = import_graph._imports_of("rdna_flash_attn.dispatch.router", module, known)
    assert [imp.imported for imp in found] == [expected]


def test_rules_catch_an_upward_import_a_circle_and_a_hidden_import():
    # The checks must fail on what they exist to catch.
    upward = import_graph.Import("rdna_flash_attn.ops.attention", "rdna_flash_attn.dispatch.router", 1, False)
    back = import_graph.Import("rdna_flash_attn.dispatch.router", "rdna_flash_attn.ops.attention", 1, False)
    hidden = import_graph.Import("rdna_flash_attn.runtime.loader", "rdna_flash_attn.runtime.device", 9, True)
    sibling = import_graph.Import("rdna_flash_attn.config", "rdna_flash_attn.version", 1, False)
    assert len(import_graph.layer_violations([upward, sibling])) == 2
    assert import_graph.cycles([upward, back]) != []
    assert import_graph.hidden_imports([hidden]) != []
