"""The import graph of the repository's Python, read from its sources (nothing is imported): the
installed package (rdna_flash_attn) in its layers, the lab beside it (rdna_fa_lab) and the bench
scripts (bench), the rules they follow, and the diagram of them in docs/architecture.md.

    python -m tests.import_graph           # print the layer diagram (Mermaid)
    python -m tests.import_graph --write   # put it into docs/architecture.md between its markers

tests/test_layers.py checks the rules on this graph and that the page's diagram is the current one.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE, LAB, BENCH, TESTS = "rdna_flash_attn", "rdna_fa_lab", "bench", "tests"
WALKED = (PACKAGE, LAB, BENCH)  # the trees whose imports are read
DIAGRAM_PAGE = REPO / "docs" / "architecture.md"
DIAGRAM_START = "<!-- layers diagram: python -m tests.import_graph --write -->"
DIAGRAM_END = "<!-- end of layers diagram -->"

# Layer of each part, lowest first. A module may import modules of its own part and of parts with a
# lower rank, never one of a higher rank or a sibling of the same rank: so the package imports nothing
# of the lab, the lab nothing of bench, and nothing walked imports the tests.
LAYERS = {
    "environment": -1,
    "config": 0,
    "version": 0,
    "runtime": 1,
    "ops": 2,
    "dispatch": 3,
    "integrations": 4,
    "tools": 5,
    "api": 6,  # the package's own __init__, __main__ and the launch entry point
    "lab_interpreter": 7,
    "lab_hosts": 7,
    "lab": 8,  # the lab's CLI, its verbs, the estimates and the static report
    "bench": 9,
    "tests": 10,
}
PACKAGE_PARTS = ("environment", "config", "version", "runtime", "ops", "dispatch", "integrations", "tools")
LAB_PARTS = ("interpreter", "hosts")
LABELS = {
    "api": "rdna_flash_attn: the public API",
    "tools": "tools: the CLI",
    "integrations": "integrations: launcher, .pth hook, diffusers, flash-attn API",
    "dispatch": "dispatch: kernels or fallback, self-test, SDPA override",
    "ops": "ops: the kernels as torch ops",
    "runtime": "runtime: code objects, devices, loading, launching",
    "config": "config: settings, logger",
    "environment": "environment: the RDNA_FA_* variables read one way",
    "version": "version",
    "lab": "rdna_fa_lab: the lab's CLI, bench without a GPU, estimates, static report, coverage",
    "lab_interpreter": "rdna_fa_lab.interpreter: code objects run on the CPU",
    "lab_hosts": "rdna_fa_lab.hosts: ComfyUI, the WebUIs, diffusers, sd-scripts as hosts",
    "bench": "bench: benchmarks, studies, the estimators' records (python -m bench.NAME)",
}
INSTALLED = "installed"  # the diagram's box around the package's layers
# Imports inside functions that are not there to hide a circle, each with its reason.
DEFERRED_IMPORTS = {
    ("rdna_flash_attn.integrations.autoload", "rdna_flash_attn.dispatch.sdpa_patch"):
        "the .pth hook loads autoload.py by its path before torch is imported; the package comes after torch",
    ("rdna_flash_attn.integrations.autoload", "rdna_flash_attn.integrations.aten_attention"):
        "the .pth hook loads autoload.py by its path before torch is imported; the package comes after torch",
    ("rdna_fa_lab.interpreted", "rdna_fa_lab.interpreter"):
        "the interpreter needs numpy and tinygrad; the lab's bench shows the expected speed without them",
    ("rdna_fa_lab.interpreted_selftest", "rdna_fa_lab.interpreter"):
        "the interpreter needs numpy and tinygrad; without them the self-test says what to install",
}
# Edits of sys.path in the repository's Python outside the package, each with its reason: the repository's
# own code is imported as packages (python -m from the repository's root), never found by a path edit.
SYS_PATH_TREES = (LAB, BENCH, TESTS)
SYS_PATH_EDITS = {
    ("rdna_fa_lab/hosts/comfyui_harness.py", "put_first_on_path"):
        "a host's own code imports its modules as top-level names from its folder, as the host runs it",
    ("rdna_fa_lab/hosts/comfyui_harness.py", "take_off_path"): "the host's folder off sys.path again",
    ("tests/webui/conftest.py", "start"): "a fake WebUI's folders, as the WebUI runs from them (undone after the test)",
    ("tests/test_flash_attn_compat.py", "flash_attn"):
        "the stand-in's folder as `launch --flash-attn` puts it (undone after the test)",
    ("tests/test_flash_attn_compat.py", "real_flash_attn_dir"):
        "a folder standing in for an installed flash-attn (undone after the test)",
}
SYS_PATH_METHODS = ("insert", "append", "extend", "remove", "pop", "clear")
# Shell scripts that would put the repository on the module path instead.
SHELL_SCRIPTS = ("dev/*.sh", "bench/*.sh", ".ci/*")
SHELL_PATH_EDIT = re.compile(r"\bsys\.path\b|\bPYTHONPATH=[\"']?(\.|\$\{?PWD\}?|\$\(pwd\))(?=[\s:\"']|$)")


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    in_function: bool


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(trees: tuple[str, ...] = WALKED) -> dict[str, Path]:
    """Every module of the given trees (default: package, lab, bench) by its dotted name."""
    return {module_name(path): path for tree in trees for path in sorted((REPO / tree).rglob("*.py"))}


def part(module: str) -> str:
    """The layer a module belongs to: the package's subpackage ("api" for its top-level modules), the
    lab's interpreter or hosts ("lab" for the rest of it), bench or tests."""
    top, *rest = module.split(".")
    if top == PACKAGE:
        return rest[0] if rest and rest[0] in PACKAGE_PARTS else "api"
    if top == LAB:
        return f"lab_{rest[0]}" if rest and rest[0] in LAB_PARTS else "lab"
    return top


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                targets = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                source = _resolve(module, path.name == "__init__.py", child)
                # `from package import submodule` imports the submodule; `from module import name` the module
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                           for alias in child.names]
            else:
                visit(child, nested)
                continue
            found.extend(Import(module, target, child.lineno, in_function) for target in dict.fromkeys(targets)
                         if target.split(".")[0] in (*WALKED, TESTS))

    visit(tree, False)
    return found


def package_imports() -> list[Import]:
    """Every import of the package's, the lab's, bench's or the tests' modules by a module of the
    package, the lab or bench, at module level or inside a function."""
    found = modules()
    known = set(found) | set(modules((TESTS,)))
    return [imp for name, path in found.items() for imp in _imports_of(name, path, known)]


def cycles(imports: list[Import]) -> list[list[str]]:
    """The import cycles among the modules (each once, as a list of modules)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.importer, set()).add(imp.imported)
    found, state = [], {}  # state: 1 on the current path, 2 done

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt, path)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [])
    return found


def layer_violations(imports: list[Import]) -> list[str]:
    """Imports of a higher layer, or of a sibling of the same rank, one line each."""
    problems = []
    for imp in imports:
        source, target = part(imp.importer), part(imp.imported)
        if source != target and LAYERS[target] >= LAYERS[source]:
            problems.append(f"{imp.importer} (line {imp.line}, layer {source}) imports {imp.imported} (layer {target})")
    return problems


def hidden_imports(imports: list[Import]) -> list[str]:
    """Imports inside functions that DEFERRED_IMPORTS does not explain."""
    return [f"{imp.importer} line {imp.line} imports {imp.imported} inside a function"
            for imp in imports if imp.in_function and (imp.importer, imp.imported) not in DEFERRED_IMPORTS]


def _sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def _edits_path(node: ast.AST) -> bool:
    """Whether a node changes the module search path: sys.path.insert(...) and the other list methods,
    an assignment to sys.path or one of its items, monkeypatch.syspath_prepend, site.addsitedir."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        func = node.func
        return ((func.attr in SYS_PATH_METHODS and _sys_path(func.value)) or func.attr == "syspath_prepend"
                or (func.attr == "addsitedir" and isinstance(func.value, ast.Name) and func.value.id == "site"))
    if isinstance(node, (ast.Assign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(_sys_path(t) or (isinstance(t, ast.Subscript) and _sys_path(t.value)) for t in targets)
    return False


def sys_path_edits_in(source: str, relative: str, allowed: dict = SYS_PATH_EDITS) -> list[str]:
    """The path edits in one Python file (`relative` to the repository) that `allowed` does not explain,
    one line each, naming the function they are in."""
    found = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if _edits_path(child) and (relative, function) not in allowed:
                found.append(f"{relative} line {child.lineno} in {function or 'the module'}: "
                             f"{ast.unparse(child).splitlines()[0]}")
            visit(child, inner)

    visit(ast.parse(source, filename=relative), None)
    return found


def sys_path_edits() -> list[str]:
    """Every unexplained edit of the module path in the lab, bench and the tests, and every shell script
    of dev/, bench/ and .ci/ that puts the repository on the path."""
    found = []
    for tree in SYS_PATH_TREES:
        for path in sorted((REPO / tree).rglob("*.py")):
            found += sys_path_edits_in(path.read_text(encoding="utf-8"), path.relative_to(REPO).as_posix())
    for pattern in SHELL_SCRIPTS:
        for path in sorted(REPO.glob(pattern)):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if SHELL_PATH_EDIT.search(line):
                    found.append(f"{path.relative_to(REPO).as_posix()} line {number}: {line.strip()}")
    return found


def _node(name: str) -> str:
    return f'{name}["{LABELS[name]}"]'


def layer_diagram(imports: list[Import]) -> str:
    """The package's layers in one box, the lab's parts and bench beside it, and how many module-level
    imports run from each to each (into the package as a whole from outside it), as a Mermaid graph."""
    def end(module: str, importer: str) -> str:
        target = part(module)
        return INSTALLED if target in LAYERS and LAYERS[target] <= LAYERS["api"] < LAYERS[part(importer)] else target

    edges = Counter((part(imp.importer), end(imp.imported, imp.importer)) for imp in imports if not imp.in_function)
    edges = Counter({pair: n for pair, n in edges.items() if pair[0] != pair[1]})
    rank = {**LAYERS, INSTALLED: LAYERS["api"]}
    inside = sorted((n for n in LAYERS if LAYERS[n] <= LAYERS["api"]), key=lambda n: (-LAYERS[n], n))
    outside = sorted((n for n in LABELS if LAYERS[n] > LAYERS["api"]), key=lambda n: (-LAYERS[n], n))
    lines = ["```mermaid", "flowchart TD"]
    lines += [f"    {_node(name)}" for name in outside]
    lines.append(f'    subgraph {INSTALLED}["the installed package: rdna_flash_attn"]')
    lines += [f"        {_node(name)}" for name in inside]
    lines.append("    end")
    lines += [f"    {a} -->|{n}| {b}" for (a, b), n in sorted(edges.items(), key=lambda e: (-rank[e[0][0]], e[0]))]
    lines.append("```")
    return "\n".join(lines)


def page_diagram(text: str) -> str | None:
    """The diagram between the page's markers, or None without markers."""
    if DIAGRAM_START not in text or DIAGRAM_END not in text:
        return None
    return text.split(DIAGRAM_START, 1)[1].split(DIAGRAM_END, 1)[0].strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.import_graph", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="replace the diagram between docs/architecture.md's markers")
    args = parser.parse_args(argv)
    diagram = layer_diagram(package_imports())
    if not args.write:
        print(diagram)
        return 0
    text = DIAGRAM_PAGE.read_text(encoding="utf-8")
    if page_diagram(text) is None:
        print(f"{DIAGRAM_PAGE} has no markers {DIAGRAM_START!r} ... {DIAGRAM_END!r}", file=sys.stderr)
        return 1
    head, rest = text.split(DIAGRAM_START, 1)
    DIAGRAM_PAGE.write_text(f"{head}{DIAGRAM_START}\n{diagram}\n{DIAGRAM_END}{rest.split(DIAGRAM_END, 1)[1]}",
                            encoding="utf-8")
    print(f"wrote the layer diagram into {DIAGRAM_PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
