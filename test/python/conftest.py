"""Settings every test process shares."""

import os
import tempfile

# The per-user cache (the benchmark driver's own promotions, read by recipe="auto") goes to a
# folder made for this pytest run, so tests neither read nor write the user's real one; child
# processes inherit it.
os.environ["TABSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="tabserve-test-cache-")
