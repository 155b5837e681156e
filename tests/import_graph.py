"""The import graph of the core package, read from its sources (nothing is imported), its layers, and
the diagram of them in docs/architecture.md.

    python -m tests.import_graph           # print the layer diagram (Mermaid)
    python -m tests.import_graph --write   # put it into docs/architecture.md between its markers

tests/test_layers.py checks the rules on this graph and that the page's diagram is the current one.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "rdna_flash_attn"
PACKAGE_DIR = REPO / PACKAGE
DIAGRAM_PAGE = REPO / "docs" / "architecture.md"
DIAGRAM_START = "<!-- layers diagram: python -m tests.import_graph --write -->"
DIAGRAM_END = "<!-- end of layers diagram -->"

# Layer of each part of the package, lowest first. A module may import modules of its own part and of
# parts with a lower rank, never one of a higher rank or a sibling of the same rank.
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
}
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
}
# Imports inside functions that are not there to hide a circle, each with its reason.
DEFERRED_IMPORTS = {
    ("rdna_flash_attn.integrations.autoload", "rdna_flash_attn.dispatch.sdpa_patch"):
        "the .pth hook loads autoload.py by its path before torch is imported; the package comes after torch",
}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    in_function: bool


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name."""
    return {module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def part(module: str) -> str:
    """The layer a module belongs to: its subpackage, or "api" for the package's top-level modules."""
    pieces = module.split(".")
    if len(pieces) == 1:
        return "api"
    return pieces[1] if pieces[1] in LAYERS and pieces[1] != "api" else "api"


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
                         if target == PACKAGE or target.startswith(PACKAGE + "."))

    visit(tree, False)
    return found


def package_imports() -> list[Import]:
    """Every import of a package module by a package module, at module level or inside a function."""
    found = modules()
    return [imp for name, path in found.items() for imp in _imports_of(name, path, set(found))]


def cycles(imports: list[Import]) -> list[list[str]]:
    """The import cycles among the package's modules (each once, as a list of modules)."""
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
    """Imports of package modules inside functions that DEFERRED_IMPORTS does not explain."""
    return [f"{imp.importer} line {imp.line} imports {imp.imported} inside a function"
            for imp in imports if imp.in_function and (imp.importer, imp.imported) not in DEFERRED_IMPORTS]


def layer_diagram(imports: list[Import]) -> str:
    """The layers and how many module-level imports run from each to each, as a Mermaid graph."""
    edges = Counter((part(imp.importer), part(imp.imported)) for imp in imports
                    if not imp.in_function and part(imp.importer) != part(imp.imported))
    lines = ["```mermaid", "flowchart TD"]
    lines += [f'    {name}["{LABELS[name]}"]' for name in sorted(LAYERS, key=lambda n: (-LAYERS[n], n))]
    lines += [f"    {a} -->|{n}| {b}" for (a, b), n in sorted(edges.items(), key=lambda e: (-LAYERS[e[0][0]], e[0]))]
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
