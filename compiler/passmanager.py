"""The pass manager: checks requires/provides, runs each pass, then lints, verifies, times and snapshots."""
from __future__ import annotations

import importlib
import logging
import time

from harmony.base.errors import ConfigError, HarmonyError, PassError
from harmony.compiler.config import DEFAULT_PIPELINE
from harmony.compiler.ir import PassReport, Program
from harmony.compiler.printer import schedule_code
from harmony.compiler.verify import verify

log = logging.getLogger("harmony")
BASE_CAPABILITIES = {"cost"}


def load(name: str):
    """The pass module ``harmony.passes.<name>``; a helper module of a pass there is not one."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ConfigError(f"passes= takes pass names such as {DEFAULT_PIPELINE[0]!r}, got {name!r}; the passes are "
                          f"{', '.join(DEFAULT_PIPELINE)}")
    try:
        module = importlib.import_module(f"harmony.passes.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"harmony.passes.{name}":
            raise
        raise ConfigError(f"unknown pass {name!r}; the passes are {', '.join(DEFAULT_PIPELINE)}") from None
    if not all(hasattr(module, a) for a in ("NAME", "REQUIRES", "PROVIDES", "run")):
        raise ConfigError(f"{name!r} is a helper module of a pass, not a pass; the passes are "
                          f"{', '.join(DEFAULT_PIPELINE)}")
    return module


def check_order(passes) -> None:
    """Each pass's ``REQUIRES`` provided by a pass before it, and nothing a pass must come ``AFTER`` (what it
    accounts for where it is there, without needing it) provided by a pass after it."""
    have = set(BASE_CAPABILITIES)
    for i, p in enumerate(passes):
        missing = set(p.REQUIRES) - have
        if missing:
            before = [q.NAME for q in passes[:i]] or ["nothing"]
            raise ConfigError(f"pass {p.NAME!r} requires {sorted(missing)}, which no pass before it provides "
                              f"(passes before it: {', '.join(before)}); put a pass that provides it first")
        for q in passes[i + 1:]:
            late = set(getattr(p, "AFTER", ())) & set(q.PROVIDES)
            if late:
                raise ConfigError(f"pass {p.NAME!r} must run after pass {q.NAME!r}: it accounts for the "
                                  f"{', '.join(sorted(late))} that {q.NAME!r} provides; put {q.NAME!r} first")
        have |= set(p.PROVIDES)


def split_choices(entries) -> tuple[list[str], dict]:
    """``passes=`` entries as (names, choices): an entry is a pass's name, or ``(name, choice)`` to hand that pass
    its choice (plain data: what its search would have found) instead of letting it search."""
    names, choices = [], {}
    for entry in entries:
        if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str):
            names.append(entry[0])
            choices[entry[0]] = entry[1]
        else:
            names.append(entry)
    return names, choices


def run_passes(program: Program, entries=DEFAULT_PIPELINE) -> Program:
    """Run the passes ``entries`` names in order (see ``split_choices`` for handing one its choice)."""
    names, choices = split_choices(entries)
    passes = [load(n) for n in names]
    check_order(passes)
    done: list[str] = []
    for p in passes:
        start = time.perf_counter()
        try:
            result = p.run(program, choices.get(p.NAME))
            program = result.program
            if program.schedule is not None:
                program.schedule.lint()
            if "residency" in program.capabilities | set(p.PROVIDES):
                verify(program)
        except HarmonyError as e:
            e.add_note(f"while running pass {p.NAME!r} after passes {done or '[]'}")
            raise
        except Exception as e:  # noqa: BLE001 - any other failure is a compiler bug: name where it happened
            raise PassError(f"pass {p.NAME!r} failed after passes {done or '[]'}: {type(e).__name__}: {e}") from e
        report: PassReport = result.report
        report.seconds = time.perf_counter() - start
        program.reports.append(report)
        program.capabilities |= set(p.PROVIDES)
        # plain code: the byte comments replay the schedule's memory, which sm.code does when it is read
        program.history.append((p.NAME, f"# after pass {p.NAME!r} ({report.seconds * 1e3:.1f} ms)\n"
                                        + schedule_code(program, memory=False)))
        done.append(p.NAME)
        log.info("harmony: pass %s: %s in %.2f s%s", p.NAME, report.title, report.seconds, _chose(report))
    return program


def _chose(report: PassReport) -> str:
    """The choice a pass made, for its log line: its report's totals, the first few."""
    items = [f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in list(report.totals.items())[:4]
             if isinstance(v, (int, float, str))]
    return f" ({', '.join(items)})" if items else ""
