"""The package's layout: layers that import one way, no circle, no private name taken from another module.

`LAYERS` is the one table of the package's layers, lowest first (docs/layout.md draws it): a module imports only from
its own layer and the layers below, whether at the top of the file or inside a function. Imports under
`if TYPE_CHECKING:` (annotations only) and in an `if __name__ == "__main__":` block (a command line) never run when
another module imports the file, so they do not count. Within a layer the imports form no circle, and a name that
starts with `_` stays in its module.

`dcinterp/model.py` is the model; what it imports (config, loading, memory, the TransformerLens surface in `tl_api`,
...) must not import it back (issue #26).
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dcinterp"

# The layers, lowest first. A module belongs to the entry that names it or, failing that, the longest entry that names
# a package above it (`dcinterp.dcmha` holds every `dcinterp.dcmha.*`). The package's own `__init__` imports its
# names lazily, by name, and is no layer.
LAYERS: dict[str, tuple[str, ...]] = {
    "foundations": (
        "dcinterp.config",
        "dcinterp.devices",
        "dcinterp.checks",
        "dcinterp.cli",
        "dcinterp.distributed",
    ),
    "the dataset": (
        "dcinterp.synth",
        "dcinterp.synth.catalog",
        "dcinterp.synth.generator",
        "dcinterp.synth.records",
        "dcinterp.synth.check",
        "dcinterp.synth.contrast",
        "dcinterp.tokenizer",
    ),
    "DCMHA": ("dcinterp.dcmha",),
    "the model": (
        "dcinterp.components",
        "dcinterp.model",
        "dcinterp.conversion",
        "dcinterp.loading",
        "dcinterp.kv_cache",
        "dcinterp.tl_api",
        "dcinterp.processing",
        "dcinterp.memory",
        "dcinterp.random_checkpoint",
    ),
    "analyses": (
        "dcinterp.attribution",
        "dcinterp.composition",
        "dcinterp.circuits",
        "dcinterp.qk_run",
        "dcinterp.qk",
        "dcinterp.qk_weights",
        "dcinterp.ablation",
        "dcinterp.patching",
        "dcinterp.discovery",
        "dcinterp.views",
        "dcinterp.synth.evaluate",
        "dcinterp.synth.accuracy",
        "dcinterp.transcoders",
        "dcinterp.graph_pruning",
        "dcinterp.attribution_graph",
        "dcinterp.graph_export",
    ),
    "plotting": ("dcinterp.plotting",),
    "applications": (
        "dcinterp.synth.__main__",
        "dcinterp.synth.commands",
        "dcinterp.synth.ablate",
        "dcinterp.synth.circuit",
        "dcinterp.train",
        "dcinterp.study",
        "dcinterp.notebooks",
    ),
}


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
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
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
            names = {f"{base}.{alias.name}" for alias in node.names}
            found.update(names)
            if not names <= modules:  # `from . import sibling` imports the sibling, not the package's names
                found.add(base)
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


def layer_of(module: str) -> int:
    """The index in LAYERS of a module's layer; a module missing from the table fails the test, naming it."""
    best, layer = "", None
    for index, names in enumerate(LAYERS.values()):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > len(best):
                best, layer = name, index
    assert layer is not None, f"{module} is in no layer: add it to LAYERS in tests/test_layout.py (and docs/layout.md)"
    return layer


def import_graph() -> dict[str, set[str]]:
    """{module: the dcinterp modules it imports}, the package's lazy `__init__` left out."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    del modules["dcinterp"]
    return {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}


def test_every_module_has_a_layer_and_imports_only_from_its_layer_and_below():
    names = list(LAYERS)
    upward = [
        f"{module} ({names[layer_of(module)]}) imports {imported} ({names[layer_of(imported)]})"
        for module, imports in sorted(import_graph().items())
        for imported in sorted(imports)
        if layer_of(imported) > layer_of(module)
    ]
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_circle_of_imports():
    found = circles(import_graph())
    assert not found, "modules that import each other (functions included):\n" + "\n".join(
        " <-> ".join(component) for component in found
    )


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def private_names_taken(path: Path) -> list[str]:
    """`from dcinterp.x import _name`, and `x._name` where `x` is a dcinterp module the file imported, from a module
    other than the file's own."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    tree = ast.parse(path.read_text())
    taken, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base != "dcinterp" and not base.startswith("dcinterp."):
                continue
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
                elif alias.name.startswith("_") and not alias.name.startswith("__") and base != name:
                    taken.append(f"{name} imports {alias.name} from {base} (line {node.lineno})")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and aliases[node.value.id] != name
        ):
            taken.append(f"{name} uses {aliases[node.value.id]}.{node.attr} (line {node.lineno})")
    return taken


def test_no_private_name_crosses_modules():
    taken = [line for path in sorted(PACKAGE.rglob("*.py")) for line in private_names_taken(path)]
    assert not taken, "private names taken from another module (make them public, with an Args docstring):\n" + (
        "\n".join(taken)
    )


def test_a_private_name_taken_is_found(tmp_path, monkeypatch):
    fake = tmp_path / "dcinterp"
    (fake / "sub").mkdir(parents=True)
    for file in ("__init__.py", "a.py", "sub/__init__.py"):
        (fake / file).write_text("")
    (fake / "sub" / "b.py").write_text("from ..a import _hidden, shown\nfrom .. import a\n\na._other()\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert private_names_taken(fake / "sub" / "b.py") == [
        "dcinterp.sub.b imports _hidden from dcinterp.a (line 1)",
        "dcinterp.sub.b uses dcinterp.a._other (line 4)",
    ]


def test_the_docs_draw_the_layers_of_this_table():
    page = (PACKAGE.parent / "docs" / "layout.md").read_text()
    diagram = page.split("```text")[1].split("```")[0]
    for index, name in enumerate(LAYERS):
        assert f"\n{index}  {name} " in diagram, f"docs/layout.md draws no layer {index} named {name!r}"
