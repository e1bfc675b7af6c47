"""The packages are layered one way, and no package's modules import each other in a cycle.

    common  <-  ngram (imports nothing of ours)  <-  server  <-  index  <-  bench

`common` holds what every layer needs (chat formats and the tool-call parser, the tokenizer, the
bundled model's files, data paths, start-up progress); `ngram` is the drafter and knows nothing
else of ours; `server` serves; `index` turns traces into an index (distillation drives the server's
engine); `bench` measures everything. Every import counts, lazy ones inside functions included.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["common", "ngram", "server", "index", "bench"]
MAY_IMPORT = {pkg: set(LAYERS[:i]) for i, pkg in enumerate(LAYERS)}
MAY_IMPORT["ngram"] = set()  # the drafter stands alone: numpy, marisa-trie and its C kernels only


def _imports(path: Path) -> set[str]:
    """Every absolute import of ours in `path`, as dotted module names."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found.update(n for n in names if n.split(".")[0] in LAYERS)
    return found


def _modules() -> dict[str, set[str]]:
    graph = {}
    for pkg in LAYERS:
        for path in sorted((ROOT / pkg).glob("*.py")):
            name = pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"
            graph[name] = _imports(path)
    return graph


def test_every_package_imports_only_the_layers_below_it():
    wrong = sorted(f"{module} imports {target}" for module, targets in _modules().items() for target in targets
                   if target.split(".")[0] != module.split(".")[0]
                   and target.split(".")[0] not in MAY_IMPORT[module.split(".")[0]])
    assert not wrong, wrong


def test_no_modules_import_each_other_in_a_cycle():
    graph = _modules()
    edges = {m: {t for t in targets if t in graph and t != m} for m, targets in graph.items()}
    cycles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, [" -> ".join(c) for c in cycles]


def test_the_layering_test_sees_every_package():
    assert set(LAYERS) == {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists() and p.name != "tests"}
    assert "common.chat_format" in _modules()["server.protocol"] | _modules()["server.serving"]
