import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Plans must not depend on the machine profile a user or a benchmark cached (Hardware.profile saves one for
# Hardware.this_machine(), which compile and the balance tests plan with): with one measured on this machine,
# the balanced replicated and partitioned runs of test_zero3_uneven planned different packs, so their 4-bit
# all-reduces drew their stochastic rounding in different groups and the bitwise checks failed. Every test, and
# every rank it spawns, gets an empty cache of its own instead.
_cache = tempfile.mkdtemp(prefix="harmony-test-cache-")
os.environ["HARMONY_CACHE_DIR"] = _cache
atexit.register(shutil.rmtree, _cache, ignore_errors=True)

# Under pytest-xdist (the README's `-n 2`) each worker's OpenMP team shares the cores with the other
# worker's: a team waiting at a barrier for a member the other process descheduled stalls every small op, so
# each worker takes its share of the cores (the commit that made this has the figures).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    import torch
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, _cores // _workers))


def _module_scoped(item) -> bool:
    return any(defs[-1].scope == "module" for defs in item._fixtureinfo.name2fixturedefs.values())


@pytest.hookimpl(tryfirst=True)      # before xdist's own hook reads the groups (``--dist loadgroup``)
def pytest_collection_modifyitems(config, items):
    """The tests of a module that share a module-scoped fixture (one spawn of ranks checked many ways) run on
    one worker, so the fixture runs once; ``--dist loadgroup`` hands every other test out one by one."""
    for item in items:
        if _module_scoped(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
