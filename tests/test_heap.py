"""glibc's heap kept around qserve's engines (the glibc-heap-kept patch, qserve.compat.glibc), measured in page faults."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

MIB = 256
PAGES = MIB * 1024 * 1024 // os.sysconf("SC_PAGE_SIZE")  # what touching one allocation faults in, page by page

# In a fresh interpreter (glibc's malloc state untouched by pytest): each round allocates MIB MiB,
# writes every byte and frees it; the page faults and resident size of each step are printed.
ROUNDS = """
import ctypes, json, resource
from qserve.compat.glibc import allocations_kept
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() >> 20

def round_faults(mib={mib}):
    before, size = faults(), mib << 20
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    libc.free(ctypes.c_void_p(p))
    return faults() - before

out = {{"outside": [round_faults(), round_faults()]}}
with allocations_kept():
    out["inside"] = [round_faults(), round_faults()]
    out["rss_inside"] = rss_mib()
out["rss_after"] = rss_mib()
out["after"], out["after_16_mib"] = [round_faults(), round_faults()], [round_faults(16), round_faults(16)]
print(json.dumps(out))
"""


def _rounds(**env: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", ROUNDS.format(mib=MIB)],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"} | env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_freed_memory_is_reused_inside_the_block_and_returned_after() -> None:
    got = _rounds()
    # Outside: glibc maps every large allocation afresh, so each round faults in every page again.
    assert all(n >= 0.95 * PAGES for n in got["outside"]), got
    # Inside: the first round's pages stay in the heap and the second round reuses them.
    assert got["inside"][0] >= 0.95 * PAGES and got["inside"][1] < 0.02 * PAGES, got
    assert got["rss_inside"] - got["rss_after"] >= 0.9 * MIB, got  # malloc_trim gave the kept pages back
    # After: large blocks are mapped afresh again, and below 32 MiB the heap reuses freed pages, as
    # glibc's own dynamic threshold ends up (setting any threshold ends that rule for the process).
    assert all(n >= 0.95 * PAGES for n in got["after"]), got
    assert got["after_16_mib"][1] < 0.02 * PAGES * 16 / MIB, got


@pytest.mark.parametrize("env", [{"MALLOC_TOP_PAD_": "131072"}, {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}])
def test_a_user_who_tuned_malloc_keeps_their_settings(env: dict[str, str]) -> None:
    got = _rounds(**env)
    assert all(n >= 0.95 * PAGES for n in got["inside"]), got
