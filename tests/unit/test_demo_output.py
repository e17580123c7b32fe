"""The demo's output as a log file sees it (issue 25 item 6): progress bars redraw only on a terminal, and the
busbw plot takes the bench's rows (log axes, sizes as KiB/MiB, the samples' spread)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddlfast import demo


def test_progress_into_a_log_is_one_line_per_epoch(capsys: pytest.CaptureFixture[str]) -> None:
    for epoch in range(2):
        for done in range(1, 6):
            demo.progress(epoch, 2, done, 5, "loss 0.1")
    out = capsys.readouterr().out
    assert "\r" not in out
    assert out.splitlines() == [f"  epoch  {e}/2 [{'#' * 30}] 5/5 loss 0.1" for e in (1, 2)]


def row(size: int, median_us: float, samples_us: list[float]) -> dict:
    bw = size / (median_us * 1e-6) / 1e9 * 1.5
    summary = {"median_us": median_us, "busbw_GBps": bw, "samples_us": samples_us}
    return {"size_bytes": size, "world": 4, "dtype": "float32", "ddlfast": summary, "mpi": dict(summary)}


def test_plot_is_written(tmp_path: Path) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    rows = [row(4096, 50.0, [40.0, 50.0, 90.0]), row(64 << 20, 30000.0, [29000.0, 30000.0, 31000.0])]
    path = tmp_path / "busbw.png"
    demo.save_plot(rows, str(path))
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100
