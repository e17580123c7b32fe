"""`python -m ddlfast.horovodrun -np N [-H hosts] script.py ...`: horovodrun's common flags, mapped to the MPI
launcher of the MPI ddlfast was built against (the `mpiexec` beside the running Python, else on PATH).

    -np/--num-proc N          mpiexec -n N
    -H/--hosts h1:2,h2:2      Open MPI: --host h1:2,h2:2; MPICH (Hydra): -hosts h1:2,h2:2
    -hostfile/--hostfile F    Open MPI: --hostfile F; MPICH: -f F
    -p/--ssh-port P           Open MPI: --mca plm_rsh_args "-p P"; MPICH: -launcher-exec "ssh -p P"
    --start-timeout S         accepted (the stall limit is DDLFAST_TIMEOUT_S)
    --verbose, --mpi          accepted; --gloo, --jsrun, elastic flags (--min-np, --host-discovery-script, ...) are
                              refused: ddlfast runs on MPI only, and elastic training is not supported
    -x/--env NAME[=VALUE]     exported to every rank
    --dry-run                 print the launcher command instead of running it

Everything from the script on is passed through. HOROVOD_* settings with a ddlfast twin are mapped
(HOROVOD_FUSION_THRESHOLD -> DDLFAST_BUCKET_BYTES); the rest are ignored, as docs/horovod.md lists.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

_REFUSED = ("--gloo", "--jsrun", "--min-np", "--max-np", "--host-discovery-script", "--slots-per-host",
            "--elastic-timeout", "--reset-limit", "--blacklist-cooldown-range", "--network-interface", "--nics")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ddlfast.horovodrun",
                                     description="horovodrun's common flags, run through the MPI launcher")
    parser.add_argument("-np", "--num-proc", dest="np", type=int, required=True, help="number of ranks")
    parser.add_argument("-H", "--hosts", dest="hosts", help="host1:slots,host2:slots")
    parser.add_argument("-hostfile", "--hostfile", dest="hostfile", help="a hostfile (host slots=N per line)")
    parser.add_argument("-p", "--ssh-port", dest="ssh_port", type=int)
    parser.add_argument("--start-timeout", type=int)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--mpi", action="store_true")
    parser.add_argument("-x", "--env", action="append", default=[], help="NAME or NAME=VALUE for every rank")
    parser.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the script and its arguments")
    return parser


def _launcher() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else (shutil.which("mpiexec") or "mpiexec")


def _flavour(mpiexec: str) -> str:
    """'openmpi' or 'mpich' (Hydra), from the launcher's --version."""
    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return "mpich"
    return "openmpi" if "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text else "mpich"


def command_for(argv: Sequence[str], mpiexec: str | None = None, flavour: str | None = None) -> list[str]:
    """The launcher command for horovodrun's arguments (raises SystemExit with a message on refused flags)."""
    refused = [a for a in argv if a.split("=")[0] in _REFUSED]
    if refused:
        raise SystemExit(f"ddlfast.horovodrun: {refused[0]} is not supported (ddlfast runs on MPI; no elastic "
                         "training): see docs/horovod.md")
    args = _parser().parse_args(list(argv))
    if args.np < 1:
        raise SystemExit(f"ddlfast.horovodrun: -np {args.np}: give 1 or more ranks")
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit("ddlfast.horovodrun: no script to run")
    if command[0].endswith(".py"):
        command = [sys.executable, *command]
    mpiexec = mpiexec or _launcher()
    flavour = flavour or _flavour(mpiexec)
    line = [mpiexec, "-n", str(args.np)]
    if args.hosts:
        line += ["--host", args.hosts] if flavour == "openmpi" else ["-hosts", args.hosts]
    if args.hostfile:
        line += ["--hostfile", args.hostfile] if flavour == "openmpi" else ["-f", args.hostfile]
    if args.ssh_port:
        line += (["--mca", "plm_rsh_args", f"-p {args.ssh_port}"] if flavour == "openmpi"
                 else ["-launcher-exec", f"ssh -p {args.ssh_port}"])
    environment = dict(item.split("=", 1) if "=" in item else (item, os.environ.get(item, "")) for item in args.env)
    threshold = os.environ.get("HOROVOD_FUSION_THRESHOLD")
    if threshold:  # Horovod's fusion buffer is ddlfast's bucket
        environment.setdefault("DDLFAST_BUCKET_BYTES", threshold)
    for name, value in environment.items():
        line += ["-x", f"{name}={value}"] if flavour == "openmpi" else ["-genv", name, value]
    return line + command


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        line = command_for(argv)
    except SystemExit as refusal:
        if not isinstance(refusal.code, str):  # argparse's own exit: its message is printed already
            raise
        print(refusal.code, file=sys.stderr)
        return 2  # a refused command line, as every ddlfast tool's bad input
    if "--dry-run" in argv:
        print(" ".join(line))
        return 0
    return subprocess.call(line)


if __name__ == "__main__":
    sys.exit(main())
