"""The pack layout: the engine imports as a top-level package and as a subpackage loaded by file path."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent
HOST_MODULES = {"comfy", "comfy_api", "comfy_extras", "folder_paths", "server", "nodes", "execution", "latent_preview"}


def test_engine_imports_top_level():
    import sdvg

    assert sdvg.__version__
    assert issubclass(sdvg.ConfigError, ValueError)


def _absolute_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_engine_never_imports_comfyui_and_uses_relative_imports():
    for path in sorted((REPO / "sdvg").rglob("*.py")):
        imported = _absolute_imports(path)
        assert not imported & HOST_MODULES, f"{path} imports a ComfyUI module: {imported & HOST_MODULES}"
        assert "sdvg" not in imported, f"{path} imports 'sdvg' absolutely; use relative imports"


def test_pack_imports_by_path_like_comfyui():
    """ComfyUI loads a pack with spec_from_file_location under its path with '.' replaced by '_x_'."""
    module_name = str(REPO).replace(".", "_x_")
    spec = importlib.util.spec_from_file_location(
        module_name, REPO / "__init__.py", submodule_search_locations=[str(REPO)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
        assert module.WEB_DIRECTORY == "./web"
        assert callable(module.comfy_entrypoint)
        assert not hasattr(module, "NODE_CLASS_MAPPINGS"), "export comfy_entrypoint or NODE_CLASS_MAPPINGS, not both"
        engine = importlib.import_module(f"{module_name}.sdvg")
        assert engine.__name__ == f"{module_name}.sdvg"
        import sdvg as top_level

        assert engine is not top_level and engine.__version__ == top_level.__version__
        errors = importlib.import_module(f"{module_name}.sdvg.errors")
        assert issubclass(errors.ConfigError, ValueError)
    finally:
        for name in [n for n in sys.modules if n == module_name or n.startswith(module_name + ".")]:
            del sys.modules[name]


def test_packaging_metadata():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    project, comfy = meta["project"], meta["tool"]["comfy"]
    for key in ("name", "version", "description", "license", "dependencies"):
        assert key in project
    for key in ("PublisherId", "DisplayName", "Icon"):
        assert comfy.get(key)
    assert "web" not in comfy, "[tool.comfy] web would load the JS twice alongside WEB_DIRECTORY"
    reqs = [line.split("#")[0].strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
    names = {r.split(">")[0].split("=")[0].split("<")[0].strip().lower() for r in reqs if r}
    assert not names & {"torch", "torchvision", "torchaudio"}
    assert {"diffusers", "transformers", "safetensors", "numpy", "pillow", "av"} <= names
    deps = {d.split(">")[0].split("=")[0].strip().lower() for d in project["dependencies"]}
    assert deps == names, "pyproject dependencies and requirements.txt must list the same packages"


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    assert "make test" in ci.splitlines()[-1]
    assert "make test" in readme
    constraints = (REPO / "constraints.txt").read_text()
    pins = [line.strip() for line in constraints.splitlines() if line.strip() and not line.startswith("#")]
    assert "torch==2.13.0" in pins
    assert not any(p.startswith("torchvision") for p in pins)


def _other_pythons() -> list[list[str]]:
    """Interpreters for 3.10, 3.12 and 3.13 if this machine has them (pyenv or on PATH)."""
    import shutil
    import subprocess

    found = []
    for version in ("3.10", "3.12", "3.13"):
        exe = shutil.which(f"python{version}")
        cmd = [exe] if exe else None
        if cmd is not None:
            probe = subprocess.run([*cmd, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True)
            if probe.returncode != 0:
                cmd = None
        if cmd is None and shutil.which("pyenv"):
            listing = subprocess.run(["pyenv", "versions", "--bare"], capture_output=True, text=True).stdout.split()
            match = [v for v in listing if v.startswith(version + ".")]
            if match:
                cmd = ["env", f"PYENV_VERSION={match[-1]}", "python"]
        if cmd is not None:
            found.append(cmd)
    return found


def test_sources_compile_on_python_3_10_to_3_13():
    """Users run ComfyUI on Python 3.10-3.13: every engine and node module must at least compile there."""
    import subprocess

    pythons = _other_pythons()
    if not pythons:
        import pytest

        pytest.skip("no Python 3.10/3.12/3.13 interpreter on this machine")
    files = [str(p) for d in ("sdvg", "nodes") for p in sorted((REPO / d).rglob("*.py"))] + [str(REPO / "__init__.py")]
    code = "import sys\nfor f in sys.argv[1:]:\n    compile(open(f, encoding='utf-8').read(), f, 'exec')\nprint(sys.version_info[:2])"
    for cmd in pythons:
        proc = subprocess.run([*cmd, "-c", code, *files], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{' '.join(cmd)}: {proc.stderr[-2000:]}"


def _engine_import_graph() -> dict[str, set[str]]:
    """Module → the engine modules it imports (relative imports anywhere in the file, outside TYPE_CHECKING)."""
    root = REPO / "sdvg"
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).with_suffix("")
        parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
        package = parts if rel.name == "__init__" else parts[:-1]
        name = ".".join(parts) or "__init__"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and getattr(node.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(node)}
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level and id(node) not in typing_only:
                base = package[: len(package) - (node.level - 1)]
                targets = [node.module] if node.module else [a.name for a in node.names]
                deps |= {".".join([*base, *t.split(".")]) or "__init__" for t in targets}
        graph[name] = {d for d in deps if d != name}
    return graph


def test_engine_has_no_import_cycles():
    graph = _engine_import_graph()
    known = set(graph)

    def visit(node, stack, done):
        if node in done or node not in known:
            return
        if node in stack:
            raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(node):], node]))
        stack.append(node)
        for dep in sorted(graph[node]):
            visit(dep, stack, done)
        stack.pop()
        done.add(node)

    done: set[str] = set()
    for node in sorted(graph):
        visit(node, [], done)
    assert "sampling.sampler" in graph and "bench.runner" in graph  # the graph covers the packages too


def test_no_engine_file_is_over_500_lines():
    sizes = {p.relative_to(REPO).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
             for p in (REPO / "sdvg").rglob("*.py")}
    assert not {k: v for k, v in sizes.items() if v > 500}, sizes


def test_models_never_import_loaders_or_anything_above_them():
    """Loading flows one way: ``loaders → models``. A model reads no file and imports no loader (nor the sampler,
    the outputs, the CLI …): only the foundation modules at the top level and other models."""
    graph = _engine_import_graph()
    foundation = {p.stem for p in (REPO / "sdvg").glob("*.py")} - {"__init__", "__main__"}
    for name, deps in sorted(graph.items()):
        if name == "models" or name.startswith("models."):
            above = {d for d in deps if d not in foundation and not (d == "models" or d.startswith("models."))}
            assert not above, f"sdvg/{name.replace('.', '/')}.py imports {sorted(above)}: models import no loaders"
    assert "models.dit" in graph and any(d.startswith("models") for d in graph["loaders.wan"])  # the graph is real


def _engine_packages() -> set[str]:
    return {p.parent.name for p in (REPO / "sdvg").glob("*/__init__.py")}


def _engine_imports_of(path: Path, package_parts: list[str]) -> list[tuple[int, str]]:
    """(line, dotted target inside sdvg) of every relative import of ``path`` that reaches the engine. ``package_parts``
    is the importing module's package as seen from the repository root (``["nodes"]``, ``["sdvg", "cli"]``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package_parts[: len(package_parts) - (node.level - 1)]
            target = [*base, *(node.module.split(".") if node.module else [])]
            if target[:1] == ["sdvg"]:
                found.append((node.lineno, ".".join(target[1:])))
    return found


def test_nodes_and_cli_import_only_package_facades():
    """The ComfyUI nodes and the CLI use the engine through ``sdvg`` and its packages' ``__init__`` (the facades),
    never a module inside a package: the facades are the public API, the modules behind them may move."""
    facades = {"", *_engine_packages()}
    files = [(p, ["nodes"]) for p in sorted((REPO / "nodes").glob("*.py"))]
    files += [(p, ["sdvg", "cli"]) for p in sorted((REPO / "sdvg" / "cli").glob("*.py"))]
    files.append((REPO / "__init__.py", []))
    seen = 0
    for path, package in files:
        for line, target in _engine_imports_of(path, package):
            seen += 1
            if package == ["sdvg", "cli"] and (target in {"cli", "errors", "facade", "stop"}
                                               or target.startswith("cli.")):
                continue  # the CLI's own modules; the foundation's errors and stop signals
            assert target in facades, (
                f"{path.relative_to(REPO)}:{line} imports sdvg.{target}: import from the package facade "
                f"(sdvg.{target.split('.')[0]}) instead")
    assert seen > 20  # the rule looked at real imports


def test_engine_top_level_is_the_foundation_only():
    """At most 10 modules at sdvg/'s top level; everything else lives in a subpackage with a facade."""
    modules = sorted(p.name for p in (REPO / "sdvg").glob("*.py"))
    assert len(modules) <= 10, modules
    for package in _engine_packages():
        assert (REPO / "sdvg" / package / "__init__.py").read_text(encoding="utf-8").strip(), f"{package} has no facade"


def test_cli_and_node_defaults_are_the_engines(tmp_path):
    """Every default is declared once, on the engine's config dataclasses: the CLI's flags and the nodes' widgets with
    nothing set give exactly the engine's default configs."""
    from sdvg.cli.args import cache_config_from_args, router_config_from_args, sampler_config_from_args
    from sdvg.cli.commands import build_parser
    from sdvg.sampling import DEFAULT_PROFILE, PROFILES, CacheConfig, Compat, RouterConfig, SamplerConfig
    from tests.host import pack, stub

    assert PROFILES[DEFAULT_PROFILE] == Compat()
    args = build_parser().parse_args(["generate", "--prompt", "x", "--out", str(tmp_path / "v.mp4")])
    assert router_config_from_args(args) == RouterConfig().validate()
    assert sampler_config_from_args(args, None) == SamplerConfig().validate()
    evaluate = build_parser().parse_args(["eval", "--prompts", "p.txt", "--out", str(tmp_path / "e")])
    assert cache_config_from_args(evaluate) == CacheConfig() and evaluate.seed == SamplerConfig.seed

    stub.install(tmp_path / "models")
    try:
        pack.load_pack()
        engine = pack.submodule("sdvg.sampling")
        router, sampler = pack.submodule("nodes.router"), pack.submodule("nodes.sampler")

        def widget_defaults(cls, skip=()):
            return {i.id: i.default for i in cls.define_schema().inputs if i.default is not None and i.id not in skip}

        got = router.build_router_config(**widget_defaults(router.SDVGRewardRouter))
        assert got == engine.RouterConfig().validate()
        widgets = widget_defaults(sampler.SDVGSpeculativeSampler, skip={"on_cancel", "on_fault"})
        assert sampler.sampler_config(**widgets) == engine.SamplerConfig().validate()
    finally:
        pack.unload_pack()
        stub.uninstall()
