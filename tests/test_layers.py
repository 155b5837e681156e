"""The import rules of the repository's Python: the installed package's layers run one way (tools ->
integrations -> dispatch -> ops -> runtime), the lab sits on the package and bench on the lab, nothing
imports the tests, no module takes part in an import circle, no import inside a function hides one, no
module of the lab, bench or the tests edits sys.path to find the repository's own code, every module
imports, and the diagram of the layers in docs/architecture.md is the one the sources give."""

import importlib

import pytest

from . import import_graph

NOT_IMPORTED = ("rdna_flash_attn.__main__", "rdna_fa_lab.__main__")  # they run the CLI; test_cli runs them


@pytest.fixture(scope="module")
def imports():
    return import_graph.package_imports()


def test_the_graph_sees_the_package_the_lab_and_bench(imports):
    # A walker that found nothing would pass every rule below.
    importers = {imp.importer for imp in imports}
    assert {"rdna_flash_attn", "rdna_flash_attn.dispatch.router", "rdna_flash_attn.ops.attention",
            "rdna_flash_attn.runtime.loader", "rdna_flash_attn.tools.benchmark", "rdna_fa_lab.coverage",
            "rdna_fa_lab.interpreter.library", "rdna_fa_lab.hosts.webui_harness", "bench.suite",
            "bench.estimate_gfx1100"} <= importers
    assert {import_graph.part(name) for name in importers} >= {"api", "tools", "lab", "lab_interpreter", "lab_hosts",
                                                                 "bench"}
    assert len(imports) > 150


def test_no_import_circles(imports):
    assert import_graph.cycles(imports) == []


def test_imports_run_down_the_layers(imports):
    assert import_graph.layer_violations(imports) == []


def test_no_imports_hidden_in_functions(imports):
    assert import_graph.hidden_imports(imports) == []


def test_every_module_has_a_layer():
    for name in import_graph.modules():
        assert import_graph.part(name) in import_graph.LAYERS, name


# bench's calibration scripts read their command line on import and need Triton; the other modules import here.
@pytest.mark.parametrize("name", sorted(name for name in import_graph.modules()
                                        if name not in NOT_IMPORTED and not name.startswith("bench.calibration")))
def test_every_module_imports(name):
    assert importlib.import_module(name).__name__ == name


def test_architecture_page_diagram_is_current(imports):
    page = import_graph.DIAGRAM_PAGE.read_text(encoding="utf-8")
    assert import_graph.page_diagram(page) == import_graph.layer_diagram(imports), (
        "the layers changed: python -m tests.import_graph --write")


@pytest.mark.parametrize("importer, source, expected", [
    ("rdna_flash_attn.dispatch.router", "from ..runtime import loader\n", "rdna_flash_attn.runtime.loader"),
    ("rdna_flash_attn.dispatch.router", "from ..runtime.loader import KernelUnavailable\n",
     "rdna_flash_attn.runtime.loader"),
    ("rdna_flash_attn.dispatch.router", "from . import selftest\n", "rdna_flash_attn.dispatch.selftest"),
    ("rdna_flash_attn.dispatch.router", "import rdna_flash_attn.tools.cli\n", "rdna_flash_attn.tools.cli"),
    ("rdna_fa_lab.masked_throughput_estimate", "from . import throughput_estimate\n",
     "rdna_fa_lab.throughput_estimate"),
    ("bench.suite", "from bench import results_page\n", "bench.results_page"),
    ("bench.suite", "from tests.test_quantized import modelled_attention\n", "tests.test_quantized"),
])
def test_walker_resolves_relative_and_absolute_imports(tmp_path, importer, source, expected):
    module = tmp_path / "module.py"
    module.write_text(source)
    known = set(import_graph.modules()) | set(import_graph.modules((import_graph.TESTS,)))
    found = import_graph._imports_of(importer, module, known)
    assert [imp.imported for imp in found] == [expected]


def test_rules_catch_an_upward_import_a_circle_and_a_hidden_import():
    # The checks must fail on what they exist to catch.
    Import = import_graph.Import
    upward = Import("rdna_flash_attn.ops.attention", "rdna_flash_attn.dispatch.router", 1, False)
    back = Import("rdna_flash_attn.dispatch.router", "rdna_flash_attn.ops.attention", 1, False)
    hidden = Import("rdna_flash_attn.runtime.loader", "rdna_flash_attn.runtime.device", 9, True)
    sibling = Import("rdna_fa_lab.interpreter.library", "rdna_fa_lab.hosts.host_code", 1, False)
    package_to_lab = Import("rdna_flash_attn.tools.doctor", "rdna_fa_lab.interpreted", 1, False)
    lab_to_bench = Import("rdna_fa_lab.throughput_estimate", "bench.estimate_gfx1100", 1, False)
    bench_to_tests = Import("bench.backward_precision_model", "tests.edge_grid", 1, False)
    bench_circle = [Import("bench.suite", "bench.results_page", 1, False),
                    Import("bench.results_page", "bench.suite", 1, False)]
    assert len(import_graph.layer_violations([upward, sibling, package_to_lab, lab_to_bench, bench_to_tests])) == 5
    assert import_graph.cycles([upward, back]) != [] and import_graph.cycles(bench_circle) != []
    assert import_graph.hidden_imports([hidden]) != []
    assert import_graph.layer_violations([Import("bench.suite", "rdna_fa_lab.coverage", 1, False),
                                          Import("rdna_fa_lab.coverage", "rdna_flash_attn.tools.cli", 1, False)]) == []


def test_no_sys_path_edits_in_the_lab_bench_or_the_tests():
    assert import_graph.sys_path_edits() == []


@pytest.mark.parametrize("source", [
    "import sys\nsys.path.insert(0, str(REPO))\n",
    "import sys\nsys.path.append('bench')\n",
    "import sys\nif True:\n    sys.path[0] = ''\n",
    "import sys\nsys.path = ['.'] + sys.path\n",
    "import sys\nsys.path += ['.']\n",
    "def test(monkeypatch):\n    monkeypatch.syspath_prepend('bench')\n",
    "import site\nsite.addsitedir('.')\n",
    "def put_first_on_path(folder):\n    sys.path.insert(0, str(folder))\n",  # the allowed name, another file
])
def test_the_sys_path_check_fails_on_an_edit(source):
    (problem,) = import_graph.sys_path_edits_in(source, "bench/script.py")
    assert problem.startswith("bench/script.py line ")


def test_the_sys_path_check_passes_a_read_a_string_and_an_explained_edit():
    source = ("import sys\nprint(sys.path[0])\nCHILD = 'import sys; sys.path.insert(0, \".\")'\n"
              "def put_first_on_path(folder):\n    sys.path.insert(0, str(folder))\n")
    assert import_graph.sys_path_edits_in(source, "rdna_fa_lab/hosts/comfyui_harness.py") == []


def test_every_explained_sys_path_edit_is_still_made():
    # An entry whose function no longer edits the path would pass a new edit there unexplained.
    for relative, function in import_graph.SYS_PATH_EDITS:
        source = (import_graph.REPO / relative).read_text(encoding="utf-8")
        edits = import_graph.sys_path_edits_in(source, relative, allowed={})
        assert any(f" in {function}: " in edit for edit in edits), (relative, function)


@pytest.mark.parametrize("line, edits", [
    ("PYTHONPATH=. compute-sanitizer python3 tests/gpu/sanitize_kernels.py gfx11", True),
    ('PYTHONPATH="$PWD" python3 bench/suite.py', True),
    ("python3 -c 'import sys; sys.path.insert(0, \".\")'", True),
    ("export PYTHONPATH=/tmp/site", False),  # host packages unpacked for the GPU runs, not the repository
    ("python3 -m bench.suite --out \"$out\"", False),
])
def test_the_shell_check_finds_the_repository_put_on_the_path(line, edits):
    assert bool(import_graph.SHELL_PATH_EDIT.search(line)) == edits
