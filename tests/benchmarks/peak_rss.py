"""Run a training script in this process, then print this rank's peak resident memory
(ru_maxrss): the per-rank memory figure of bench_cp.py on CPUs, where torch has no
allocator statistics. Usage: peak_rss.py SCRIPT [FLAGS...] (under mpiexec like the script)."""

import os
import resource
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
script = os.path.join(ROOT, sys.argv[1])
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
rank = os.environ.get("PMI_RANK", os.environ.get("RANK", "0"))
print(f"peak_rss rank {rank}: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024} bytes", flush=True)
