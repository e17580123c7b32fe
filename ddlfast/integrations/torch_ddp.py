"""DDP communication hooks on ddlfast, and the process-group set-up they need under mpiexec.

    import ddlfast.torch as dt
    dt.init_process_group()                       # gloo, ranks and address from MPI
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(dt.HookState(), dt.allreduce_hook)   # or dt.fp16_hook / dt.bf16_hook

Each DDP bucket goes to ddlfast asynchronously (averaged, float32 accumulation on the wire) and the returned
torch.futures.Future is completed by a done-callback on ddlfast's communication thread as soon as the handle
completes (no thread hand-off per bucket). gloo
still carries DDP's own start-up broadcast and its unused-parameter bitmap; the gradients go through ddlfast.

No `from __future__ import annotations` here: DDP checks a hook's annotations by identity.
"""

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from mpi4py import MPI

from ddlfast import launch
from ddlfast.api import default_context, has_cuda
from ddlfast.context import Context
from ddlfast.engine.worker import Handle
from ddlfast.errors import DdlfastError
from ddlfast.integrations.tensors import SUPPORTED_DTYPES, collective_view, for_backward, stream_of

_LAUNCH = "launch with mpiexec, e.g. `mpiexec -n 4 python train.py` (torchrun does not start MPI)"
_WIRE = {None: None, "none": None, "fp16": "fp16", "bf16": "bf16"}


def init_process_group(backend: str = "gloo", **kwargs: Any) -> None:
    """dist.init_process_group from MPI: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (a free port rank 0 picks
    and broadcasts) are set unless already set; a torch rank that differs from the MPI rank is an error."""
    rank, world = environment_from_mpi()
    kwargs.setdefault("rank", rank)
    kwargs.setdefault("world_size", world)
    dist.init_process_group(backend=backend, **kwargs)
    if dist.get_rank() != rank or dist.get_world_size() != world:
        raise DdlfastError(f"torch rank {dist.get_rank()} of {dist.get_world_size()} is MPI rank {rank} of {world}")


_RENDEZVOUS_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def environment_from_mpi() -> tuple[int, int]:
    """Set torch's env:// rendezvous variables from MPI where they are unset (collective over COMM_WORLD: rank 0
    picks the port); returns (rank, world size). Raises DdlfastError where MPI sees this process alone but the
    launcher started several, or where RANK/WORLD_SIZE are set and differ from MPI's numbering."""
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    launch.check_world()  # torchrun (or srun, another MPI's mpiexec) started this process alone
    for name, mine in (("RANK", rank), ("WORLD_SIZE", world)):
        given = os.environ.get(name)
        if given not in (None, "") and int(given) != mine:
            raise DdlfastError(f"{name}={given} in the environment, but this is MPI rank {rank} of {world}: "
                               "torch and MPI must number the processes alike")
    if rank == 0:
        host = MPI.Get_processor_name()
        port = os.environ.get("MASTER_PORT") or str(_free_port())
    else:
        host = port = None
    host, port = comm.bcast((host, port), root=0)
    if "MASTER_ADDR" not in os.environ:
        same_host = all(comm.allgather(MPI.Get_processor_name() == host))
        os.environ["MASTER_ADDR"] = "127.0.0.1" if same_host else comm.bcast(
            _address_of(host) if rank == 0 else None, root=0)
        if os.environ["MASTER_ADDR"] == "":
            raise DdlfastError(f"rank 0's host name {host!r} does not resolve: set MASTER_ADDR to an address of "
                               "rank 0 that every rank can reach")
    os.environ["MASTER_PORT"] = port
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    return rank, world


def install_mpi_rendezvous() -> None:
    """Make torch's default env:// rendezvous take what is missing from MPI, so that plain
    `dist.init_process_group("ddlfast")` (or "gloo") works under mpiexec; where the launcher set all four
    variables (torchrun), torch's own handler runs untouched. Idempotent."""
    import importlib

    # the module: `torch.distributed.rendezvous` as an attribute is the function of that name
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    original = handlers.get("env")
    if original is None or getattr(original, "ddlfast_wrapped", False):
        return

    def env_or_mpi(url: str, *args: Any, **kwargs: Any) -> Any:
        if any(not os.environ.get(name) for name in _RENDEZVOUS_VARIABLES):
            environment_from_mpi()
        return original(url, *args, **kwargs)

    env_or_mpi.ddlfast_wrapped = True  # type: ignore[attr-defined]
    handlers["env"] = env_or_mpi


def _address_of(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return ""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def complete_future(future: torch.futures.Future, result: torch.Tensor) -> Callable[[Handle], None]:
    """A done-callback (run on ddlfast's communication thread) that completes the torch future."""

    def done(handle: Handle) -> None:
        try:
            handle.wait()
        except BaseException as error:  # noqa: BLE001 - delivered through the future
            future.set_exception(error)
        else:
            future.set_result(result)

    return done


def raise_if_failed(future: torch.futures.Future) -> torch.Tensor:
    # value() re-raises what set_exception stored; raised inside then(), it fails the C++ future DDP waits on.
    return future.value()


class HookState:
    """State for ddlfast's DDP hooks: wire compression (None, "fp16", "bf16" or per ring dimension such as
    "none,fp16"), ring dims, error feedback (the sender's rounding residual, kept per DDP bucket index), the
    ddlfast Context (default: COMM_WORLD's), and reproducible (ddlfast.fused_allreduce's: one canonical summation
    order; None: DDLFAST_REPRODUCIBLE)."""

    def __init__(self, compression: object = None, dims: object = None, error_feedback: bool = False,
                 context: Context | None = None, reproducible: bool | None = None) -> None:
        self.compression, self.dims, self.error_feedback = compression, dims, error_feedback
        self.reproducible = reproducible
        self.context = context
        self._residuals: dict = {}
        self._checked = False
        # Each bucket's collective is named (step << 20 | bucket index): the step set_step() was given, else the
        # number of DDP iterations so far (docs/trust.md says what each catches).
        self._iteration = 0
        self._user_step: int | None = None

    def set_step(self, step: int) -> None:
        """The training loop's own step: this iteration's buckets are named by it, so a rank that skipped a batch
        is caught at its next bucket (every rank raises) instead of averaging one step's gradients with
        another's."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise DdlfastError(f"set_step takes the step as an int >= 0, not {step!r}")
        self._user_step = step

    def _check_group(self, bucket: dist.GradBucket) -> None:
        if not dist.is_initialized():
            raise DdlfastError(f"ddlfast hooks need torch.distributed initialised: call "
                               f"ddlfast.torch.init_process_group() and {_LAUNCH}")
        if self.context is None:
            self.context = default_context()
        if (dist.get_rank(), dist.get_world_size()) != (self.context.rank, self.context.size):
            raise DdlfastError(f"torch rank {dist.get_rank()} of {dist.get_world_size()} is MPI rank "
                               f"{self.context.rank} of {self.context.size}: {_LAUNCH} and use "
                               "ddlfast.torch.init_process_group()")
        self._checked = True

    def reduce(self, bucket: dist.GradBucket, compression: object) -> torch.futures.Future:
        if not self._checked:
            self._check_group(bucket)
        tensor = bucket.buffer()
        if tensor.device.type != "cpu" and not (tensor.device.type == "cuda" and has_cuda()):
            raise DdlfastError(f"a DDP bucket on {tensor.device}: ddlfast takes CPU (or, in a CUDA build, CUDA) "
                               "tensors")
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise DdlfastError(f"a DDP bucket of dtype {tensor.dtype}: ddlfast reduces float32, float64, "
                               "float16 and bfloat16 gradients")
        if compression is not None and self.error_feedback:
            self._add_residual(bucket.index(), tensor, compression)
        name = (self._iteration if self._user_step is None else self._user_step) << 20 | bucket.index()
        if bucket.is_last():
            self._iteration += 1
        with for_backward(self.context):  # DDP runs comm hooks in backward, maybe on an autograd device thread
            handle = self.context.fused_allreduce_async([collective_view(tensor)], op="average", dims=self.dims,
                                                        compression=compression, stream=stream_of(tensor), name=name,
                                                        reproducible=self.reproducible)
        future: torch.futures.Future = torch.futures.Future()
        handle.add_done_callback(complete_future(future, tensor))
        return future.then(raise_if_failed)

    def _add_residual(self, index: int, tensor: torch.Tensor, compression: object) -> None:
        """Add what the last wire rounding of this bucket lost, and keep what this one will lose."""
        residual = self._residuals.get(index)
        if residual is not None and residual.shape == tensor.shape:
            tensor.add_(residual)
        wire = torch.bfloat16 if str(compression).endswith("bf16") else torch.float16
        self._residuals[index] = tensor - tensor.to(wire).to(tensor.dtype)


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with ddlfast (the state's compression, none by default)."""
    return state.reduce(bucket, _WIRE.get(state.compression, state.compression))


def fp16_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with fp16 on the wire (float32 accumulation), like torch's fp16_compress_hook."""
    return state.reduce(bucket, "fp16")


def bf16_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with bf16 on the wire (float32 accumulation)."""
    return state.reduce(bucket, "bf16")


__all__ = ["HookState", "allreduce_hook", "bf16_hook", "fp16_hook", "init_process_group"]
