"""Imports flow one way (STYLE.md): a module may import only modules of a lower rank, or of its own rank
inside its own package. The table is the architecture diagram of docs/architecture.md."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "sparkrelay"

# rank: higher ranks orchestrate lower ones; longest prefix wins
RANKS = {
    "sparkrelay": 0,
    "sparkrelay.config": 0,
    "sparkrelay.corpus": 0,
    "sparkrelay.envs": 0,
    "sparkrelay.engine.request": 0,
    "sparkrelay.engine.block_manager": 0,
    "sparkrelay.spec.stats": 0,
    "sparkrelay.engine.scheduler": 1,
    "sparkrelay.engine.stop": 1,
    "sparkrelay.models": 1,
    "sparkrelay.kvcache": 1,
    "sparkrelay.spec.verify": 1,
    "sparkrelay.transfer": 1,
    "sparkrelay.pipeline.partition": 1,
    "sparkrelay.router": 1,
    "sparkrelay.launch_router": 2,
    "sparkrelay.spec": 2,
    "sparkrelay.runner": 3,
    "sparkrelay.disagg": 3,
    "sparkrelay.pipeline": 4,
    "sparkrelay.engine.engine": 5,
    "sparkrelay.engine.disagg_engine": 5,
    "sparkrelay.llm": 6,
    "sparkrelay.server": 6,
    "sparkrelay.launch_server": 7,
    "sparkrelay.bench_common": 7,
    "sparkrelay.cluster": 7,
    "sparkrelay.bench_serving_report": 7,
    "sparkrelay.bench_offline": 8,
    "sparkrelay.bench_serving": 8,
    "sparkrelay.bench_pd": 8,
    "sparkrelay.demo": 8,
    "sparkrelay.soak": 8,
    "sparkrelay.soak_report": 7,
    "sparkrelay.fuzz_http": 8,
    "sparkrelay.fuzz_cases": 7,
    "sparkrelay.tools": 8,
}
TORCH_FREE = ("sparkrelay.engine.request", "sparkrelay.engine.block_manager", "sparkrelay.engine.scheduler",
              "sparkrelay.config", "sparkrelay.spec.stats", "sparkrelay.envs", "sparkrelay.pipeline.partition",
              "sparkrelay.transfer.base", "sparkrelay.transfer.bootstrap", "sparkrelay.transfer.zmq_backend")


def rank(module: str) -> tuple[int, str]:
    best = max((p for p in RANKS if module == p or module.startswith(p + ".")), key=len)
    return RANKS[best], best


def modules():
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        yield name.removesuffix(".__init__"), path


def imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "sparkrelay":  # `from sparkrelay import bench_common` names a submodule
                yield from (f"sparkrelay.{a.name}" for a in node.names)
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
            r, box = rank(imp)
            same_package = imp.rsplit(".", 1)[0] == name.rsplit(".", 1)[0] or box == own_box
            if r > own_rank or (r == own_rank and not same_package and box != "sparkrelay"):
                bad.append(f"{name} imports {imp}")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_scheduler_and_block_manager_are_torch_free():
    for name, path in modules():
        if name in TORCH_FREE:
            assert not any(i.split(".")[0] == "torch" for i in imports(path)), f"{name} imports torch"
