"""Size limits of the package code, checked by .ci/run: no file over 500 lines, no function over 80.

Long files and functions are where one job turns into three; the limits keep each module readable in one
sitting. Benchmarks and tests are scripts, not package code, and are not held to them. ``OVER`` listed what was
already over its limit when the check came in (issue 27; empty since): an entry may shrink, never grow, and
nothing new may join it; take an entry out once it is within its limit.
"""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ("harmony", "base", "compiler", "passes", "runtime", "viz", "driver")
MAX_FILE, MAX_FUNCTION = 500, 80
OVER: dict[str, int] = {}   # file or file:function -> lines when the check came in


def problems() -> list[str]:
    out = []
    for folder in PACKAGE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            lines = text.count("\n") + 1
            rel = path.relative_to(ROOT)
            out += _over(str(rel), lines, MAX_FILE, f"{rel}: {lines} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    what = f"{rel}:{node.lineno}: {node.name} is {n} lines"
                    out += _over(f"{rel}:{node.name}", n, MAX_FUNCTION, what)
    return out


def _over(key: str, size: int, limit: int, what: str) -> list[str]:
    if size <= limit:
        return []
    known = OVER.get(key)
    if known is None:
        return [f"{what} (at most {limit})"]
    if size > known:
        return [f"{what}, {size - known} more than when the check came in ({known}; at most {limit})"]
    return []



if __name__ == "__main__":
    found = problems()
    print("\n".join(found) or f"sizes: nothing new over {MAX_FILE} lines a file or {MAX_FUNCTION} a function, and "
                                f"none of the {len(OVER)} known to be over has grown")
    sys.exit(1 if found else 0)
