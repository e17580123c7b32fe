"""The cost of ddlfast.elastic's commit() (docs/elastic.md, Costs): TorchState of a 25 M-parameter model with SGD
momentum, beside the earlier save (clone every tensor, deepcopy the optimizer's state) and NumpyState of 25 M
float32, alternating, median of ITERS after a warm-up. Needs Open MPI's fault tolerance:

    mpirun --with-ft ulfm -n 2 python bench/elastic_commit.py
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import numpy as np
import torch

import ddlfast
import ddlfast.elastic


class ClonedTorchState(ddlfast.elastic.TorchState):
    """TorchState's save before it reused the last snapshot: a new tensor per commit."""

    def save(self) -> Any:
        model = {name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()}
        optimizer = copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None
        return model, optimizer, {name: copy.deepcopy(getattr(self, name)) for name in self._scalars}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--features", type=int, default=5000, help="Linear(F, F): F*F weights (5000: 25 M)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Linear(args.features, args.features)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(torch.randn(2, args.features)).sum().backward()
    optimizer.step()  # the momentum buffers exist
    states = {
        "TorchState": ddlfast.elastic.TorchState(model=model, optimizer=optimizer, step=0),
        "TorchState, cloning save": ClonedTorchState(model=model, optimizer=optimizer, step=0),
        "NumpyState, same count of float32": ddlfast.elastic.NumpyState(
            params=np.ones(args.features * args.features, np.float32), step=0),
    }
    seconds: dict[str, list[float]] = {name: [] for name in states}
    for iteration in range(args.iters + 1):
        for name, state in states.items():
            ddlfast.barrier()
            start = time.perf_counter()
            state.commit()
            if iteration:  # the first commit allocates its snapshot
                seconds[name].append(time.perf_counter() - start)
    if ddlfast.rank() == 0:
        print(f"commit() on {ddlfast.size()} ranks, {args.features ** 2 / 1e6:.0f} M parameters, median of "
              f"{args.iters} (min-max), torch threads {torch.get_num_threads()}")
        for name, values in seconds.items():
            print(f"  {name}: {statistics.median(values) * 1e3:.0f} ms ({min(values) * 1e3:.0f}-"
                  f"{max(values) * 1e3:.0f})")


if __name__ == "__main__":
    main()
