"""`python -m ddlfast.info`: what this build of ddlfast is and which MPI it and mpi4py run on.

    python -m ddlfast.info            # every build fact, one per line
    python -m ddlfast.info --short    # one line (scripts/setup.sh prints it after a build)
    python -m ddlfast.info --json
"""

from __future__ import annotations

import argparse
import json
import sys

import ddlfast
from ddlfast import mpi_check


def mpi_facts() -> dict:
    """The MPI ddlfast was compiled against (and its mpicc), the MPI mpi4py runs on, and mpi4py's build."""
    import mpi4py
    from mpi4py import MPI

    recorded = mpi_check.built_with()
    return {
        "cuda_kernels": mpi_check.recorded_fact("CUDA_KERNELS") or "not recorded (an older build)",
        "ddlfast_built_against": str(recorded[0]) if recorded else "not recorded",
        "ddlfast_mpicc": recorded[1] if recorded else "not recorded",
        "mpi4py_runs_on": " ".join(MPI.Get_library_version().split("\n")[0].replace("\0", "").split()),
        "mpi4py": f"{mpi4py.__version__} ({mpi4py.__file__.rsplit('/', 1)[0]})",
        "mpi4py_config": mpi4py.get_config(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddlfast.info", description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="one line")
    parser.add_argument("--json", action="store_true", help="one JSON document")
    args = parser.parse_args(argv)
    facts = {**mpi_facts(), **ddlfast.build_info()}
    if args.json:
        json.dump(facts, sys.stdout, indent=1, default=str)
        print()
    elif args.short:
        print(f"ddlfast built: {facts['kernel_selected']} | {facts['cuda_kernels']} | built against "
              f"{facts['ddlfast_built_against']} ({facts['ddlfast_mpicc']}) | mpi4py runs on {facts['mpi4py_runs_on']}")
    else:
        for key, value in facts.items():
            print(f"{key:24} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
