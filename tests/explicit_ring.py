"""Run by test_context_parallel.py in place of 09_context_parallel.py, with its flags: the same
main(), with every ring block explicit (fused_kernel's choice on XPU) and taken a few queries at
a time (EXPLICIT_SCORES, argv's first item), so that a training run's losses check the chunked
explicit block against 01's."""

import importlib
import sys

cp_module = importlib.import_module("09_context_parallel")

if __name__ == "__main__":
    cp_module.fused_kernel = lambda device_type, dtype, head_dim: "explicit"
    cp_module.EXPLICIT_SCORES = int(sys.argv.pop(1))
    sys.argv[0] = cp_module.__file__  # the script's own name in its lines
    cp_module.main()
