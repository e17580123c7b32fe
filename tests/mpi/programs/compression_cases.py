"""Runs on every rank: fp16/bf16 wire accuracy on adversarial inputs against
an fp64 reference (within the stated bound and below reducing in half
precision directly), identical bits everywhere, per-dimension choice, error
feedback, bad input, and training the demo model with compressed gradients."""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np
from harness import comm, expect, failures, rank, report_and_exit, world

import ddlfast
from ddlfast.compression import TopKCodec
from ddlfast.demo import load_digits_split, train_numpy

WIRES = {"fp16": (np.float16, 2.0**-11), "bf16": (ml_dtypes.bfloat16, 2.0**-8)}


def adversarial(owner: int, count: int) -> np.ndarray:
    rng = np.random.default_rng([owner, count])
    magnitudes = 10.0 ** rng.uniform(-4, 1.5, count)  # five and a half orders of magnitude
    return (rng.standard_normal(count) * magnitudes).astype(np.float32)


count = 200_003
inputs = [adversarial(r, count).astype(np.float64) for r in range(world)]
reference = np.sum(inputs, axis=0)
scale = np.sum(np.abs(inputs), axis=0)
dims_options = ["flat"] + (["2x2"] if world == 4 else [])
for wire, (half, unit) in WIRES.items():
    naive = inputs[0].astype(half)
    for other in inputs[1:]:  # what Horovod's/DDP's fp16 hooks do: add in half precision
        naive = (naive.astype(np.float32) + other.astype(half).astype(np.float32)).astype(half)
    naive_error = float(np.mean(np.abs(naive.astype(np.float64) - reference) / scale))
    for dims in dims_options:
        data = adversarial(rank, count)
        ddlfast.allreduce(data, dims=dims, compression=wire)
        error = np.abs(data.astype(np.float64) - reference)
        bound = world * (unit * scale + 2.0**-24)  # one rounding per ring hop, plus subnormal spacing
        expect(bool(np.all(error <= bound)), f"{wire} {dims}: error exceeds the stated bound "
               f"(worst {float(np.max(error / bound)):.2f} x bound)")
        ours = float(np.mean(error / scale))
        expect(ours < naive_error, f"{wire} {dims}: mean relative error {ours:.3g} is not below "
               f"half-precision reduction's {naive_error:.3g}")
        digests = comm.allgather(hashlib.sha256(data.tobytes()).hexdigest())
        expect(len(set(digests)) == 1, f"{wire} {dims}: bits differ across ranks")
        if rank == 0:
            print(f"{wire} dims={dims}: mean rel error {ours:.3g} (half-precision reduce {naive_error:.3g})")

# Per-dimension choice: compress only the second (slow) dimension.
if world == 4:
    data = adversarial(rank, count)
    ddlfast.allreduce(data, dims="2x2", compression="none,fp16")
    error = np.abs(data.astype(np.float64) - reference)
    expect(bool(np.all(error <= world * (2.0**-11 * scale + 2.0**-24))), "none,fp16: error exceeds bound")
    expect(len(set(comm.allgather(hashlib.sha256(data.tobytes()).hexdigest()))) == 1, "none,fp16: bits differ")

# Average pre-scales: values whose sum overflows fp16 survive; sum raises instead of returning inf.
big = np.full(50_000, 30_000.0, np.float32)
ddlfast.allreduce(big, op="average", compression="fp16")
expect(bool(np.all(big == 30_000.0)), f"average with fp16 wire gave {big[:2]}")
if world > 2:
    big = np.full(50_000, 30_000.0, np.float32)
    try:
        ddlfast.allreduce(big, op="sum", compression="fp16")
        failures.append(f"rank {rank}: fp16 overflow in a sum was silent")
    except ddlfast.DdlfastError as error:
        expect("overflow" in str(error), f"overflow message: {error}")

# Error feedback: the residual carries what one step's rounding lost into the next.
steps = [adversarial(rank + 10 * s, 10_000) for s in range(3)]
running = np.zeros(10_000)
for step in steps:
    data = step.copy()
    ddlfast.fused_allreduce([data, np.zeros(5, np.float32)], compression="fp16", error_feedback=True)
    running += data
exact = sum(np.sum([adversarial(r + 10 * s, 10_000).astype(np.float64) for r in range(world)], axis=0)
            for s in range(3))
plain = sum(ddlfast.allreduce(adversarial(rank + 10 * s, 10_000), compression="fp16").astype(np.float64)
            for s in range(3))
expect(np.abs(running - exact).mean() <= np.abs(plain - exact).mean() * 1.05,
       "error feedback did not reduce the accumulated error")

# Bad input: integer arrays, unknown codecs, codecs whose payload sizes differ across ranks.
for name, call, needle in [
    ("int array", lambda: ddlfast.allreduce(np.ones(10, np.int32), compression="fp16"), "float32 arrays only"),
    ("unknown codec", lambda: ddlfast.allreduce(np.ones(10, np.float32), compression="zip"), "unknown codec"),
    ("dims count", lambda: ddlfast.allreduce(np.ones(10, np.float32), compression="none,fp16,fp16"), "dimensions"),
]:
    try:
        call()
        failures.append(f"rank {rank} {name}: no error")
    except ddlfast.DdlfastError as error:
        expect(needle in str(error), f"{name}: message {error}")


class RaggedCodec:
    """Returns a payload whose size differs across ranks: must be an error, not garbage."""

    def compress(self, bucket: np.ndarray, state: dict) -> list[np.ndarray]:
        return [bucket.reshape(-1)[: 10 + rank].copy()]

    def decompress(self, payloads: list[list[np.ndarray]], bucket: np.ndarray, state: dict) -> None:
        bucket[...] = 0


if world > 1:
    try:
        ddlfast.fused_allreduce([np.ones(100, np.float32)], compression=RaggedCodec())
        failures.append(f"rank {rank}: ragged codec payloads were accepted")
    except ddlfast.DdlfastError as error:
        expect("disagree" in str(error), f"ragged codec message: {error}")

# Training the demo model: fp16 wire within 1 point of fp32; top-k (10%) with error feedback trains.
data = load_digits_split()
fp32 = train_numpy(data, 6, 64, 0.1, comm, False)
fp16 = train_numpy(data, 6, 64, 0.1, comm, False, compression="fp16")
topk = train_numpy(data, 6, 64, 0.1, comm, False, compression=TopKCodec(0.1))
expect(abs(fp16.accuracy - fp32.accuracy) <= 0.01, f"fp16 accuracy {fp16.accuracy} vs fp32 {fp32.accuracy}")
expect(topk.accuracy >= fp32.accuracy - 0.05, f"top-k accuracy {topk.accuracy} vs fp32 {fp32.accuracy}")
if rank == 0:
    print(f"digits accuracy: fp32 {fp32.accuracy:.4f} fp16-wire {fp16.accuracy:.4f} top-k(10%) {topk.accuracy:.4f}")

report_and_exit()
