"""Runs a script against another checkout's jax_nbx instead of the installed one.

    python benchmarks/run_checkout.py /path/to/old-checkout benchmarks/cpu.py --models ...

The old checkout needs its compiled module in place (jax_nbx/_ffi*.so, e.g.
copied from its build).  The editable install's import hook is dropped, so
`import jax_nbx` finds the checkout's package: A/B of two builds in the same
virtual environment, alternated in separate processes.
"""
from __future__ import annotations

import runpy
import sys


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    root, script, *args = sys.argv[1:]
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
    sys.path.insert(0, root)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
