""".ci/arch.py on a small fake tree whose every count is known: a cycle, upward, sideways and face imports, private
names, op-name comparisons and identity checks, tier strings, deferred imports, long files and functions, docs, and
one parallel mode's markers; and its ``--max`` limits."""
import json
import subprocess
import sys
from pathlib import Path

ARCH = Path(__file__).resolve().parent.parent / ".ci" / "arch.py"

PYPROJECT = """
[project]
name = "harmony"

[tool.setuptools.package-dir]
"harmony" = "harmony"
"harmony.base" = "base"
"harmony.runtime" = "runtime"   # a comment
"harmony.compiler" = "compiler"
"harmony.passes" = "passes"
"harmony.viz" = "viz"
"harmony.driver" = "driver"

[tool.ruff]
line-length = 120
"""

FILES = {
    "harmony/__init__.py": "from harmony.api import compile  # noqa: F401\n",
    "harmony/api.py": '"""The face."""\n\n\ndef compile(model):\n    return model\n',
    "harmony/checkpoint/__init__.py": "X = 1\nY = 2\n",        # a face sub-package
    "base/__init__.py": "",
    "base/tiers.py": 'import enum\n\n\nclass Tier(str, enum.Enum):\n    DEVICE = "device"\n    HOST = "host"\n',
    "base/util.py": "from harmony.runtime.a import tier  # upward\n",
    "runtime/__init__.py": "",
    # the op table in a sub-package: stubs beside OPS, one more registered elsewhere
    "runtime/ops/__init__.py": ('OPS = {}\n\n\ndef swap_in(pack): ...\n\n\n'
                                'def step(pack):\n    """Update."""\n    ...\n\n\n'
                                "def register(stub, execute):\n    OPS[stub] = execute\n\n\n"
                                "def helper():\n    return 1\n"),
    "runtime/ops/move.py": ("import atexit\n\nfrom harmony.runtime.ops import register\n\n\ndef gather(pack): ...\n\n\n"
                            "def flush(): ...\n\n\nregister(gather, None)\natexit.register(flush)\n"),
    "runtime/a.py": 'from harmony.runtime import b\n\n\ndef tier():\n    return "device"\n',
    "runtime/b.py": "def later():\n    from harmony.runtime.a import _hidden\n    return _hidden\n",
    "runtime/tiers/__init__.py": "",
    "runtime/tiers/disk.py": "from ..a import tier\nfrom . import mem\n",
    "runtime/tiers/mem.py": 'X = "host"\n',
    "compiler/__init__.py": "",
    "compiler/x.py": '''"""host"""
import harmony.runtime.ops as ops
from harmony import api

DOC = ops.__doc__


def check(n, name, x):
    if n.target is ops.step:
        return f"disk{x}"
    if name == "swap_in" or n.target.__name__ in ("gather", "other"):
        return "disk"
    if n.target in (ops.swap_in, ops.gather):
        return ops._private(x)
    if name == "forward" or n.target is api:
        return "cpu"
    return f"{x or 'host'}"
''',
    "passes/__init__.py": "",
    "passes/p.py": ('from harmony.viz import draw\n\n\ndef f(cfg, plan):\n'
                    '    return cfg.parallel == "pipeline" and plan.stage\n'),
    "viz/__init__.py": "",
    "viz/draw.py": '"""plan.stage, in a docstring."""\nX = 1   # pipeline_group, in a comment\n',
    "driver/__init__.py": "",
    "driver/run.py": "def go():\n    import harmony\n    import harmony.api\n    return harmony\n",
    "runtime/big.py": ("def long():\n" + "    x = 1\n" * 69 + "    return x\n" + "Y = 1\n" * 389),   # 460 lines
    "runtime/huge.py": ("def sixty():\n" + "    x = 1\n" * 58 + "    return x\n" + "Z = 1\n" * 460),  # 520 lines
    # not package code
    "tests/test_x.py": 'import harmony.api\nX = "device"\n',
    "examples/e.py": 'from harmony.runtime import a\nX = "disk"\n',
    "README.md": "# Fake\n\ntext\n",
    "docs/a.md": "a\n",
    "docs/sub/b.md": "b\n",
    "docs/c.txt": "c\n",
}


def _tree(tmp_path: Path) -> Path:
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    for rel, text in FILES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ARCH), *args], capture_output=True, text=True, timeout=60)


def test_counts_of_a_fake_tree(tmp_path):
    root = _tree(tmp_path)
    out = _run("--root", str(root), "--json", "--verbose")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    counts, details = got["counts"], got["details"]
    face = sum(len(t.splitlines()) for rel, t in FILES.items() if rel.startswith("harmony/"))
    assert counts == {
        "face_lines": face,
        "face_imported": 3,          # compiler/x.py: harmony.api; driver/run.py: harmony, harmony.api
        "import_cycles": 1,          # runtime.a <-> runtime.b
        "modules_in_cycles": 2,
        "upward_imports": 4,         # base -> runtime, compiler -> face, driver -> face twice
        "sideways_imports": 1,       # passes -> viz
        "private_names": 2,          # from harmony.runtime.a import _hidden; ops._private (not ops.__doc__)
        "op_name_comparisons": 2,    # name == "swap_in"; __name__ in ("gather", ...) (not "forward": no such op)
        "op_identity_checks": 2,     # target is ops.step; target in (ops.swap_in, ops.gather) (not `is api`)
        "tier_strings": 4,           # runtime/a.py, runtime/tiers/mem.py, compiler/x.py's "disk" and 'host' in {}
        "deferred_import_share": 25.0,   # 3 of 12 statements
        "files_450_500": 1,          # runtime/big.py
        "files_over_500": 1,         # runtime/huge.py
        "functions_over_60": 1,      # runtime/big.py's long (71 lines), not huge.py's sixty (60)
        "readme_lines": 3,
        "docs_pages": 2,
        "mode_files_data_parallel": 0,
        "mode_files_zero1": 0,
        "mode_files_zero3": 0,
        "mode_files_pipeline": 1,    # passes/p.py, not viz/draw.py's docstring and comment
        "mode_files_balance": 0,
    }
    assert details["op_name_comparisons"][0] == "op names (3): gather, step, swap_in"
    assert details["import_cycles"][0] == "cycle 1 (2 modules): harmony.runtime.a, harmony.runtime.b"
    assert any("runtime/b.py:2: harmony.runtime.b -> harmony.runtime.a (deferred)" in d
               for d in details["import_cycles"])
    assert any("[base 0 -> runtime 1]" in d for d in details["upward_imports"])
    assert any("driver/run.py:2: harmony.driver.run -> harmony (deferred)" in d for d in details["face_imported"])
    assert details["tier_strings"] == ["compiler/x.py: 2 (lines 12, 17)", "runtime/a.py: 1 (lines 5)",
                                       "runtime/tiers/mem.py: 1 (lines 1)"]


def test_plain_output_and_limits(tmp_path):
    root = _tree(tmp_path)
    plain = _run("--root", str(root))
    assert plain.returncode == 0 and "import_cycles: 1\n" in plain.stdout
    assert "\n    " not in plain.stdout                     # details only with --verbose
    over = _run("--root", str(root), "--max", "import_cycles=0", "--max", "upward_imports=9")
    assert over.returncode == 1 and "import_cycles is 1, over its limit 0" in over.stderr
    assert _run("--root", str(root), "--max", "import_cycles=1").returncode == 0
    assert _run("--root", str(root), "--max", "no_such_count=1").returncode == 2
