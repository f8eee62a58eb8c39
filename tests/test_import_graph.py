"""No import circles inside the package, and no import from a lower part to a higher one (issue 20).

The graph is read from the source with ``ast``, not by importing anything: every ``import`` and
``from ... import`` of a ``vllama_proxy`` module counts, at module level or inside a function
(a lazy import still ties the two modules), and so do ``TYPE_CHECKING`` imports for the circle
check (a type named both ways is a circle of knowledge even if Python never runs it). Relative
imports are resolved against the importing file's package; ``from pkg import name`` counts as an
import of ``pkg.name`` where that is a module, else of ``pkg`` itself.

The client side stands apart (issue 29.3): ``client/`` imports its own modules and the package
root (the wire helpers both sides share), never the server's; it and the root use the standard
library and a few small libraries only. One test runs instead of reading: ``vllama list``
through the entry point must leave no server module in ``sys.modules``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = "vllama_proxy"

#: The parts, lowest first: a module may import its own part and the parts below it, at run time
#: and for annotations alike (issue 41.5: no arrow runs back up; an object handed in from above,
#: such as the supervisor's status board in models/vllm_servers.py, is typed by a protocol of that
#: lower part, models/boards.py).
LAYERS = [
    [PKG, f"{PKG}.errors", f"{PKG}.logs"],
    [f"{PKG}.ipc"],  # the cross-process floor: the lock, the bells, the spawn context of shared arrays
    [f"{PKG}.upstream"],
    [f"{PKG}.models"],
    [f"{PKG}.settings"],
    [f"{PKG}.supervisor"],
    [f"{PKG}.api"],
    [f"{PKG}.front"],
    [f"{PKG}.client"],
    [f"{PKG}.cli", f"{PKG}.__main__"],
]


#: The server's side of the package: ``client/`` imports none of it (issue 29.3). The client talks
#: to a server over HTTP only; what both read off the wire the same way (``OLLAMA_HOST``, an error
#: body's text, the parser with a "did you mean") lives in the package root, ``vllama_proxy/__init__.py``.
SERVER = [f"{PKG}.{part}" for part in ("settings", "api", "front", "supervisor", "models", "upstream", "errors", "logs")]
#: What ``client/`` may import beside its own package, the package root and the standard library:
#: small libraries (aiohttp as ``vllama batch``'s HTTP client, never the server's code built on it).
CLIENT_LIBRARIES = {"orjson", "tqdm", "aiohttp"}
#: What the package root may import beside the standard library: it is the client's too.
ROOT_LIBRARIES = {"orjson"}


def _module_of(path: Path, root: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _type_checking_ids(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
            (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
            or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
        ):
            for stmt in node.body:
                out |= {id(n) for n in ast.walk(stmt)}
    return out


def import_graph(root: Path = ROOT, *, type_checking: bool = True) -> dict[str, set[str]]:
    """module -> the package modules it imports (dotted names)."""
    files = {}
    for path in sorted((root / PKG).rglob("*.py")):
        files[_module_of(path, root)] = path
    modules = {m for m, _ in files}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for (mod, is_pkg), path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = set() if type_checking else _type_checking_ids(tree)
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        graph[mod].add(f"{base}.{alias.name}")
                    elif base in modules:
                        graph[mod].add(base)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules:
                        graph[mod].add(alias.name)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each circle as a path ``a -> b -> ... -> a`` (one per strongly connected component)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)

    cycles = []
    for comp in components:  # a shortest way round from the first module, for the message
        start, members = comp[0], set(comp)
        paths, seen, found = [[start]], {start}, None
        while paths and found is None:
            nxt = []
            for p in paths:
                for w in sorted(graph[p[-1]] & members):
                    if w == start:
                        found = p + [start]
                        break
                    if w not in seen:
                        seen.add(w)
                        nxt.append(p + [w])
                if found:
                    break
            paths = nxt
        cycles.append(found or comp)
    return cycles


def layer_of(module: str) -> int | None:
    best, level = -1, None
    for i, layer in enumerate(LAYERS):
        for part in layer:
            inside = module == part or (part != PKG and module.startswith(part + "."))
            if inside and len(part) > best:
                best, level = len(part), i
    return level


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles in the package:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


def test_no_upward_imports() -> None:
    """No import from a lower part to a higher one, ``TYPE_CHECKING`` ones included: a type named from
    below is knowledge of the floor above all the same."""
    upward = []
    for mod, targets in sorted(import_graph().items()):
        here = layer_of(mod)
        for t in sorted(targets):
            there = layer_of(t)
            if here is not None and there is not None and there > here:
                upward.append(f"  {mod} -> {t}")
    assert not upward, "imports from a lower part to a higher one (see LAYERS):\n" + "\n".join(upward)


#: Inside ``api/``, its rooms by job, lowest first: the wire (pure), what is measured and charged, who may
#: ask and how much, the router's keys, the app's state, the request's way, the handlers, the wiring.
API_ROOMS = [
    [f"{PKG}.api.ollama"],
    [f"{PKG}.api.metrics", f"{PKG}.api.usage"],
    [f"{PKG}.api.policy"],
    [f"{PKG}.api.fleet"],
    [f"{PKG}.api.app_state"],
    [f"{PKG}.api.request"],
    [f"{PKG}.api.routes"],
    [f"{PKG}.api.app", f"{PKG}.api"],
]


def _api_room(mod: str) -> int | None:
    best, at = None, -1
    for i, room in enumerate(API_ROOMS):
        for r in room:
            if (mod == r or mod.startswith(r + ".")) and len(r) > at:
                best, at = i, len(r)
    return best


def test_api_rooms_import_downward() -> None:
    """``api/``'s folders stand on each other in one order (:data:`API_ROOMS`): the request's way uses the
    wire, the policies and the ledger, never the other way round; every module of ``api/`` is in a room."""
    graph = import_graph()
    lost = sorted(m for m in graph if m.startswith(f"{PKG}.api") and _api_room(m) is None)
    assert not lost, f"api/ modules in no room of API_ROOMS: {lost}"
    upward = [f"  {m} -> {t}" for m, ts in sorted(graph.items()) if m.startswith(f"{PKG}.api")
              for t in sorted(ts) if t.startswith(f"{PKG}.api") and (_api_room(t) or 0) > (_api_room(m) or 0)]
    assert not upward, "api/ rooms importing a higher one (see API_ROOMS):\n" + "\n".join(upward)


def test_only_the_app_reaches_into_the_routes() -> None:
    """Inside ``api/``, the handlers (``routes/``) stand on the rest: the middlewares and helpers beside
    them import nothing of ``routes/``; only ``app.py`` wires the routes (issue 41.5: ``admission.py``
    imported ``routes/body.read_body``)."""
    routes = f"{PKG}.api.routes"
    reaching = [f"  {mod} -> {t}" for mod, targets in sorted(import_graph(type_checking=False).items())
                if mod.startswith(f"{PKG}.api.") and not mod.startswith(routes) and mod != f"{PKG}.api.app"
                for t in sorted(targets) if t == routes or t.startswith(routes + ".")]
    assert not reaching, "api/ modules below the routes import them:\n" + "\n".join(reaching)


#: What the translators (``api/ollama/to_openai.py``, ``to_ollama.py``) may import of the package: the error tree, what a model
#: is, the Ollama wire types and the clock of durations; of ``upstream/`` only its body encoder.
TRANSLATE_MAY_IMPORT = (f"{PKG}.errors", f"{PKG}.models", f"{PKG}.api.ollama.types", f"{PKG}.api.ollama.timestamps",
                        f"{PKG}.api.ollama.to_openai", f"{PKG}.api.ollama.to_ollama")
#: What they may import from outside beside the standard library.
TRANSLATE_LIBRARIES = {"orjson"}


def test_the_translators_do_no_io() -> None:
    """``api/ollama/`` holds the translators by direction (Ollama's ``openai/openai.go`` keeps its
    ``From*``/``To*`` functions so): pure, no aiohttp, no HTTP client, nothing of the app, the routes,
    the relay or the metrics; ``api/request/relay.py`` beside them sends and streams."""
    folder = ROOT / PKG / "api" / "ollama"
    files = [folder / "to_openai.py", folder / "to_ollama.py"]
    assert all(p.exists() for p in files), f"no translators by direction in {folder}"
    graph = import_graph()
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    wrong = []
    for path in files:
        mod, _ = _module_of(path, ROOT)
        wrong += [f"  {mod} -> {t}" for t in sorted(graph[mod])
                  if t != f"{PKG}.upstream" and not any(t == ok or t.startswith(ok + ".") for ok in TRANSLATE_MAY_IMPORT)]
        wrong += [f"  {mod}: {n}" for n in sorted(_libraries(path) - stdlib - TRANSLATE_LIBRARIES - {PKG})]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == f"{PKG}.upstream":
                wrong += [f"  {mod}: upstream.{a.name}" for a in node.names if a.name != "encode_json"]
    assert not wrong, "the translators import what does I/O or stands above them:\n" + "\n".join(wrong)


#: The supervisor's pure deciders, which ``supervisor/lifecycle.py``'s owner loop calls: what a look at
#: vLLM's load means (``hang.py``), when a new adapter needs a restart (``lora_restart.py``), an on-demand
#: slot's new model (``respec.py``), the wait after a failure (``restarts.py``). What of the package they
#: may import: plain data only.
DECIDERS = ("hang.py", "lora_restart.py", "respec.py", "restarts.py")
DECIDERS_MAY_IMPORT = (f"{PKG}.models.adapters", f"{PKG}.models.launch_spec", f"{PKG}.supervisor.hang")
#: The standard library's modules a decider may not import: a clock, the loop, processes, files, sockets.
IO_MODULES = {"asyncio", "os", "time", "subprocess", "socket", "threading", "multiprocessing", "signal", "shutil", "pathlib"}


def test_the_supervisors_deciders_do_no_io() -> None:
    """Each decider takes the state it decides on and returns the decision: no clock, loop, process or
    file of its own, nothing of the supervisor that acts on it, no library but the standard one."""
    folder = ROOT / PKG / "supervisor"
    graph = import_graph()
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    wrong = []
    for name in DECIDERS:
        path = folder / name
        mod, _ = _module_of(path, ROOT)
        wrong += [f"  {mod} -> {t}" for t in sorted(graph[mod]) if not any(t == ok or t.startswith(ok + ".") for ok in DECIDERS_MAY_IMPORT)]
        wrong += [f"  {mod}: {n}" for n in sorted(_libraries(path) - {PKG}) if n not in stdlib or n in IO_MODULES]
    assert not wrong, "the supervisor's deciders import what does I/O or acts:\n" + "\n".join(wrong)


def test_every_module_has_a_layer() -> None:
    lost = sorted(m for m in import_graph() if layer_of(m) is None)
    assert not lost, f"modules on no layer (add them to LAYERS): {lost}"


def test_top_level_is_small() -> None:
    entries = sorted(p.name for p in (ROOT / PKG).iterdir()
                     if p.name not in ("__pycache__", "__init__.py", "__main__.py") and not p.name.endswith(".pyc"))
    assert len(entries) <= 11, f"the package's top level has {len(entries)} entries: {entries}"


def _libraries(path: Path) -> set[str]:
    """The top-level names of what ``path`` imports from outside (relative imports left out)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_client_imports_nothing_of_the_server() -> None:
    """``client/`` imports its own modules and the package root, nothing else of the package."""
    graph = import_graph()
    crossing = [f"  {mod} -> {t}" for mod, targets in sorted(graph.items()) if mod.startswith(f"{PKG}.client")
                for t in sorted(targets) if t != PKG and not t.startswith(f"{PKG}.client")]
    assert not crossing, "the client imports the server's side (it may import client/ and vllama_proxy/__init__.py):\n" \
        + "\n".join(crossing)
    assert not graph[PKG], f"the package root imports the package: {sorted(graph[PKG])}"


def test_client_libraries_are_small() -> None:
    """``client/`` and the root it imports use the standard library and a few small libraries only
    (not pydantic-settings, structlog, prometheus-client: the server's)."""
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    wrong = []
    for path in sorted((ROOT / PKG / "client").rglob("*.py")):
        wrong += [f"  {path.relative_to(ROOT)}: {n}" for n in sorted(_libraries(path) - stdlib - CLIENT_LIBRARIES - {PKG})]
    root = ROOT / PKG / "__init__.py"
    wrong += [f"  {root.relative_to(ROOT)}: {n}" for n in sorted(_libraries(root) - stdlib - ROOT_LIBRARIES)]
    assert not wrong, "libraries the client side may not import:\n" + "\n".join(wrong)


def _modules_after(code: str) -> tuple[list[str], str]:
    """``sys.modules`` of a fresh Python (the source tree on its path) once ``code`` has run, and its stderr."""
    r = subprocess.run([sys.executable, "-c", f"import sys\n{code}\nprint(' '.join(sorted(sys.modules)))"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    return r.stdout.split(), r.stderr


def test_a_client_command_loads_nothing_of_the_server() -> None:
    """Run, not read: ``vllama list`` through the ``vllama`` entry point (``cli.py``, which also
    dispatches ``serve``) leaves no server module and none of its libraries in ``sys.modules``."""
    modules, stderr = _modules_after("from vllama_proxy.cli import main\ntry:\n    main(['list', '--host', '127.0.0.1:9'])\n"
                                     "except SystemExit:\n    pass")
    assert "could not connect" in stderr, stderr  # the command ran
    heavy = tuple(SERVER) + ("pydantic", "pydantic_settings", "structlog", "prometheus_client", "aiohttp")
    loaded = sorted({m if m.startswith(PKG) else m.split(".")[0] for m in modules
                     if any(m == h or m.startswith(h + ".") for h in heavy)})
    assert not loaded, f"`vllama list` loaded the server's modules: {loaded}"


def test_a_server_imports_the_hubs_api_only_to_pull() -> None:
    """Every worker of every ``vllama serve`` imports the app (``front/server.py``); huggingface_hub's API,
    errors and HTTP client (httpx2, ~0.1 s of each import) come only with a pull, a delete or a scan of the
    cache (``models/hub.py``, ``models/local.py``, ``models/pull_room.py`` import them in those functions)."""
    modules, _ = _modules_after("import vllama_proxy.front.server")
    loaded = sorted(m for m in modules if m in ("httpx2", "huggingface_hub.hf_api", "huggingface_hub.errors",
                                                "huggingface_hub.file_download", "huggingface_hub.utils"))
    assert not loaded, f"the server's import loaded huggingface_hub's API: {loaded}"
# ---------------------------------------------------------------------------- errors (issue 29.2)

#: Where errors become HTTP answers: the error middleware (``api/app.py``; aiohttp's own 404/405/413
#: and the 417 of ``Expect`` are translated there too). ``/v1`` answers vLLM's own error shape for
#: the names vllama resolves itself (``api/routes/openai.py``), as vLLM would, not Ollama's.
ERROR_BOUNDARY = {f"{PKG}.errors", f"{PKG}.api.app"}
VLLM_SHAPE = {f"{PKG}.api.routes.openai"}


def _modules() -> dict[str, ast.AST]:
    return {_module_of(p, ROOT)[0]: ast.parse(p.read_text(), str(p)) for p in sorted((ROOT / PKG).rglob("*.py"))}


def _error_classes() -> set[str]:
    tree = ast.parse((ROOT / PKG / "errors.py").read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}


def _name(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def test_every_error_is_a_class_of_the_one_tree() -> None:
    """A client-facing error is declared in ``errors.py`` (no subclass of its tree elsewhere), and
    its status is its class's: no raise site passes ``status=``."""
    tree_classes = _error_classes()
    found = []
    for mod, tree in _modules().items():
        if mod == f"{PKG}.errors":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(_name(b) in tree_classes for b in node.bases):
                found.append(f"  {mod}: class {node.name} extends the error tree outside errors.py")
            if isinstance(node, ast.Call) and _name(node.func) in tree_classes and any(k.arg == "status" for k in node.keywords):
                found.append(f"  {mod}:{node.lineno}: {_name(node.func)}(..., status=...)")
    assert not found, "errors outside the one tree of errors.py:\n" + "\n".join(found)


def test_only_the_boundary_writes_error_responses() -> None:
    """Ollama's ``{"error"}`` body is built by ``errors.py`` alone (``error_response``, ``error_line``),
    and an HTTP error status is written into a response only at the boundary: everywhere else an
    error is raised (or handed to ``error_response``), its status read from the tree."""
    found = []
    for mod, tree in _modules().items():
        if mod in ERROR_BOUNDARY:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            if _name(node.func) == "error_body":
                found.append(f"  {mod}:{node.lineno}: error_body(...)")
            if mod not in VLLM_SHAPE and _name(node.func) in ("Response", "json_response", "StreamResponse"):
                for k in node.keywords:
                    if k.arg == "status" and isinstance(k.value, ast.Constant) and isinstance(k.value.value, int) and k.value.value >= 400:
                        found.append(f"  {mod}:{node.lineno}: {_name(node.func)}(status={k.value.value})")
    assert not found, "error answers written outside the boundary (raise an errors.py class instead):\n" + "\n".join(found)
