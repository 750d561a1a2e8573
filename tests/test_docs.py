"""Every fenced code block of README.md and docs/*.md runs, or is checked, so the documentation cannot drift.

A block's fence says what it is:

- ```python: run. The python blocks of one page run in order, in one namespace, in a temp directory of the page's
  own, so a page may build a tiny model in its first block and use it in the next ones.
- ```python cuda: run where CUDA is; elsewhere compiled only, and skipped.
- ```python torchrun: one rank's code under torchrun, which cannot run in this process: compiled, every
  ``harmony.x.y`` it names resolved, and the keywords of each ``harmony.compile(...)`` whose values are literals
  checked by ``harmony.Config`` (a field that does not exist or a value it refuses fails).
- ```bash / ```sh: each command checked (below); ```bash run also runs each one for real (keep those cheap).
- ```text: output, a report, a layout: not run. A fence without a language fails: say what it is.

A command is checked by what it runs: ``pip install`` names an extra pyproject.toml has and the torch .ci/run
pins; ``python -m pytest ... tests`` is .ci/run's test command and other pytest lines name files that exist;
``python script.py ARGS``, ``python -m harmony ARGS``, ``python -m benchmarks ARGS`` and ``torchrun OPTS script.py
ARGS`` name a script that exists and ARGS its argparse accepts (the script runs up to its ``parse_args`` in a
child process, then stops); ``bash script.sh`` names a script ``bash -n`` accepts, and a ``VAR=...`` before it is a
variable the script reads. An argument that looks like a repository path must exist.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import harmony

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"python", "bash", "sh", "text"}
FENCE = re.compile(r"^(\s*)(```+)(.*)$")


@dataclass
class Block:
    page: Path
    line: int          # of the opening fence, 1-based
    lang: str
    tags: tuple
    source: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    found, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, info = m.groups()
        words = info.split()
        body, j = [], i + 1
        while j < len(lines) and not (lines[j].strip() == ticks and lines[j].startswith(indent)):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        assert j < len(lines), f"{page.relative_to(ROOT)}:{i + 1}: a code block that is never closed"
        found.append(Block(page, i + 1, words[0] if words else "", tuple(words[1:]), "\n".join(body) + "\n"))
        i = j + 1
    return found


BLOCKS = [b for page in PAGES for b in blocks_of(page)]


def test_the_pages_exist_and_link_to_each_other():
    docs = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert len(docs) >= 8, docs
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    index = (ROOT / "docs" / "index.md").read_text()
    for name in docs:
        if name != "index.md":
            assert f"({name})" in index, f"docs/index.md does not link to {name}"
            assert f"(docs/{name})" in readme, f"README.md does not link to docs/{name}"
    for page in PAGES:     # relative links point at files that exist, and at headings those have
        for target, anchor in re.findall(r"\]\(([^)#:\s]*)(?:#([^)]*))?\)", page.read_text()):
            path = page.parent / target if target else page
            assert path.exists(), f"{page.relative_to(ROOT)} links to {target}, which is missing"
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path), f"{page.relative_to(ROOT)} links to {target}#{anchor}: no such heading"


def _anchors(page: Path) -> set[str]:
    """GitHub's ids of a page's headings (outside code blocks): lower case, punctuation dropped, spaces as dashes."""
    heads, fenced = [], False
    for line in page.read_text().splitlines():
        fenced ^= bool(FENCE.match(line))
        if not fenced and re.match(r"^#+ ", line):
            heads.append(line.lstrip("#").strip())
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_the_readme_opens_with_the_demo_and_the_test_command_of_ci():
    first = blocks_of(ROOT / "README.md")[0]
    lines = [line for line in first.source.splitlines() if line and not line.startswith("#")]
    installs, test = _ci_install_and_test()
    assert first.lang == "bash" and len(lines) == 2, first.source
    assert lines[0].endswith("&& python -m harmony demo"), lines[0]
    assert lines[1] == " && ".join([*installs, test]), f"README's test command is not .ci/run's:\n{lines[1]}"


def test_every_block_says_what_it_is():
    bad = [b.id for b in BLOCKS if b.lang not in LANGUAGES]
    assert not bad, f"blocks without a known language ({', '.join(sorted(LANGUAGES))}): {bad}"


# -- python ---------------------------------------------------------------------------------------
_namespaces: dict[Path, dict] = {}
_failed: dict[Path, str] = {}


@pytest.fixture(scope="module", autouse=True)
def _one_thread_and_close_modules():
    # the blocks' models are tiny: a second OpenMP thread only waits at barriers (spinning, where torch was loaded
    # before harmony could ask OpenMP to sleep), so they run on one, as under the CI's xdist workers (conftest)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    for ns in _namespaces.values():
        for value in list(ns.values()):
            if isinstance(value, harmony.ScheduledModule):
                value.close()


def _code(block: Block):
    # padded so that a traceback names the page and its line
    return compile("\n" * block.line + block.source, str(block.page), "exec")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.id)
def test_python_block(block, tmp_path_factory, monkeypatch):
    code = _code(block)
    if "torchrun" in block.tags:
        return _check_rank_code(block)
    if "cuda" in block.tags and not torch.cuda.is_available():
        pytest.skip("needs CUDA (compiled only)")
    if block.page in _failed:
        pytest.skip(f"an earlier block of this page failed ({_failed[block.page]})")
    ns = _namespaces.setdefault(block.page, {"__name__": "__main__"})
    here = ns.setdefault("__tmp__", tmp_path_factory.mktemp(block.page.stem))
    monkeypatch.chdir(here)
    try:
        exec(code, ns)
    except BaseException:
        _failed[block.page] = block.id
        raise


def _check_rank_code(block: Block) -> None:
    """Names under ``harmony`` resolve; ``harmony.compile``'s literal keywords pass their config group's checks (and
    ``harmony.Config``'s, where every keyword is a literal)."""
    tree = ast.parse(block.source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = _dotted(node)
            if chain and chain[0] == "harmony":
                _resolve(chain, block)
        if isinstance(node, ast.Call) and _dotted(node.func) == ["harmony", "compile"]:
            given = [kw for kw in node.keywords if kw.arg not in (None, "example_batch", "config")]
            unknown = [kw.arg for kw in given if kw.arg not in harmony.Config.__dataclass_fields__]
            assert not unknown, f"{block.id}: harmony.compile has no option {unknown}"
            literal = {}
            for kw in given:
                try:
                    literal[kw.arg] = ast.literal_eval(kw.value)
                except ValueError:
                    pass
            for group in GROUPS:
                group(**{k: v for k, v in literal.items() if k in group.__dataclass_fields__})
            if len(literal) == len(given):
                harmony.Config(**literal)


GROUPS = (harmony.TrainConfig, harmony.MemoryConfig, harmony.DiskConfig, harmony.ParallelConfig,
          harmony.NumericsConfig, harmony.PlanConfig)


def _dotted(node) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _resolve(chain: list[str], block: Block) -> None:
    import importlib
    obj, path = harmony, "harmony"
    for name in chain[1:]:
        if not hasattr(obj, name):
            try:
                obj = importlib.import_module(f"{path}.{name}")
            except ModuleNotFoundError:
                pytest.fail(f"{block.id}: {path}.{name} does not exist")
        else:
            obj = getattr(obj, name)
        path = f"{path}.{name}"


# -- bash -------------------------------------------------------------------------------------------
def _ci_install_and_test() -> tuple[list[str], str]:
    last = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    parts = [p.strip() for p in last.split("&&")]
    return [_quiet_off(p) for p in parts if p.startswith("pip ")], next(p for p in parts if "pytest" in p)


def _quiet_off(cmd: str) -> str:
    return " ".join(w for w in cmd.split() if w != "-q")


def commands_of(source: str) -> list[str]:
    """The commands of a bash block: lines joined at a trailing backslash, comments dropped, split at ``&&``."""
    out, pending = [], ""
    for line in source.splitlines():
        line = pending + line
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        words = shlex.split(line, comments=True)
        if not words:
            continue
        cmd = []
        for w in words + ["&&"]:
            if w == "&&":
                if cmd:
                    out.append(shlex.join(cmd))
                cmd = []
            else:
                cmd.append(w)
    return out


# (script, how many of its own arguments come first) -> the script its further arguments go to
FORWARDED = {"benchmarks/gpu.sh": ("benchmarks/gpu.py", 2)}
ENV_ARGUMENTS = {"LARGEST_ARGS": "benchmarks/largest.py"}   # a variable holding another script's arguments


def plan_checks(cmd: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(problems found without running anything, [(script, argv) to parse])."""
    words = shlex.split(cmd)
    problems, parse = [], []
    env = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    head = words[0]
    if head == "pip":
        pins, _ = _ci_install_and_test()
        if words[1] != "install":
            problems.append(f"not a pip install: {cmd}")
        for w in words[2:]:
            m = re.match(r"^\.\[(\w+)\]$", w)
            extras = _extras()
            if m and m.group(1) not in extras:
                problems.append(f"{cmd}: pyproject.toml has no extra {m.group(1)!r} ({sorted(extras)})")
            if w.startswith("torch==") and not any(w in p for p in pins):
                problems.append(f"{cmd}: .ci/run pins another torch ({pins})")
        return problems, parse
    if head in ("apt-get", "ruff"):
        return problems, parse
    if head == "torchrun":
        from torch.distributed.run import get_args_parser
        a = get_args_parser().parse_args(words[1:])
        words = ["python", a.training_script, *a.training_script_args]
        head = "python"
    if head == "python":
        if words[1:3] == ["-m", "pytest"]:
            _, ci_test = _ci_install_and_test()
            if words[-1] == "tests":
                if cmd != ci_test:
                    problems.append(f"the test command is not .ci/run's:\n  {cmd}\n  {ci_test}")
            for w in words[3:]:
                if w.startswith("tests/") and not (ROOT / w.split("::")[0]).exists():
                    problems.append(f"{cmd}: no {w}")
            return problems, parse
        if words[1] == "-m":
            module, argv = words[2], words[3:]
            target = {"harmony": "harmony/__main__.py", "benchmarks": "benchmarks/__main__.py"}.get(module)
            if target is None:
                problems.append(f"{cmd}: python -m {module} is not checked here (add it to test_docs.py)")
                return problems, parse
        else:
            target, argv = words[1], words[2:]
        if not (ROOT / target).exists():
            problems.append(f"{cmd}: {target} does not exist")
            return problems, parse
        problems += _paths_exist(argv, cmd)
        if "ArgumentParser" in (ROOT / target).read_text():
            parse.append((target, argv))
        elif argv:      # a script that reads sys.argv itself: only its name is checked
            problems.append(f"{cmd}: {target} has no argparse parser to check its arguments with")
        return problems, parse
    if head == "bash":
        script, argv = words[1], words[2:]
        path = ROOT / script
        if not path.exists():
            return [f"{cmd}: {script} does not exist"], parse
        done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        if done.returncode:
            problems.append(f"{script}: bash -n: {done.stderr}")
        text = path.read_text()
        for k, v in env.items():
            if k not in text:
                problems.append(f"{cmd}: {script} does not read {k}")
            if k in ENV_ARGUMENTS:
                parse.append((ENV_ARGUMENTS[k], shlex.split(v)))
        if script in FORWARDED:
            other, own = FORWARDED[script]
            parse.append((other, argv[own:]))
        problems += _paths_exist(argv, cmd)
        return problems, parse
    return [f"{cmd}: no check for {head!r} commands (add one to test_docs.py)"], parse


def _paths_exist(argv, cmd) -> list[str]:
    return [f"{cmd}: {a} does not exist" for a in argv
            if re.match(r"^(benchmarks|examples|tests|harmony|docs)/\S+\.\w+$", a) and not (ROOT / a).exists()]


def _extras() -> set[str]:
    section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^(\w+) = ", section, flags=re.M))


# A child process takes (script, argv) pairs as JSON and runs each script up to the end of its parse_args.
_PARSER = r'''
import argparse, json, os, runpy, sys
class Parsed(BaseException):
    pass
original = argparse.ArgumentParser.parse_args
def parse_args(self, args=None, namespace=None):
    original(self, args, namespace)
    raise Parsed
argparse.ArgumentParser.parse_args = parse_args
results = []
for script, argv in json.load(sys.stdin):
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        if script.endswith("__main__.py"):
            runpy.run_module(os.path.dirname(script).replace("/", "."), run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
        results.append("the script ran to its end without calling parse_args")
    except Parsed:
        results.append("")
    except SystemExit as e:     # --help exits 0
        results.append("" if e.code in (0, None) else f"argparse refused the arguments (exit {e.code})")
    except BaseException as e:
        results.append(f"{type(e).__name__}: {e}")
    finally:
        sys.path.pop(0)
print(json.dumps(results))
'''

_parsed: dict = {}


def _parse_all() -> dict:
    """Every (script, argv) of every bash block, parsed in one child process (importing torch once)."""
    if not _parsed:
        todo = []
        for b in BLOCKS:
            if b.lang in ("bash", "sh"):
                for cmd in commands_of(b.source):
                    todo += plan_checks(cmd)[1]
        todo = list(dict.fromkeys((s, tuple(a)) for s, a in todo))
        done = subprocess.run([sys.executable, "-c", _PARSER], input=json.dumps(todo), cwd=ROOT, text=True,
                              capture_output=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert done.returncode == 0, done.stderr[-3000:]
        _parsed.update(zip(todo, json.loads(done.stdout.strip().splitlines()[-1])))
    return _parsed


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in ("bash", "sh")], ids=lambda b: b.id)
def test_bash_block(block, tmp_path):
    cmds = commands_of(block.source)
    assert cmds, f"{block.id}: an empty block"
    problems = []
    for cmd in cmds:
        found, parse = plan_checks(cmd)
        problems += found
        results = _parse_all()
        for script, argv in parse:
            why = results[(script, tuple(argv))]
            if why:
                problems.append(f"{shlex.join([script, *argv])}: {why}")
    assert not problems, "\n".join(problems)
    if "run" in block.tags:
        for folder in ("examples", "benchmarks", "tests"):     # run where the files it writes land in a temp dir
            (tmp_path / folder).symlink_to(ROOT / folder)
        for cmd in cmds:
            t0 = time.perf_counter()
            done = subprocess.run(cmd, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, f"{cmd}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            assert time.perf_counter() - t0 < 60, f"{cmd} took too long for a doc block run for real"
