"""GRPOTrainer.plot(): the run's curves on request, shown inline by a notebook (the whole notebook runs in
tests/integration/test_notebook.py)."""

from __future__ import annotations

import pytest

from grpo import GRPOConfig, GRPOTrainer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.integration
def test_plot_before_training_names_the_missing_file_and_after_shows_the_summary(tiny_model_dir, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(8)]
    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, max_steps=1, use_cpu=True, report_to="none", disable_tqdm=True)
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=rows)
    with pytest.raises(FileNotFoundError, match=r"metrics\.jsonl"):
        trainer.plot()
    trainer.train()
    plots = trainer.plot()
    assert plots.summary == tmp_path / "run" / "plots" / "summary.png"
    assert plots._repr_png_().startswith(PNG_MAGIC)  # what IPython shows for the cell's value
