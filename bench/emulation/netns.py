"""Emulated hosts on one machine: one network namespace per host, a bridge, tbf-shaped links, one MPICH job.

    with EmulatedCluster(hosts=2, rate="1gbit") as cluster:
        result = cluster.run([2, 2], [sys.executable, "program.py"])

Layout (needs root, `ip`, `tc`, `unshare`):

    root namespace: bridge <prefix>br 10.213.N.1/24 (private, no default route)
      +- veth <prefix>v<i>  --tbf-->  host i        (traffic into host i)
    namespace <prefix>h<i>: veth emu0 10.213.N.(10+i)/24  --tbf-->  bridge   (traffic out of host i)

MPICH runs across them with hydra's ssh launcher pointed at netns_launcher.sh, `-localhost` the bridge address.
Transport: the mpich wheel defaults to UCX, whose shared-memory transports would connect processes in different
namespaces directly, bypassing the shaped links; libfabric's tcp provider on emu0 does not
(MPIR_CVAR_CH4_NETMOD=ofi, FI_PROVIDER=tcp, FI_TCP_IFACE=emu0). Inside a host MPICH still uses shared memory.
tbf needs a burst of a few 64 KiB (GSO) segments, or it drops them and TCP stalls.

Everything is removed on exit, on failure too: processes left in the namespaces are killed (they are ours),
then namespaces, veths and the bridge deleted. `python -m bench.emulation.netns --cleanup` removes leftovers of
runs that were killed outright.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

LAUNCHER = Path(__file__).with_name("netns_launcher.sh")
PREFIX_PATTERN = re.compile(r"^dfe[0-9a-f]{4}")
INTERFACE = "emu0"


def available() -> str | None:
    """None if this machine can emulate hosts, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (apt-get install iproute2 util-linux)"
    return None


def _ip(*args: str, namespace: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    command = ["ip", *(["-n", namespace] if namespace else []), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()}")
    return result


def _tc(*args: str, namespace: str | None = None) -> None:
    command = (["ip", "netns", "exec", namespace] if namespace else []) + ["tc", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()}")


def _used_subnets() -> set[int]:
    text = _ip("-o", "-4", "addr", "show").stdout
    return {int(m.group(1)) for m in re.finditer(r"inet 10\.213\.(\d+)\.", text)}


class EmulatedCluster:
    """`hosts` namespaces on a bridge, each host's link shaped to `rate` (tc syntax, e.g. 1gbit) both ways."""

    def __init__(self, hosts: int, rate: str = "1gbit", burst: str = "256kb", queue: str = "50ms") -> None:
        if hosts < 1:
            raise ValueError("hosts must be >= 1")
        self.hosts, self.rate, self.burst, self.queue = hosts, rate, burst, queue
        self.prefix = f"dfe{os.getpid() & 0xFFFF:04x}"
        self.bridge = f"{self.prefix}br"
        self.subnet = 0
        self.cache_dir = ""
        self._created: list[tuple[str, str]] = []  # ("netns"|"link", name), in creation order

    # -- names ------------------------------------------------------------------------------------------------

    def namespace(self, host: int) -> str:
        return f"{self.prefix}h{host}"

    @property
    def bridge_address(self) -> str:
        return f"10.213.{self.subnet}.1"

    def host_address(self, host: int) -> str:
        return f"10.213.{self.subnet}.{10 + host}"

    # -- lifetime ---------------------------------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        try:
            self.setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def setup(self) -> None:
        used = _used_subnets()
        self.subnet = next(n for n in [*range(os.getpid() % 200 + 20, 255), *range(1, 255)] if n not in used)
        self.cache_dir = tempfile.mkdtemp(prefix="ddlfast-emu-cache-")
        _ip("link", "add", self.bridge, "type", "bridge")
        self._created.append(("link", self.bridge))
        _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host in range(self.hosts):
            namespace, outside = self.namespace(host), f"{self.prefix}v{host}"
            _ip("netns", "add", namespace)
            self._created.append(("netns", namespace))
            _ip("link", "add", outside, "type", "veth", "peer", "name", INTERFACE, "netns", namespace)
            self._created.append(("link", outside))
            _ip("link", "set", outside, "master", self.bridge, "up")
            _ip("addr", "add", f"{self.host_address(host)}/24", "dev", INTERFACE, namespace=namespace)
            _ip("link", "set", INTERFACE, "up", namespace=namespace)
            _ip("link", "set", "lo", "up", namespace=namespace)
            shape = ("qdisc", "replace", "dev")
            limits = ("root", "tbf", "rate", self.rate, "burst", self.burst, "latency", self.queue)
            _tc(*shape, outside, *limits)
            _tc(*shape, INTERFACE, *limits, namespace=namespace)

    def teardown(self) -> None:
        """Best effort and idempotent: every step is tried even when an earlier one fails."""
        for kind, name in self._created:
            if kind == "netns":
                _kill_namespace_processes(name)
        for kind, name in reversed(self._created):
            if kind == "netns":
                _ip("netns", "delete", name, check=False)
            else:
                _ip("link", "delete", name, check=False)
        self._created.clear()
        if self.cache_dir:
            shutil.rmtree(self.cache_dir, ignore_errors=True)
            self.cache_dir = ""

    # -- running MPI across the hosts -------------------------------------------------------------------------

    def environment(self) -> dict[str, str]:
        return {
            "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": INTERFACE,
            "DDLFAST_CACHE_DIR": self.cache_dir, "PYTHONUNBUFFERED": "1",
        }

    def mpiexec_command(self, ranks_per_host: Sequence[int], argv: Sequence[str], ranks: int | None = None) -> list:
        """`ranks_per_host[i]` slots on host i; ranks fill them in order (hydra's block mapping). Pass `ranks`
        larger than the slots to wrap around (e.g. [1, 1] with ranks=4 places ranks round-robin)."""
        if len(ranks_per_host) != self.hosts:
            raise ValueError(f"ranks_per_host has {len(ranks_per_host)} entries for {self.hosts} hosts")
        hosts = ",".join(f"{self.namespace(h)}:{n}" for h, n in enumerate(ranks_per_host) if n > 0)
        total = ranks if ranks is not None else sum(ranks_per_host)
        return [_mpiexec(), "-launcher", "ssh", "-launcher-exec", str(LAUNCHER), "-hosts", hosts,
                "-localhost", self.bridge_address, "-n", str(total), *argv]

    def run(self, ranks_per_host: Sequence[int], argv: Sequence[str], timeout: float = 120,
            env: dict[str, str] | None = None, ranks: int | None = None) -> subprocess.CompletedProcess:
        """Run an MPI job across the hosts; on timeout kill the whole job and raise subprocess.TimeoutExpired."""
        full_env = {**os.environ, **self.environment(), **(env or {})}
        full_env["PATH"] = f"{Path(sys.executable).parent}:{full_env.get('PATH', '')}"
        command = self.mpiexec_command(ranks_per_host, argv, ranks)
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=full_env, start_new_session=True)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            for host in range(self.hosts):
                _kill_namespace_processes(self.namespace(host))
            raise
        return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else "mpiexec"


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.communicate()


def _kill_namespace_processes(namespace: str) -> None:
    """SIGKILL what runs in a namespace we created (our MPI proxies and ranks), then wait for it to go."""
    for _ in range(20):
        result = _ip("netns", "pids", namespace, check=False)
        pids = [int(p) for p in result.stdout.split()] if result.returncode == 0 else []
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def cleanup_leftovers() -> list[str]:
    """Remove namespaces and links named like ours (dfeXXXX...) that killed runs left behind."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if PREFIX_PATTERN.match(name):
            _kill_namespace_processes(name)
            _ip("netns", "delete", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if PREFIX_PATTERN.match(name):
            _ip("link", "delete", name, check=False)
            removed.append(name)
    return removed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cleanup", action="store_true", help="remove leftovers of killed runs")
    args = parser.parse_args(argv)
    if args.cleanup:
        print("removed:", " ".join(cleanup_leftovers()) or "nothing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
