import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# Plans must not depend on the machine profile a user or a benchmark cached (Hardware.profile saves one for
# Hardware.this_machine(), which compile and the balance tests plan with): with one measured on this machine,
# the balanced replicated and partitioned runs of test_zero3_uneven planned different packs, so their 4-bit
# all-reduces drew their stochastic rounding in different groups and the bitwise checks failed. Every test, and
# every rank it spawns, gets an empty cache of its own instead.
_cache = tempfile.mkdtemp(prefix="harmony-test-cache-")
os.environ["HARMONY_CACHE_DIR"] = _cache
atexit.register(shutil.rmtree, _cache, ignore_errors=True)
