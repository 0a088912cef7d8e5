"""Imports flow one way: a module may import only modules of a lower rank, or of its own rank inside
its own package. The rule and the table are docs/architecture.md's opening paragraph and diagram."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "sparkrelay"

# One rank per package (a root module is its own box): a module may import lower ranks, and its own
# package.
RANKS = {
    "sparkrelay": 0,  # the package's lazy re-exports
    "sparkrelay.config": 0,
    "sparkrelay.codec": 0,
    "sparkrelay.trace": 0,
    "sparkrelay.envs": 1,
    "sparkrelay.host": 1,
    "sparkrelay.scheduler": 1,
    "sparkrelay.models": 1,
    "sparkrelay.kvcache": 1,
    "sparkrelay.transfer": 1,
    "sparkrelay.router": 1,
    "sparkrelay.spec": 2,
    "sparkrelay.grammar": 2,
    "sparkrelay.launch_router": 2,
    "sparkrelay.runner": 3,
    "sparkrelay.pipeline": 4,
    "sparkrelay.disagg": 5,
    "sparkrelay.engine": 6,
    "sparkrelay.manager": 7,
    "sparkrelay.llm": 7,
    "sparkrelay.server": 8,
    "sparkrelay.launch_server": 9,
    "sparkrelay.tools": 10,
}
TORCH_FREE = (
    "sparkrelay.codec",
    "sparkrelay.trace",
    "sparkrelay.scheduler",
    "sparkrelay.config",
    "sparkrelay.envs",
    "sparkrelay.host",
    "sparkrelay.spec.stats",
    "sparkrelay.pipeline.partition",
    "sparkrelay.transfer",
    "sparkrelay.router",
    "sparkrelay.launch_router",
)


def box(module: str) -> str:
    """The package (or root module) a module belongs to: sparkrelay.X for
    sparkrelay.X[.anything]."""
    parts = module.split(".")
    return ".".join(parts[:2])


def rank(module: str) -> tuple[int, str]:
    b = box(module)
    assert b in RANKS, f"{b} has no rank: add it to RANKS (and to docs/architecture.md's diagram)"
    return RANKS[b], b


def modules():
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        yield name.removesuffix(".__init__"), path


def is_module(name: str) -> bool:
    return (PKG / f"{name}.py").is_file() or (PKG / name / "__init__.py").is_file()


def imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from sparkrelay import llm` names a submodule, `LLM` a re-export
            if node.module == "sparkrelay":
                yield from (
                    f"sparkrelay.{a.name}" if is_module(a.name) else "sparkrelay"
                    for a in node.names
                )
            else:
                yield node.module


def test_imports_flow_down():
    bad = []
    for name, path in modules():
        if name == "sparkrelay":
            continue  # the package's lazy re-exports
        own_rank, own_box = rank(name)
        for imp in imports(path):
            if not imp.startswith("sparkrelay"):
                continue
            r, imp_box = rank(imp)
            if imp_box != own_box and r >= own_rank:
                bad.append(f"{name} (rank {own_rank}) imports {imp} (rank {r})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycle_between_modules_or_packages():
    modules_graph: dict[str, set[str]] = {}
    packages_graph: dict[str, set[str]] = {}
    names = {name for name, _ in modules()}
    for name, path in modules():
        targets = {i for i in imports(path) if i in names and i != name}
        modules_graph[name] = targets
        packages_graph.setdefault(box(name), set()).update(
            box(t) for t in targets if box(t) != box(name)
        )
    for graph in (modules_graph, packages_graph):
        cycle = find_cycle(graph)
        assert not cycle, "import cycle: " + " -> ".join(cycle)


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the directed graph as [a, b, ..., a], or [] (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in graph:
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph.get(root, ())))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return []


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a"}}) == []


def test_scheduler_and_block_manager_are_torch_free():
    for name, path in modules():
        if any(name == t or name.startswith(t + ".") for t in TORCH_FREE):
            assert not any(i.split(".")[0] == "torch" for i in imports(path)), (
                f"{name} imports torch"
            )
