"""grpo.run.progress in a Jupyter kernel: the bar is one notebook output (HTML and plain text, no terminal
escapes) replaced after each step, instead of rich's live display (which needs ipywidgets there)."""

from __future__ import annotations

import pytest

from grpo.run import progress


class FakeHandle:
    """IPython's DisplayHandle: records each bundle shown, as the notebook would hold it."""

    def __init__(self):
        self.shown: list[dict] = []

    def update(self, obj) -> None:
        self.shown.append(obj._repr_mimebundle_())


@pytest.fixture
def notebook(monkeypatch):
    display = pytest.importorskip("IPython.display")
    handle = FakeHandle()

    def fake_display(obj, display_id=False):
        assert display_id is True  # a handle, so that later steps replace this output
        handle.update(obj)
        return handle

    monkeypatch.setattr(display, "display", fake_display)
    monkeypatch.setattr(progress, "in_notebook", lambda: True)
    return handle


def test_in_a_notebook_the_bar_is_one_output_updated_per_step(notebook, capsys):
    with progress.StepProgress(total_steps=3, start_step=1) as bar:
        bar.update(2, {"reward/mean": 0.5, "accuracy": 0.25, "kl": 0.01})
        bar.update(3, {"reward/mean": 0.75, "accuracy": 0.5, "kl": 0.02, "eval/accuracy": 1.0})
    texts = [shown["text/plain"] for shown in notebook.shown]
    assert len(texts) == 4  # shown at the start, after each step, and stopped at the end
    assert "1/3" in texts[0] and "2/3" in texts[1] and "reward +0.500" in texts[1]
    assert "3/3" in texts[-1] and "eval 1.00" in texts[-1] and texts[-1].startswith("GRPO")
    for shown in notebook.shown:
        assert "\x1b" not in shown["text/plain"] + shown["text/html"]
        assert shown["text/html"].startswith("<pre") and "font-weight: bold" in shown["text/html"]
    assert capsys.readouterr().out == ""  # nothing printed besides the display


def test_outside_a_notebook_the_bar_is_rich_live_display(monkeypatch, capsys):
    monkeypatch.setattr(progress, "in_notebook", lambda: False)
    with progress.StepProgress(total_steps=2) as bar:
        bar.update(2, {"reward/mean": 1.0, "accuracy": 1.0, "kl": 0.0})
    assert bar._notebook is None and "2/2" in capsys.readouterr().out
