"""The house reads as the pipeline: the import contracts of pyproject.toml hold (import-linter)."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_import_contract_is_kept():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "import-linter is a dev dependency: make setup installs it"
    done = subprocess.run([lint, "--no-cache", "--no-logo"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def _library_trees():
    """Every module of the library, parsed: ``(path relative to the repository, tree)``."""
    import ast

    for path in sorted((REPO / "memo").rglob("*.py")):
        yield path.relative_to(REPO).as_posix(), ast.parse(path.read_text())


def test_no_function_of_the_library_runs_over_100_lines():
    import ast

    long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, tree in _library_trees() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100]
    assert long == []


# What a method does, asked of it outside its activation policy: the flags of a method, and its
# settings read off an object named for it (``method.recompute_granularity``, ``workload.method.alpha``)
_METHOD_FLAGS = {"swaps", "tiled", "walks_tiles", "offloads", "ours"}
_METHOD_SETTINGS = {"layer_activations", "recompute_granularity", "recompute_method", "recompute_num_layers",
                    "recompute_modules", "offload_modules", "cp_attention", "alpha", "tile_tokens", "loss"}


def test_only_the_activation_policies_and_the_configuration_read_a_methods_settings():
    import ast

    readers = []
    for path, tree in _library_trees():
        if path.startswith(("memo/policy/", "memo/config/")):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            base = ast.unparse(node.value)
            flag = node.attr in _METHOD_FLAGS and not base.startswith("self")
            setting = node.attr in _METHOD_SETTINGS and (base == "method" or base.endswith(".method"))
            if flag or setting:
                readers.append(f"{path}:{node.lineno} {base}.{node.attr}")
    assert readers == []
