"""Measure a package's structure from its source: modules, imports between them, floors, import circles,
imports that run back up a circle, and the longest function and class.

    python tools/structure.py chunkmem              # the package in this checkout
    python tools/structure.py chunkmem --edges      # and every import, module -> module

An *import* is a distinct pair (module A imports module B) among the package's own modules, wherever the
import statement stands (function-level imports count; ``if TYPE_CHECKING:`` ones do not, as they never
run). A module's *floor* is 1 + the highest floor it imports (1: it imports none of the package); a
*circle* is a set of modules that import each other (a strongly connected component of more than one
module), and an import inside a circle *runs back up*. Sizes are in lines.
"""
from __future__ import annotations

import argparse
import ast
import os
import sys


def modules_of(package_dir: str) -> dict[str, str]:
    """Dotted module name -> file path, for every ``.py`` file of the package."""
    root = os.path.dirname(os.path.abspath(package_dir))
    found = {}
    for folder, _, files in os.walk(package_dir):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                found[dotted[:-len(".__init__")] if dotted.endswith(".__init__") else dotted] = path
    return found


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(module: str, path: str, known: dict[str, str]) -> set[str]:
    """The package's modules that ``module`` imports."""
    tree = ast.parse(open(path).read())
    skipped = _type_checking_lines(tree)
    is_package = path.endswith("__init__.py")
    out: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    out.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                base = parts if is_package else parts[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                if f"{target}.{alias.name}" in known:
                    out.add(f"{target}.{alias.name}")
                elif target in known:
                    out.add(target)
    out.discard(module)
    return out


def circles(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return found


def floors(edges: dict[str, set[str]], in_circle: dict[str, int]) -> dict[str, int]:
    """Each module's floor, a circle counted as one module."""
    memo: dict[str, int] = {}

    def floor(v: str, seen: frozenset) -> int:
        if v in memo:
            return memo[v]
        below = [w for w in edges[v] if w not in seen and in_circle.get(w, -1) != in_circle.get(v, -2)]
        result = 1 + max((floor(w, seen | {v}) for w in below), default=0)
        memo[v] = result
        return result

    return {v: floor(v, frozenset()) for v in edges}


def longest(paths: dict[str, str], kind: type) -> tuple[int, str]:
    best = (0, "")
    for module, path in paths.items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, kind):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                best = max(best, (size, f"{module}.{node.name}"))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("package", help="the package's folder, e.g. chunkmem")
    parser.add_argument("--edges", action="store_true", help="print every import, module -> module")
    args = parser.parse_args()
    paths = modules_of(args.package)
    edges = {m: imports_of(m, p, paths) for m, p in paths.items()}
    found = circles(edges)
    in_circle = {m: i for i, c in enumerate(found) for m in c}
    back_up = sum(1 for v, ws in edges.items() for w in ws if v in in_circle and in_circle.get(w) == in_circle[v])
    floor_of = floors(edges, in_circle)
    function = longest(paths, (ast.FunctionDef, ast.AsyncFunctionDef))
    cls = longest(paths, ast.ClassDef)
    print(f"modules {len(paths)}, imports {sum(len(w) for w in edges.values())}, floors {max(floor_of.values())}, "
          f"circles {len(found)}, imports that run back up {back_up}")
    for c in found:
        print("  circle:", ", ".join(sorted(c)))
    print(f"longest function: {function[1]} ({function[0]} lines); longest class: {cls[1]} ({cls[0]} lines)")
    if args.edges:
        for v in sorted(edges, key=lambda m: (-floor_of[m], m)):
            print(f"  floor {floor_of[v]:2d} {v} -> {', '.join(sorted(edges[v])) or '-'}")


if __name__ == "__main__":
    main()
