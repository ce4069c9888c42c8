"""The loop's callouts as TRL's: a ``transformers.TrainerState`` whose ``log_history`` carries TRL's metric
names, and ``TrainerCallback`` events in Trainer's order.

TRL counts optimizer updates (``global_step``); a grpo step is ``num_iterations`` of them, so step ``s``
ends at ``global_step = s * num_iterations``. Log entries average the steps of a ``logging_steps`` window,
as TRL's do.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from grpo.training.loop import LoopHooks

# grpo's metric -> TRL's name for the same quantity (reward_std and rewards/<fn>/mean are converted below)
TRL_NAMES = {
    "loss": "loss", "grad_norm": "grad_norm", "learning_rate": "learning_rate", "reward/mean": "reward",
    "kl": "kl", "entropy": "entropy", "completion_length/mean": "completions/mean_length",
    "completion_length/max": "completions/max_length", "truncated_fraction": "completions/clipped_ratio",
    "clip_fraction": "clip_ratio/region_mean", "zero_std_fraction": "frac_reward_zero_std",
    "time/step_s": "step_time", "epoch": "epoch",
}
LAST_OF_WINDOW = ("grad_norm", "learning_rate", "epoch")  # TRL logs the window's last value of these


def trl_metrics(metrics: dict[str, float], reward_names: list[str], completions: int,
                with_kl: bool) -> dict[str, float]:
    """A grpo step's metrics under TRL's names (grpo's other metrics keep theirs). ``reward_std`` with Bessel's
    correction over the step's ``completions``, as TRL computes it; ``kl`` only when beta != 0, as TRL."""
    out = {}
    for name, value in metrics.items():
        if name in TRL_NAMES:
            out[TRL_NAMES[name]] = value
        elif name.startswith("reward/") and name[len("reward/"):] in reward_names:
            out[f"rewards/{name[len('reward/'):]}/mean"] = value
        elif name not in ("reward/std", "reward/mean_sq"):
            out[name] = value
    if "reward/std" in metrics:
        out["reward_std"] = metrics["reward/std"] * math.sqrt(completions / max(completions - 1, 1))
    if not with_kl:
        out.pop("kl", None)
    return out


class CallbackHooks(LoopHooks):
    """Feeds ``state`` and calls ``callbacks`` (``TrainerCallback`` instances) as Trainer does:
    on_train_begin, then per step on_step_begin, on_step_end, on_log (every logging window), on_evaluate,
    on_save, and at the end the summary on_log and on_train_end. ``control.should_training_stop`` set by a
    callback stops training after the step (its checkpoint is written first)."""

    def __init__(self, args, state, control, callbacks: list, *, model, tokenizer, reward_names: list[str],
                 completions_per_step: int, updates_per_step: int, logging_steps: int,
                 write_trainer_state: bool = False):
        self.args, self.state, self.control, self.callbacks = args, state, control, callbacks
        self.model, self.tokenizer = model, tokenizer
        self.reward_names, self.completions, self.ni = reward_names, completions_per_step, updates_per_step
        self.logging_steps = logging_steps  # in updates, as TRL's
        self.write_trainer_state = write_trainer_state  # into each checkpoint folder, as Trainer does (TRL's layout)
        self.window: list[dict[str, float]] = []
        self.pending: list[tuple[str, dict]] = []  # on_evaluate/on_save of the running step, fired after on_log
        self.in_step = False
        self.losses: list[float] = []  # every step's, for train_loss (TRL's mean over all steps)
        self.started = time.perf_counter()

    def _call(self, event: str, **kwargs) -> None:
        for callback in self.callbacks:
            result = getattr(callback, event)(self.args, self.state, self.control, model=self.model,
                                              processing_class=self.tokenizer, **kwargs)
            if result is not None:
                self.control = result

    def train_begin(self, start_step: int, max_steps: int) -> None:
        self.state.max_steps, self.state.global_step = max_steps * self.ni, start_step * self.ni
        self.state.logging_steps = self.logging_steps
        self.state.is_local_process_zero = int(os.environ.get("LOCAL_RANK", "0")) == 0
        self.state.is_world_process_zero = int(os.environ.get("RANK", "0")) == 0
        self.started = time.perf_counter()
        self.control.should_training_stop = False
        self._call("on_train_begin")

    def step_begin(self, step: int) -> None:
        self.in_step = True
        self._call("on_step_begin")

    def evaluated(self, step: int, metrics: dict[str, float]) -> None:
        entry = {"eval_" + name.split("/", 1)[-1]: value for name, value in metrics.items()}
        entry["step"] = step * self.ni
        if self.in_step:
            self.pending.append(("on_evaluate", entry))
        else:
            self._log(entry)
            self._call("on_evaluate", metrics=entry)

    def saved(self, step: int, path: Path) -> None:
        if self.in_step:
            self.pending.append(("on_save", {"path": path}))
        else:
            self._saved(path)

    def _saved(self, path: Path) -> None:
        """transformers' ``trainer_state.json`` (the log history to this step) into the checkpoint, then on_save."""
        if self.write_trainer_state:
            partial = path / ".trainer_state.json.tmp"
            self.state.save_to_json(str(partial))
            os.replace(partial, path / "trainer_state.json")
        self._call("on_save")

    def step_end(self, step: int, metrics: dict[str, float]) -> bool:
        self.state.global_step = step * self.ni
        self.state.epoch = metrics.get("epoch", self.state.epoch)
        if metrics.get("loss") is not None:
            self.losses.append(metrics["loss"])
        self.window.append(trl_metrics(metrics, self.reward_names, self.completions,
                                       with_kl=bool(getattr(self.args, "beta", 0))))
        self._call("on_step_end")
        first = step == 1 and getattr(self.args, "logging_first_step", False)
        if self.state.global_step % self.logging_steps < self.ni or first:
            self._log(self._window_entry())
        for event, entry in self.pending:
            if event == "on_evaluate":
                self._log(entry)
                self._call(event, metrics=entry)
            else:
                self._saved(entry["path"])
        self.pending, self.in_step = [], False
        return bool(self.control.should_training_stop)

    def _window_entry(self) -> dict[str, float]:
        names = dict.fromkeys(name for entry in self.window for name in entry)
        entry = {}
        for name in names:
            values = [e[name] for e in self.window if name in e and e[name] is not None and not math.isnan(e[name])]
            entry[name] = (values[-1] if name in LAST_OF_WINDOW else sum(values) / len(values)) if values else None
        self.window = []
        entry["step"] = self.state.global_step
        return entry

    def _log(self, entry: dict) -> None:
        self.state.log_history.append(entry)
        self._call("on_log", logs=entry)

    def train_end(self, last_step: int) -> None:
        runtime = time.perf_counter() - self.started
        steps = max(self.state.global_step, 1)
        leftover = self._window_entry() if self.window else {}  # TRL merges unlogged steps into the summary
        leftover.pop("loss", None), leftover.pop("step", None)
        summary = {**leftover, "train_runtime": runtime, "train_samples_per_second": self.completions * steps / self.ni / runtime,
                   "train_steps_per_second": steps / runtime, "total_flos": 0.0,
                   "train_loss": sum(self.losses) / len(self.losses) if self.losses else 0.0,
                   "epoch": self.state.epoch, "step": self.state.global_step}
        self._log(summary)
        self._call("on_train_end")

    def summary(self) -> dict:
        """The last summary entry (``train_runtime``, ``train_loss``, ...), or {} before training ends."""
        for entry in reversed(self.state.log_history):
            if "train_runtime" in entry:
                return entry
        return {}
