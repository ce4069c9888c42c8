"""What the TRL scripts beside this file record, as any TRL user's callback would: every callback event
with the global step it saw, and at the end the trainer's state, written to ``<output_dir>/report.json``."""

import json
from pathlib import Path

from transformers import TrainerCallback

EVENTS = ("on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin", "on_substep_end",
          "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_log", "on_evaluate", "on_save",
          "on_epoch_end", "on_train_end")


class EventRecorder(TrainerCallback):
    def __init__(self):
        self.events = []
        for event in EVENTS:
            setattr(self, event, self._recorder(event))

    def _recorder(self, event):
        def record(args, state, control, **kwargs):
            self.events.append([event, state.global_step])
        return record


def write_report(trainer, recorder, **extra):
    out = Path(trainer.args.output_dir)
    report = {"events": recorder.events, "global_step": trainer.state.global_step,
              "log_history": trainer.state.log_history,
              "checkpoints": sorted(p.name for p in out.glob("checkpoint-*")), **extra}
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
