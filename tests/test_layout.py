"""The package's layout: dependencies point one way, away from the model file (issue #26).

`dcinterp/model.py` is the model; what it imports (config, loading, memory, the TransformerLens surface in
`tl_api`, ...) must not import it back, not even inside a function. Imports under `if TYPE_CHECKING:` (annotations
only) and in an `if __name__ == "__main__":` block (a command line) never run when the model imports the module,
so they do not count.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dcinterp"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def skipped_block(node: ast.If) -> bool:
    test = ast.unparse(node.test)
    return test in ("TYPE_CHECKING", "typing.TYPE_CHECKING") or test.replace("'", '"') == '__name__ == "__main__"'


def imports_of(path: Path) -> set[str]:
    """The dcinterp modules a file imports anywhere (functions included), less the skipped blocks."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and skipped_block(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m == "dcinterp" or m.startswith("dcinterp.")}


def test_nothing_the_model_imports_imports_it_back():
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: {m for m in imports_of(path) if m in modules} for name, path in modules.items()}
    reached, todo = set(), list(graph["dcinterp.model"])
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(graph[name])
    reached.discard("dcinterp")  # the package's __init__ imports lazily (by name, on first use)
    assert "dcinterp.model" not in reached, {m for m in reached if "dcinterp.model" in graph[m]}
    assert {"dcinterp.loading", "dcinterp.memory", "dcinterp.tl_api"} <= reached  # the test sees the imports


def test_the_model_file_holds_the_model_and_tl_api_the_transformer_lens_surface():
    from dcinterp.model import HookedDCFormer
    from dcinterp.tl_api import TransformerLensAPI

    assert issubclass(HookedDCFormer, TransformerLensAPI)
    for name in ("W_Q", "to_tokens", "generate", "tokens_to_residual_directions", "accumulated_bias"):
        assert name in vars(TransformerLensAPI) and name not in vars(HookedDCFormer), name
    for name in ("forward", "run_with_cache", "from_pretrained"):
        assert name in vars(HookedDCFormer), name
