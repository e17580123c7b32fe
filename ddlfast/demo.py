"""The main job: data-parallel training on scikit-learn's digits under
`mpiexec -n P python -m ddlfast.demo`.

1. A NumPy MLP with a hand-written trainer that averages its gradients with
   ddlfast.fused_allreduce (the design card's user), checked against the same
   training run in one process with the same global batch.
2. The same model in PyTorch the way most users train: DistributedDataParallel
   with ddlfast.torch.allreduce_hook (buckets averaged by ddlfast while backward
   runs), reporting how much communication was hidden when it can be measured.
3. The bench table, ddlfast beside MPI_Allreduce, and a PNG of busbw vs size.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

import ddlfast

HIDDEN = 128


# ---- data ------------------------------------------------------------------------------------------------------

@dataclass
class Dataset:
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray


def load_digits_split(seed: int = 0) -> Dataset:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return Dataset(x[:split], y[:split], x[split:], y[split:])


def global_batches(count: int, batch: int, epoch: int, seed: int = 1) -> list[np.ndarray]:
    """The global batches of one epoch: the same on every rank and in the single-process run."""
    order = np.random.default_rng([seed, epoch]).permutation(count)
    return [order[i:i + batch] for i in range(0, count - batch + 1, batch)]


def shard(indices: np.ndarray, rank: int, world: int) -> np.ndarray:
    return np.array_split(indices, world)[rank]


# ---- the NumPy model -------------------------------------------------------------------------------------------

def init_mlp(inputs: int, classes: int, seed: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal((inputs, HIDDEN)) * np.sqrt(2 / inputs)).astype(np.float32),
        np.zeros(HIDDEN, np.float32),
        (rng.standard_normal((HIDDEN, classes)) * np.sqrt(2 / HIDDEN)).astype(np.float32),
        np.zeros(classes, np.float32),
    ]


def mlp_loss_and_grads(params: list[np.ndarray], x: np.ndarray, y: np.ndarray, total: int
                       ) -> tuple[float, list[np.ndarray]]:
    """Cross-entropy summed over this shard, divided by the global batch size `total`,
    so that summing shard gradients over ranks gives the global-batch gradient."""
    w1, b1, w2, b2 = params
    hidden = np.maximum(x @ w1 + b1, 0)
    logits = hidden @ w2 + b2
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    loss = float(-np.log(probs[np.arange(len(y)), y] + 1e-12).sum() / total)
    d_logits = probs
    d_logits[np.arange(len(y)), y] -= 1
    d_logits /= total
    d_hidden = (d_logits @ w2.T) * (hidden > 0)
    return loss, [x.T @ d_hidden, d_hidden.sum(0), hidden.T @ d_logits, d_logits.sum(0)]


def mlp_accuracy(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    w1, b1, w2, b2 = params
    return float(((np.maximum(x @ w1 + b1, 0) @ w2 + b2).argmax(1) == y).mean())


def progress(epoch: int, epochs: int, done: int, total: int, extra: str = "", width: int = 30) -> None:
    """A bar redrawn in place on a terminal; into a file or a pipe (a log), one line per epoch, when it ends."""
    on_terminal = sys.stdout.isatty()
    if not on_terminal and done != total:
        return
    filled = int(width * done / max(total, 1))
    sys.stdout.write(f"{chr(13) if on_terminal else ''}  epoch {epoch + 1:>2}/{epochs} "
                     f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {extra}")
    if done == total:
        sys.stdout.write("\n")
    sys.stdout.flush()


@dataclass
class TrainResult:
    accuracy: float
    loss: float
    samples_per_s: float
    communication_s: float
    total_s: float
    hidden_fraction: float | None = None
    overlap: object = None


def train_numpy(data: Dataset, epochs: int, batch: int, lr: float, comm: MPI.Intracomm | None,
                show: bool, compression: object = None) -> TrainResult:
    """comm=None: the single-process reference with the same global batches."""
    rank, world = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
    params = init_mlp(data.train_x.shape[1], 10)
    communication = 0.0
    loss = 0.0
    start = time.perf_counter()
    for epoch in range(epochs):
        batches = global_batches(len(data.train_x), batch, epoch)
        for step, indices in enumerate(batches):
            mine = shard(indices, rank, world)
            loss, grads = mlp_loss_and_grads(params, data.train_x[mine], data.train_y[mine], len(indices))
            if comm is not None:
                t = time.perf_counter()
                # Shard gradients already carry 1/batch: their sum is the global-batch gradient.
                ddlfast.fused_allreduce(grads, op="sum", comm=comm, compression=compression)
                communication += time.perf_counter() - t
            for p, g in zip(params, grads, strict=True):
                p -= lr * g
            if show and (step % 5 == 0 or step == len(batches) - 1):
                progress(epoch, epochs, step + 1, len(batches), f"loss {loss * world:.3f}")
    total = time.perf_counter() - start
    samples = epochs * len(global_batches(len(data.train_x), batch, 0)) * batch
    return TrainResult(mlp_accuracy(params, data.test_x, data.test_y), loss * world, samples / total,
                       communication, total)


# ---- the PyTorch model -----------------------------------------------------------------------------------------

def train_torch(data: Dataset, epochs: int, batch: int, lr: float, comm: MPI.Intracomm, show: bool,
                width: int = 512) -> TrainResult:
    import torch
    import torch.distributed as dist

    import ddlfast.torch as dt

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dt.init_process_group("gloo")  # ranks and address from MPI; gloo only sets DDP up, ddlfast reduces
    rank, world = comm.Get_rank(), comm.Get_size()
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(data.train_x.shape[1], width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # defaults, as users run it; broadcasts rank 0's weights
    ddp.register_comm_hook(dt.HookState(), dt.allreduce_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    train_x, train_y = torch.from_numpy(data.train_x), torch.from_numpy(data.train_y)
    loss_value = 0.0
    start = time.perf_counter()
    for epoch in range(epochs):
        batches = global_batches(len(data.train_x), batch, epoch)
        for step, indices in enumerate(batches):
            mine = torch.from_numpy(shard(indices, rank, world))
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(train_x[mine]), train_y[mine])
            loss.backward()
            optimizer.step()
            loss_value = loss.detach().item()
            if show and (step % 5 == 0 or step == len(batches) - 1):
                progress(epoch, epochs, step + 1, len(batches), f"loss {loss_value:.3f}")
    total = time.perf_counter() - start
    with torch.no_grad():
        accuracy = float((model(torch.from_numpy(data.test_x)).argmax(1).numpy() == data.test_y).mean())
    samples = epochs * len(global_batches(len(data.train_x), batch, 0)) * batch
    from ddlfast.overlap import measure_overlap

    torch.manual_seed(4)
    probe = measure_overlap(model, train_x[:batch // world], train_y[:batch // world], steps=5, warmup=2,
                            comm=comm)
    return TrainResult(accuracy, loss_value, samples / total, probe.communication_s, total,
                       probe.hidden_fraction, probe)


# ---- the report ------------------------------------------------------------------------------------------------

def save_plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ddlfast.bench import busbw_factor, format_bytes

    sizes = [row["size_bytes"] for row in rows]
    fig, axis = plt.subplots(figsize=(7, 4.5))
    for name, style, label in (("ddlfast", "o-", "ddlfast"), ("mpi", "s--", "MPI_Allreduce (mpi4py)")):
        line, = axis.plot(sizes, [row[name]["busbw_GBps"] for row in rows], style, label=f"{label} (median)")
        # the spread of the samples: busbw of the slowest and the fastest iteration of each size
        spread = [[row["size_bytes"] / (t * 1e-6) / 1e9 * busbw_factor(row["world"]) for t in
                   (max(row[name]["samples_us"]), min(row[name]["samples_us"]))] for row in rows]
        axis.fill_between(sizes, [low for low, _ in spread], [high for _, high in spread], color=line.get_color(),
                          alpha=0.15, linewidth=0)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")  # a linear axis flattens the small sizes into the floor
    axis.set_xticks(sizes, [format_bytes(size).replace("KiB", " KiB").replace("MiB", " MiB")
                            .replace("GiB", " GiB") for size in sizes])
    axis.set_xlabel("message size")
    axis.set_ylabel("busbw (GB/s), band: fastest to slowest iteration")
    axis.set_title(f"allreduce busbw, {rows[0]['world']} ranks, {rows[0]['dtype']}")
    axis.grid(True, alpha=0.3)
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


MAX_LEARNING_RATE = 100.0  # far above any that trains the MLP; NaN and infinity refused


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--sizes", default="4KiB,64KiB,1MiB,16MiB,64MiB")
    parser.add_argument("--plot", default=os.path.join("out", "busbw.png"))
    args = parser.parse_args(argv)
    from ddlfast import bench

    # Every number checked before training starts (the bench's sizes only after both trainings, before)
    try:
        sizes = bench.parse_sizes(args.sizes)
    except ddlfast.DdlfastError as error:
        parser.error(str(error))
    if args.epochs < 1 or args.batch < 1 or not 0 < args.lr <= MAX_LEARNING_RATE:
        parser.error(f"--epochs and --batch must be >= 1 and --lr from above 0 to {MAX_LEARNING_RATE:g}")
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    show = rank == 0
    data = load_digits_split()
    if show:
        info = ddlfast.build_info()
        print(f"ddlfast demo: {world} ranks | kernels {info['kernel_selected']} | {info['mpi_library']}")
        print(f"digits: {len(data.train_x)} train / {len(data.test_x)} test, global batch {args.batch}")
        print("[1] NumPy MLP, gradients averaged with ddlfast.fused_allreduce")
    parallel = train_numpy(data, args.epochs, args.batch, args.lr, comm, show)
    if show:
        single = train_numpy(data, args.epochs, args.batch, args.lr, None, False)
        print(f"    accuracy {parallel.accuracy:.4f} (single process, same global batch: {single.accuracy:.4f}, "
              f"difference {abs(parallel.accuracy - single.accuracy) * 100:.2f} points)")
        print(f"    loss {parallel.loss:.4f} | {parallel.samples_per_s:,.0f} samples/s | communication "
              f"{parallel.communication_s:.2f} s of {parallel.total_s:.2f} s (blocking, not hidden)")
    status = 0
    if show and abs(parallel.accuracy - single.accuracy) > 0.01:
        print("    FAILED: data-parallel accuracy is not within 1 point of single-process training")
        status = 1
    if not args.skip_torch:
        if show:
            print("[2] PyTorch MLP: DistributedDataParallel(model) + ddlfast.torch.allreduce_hook")
        result = train_torch(data, max(2, args.epochs // 2), args.batch, args.lr / 2, comm, show)
        if show:
            o = result.overlap
            print(f"    accuracy {result.accuracy:.4f} | loss {result.loss:.4f} | {result.samples_per_s:,.0f} "
                  f"samples/s")
            print("    step time (median): " + " | ".join(f"{name} {s * 1e3:.2f} ms" for name, s in o.routes_s.items()))
            print(f"    {o.describe('DDP + allreduce_hook')}")
    if not args.skip_bench:
        if show:
            print("[3] allreduce bench: ddlfast beside MPI_Allreduce, same run")
        rows = bench.run_bench(sizes=sizes, dtype="float32", dims_list=["flat"],
                               iters=None, warmup=None, op="sum", check=True)
        if any(row.get("check") != "ok" for row in rows):
            status = 1
        if show:
            print(bench.format_table(rows, world))
            if world > 1:
                os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
                save_plot(rows, args.plot)
                print(f"busbw plot: {os.path.abspath(args.plot)}")
    return comm.bcast(status, root=0)


if __name__ == "__main__":
    sys.exit(main())
