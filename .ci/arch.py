"""Architecture counts of the package code, so a refactor can report them before and after.

    python .ci/arch.py                   # one `key: value` line a count
    python .ci/arch.py --verbose         # and under each, what it counted (file:line)
    python .ci/arch.py --json            # {key: value}; with --verbose, {"counts": ..., "details": ...}
    python .ci/arch.py --max import_cycles=0 --max upward_imports=0   # exit 1 if a count is over its limit
    python .ci/arch.py --root PATH       # another tree (the tests run it on a fake one)

It parses files and never imports harmony, so it runs on a bare ``python3`` before anything is installed. Package
code is every ``*.py`` under the folders ``[tool.setuptools.package-dir]`` in pyproject.toml maps into the
``harmony`` namespace, walked recursively (``runtime/ops/`` -> ``harmony.runtime.ops``), read at run time so a
new top-level folder or sub-package is measured without a change here; tests, benchmarks, examples and .ci are
not package code. The folder mapped to the bare name is the face (harmony/). Layers, bottom to top (DESIGN.md,
"Layout"): base 0 < runtime 1 < compiler 2 < passes, viz 3 < driver 4 < the face 5; a mapped folder not in
``LAYERS`` has no layer and joins no layer count.

The counts (the keys of ``--json`` and ``--max``):

* ``face_lines``: lines (as ``wc -l``) of the face's own modules, harmony/ and its sub-packages.
* ``face_imported``: imports of a face module (``harmony.api``, ``from harmony import errors``, ``import harmony``)
  by package code outside the face, one per imported module per statement.
* ``import_cycles``, ``modules_in_cycles``: strongly connected components of more than one module in the import
  graph, and the modules in them. Every import statement counts, deferred ones inside functions and those under
  ``if TYPE_CHECKING:`` too (``--verbose`` marks those); ``from a.b import c`` is an edge to ``a.b.c`` when that
  is a module, else to ``a.b``; ``import a.b.c`` an edge to ``a.b.c`` only (not to the packages above it); an
  ``__init__.py`` is its package's module; relative imports are resolved.
* ``upward_imports``: imports of a higher layer's module by a lower layer's; ``sideways_imports``: between two
  different folders of one layer (passes and viz), reported apart.
* ``private_names``: ``from harmony.x import _name`` and ``alias._name`` where ``alias`` is a harmony module
  (``import harmony.passes.swap as swap; swap._drop``) across modules; dunder names do not count.
* ``op_name_comparisons``: ``==``, ``!=``, ``in``, ``not in`` between a name or attribute ending in ``name`` (or
  ``__name__``) and a string literal, or a tuple/list/set holding one, that is an op's name. The op names are
  read statically: the stub functions (module-level defs whose body is ``...``) of the module assigning ``OPS``,
  and the first argument of every ``register(stub, ...)`` call in the runtime's folder, wherever the table moves.
* ``op_identity_checks``: ``X.target is ops.Y``, ``target in (ops.Y, ...)``: a name ending in ``target`` against
  an op's stub, by name or attribute.
* ``tier_strings``: string constants exactly "device", "host" or "disk", not counting docstrings, the literal
  fragments of f-strings (an expression inside ``{}`` is code, and counts) or the values of an Enum's members
  (``Tier.DEVICE = "device"``, the one place they belong).
* ``deferred_import_share``: percent of the import statements naming a package module that sit inside a function.
* ``files_450_500``, ``files_over_500``, ``functions_over_60``: lines of a file as .ci/sizes.py counts them (its
  newlines + 1, so "over 500" is what it would refuse), of a function from its ``def`` to its last line.
* ``readme_lines``, ``docs_pages``: README.md's lines; the ``*.md`` under docs/ (0 without one).
* ``mode_files_<mode>``: how many package files each parallel mode's code is in. A heuristic: a file counts when
  any of the mode's regexes (``MODES``, printed by ``--verbose``) matches its code with comments and docstrings
  taken out (strings in code, such as a refusal naming ``shard_state='full'``, stay). The markers are meant to be
  the identifiers only that mode's code uses; data parallel's also run through the modes built on it.
"""
from __future__ import annotations

import argparse
import ast
import io
import json
import re
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"base": 0, "runtime": 1, "compiler": 2, "passes": 3, "viz": 3, "driver": 4, "": 5}   # "": the face
TIERS = {"device", "host", "disk"}
MODES = {   # mode -> regexes of the identifiers only its code uses (see the docstring: a heuristic)
    "data_parallel": [r"\bdata_parallel\b", r"\ballreduce\b", r"\b[Cc]ommunicator\b"],
    "zero1": [r"shard_state\s+is\s+(not\s+)?True", r"\bstate_owner\b", r"\bsync_state\b", r"\bby_owner\b",
              r"\bzero1\b"],
    "zero3": [r"shard_state\s*[!=]=\s*(FULL\b|[\"']full[\"'])", r"\b(Pack)?Shares\b", r"\.shares\s+is\s+(not\s+)?None",
              r"\.shares\.\w", r"\breduce_scatter\b", r"\bpartitioned\b"],
    "pipeline": [r"\.stage\b", r"parallel\s*[!=]=\s*[\"']pipeline[\"']", r"\bpipeline_group\b", r"\bStages\b",
                 r"\bshare_(loss|norms)\b", r"(?m)^def (send|recv)\(", r"name(__)?\s*[!=]=\s*[\"'](send|recv)[\"']",
                 r"(?m)^\s*(from|import)\b.*\b(send|recv)\b", r"\bis\s+(\w+\.)?(send|recv)\b"],
    "balance": [r"\bbalance\b", r"\bbalanced\b", r"\bplan_this_rank\b", r"\bstate_shares\b", r"\bsample_weight\b"],
}


@dataclass
class Module:
    name: str          # harmony.runtime.ops
    rel: str           # runtime/ops/
    group: str         # the package-dir entry it comes from, less the root: "runtime", "" for the face
    package: bool      # an __init__.py
    text: str
    tree: ast.Module = field(repr=False)
    nodes: list = field(default_factory=list, repr=False)      # every node of tree, walked once
    found: list | None = field(default=None, repr=False)       # imports(), worked out once

    @property
    def layer(self) -> int | None:
        return LAYERS.get(self.group)

    @property
    def where(self) -> str:     # the package that relative imports start from
        return self.name if self.package else self.name.rpartition(".")[0]


@dataclass
class Edge:
    src: str
    dst: str
    rel: str
    line: int
    deferred: bool     # inside a function
    typing: bool       # under `if TYPE_CHECKING:`

    def __str__(self) -> str:
        tags = "".join(f" ({t})" for t, on in (("deferred", self.deferred), ("type-checking", self.typing)) if on)
        return f"{self.rel}:{self.line}: {self.src} -> {self.dst}{tags}"


def package_dirs(root: Path) -> dict[str, str]:
    """``[tool.setuptools.package-dir]`` of pyproject.toml (read by hand: tomllib is not in Python 3.10)."""
    out, inside = {}, False
    for line in (root / "pyproject.toml").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("["):
            inside = line == "[tool.setuptools.package-dir]"
        elif inside and "=" in line:
            key, value = (s.strip().strip("\"'") for s in line.split("=", 1))
            out[key] = value
    return out


def load(root: Path) -> tuple[str, dict[str, Module]]:
    """The root name (``harmony``) and every package module by name."""
    dirs = package_dirs(root)
    face = min(dirs, key=len)
    owner: dict[Path, str] = {}
    for key in sorted(dirs, key=len):               # a deeper entry claims its folder's files from a shallower one
        for path in (root / dirs[key]).rglob("*.py"):
            owner[path] = key
    mods = {}
    for path, key in sorted(owner.items()):
        parts = list(path.relative_to(root / dirs[key]).with_suffix("").parts)
        package = parts[-1] == "__init__"
        name = ".".join([key] + parts[:-1] if package else [key] + parts)
        text = path.read_text(encoding="utf-8")
        group = key[len(face) + 1:].split(".")[0] if key != face else ""
        tree = ast.parse(text)
        mods[name] = Module(name, path.relative_to(root).as_posix(), group, package, text, tree, list(ast.walk(tree)))
    return face, mods


# -- imports ------------------------------------------------------------------------------------------
def _walk(tree: ast.AST):
    """(node, inside a function, under ``if TYPE_CHECKING:``) for every node below ``tree``."""
    stack = [(tree, False, False)]
    while stack:
        node, deferred, typing = stack.pop()
        for child in ast.iter_child_nodes(node):
            d = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for body, t in ((child.body, True), (child.orelse, typing)):
                    stack += [(s, d, t) for s in body]
                    yield from ((s, d, t) for s in body)
            else:
                stack.append((child, d, typing))
            yield child, deferred, typing


def _known(name: str, mods: dict) -> str | None:
    """The longest prefix of ``name`` that is a package module."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in mods:
            return ".".join(parts[:i])
    return None


def _from_base(node: ast.ImportFrom, mod: Module) -> str:
    if not node.level:
        return node.module or ""
    up = mod.where.split(".")
    base = up[:len(up) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports(mod: Module, mods: dict) -> list[tuple[ast.AST, bool, bool, list[tuple[str, str, str, str]]]]:
    """Each import statement naming a package module: (node, deferred, typing, [(bound name, the module it binds or
    "", the name a ``from`` imports or "", the module imported)]). ``import a.b as x`` binds x to a.b, ``import a.b``
    binds a to a, both importing a.b; ``from a import b`` binds b to the module a.b if there is one, importing it,
    else imports a."""
    if mod.found is not None:
        return mod.found
    out = mod.found = []
    for node, deferred, typing in _walk(mod.tree):
        targets = []
        if isinstance(node, ast.Import):
            for a in node.names:
                dst = _known(a.name, mods)
                if dst:
                    bound = a.asname or a.name.split(".")[0]
                    targets.append((bound, dst if a.asname else a.name.split(".")[0], "", dst))
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, mod)
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in mods:
                    targets.append((a.asname or a.name, sub, a.name, sub))
                elif _known(base, mods):
                    targets.append((a.asname or a.name, "", a.name, _known(base, mods)))
        if targets:
            out.append((node, deferred, typing, targets))
    return out


def graph(mods: dict) -> list[Edge]:
    edges = []
    for mod in mods.values():
        for node, deferred, typing, targets in imports(mod, mods):
            for dst in dict.fromkeys(t[3] for t in targets):
                if dst != mod.name:
                    edges.append(Edge(mod.name, dst, mod.rel, node.lineno, deferred, typing))
    return sorted(edges, key=lambda e: (e.rel, e.line, e.dst))


def cycles(names, edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    succ: dict[str, set] = {n: set() for n in names}
    for e in edges:
        succ[e.src].add(e.dst)
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for start in sorted(names):
        if start in index:
            continue
        work = [(start, iter(sorted(succ[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = counter[0]
                counter[0] += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(succ[w]))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return sorted(out)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return head and f"{head}.{node.attr}"
    return None


def private_names(mods: dict) -> list[str]:
    out = []
    for mod in mods.values():
        alias = {}
        for node, _, _, targets in imports(mod, mods):
            for bound, module, name, dst in targets:
                if module:
                    alias[bound] = module
                if _private(name) and dst != mod.name:
                    out.append(f"{mod.rel}:{node.lineno}: from {_from_base(node, mod)} import {name}")
        for node in mod.nodes:
            if isinstance(node, ast.Attribute) and _private(node.attr):
                dotted = _dotted(node.value)
                head, _, rest = (dotted or "").partition(".")
                target = alias.get(head) and ".".join(filter(None, (alias[head], rest)))
                if target in mods and target != mod.name:
                    out.append(f"{mod.rel}:{node.lineno}: {dotted}.{node.attr} ({target})")
    return out


# -- op names -----------------------------------------------------------------------------------------
def _docstring(body: list) -> bool:
    return bool(body) and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
        and isinstance(body[0].value.value, str)


def _stub(fn: ast.AST) -> bool:
    """A def whose body (past a docstring) is ``...`` (or ``pass``): a name for schedule graphs to call."""
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    body = fn.body[1:] if _docstring(fn.body) else fn.body
    return bool(body) and all(isinstance(s, ast.Pass) or isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                              and s.value.value is Ellipsis for s in body)


def op_names(mods: dict) -> set[str]:
    names = set()
    for mod in mods.values():
        defines_ops = any(isinstance(s, (ast.Assign, ast.AnnAssign)) and "OPS" in
                          [_dotted(t) for t in (s.targets if isinstance(s, ast.Assign) else [s.target])]
                          for s in mod.tree.body)
        if defines_ops:
            names |= {s.name for s in mod.tree.body if _stub(s)}
        if mod.group != "runtime":
            continue
        defs = {s.name for s in mod.tree.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
        imported = {}
        for _, _, _, targets in imports(mod, mods):
            imported.update({bound: (module, name) for bound, module, name, _ in targets})
        for node in mod.nodes:
            if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Name)):
                continue
            f = node.func
            ours = (isinstance(f, ast.Name) and f.id == "register" and (f.id in defs or f.id in imported)
                    or isinstance(f, ast.Attribute) and f.attr == "register" and _dotted(f.value) in imported)
            stub = node.args[0].id
            if ours and (stub in defs or stub in imported):
                names.add((imported[stub][1] or stub) if stub in imported else stub)
    return names


def _ends(node: ast.AST, word: str) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.endswith(word) or name == f"__{word}__"


def _items(node: ast.AST) -> list:
    return node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]


def op_checks(mods: dict, ops: set[str]) -> tuple[list[str], list[str]]:
    """(comparisons of names with op-name strings, identity checks of targets against op stubs)."""
    by_name, by_stub = [], []
    eq = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)

    def literal(node):
        return any(isinstance(x, ast.Constant) and x.value in ops for x in _items(node))

    def stub(node):
        return any(isinstance(x, ast.Name) and x.id in ops or isinstance(x, ast.Attribute) and x.attr in ops
                   for x in _items(node))
    for mod in mods.values():
        for node in mod.nodes:
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left] + node.comparators
            for a, op, b in zip(sides, node.ops, sides[1:]):
                what = (mod.rel, node.lineno, f"{mod.rel}:{node.lineno}: {ast.unparse(ast.Compare(a, [op], [b]))}")
                if isinstance(op, eq) and (_ends(a, "name") and literal(b) or _ends(b, "name") and literal(a)):
                    by_name.append(what)
                if isinstance(op, eq + (ast.Is, ast.IsNot)) and (_ends(a, "target") and stub(b)
                                                                  or _ends(b, "target") and stub(a)):
                    by_stub.append(what)
    return [w for *_, w in sorted(by_name)], [w for *_, w in sorted(by_stub)]


# -- strings, sizes, modes ----------------------------------------------------------------------------
def _docstrings(mod: Module) -> list[ast.Expr]:
    return [node.body[0] for node in mod.nodes
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and _docstring(node.body)]


def tier_strings(mods: dict) -> dict[str, list[int]]:
    """file -> the lines of its bare tier strings."""
    out = {}
    for mod in mods.values():
        skip = {id(d.value) for d in _docstrings(mod)}
        for node in mod.nodes:
            if isinstance(node, ast.JoinedStr):                 # f"...": its literal fragments
                skip.update(id(v) for v in node.values if isinstance(v, ast.Constant))
            elif isinstance(node, ast.ClassDef) and any("Enum" in ast.unparse(b) for b in node.bases):
                for s in node.body:                             # an Enum's members' values
                    if isinstance(s, (ast.Assign, ast.AnnAssign)) and s.value is not None:
                        skip.update(id(c) for c in ast.walk(s.value))
        lines = [n.lineno for n in mod.nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)
                 and n.value in TIERS and id(n) not in skip]
        if lines:
            out[mod.rel] = sorted(lines)
    return out


def code_only(mod: Module) -> str:
    """The module's text with its comments and docstrings blanked."""
    lines = mod.text.split("\n")         # as tokenize counts rows
    for d in _docstrings(mod):
        for i in range(d.lineno - 1, d.end_lineno):
            lines[i] = ""
    for tok in tokenize.generate_tokens(io.StringIO(mod.text).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col]
    return "\n".join(lines)


def _layer(mods: dict, name: str) -> str:
    mod = mods[name]
    return f"{mod.group or 'face'} {mod.layer}"


def measure(root: Path) -> tuple[dict, dict]:
    """({key: count}, {key: [detail lines]})."""
    face, mods = load(root)
    counts, details = {}, {}

    def put(key, value, lines=()):
        counts[key] = value
        details[key] = list(lines)

    put("face_lines", sum(len(m.text.splitlines()) for m in mods.values() if m.group == ""),
        [f"{m.rel}: {len(m.text.splitlines())}" for m in mods.values() if m.group == ""])
    edges = graph(mods)
    into_face = [e for e in edges if mods[e.dst].group == "" and mods[e.src].group != ""]
    put("face_imported", len(into_face), map(str, into_face))

    comps = cycles(mods, edges)
    lines = []
    for i, comp in enumerate(comps, 1):
        lines.append(f"cycle {i} ({len(comp)} modules): {', '.join(comp)}")
        inside = set(comp)
        lines += [f"    {e}" for e in edges if e.src in inside and e.dst in inside]
    put("import_cycles", len(comps), lines)
    put("modules_in_cycles", sum(map(len, comps)))

    layered = [e for e in edges if mods[e.src].layer is not None and mods[e.dst].layer is not None]
    up = [e for e in layered if mods[e.src].layer < mods[e.dst].layer]
    put("upward_imports", len(up), [f"{e}  [{_layer(mods, e.src)} -> {_layer(mods, e.dst)}]" for e in up])
    side = [e for e in layered if mods[e.src].layer == mods[e.dst].layer and mods[e.src].group != mods[e.dst].group]
    put("sideways_imports", len(side), [f"{e}  [{_layer(mods, e.src)} -> {_layer(mods, e.dst)}]" for e in side])
    private = private_names(mods)
    put("private_names", len(private), private)

    ops = op_names(mods)
    by_name, by_stub = op_checks(mods, ops)
    put("op_name_comparisons", len(by_name), [f"op names ({len(ops)}): {', '.join(sorted(ops))}"] + by_name)
    put("op_identity_checks", len(by_stub), by_stub)
    tiers = tier_strings(mods)
    put("tier_strings", sum(map(len, tiers.values())),
        [f"{rel}: {len(ls)} (lines {', '.join(map(str, ls))})"
         for rel, ls in sorted(tiers.items(), key=lambda kv: (-len(kv[1]), kv[0]))])

    stmts = [(m.rel, deferred) for m in mods.values() for _, deferred, _, _ in imports(m, mods)]
    late = {}
    for rel, deferred in stmts:
        late.setdefault(rel, [0, 0])[0] += deferred
        late[rel][1] += 1
    n_late = sum(d for _, d in stmts)
    put("deferred_import_share", round(100 * n_late / max(1, len(stmts)), 1),
        [f"{n_late} of {len(stmts)} import statements naming package modules are inside functions"]
        + [f"{rel}: {d} of {n}" for rel, (d, n) in sorted(late.items(), key=lambda kv: (-kv[1][0], kv[0])) if d])

    sizes = {m.rel: m.text.count("\n") + 1 for m in mods.values()}      # as .ci/sizes.py counts
    put("files_450_500", sum(450 <= n <= 500 for n in sizes.values()),
        [f"{rel}: {n}" for rel, n in sorted(sizes.items(), key=lambda kv: -kv[1]) if 450 <= n <= 500])
    put("files_over_500", sum(n > 500 for n in sizes.values()),
        [f"{rel}: {n}" for rel, n in sorted(sizes.items(), key=lambda kv: -kv[1]) if n > 500])
    long = sorted(((n.end_lineno - n.lineno + 1, f"{m.rel}:{n.lineno}: {n.name}") for m in mods.values()
                   for n in m.nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and n.end_lineno - n.lineno + 1 > 60), key=lambda t: (-t[0], t[1]))
    put("functions_over_60", len(long), [f"{what} is {n} lines" for n, what in long])

    readme = root / "README.md"
    put("readme_lines", len(readme.read_text(encoding="utf-8").splitlines()) if readme.exists() else 0)
    docs = sorted((root / "docs").rglob("*.md")) if (root / "docs").is_dir() else []
    put("docs_pages", len(docs), [d.relative_to(root).as_posix() for d in docs])

    code = {m.rel: code_only(m) for m in mods.values()}
    for mode, patterns in MODES.items():
        hits = {p: sorted(rel for rel, text in code.items() if re.search(p, text)) for p in patterns}
        files = sorted(set().union(*hits.values()))
        put(f"mode_files_{mode}", len(files), [f"{p}  ({len(h)}: {', '.join(h)})" for p, h in hits.items()])
    return counts, details


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the tree to measure (default: this checkout)")
    parser.add_argument("--verbose", "-v", action="store_true", help="what each count counted")
    parser.add_argument("--json", action="store_true", help="print a JSON dict")
    parser.add_argument("--max", action="append", default=[], metavar="KEY=N",
                        help="exit 1 if count KEY is over N (may be repeated)")
    args = parser.parse_args(argv)
    limits = {}
    for item in args.max:
        key, _, n = item.partition("=")
        try:
            limits[key] = float(n)
        except ValueError:
            parser.error(f"--max {item!r}: give KEY=N")
    counts, details = measure(args.root.resolve())
    unknown = sorted(set(limits) - set(counts))
    if unknown:
        parser.error(f"--max: no count named {', '.join(unknown)} (the counts: {', '.join(counts)})")
    if args.json:
        print(json.dumps({"counts": counts, "details": details} if args.verbose else counts, indent=1))
    else:
        for key, value in counts.items():
            print(f"{key}: {value}")
            for line in details[key] if args.verbose else ():
                print(f"    {line}")
    over = [f"{key} is {counts[key]}, over its limit {n:g}" for key, n in limits.items() if counts[key] > n]
    for line in over:
        print(f"arch: {line}", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
