"""Layering, import cycles and sizes of the source packages (``make check``).

Every import of one of our modules counts, at module level or inside a
function. Layers: ``aloe_kernels`` imports nothing of ours; ``aloe_build``
only ``aloe_kernels``; ``aloe_eval`` build and kernels; the vLLM plugin
(``aloe_vllm``) kernels and build; ``benchmarks`` (maintained suites) anything but the CLI and
``experiments``; ``experiments`` (one-question scripts) anything but the CLI; the ``aloe_cli`` command
every package but ``benchmarks`` and ``experiments``. No module may reach itself through imports.
Source files stay under 600 lines and functions under 80.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "aloe_kernels": "aloe_kernels",
    "aloe_build": "aloe_build",
    "aloe_eval": "aloe_eval",
    "aloe_cli": "aloe_cli",
    "aloe_vllm": "integrations/vllm",
    "benchmarks": "benchmarks",
    "experiments": "experiments",
}
ALLOWED = {
    "aloe_kernels": set(),
    "aloe_build": {"aloe_kernels"},
    "aloe_eval": {"aloe_kernels", "aloe_build"},
    "aloe_vllm": {"aloe_kernels", "aloe_build"},
    "benchmarks": {"aloe_kernels", "aloe_build", "aloe_eval", "aloe_vllm"},
    "experiments": {"aloe_kernels", "aloe_build", "aloe_eval", "aloe_vllm", "benchmarks"},
    "aloe_cli": set(PACKAGES) - {"benchmarks", "experiments"},  # the wheel ships neither
}
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of our packages."""
    out = {}
    for name, rel in PACKAGES.items():
        for f in sorted((ROOT / rel).rglob("*.py")):
            parts = list(f.relative_to(ROOT / rel).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([name, *parts])] = f
    return out


def imports(mod: str, file: Path, known: dict[str, Path]) -> set[str]:
    """Our modules that ``mod`` imports (a ``from X import Y`` of a submodule Y counts as X.Y)."""
    is_pkg = file.name == "__init__.py"
    here = mod.split(".") if is_pkg else mod.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            stem = ".".join(base + ([node.module] if node.module else []))
            # "from . import x" imports the submodule x, not the package's own __init__
            targets = ([stem] if node.module else []) + [f"{stem}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != mod:
                found.add(t)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def sizes(known: dict[str, Path]) -> list[str]:
    problems = []
    for file in known.values():
        text = file.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            problems.append(f"{file.relative_to(ROOT)}: {text.count(chr(10))} lines (limit {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    problems.append(
                        f"{file.relative_to(ROOT)}:{node.lineno}: {node.name} is {n} lines (limit {MAX_FUNCTION_LINES})"
                    )
    return problems


def main() -> int:
    known = modules()
    graph = {m: imports(m, f, known) for m, f in known.items()}
    problems = []
    for m, deps in sorted(graph.items()):
        top = m.split(".")[0]
        for d in sorted(deps):
            if d.split(".")[0] not in ALLOWED[top] | {top}:
                problems.append(f"{m} imports {d}: {top} may import only {sorted(ALLOWED[top]) or 'nothing of ours'}")
    problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    problems += sizes(known)
    for p in problems:
        print(p)
    print(
        f"{len(known)} modules, {sum(map(len, graph.values()))} imports between them: "
        f"{'OK' if not problems else f'{len(problems)} problems'}"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
