"""grpo.run.plots: PNGs from a synthetic metrics.jsonl, partial metrics, nulls and missing files."""

from __future__ import annotations

import json
import math

import pytest

from grpo.run.plots import RunPlots, plot_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def assert_png(path):
    data = path.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC), path


def test_full_run_writes_all_plots(tmp_path):
    records = []
    for step in range(1, 21):
        records.append({
            "step": step,
            "reward/mean": step / 20, "reward/std": 0.1, "reward/correctness": step / 25, "reward/format": 0.5,
            "accuracy": step / 30, "format_rate": min(1.0, step / 10),
            "kl": 0.01 * step if step != 5 else None,  # a NaN logged as null: skipped
            "completion_length/mean": 40 + step,
        })
        if step % 10 == 0:
            records.append({"step": step, "eval/accuracy": step / 25})
    write_metrics(tmp_path, records)

    written = plot_run(tmp_path)
    names = ["reward.png", "accuracy.png", "kl.png", "completion_length.png", "summary.png"]
    assert written == [tmp_path / "plots" / name for name in names]
    for path in written:
        assert_png(path)


def test_partial_metrics_skip_missing_panels(tmp_path):
    write_metrics(tmp_path, [{"step": s, "kl": math.sqrt(s), "loss": 1.0} for s in range(1, 4)]
                  + [{"step": 4, "accuracy": None}])  # accuracy only ever null: not drawn
    written = plot_run(str(tmp_path))
    assert [p.name for p in written] == ["kl.png", "summary.png"]
    for path in written:
        assert_png(path)


def test_torn_last_line_is_ignored(tmp_path):
    write_metrics(tmp_path, [{"step": 1, "kl": 0.1}, {"step": 2, "kl": 0.2}])
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "kl": 0.')
    assert [p.name for p in plot_run(tmp_path)] == ["kl.png", "summary.png"]


def test_missing_or_empty_metrics_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"metrics\.jsonl"):
        plot_run(tmp_path)
    write_metrics(tmp_path, [])
    with pytest.raises(ValueError, match="no metric records"):
        plot_run(tmp_path)


def test_run_plots_show_the_summary_inline_in_a_notebook(tmp_path):
    """What ``GRPOTrainer.plot()`` returns: IPython displays an object with ``_repr_png_`` as that PNG."""
    write_metrics(tmp_path, [{"step": s, "kl": 0.1 * s} for s in range(1, 3)])
    plots = RunPlots(tuple(plot_run(tmp_path)))
    assert plots.summary == tmp_path / "plots" / "summary.png"
    assert plots._repr_png_() == plots.summary.read_bytes()
