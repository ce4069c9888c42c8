"""The loop's callouts as TRL's: a ``transformers.TrainerState`` whose ``log_history`` carries TRL's metric
names, and ``TrainerCallback`` events in Trainer's order.

TRL counts optimizer updates (``global_step``); a grpo step is one generation and its ``u = num_iterations x
mini_batches`` updates (TRL's ``num_iterations x steps_per_generation / gradient_accumulation_steps``), so step
``s`` holds global steps ``(s - 1) * u + 1 .. s * u``. Each update gets its own
``on_step_begin``/``on_step_end`` and log entry, as TRL's: the update's loss, grad_norm, learning_rate, kl,
entropy and clip ratios; the generation's metrics (rewards, lengths, num_tokens, tools) go to the first update
after it, where TRL's ``_metrics`` put them. The events of a step's updates fire once the step is done (grpo
runs a step's updates in one call). Log entries average the updates of a ``logging_steps`` window, as TRL's do.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path

from transformers.trainer_utils import rotate_checkpoints

from grpo.api.completions import CompletionTable, completion_table, log_completions
from grpo.api.eval_entries import trl_eval_entries
from grpo.training.loop import LoopHooks, StepReport

# grpo's step metric -> TRL's name for the same quantity (rewards, lengths and tools are converted below)
TRL_NAMES = {
    "reward/mean": "reward", "zero_std_fraction": "frac_reward_zero_std",
    "completion_length/mean": "completions/mean_length", "completion_length/min": "completions/min_length",
    "completion_length/max": "completions/max_length", "truncated_fraction": "completions/clipped_ratio",
    "terminated_length/mean": "completions/mean_terminated_length",
    "terminated_length/min": "completions/min_terminated_length",
    "terminated_length/max": "completions/max_terminated_length",
    "tools/calls_per_completion": "tools/call_frequency", "tools/failure_rate": "tools/failure_frequency",
}
# TRL counts a multi-turn completion's lengths in the model's own tokens: grpo's sampled_length
SAMPLED_NAMES = {"sampled_length/mean": "completions/mean_length", "sampled_length/min": "completions/min_length",
                 "sampled_length/max": "completions/max_length"}
# Per optimizer update in TRL: taken from the update's own metrics (grpo.step.metrics.reduce_updates), not the step's
PER_UPDATE = ("loss", "grad_norm", "learning_rate", "kl", "entropy", "clip_fraction", "ratio_mean", "time/step_s",
              "epoch", "step_tokens", "policy_loss", "entropy_coef")
LAST_OF_WINDOW = ("grad_norm", "learning_rate", "epoch", "num_tokens")  # TRL logs the window's last value of these


def trl_metrics(metrics: dict[str, float], reward_names: list[str], completions: int,
                with_kl: bool) -> dict[str, float]:
    """A grpo step's metrics under TRL's names (grpo's other metrics keep theirs). ``reward/<name>`` is a reward's
    mean when ``name`` is in ``reward_names`` or has a ``reward_std/<name>``; ``reward_std`` with Bessel's
    correction over the step's ``completions``, as TRL computes it; ``kl`` only when beta != 0, as TRL."""
    out = {}
    for name, value in metrics.items():
        tail = name.split("/", 1)[-1]
        if name in TRL_NAMES:
            out[TRL_NAMES[name]] = value
        elif name.startswith("reward/") and (tail in reward_names or f"reward_std/{tail}" in metrics):
            out[f"rewards/{tail}/mean"] = value
        elif name.startswith("reward_std/"):
            out[f"rewards/{tail}/std"] = value
        elif name not in ("reward/std", "reward/mean_sq") and name not in SAMPLED_NAMES:
            out[name] = value
    out.update({trl: metrics[name] for name, trl in SAMPLED_NAMES.items() if name in metrics})
    if "reward/std" in metrics:
        out["reward_std"] = metrics["reward/std"] * math.sqrt(completions / max(completions - 1, 1))
    if not with_kl:
        out.pop("kl", None)
    return out


def trl_update_metrics(update: dict[str, float], loss_type: str) -> dict[str, float]:
    """An update's metrics under the names TRL logs for ``loss_type``: ``cispo_clip_ratio`` (cispo's cap acting:
    grpo's ``clip_fraction``), ``vespo/phi_seq_mean``, and with an entropy bonus ``policy_loss`` and
    ``entropy_coef`` (none of these otherwise, as TRL)."""
    out = {k: v for k, v in update.items() if k not in ("clip_fraction", "vespo_phi_mean", "policy_loss",
                                                         "entropy_coef")}
    if loss_type == "cispo":
        out["cispo_clip_ratio"] = update["clip_fraction"]
    if loss_type == "vespo":
        out["vespo/phi_seq_mean"] = update["vespo_phi_mean"]
    if update.get("entropy_coef") is not None:
        out.update(policy_loss=update["policy_loss"], entropy_coef=update["entropy_coef"])
    return out


def update_entries(metrics: dict[str, float], updates: list[dict[str, float]], generation: dict[str, float],
                   previous_epoch: float, with_kl: bool, loss_type: str = "grpo") -> list[dict[str, float]]:
    """One TRL log entry per optimizer update of a step: each update's own metrics, ``step_time`` (the first
    update's includes the generation and the rest of the step, as TRL's ``training_step`` does) and ``epoch``
    (moving evenly from ``previous_epoch`` to the step's); ``generation`` (the step's metrics that TRL records
    when it generates, under TRL's names) joins the first. No ``updates``: one entry of the step's metrics."""
    epoch = metrics.get("epoch", previous_epoch)
    step_s = metrics.get("time/step_s", 0.0)
    if not updates:
        return [{**generation, **{k: metrics[k] for k in ("loss", "grad_norm", "learning_rate", "entropy")
                                  if k in metrics}, "step_time": step_s, "epoch": epoch}]
    ni, later_s = len(updates), sum(u["update_s"] for u in updates[1:])
    entries = []
    for u, update in enumerate(updates):
        own = {k: v for k, v in trl_update_metrics(update, loss_type).items()
               if k != "update_s" and (with_kl or k != "kl")}
        entry = {**(generation if u == 0 else {}), **own,
                 "step_time": step_s - later_s if u == 0 else update["update_s"],
                 "epoch": previous_epoch + (epoch - previous_epoch) * (u + 1) / ni}
        entries.append(entry)
    return entries


class CallbackHooks(LoopHooks):
    """Feeds ``state`` and calls ``callbacks`` (``TrainerCallback`` instances) as Trainer does:
    on_train_begin, on_epoch_begin, then per optimizer update on_step_begin, on_substep_end (per accumulation
    micro-step but the last), on_pre_optimizer_step, on_optimizer_step, on_step_end, on_log (every logging
    window), then the step's on_evaluate, on_save and on_epoch_end, and at the end the summary on_log and
    on_train_end.
    ``control.should_training_stop`` set by a callback stops training after the step (checkpointed first)."""

    def __init__(self, args, state, control, callbacks: list, *, model, tokenizer, reward_names: list[str],
                 completions_per_step: int, updates_per_step: int, logging_steps: int,
                 write_trainer_state: bool = False, eval_rows: dict[str, int] | None = None,
                 save_total_limit: int | None = None, steps_per_epoch: int | None = None):
        self.args, self.state, self.control, self.callbacks = args, state, control, callbacks
        self.model, self.tokenizer = model, tokenizer
        self.reward_names, self.completions, self.ni = reward_names, completions_per_step, updates_per_step
        self.logging_steps = logging_steps  # in updates, as TRL's
        self.write_trainer_state = write_trainer_state  # into each checkpoint folder, as Trainer does (TRL's layout)
        self.eval_rows = eval_rows or {}  # {eval set: rows} ("": the unnamed set), an entry each
        # checkpoints kept, rotated here by Trainer's rule (the best one kept too) when the run itself does not
        self.save_total_limit = save_total_limit
        # TRL's epoch in grpo steps (the train dataset's prompts // prompts per step); None: train_begin's (the
        # schedule's), else epochs end where the step's own epoch metric passes a whole number
        self.steps_per_epoch = steps_per_epoch
        self.window: list[dict[str, float]] = []
        # the running step's on_evaluate/on_save/on_epoch_end, fired after its updates' events
        self.pending: list[tuple[str, dict]] = []
        self.in_step = False
        self.losses: list[float] = []  # every update's, for train_loss (TRL's mean over all updates)
        self.completions_table: CompletionTable | None = None  # the latest generation's, for log_completions
        self.previous_epoch: float | None = 0.0
        self.epoch_open = False  # on_epoch_begin fired and its on_epoch_end not yet
        self.started = time.perf_counter()

    def _call(self, event: str, **kwargs) -> None:
        for callback in self.callbacks:
            result = getattr(callback, event)(self.args, self.state, self.control, model=self.model,
                                              processing_class=self.tokenizer, **kwargs)
            if result is not None:
                self.control = result

    def _strategy(self, name: str) -> str:
        return getattr(self.args, name, "steps")  # TRL's default where args are not TRL's (a test's)

    def train_begin(self, start_step: int, max_steps: int, steps_per_epoch: int | None = None) -> None:
        self.steps_per_epoch = self.steps_per_epoch or steps_per_epoch
        self.state.max_steps, self.state.global_step = max_steps * self.ni, start_step * self.ni
        self.state.logging_steps = self.logging_steps
        self.state.is_local_process_zero = int(os.environ.get("LOCAL_RANK", "0")) == 0
        self.state.is_world_process_zero = int(os.environ.get("RANK", "0")) == 0
        # None: a resumed run whose state has no epoch (the first step then assumes even steps)
        self.previous_epoch = self.state.epoch if self.state.epoch or start_step == 0 else None
        self.started = time.perf_counter()
        self.control.should_training_stop = False
        self._call("on_train_begin")
        self.epoch_open = False

    def _begin_update(self) -> None:
        if not self.epoch_open:  # Trainer opens an epoch before its first update
            self._call("on_epoch_begin")
            self.epoch_open = True
        self._call("on_step_begin")

    def step_begin(self, step: int) -> None:
        self.in_step = True
        self._begin_update()

    def evaluated(self, step: int, metrics: dict[str, float]) -> None:
        entries = self.eval_entries(metrics)
        if self.in_step:  # logged once the step's updates are: with their num_tokens and epoch
            self.pending.append(("on_evaluate", {"entries": entries}))
        elif step == 0:  # eval_on_start: Trainer's evaluate() without _determine_best_metric
            self.log_evaluation(entries)
        else:
            self._track_best(self.log_evaluation(entries))

    def eval_entries(self, metrics: dict[str, float], prefix: str = "eval") -> list[dict[str, float]]:
        """An evaluation's metrics as TRL's entries, one per eval set (``trl_eval_entries``)."""
        return trl_eval_entries(metrics, self.eval_rows, getattr(self.args, "per_device_eval_batch_size", 8),
                                prefix)  # TRL's default batch: 8

    def log_evaluation(self, entries: list[dict[str, float]], prefix: str = "eval") -> dict[str, float]:
        """Log each set's entry and call on_evaluate with it, as Trainer.evaluate does set by set; returns them
        merged as Trainer.evaluate returns a dict of sets' metrics (a later set's value of a shared name wins)."""
        merged: dict[str, float] = {}
        for entry in entries:
            entry[f"{prefix}_num_tokens"] = float(self.state.num_input_tokens_seen or 0)  # the training's so far
            if self.state.epoch is not None:
                entry["epoch"] = self.state.epoch
            self._log({**entry, "step": self.state.global_step})
            self._call("on_evaluate", metrics=entry)
            merged.update(entry)
        return merged

    def _track_best(self, metrics: dict[str, float]) -> None:
        """``state.best_metric`` / ``best_global_step`` by ``metric_for_best_model``, as Trainer's
        ``_determine_best_metric`` after each evaluation during training (``best_model_checkpoint`` is set when
        a checkpoint is saved and that step's folder exists)."""
        name = getattr(self.args, "metric_for_best_model", None)
        if name is None:
            return
        key = name if name.startswith("eval_") else f"eval_{name}"
        if key not in metrics:
            raise KeyError(f"The `metric_for_best_model` training argument is set to '{key}', which is not found "
                           f"in the evaluation metrics. The available evaluation metrics are: {list(metrics)}. "
                           "Consider changing the `metric_for_best_model` via the TrainingArguments.")  # TRL's words
        greater = getattr(self.args, "greater_is_better", None)
        greater = not name.endswith("loss") if greater is None else greater
        best = self.state.best_metric
        if best is None:
            best = float("-inf") if greater else float("inf")
        value = metrics[key]
        if value > best if greater else value < best:
            self.state.best_metric = value
            if self._strategy("save_strategy") != "no":  # Trainer names a best step only where it saves
                self.state.best_global_step = self.state.global_step

    def saved(self, step: int, path: Path) -> None:
        if self.in_step:
            self.pending.append(("on_save", {"path": path}))
        else:
            self._saved(path)

    def _saved(self, path: Path) -> None:
        """transformers' ``trainer_state.json`` (the log history to this step) into the checkpoint, then on_save."""
        # Trainer's _save_checkpoint names the best checkpoint once its folder exists; on every rank, as each
        # loads it under load_best_model_at_end
        if self.state.best_global_step and path is not None:
            best = Path(path).parent / f"checkpoint-{self.state.best_global_step}"
            if best.is_dir():
                self.state.best_model_checkpoint = str(best)
        if self.write_trainer_state and self.state.is_world_process_zero:  # one writer, as Trainer's should_save
            partial = path / ".trainer_state.json.tmp"
            self.state.save_to_json(str(partial))
            os.replace(partial, path / "trainer_state.json")
            if self.save_total_limit:  # by step, as grpo prunes (Trainer's own sorts by mtime)
                rotate_checkpoints(str(Path(path).parent), self.save_total_limit, self.state.best_model_checkpoint)
        self._call("on_save")

    def step_end(self, step: int, report: StepReport) -> bool:
        metrics, updates = report.metrics, report.updates
        if getattr(self.args, "log_completions", False) and report.batch is not None:
            self.completions_table = completion_table(report.batch)
        with_kl = bool(getattr(self.args, "beta", 0))
        own = {k: v for k, v in metrics.items()  # the step's evaluation is logged on its own, as TRL's
               if k not in PER_UPDATE and not k.startswith("eval/") and k != "time/eval_s"}
        generation = trl_metrics(own, self.reward_names, self.completions, with_kl)
        seen = (self.state.num_input_tokens_seen or 0) + int(metrics.get("step_tokens", 0))
        self.state.num_input_tokens_seen, generation["num_tokens"] = seen, float(seen)
        if self.steps_per_epoch:  # TRL's epoch: whole steps' prompts per pass
            metrics = {**metrics, "epoch": step / self.steps_per_epoch}
        previous = self.previous_epoch
        if previous is None:  # resumed without a saved epoch: as if every step had covered the same share
            previous = metrics.get("epoch", 0.0) * (step - 1) / step
        entries = update_entries(metrics, updates, generation, previous, with_kl, getattr(self.args, "loss_type", "grpo"))
        first_update = (step - 1) * self.ni
        for u, entry in enumerate(entries):
            if u > 0:
                self._begin_update()
            self._optimizer_events()
            self.state.global_step = first_update + (u + 1 if updates else self.ni)
            self.state.epoch = entry["epoch"]
            if entry.get("loss") is not None:
                self.losses.append(entry["loss"])
            self.window.append(entry)
            self._call("on_step_end")
            first = self.state.global_step == 1 and getattr(self.args, "logging_first_step", False)
            due = self.state.global_step % self.logging_steps == 0
            if first or due and self._strategy("logging_strategy") == "steps":
                self._log_window()
            if self._ends_epoch(step, u == len(entries) - 1, previous, entry["epoch"]):
                self._end_epoch()  # this update finished a pass over the data
            previous = entry["epoch"]
        self.previous_epoch = self.state.epoch
        self._flush(stopping=bool(self.control.should_training_stop) or self.state.global_step >= self.state.max_steps)
        self.in_step = False
        return bool(self.control.should_training_stop)

    def _ends_epoch(self, step: int, last_update: bool, previous: float, epoch: float) -> bool:
        if self.steps_per_epoch:  # after the last update of every steps_per_epoch-th step
            return last_update and step % self.steps_per_epoch == 0
        return math.floor(epoch + 1e-9) > math.floor(previous + 1e-9)

    def _log_window(self) -> None:
        self._log(self._window_entry())
        self._log_completions()

    def _flush(self, stopping: bool) -> None:
        """The step's evaluation and checkpoint in Trainer's order: those of a steps strategy at the step's end,
        then, when an epoch ends (or training stops inside one, which Trainer closes too), on_epoch_end and those
        of an epoch strategy (logging_strategy epoch: the epoch's log entry first)."""
        pending, self.pending = self.pending, []
        epoch_ended = any(event == "on_epoch_end" for event, _ in pending)
        if stopping and self.epoch_open and not epoch_ended:
            epoch_ended, self.epoch_open = True, False
        by_epoch = {"on_evaluate": self._strategy("eval_strategy") == "epoch",
                    "on_save": self._strategy("save_strategy") == "epoch"}
        later = []
        for event, entry in pending:
            if event == "on_epoch_end":
                continue
            if epoch_ended and by_epoch[event]:
                later.append((event, entry))
            else:
                self._fire(event, entry)
        if epoch_ended:
            self._call("on_epoch_end")
            if self._strategy("logging_strategy") == "epoch" and self.window:
                self._log_window()
            for event, entry in later:
                self._fire(event, entry)

    def _fire(self, event: str, entry: dict) -> None:
        if event == "on_evaluate":
            self._track_best(self.log_evaluation(entry["entries"]))
        else:
            self._saved(entry["path"])

    def _optimizer_events(self) -> None:
        """Trainer's events inside one optimizer update, at the global step before it: on_substep_end after each
        gradient-accumulation micro-step but the last, then on_pre_optimizer_step and on_optimizer_step."""
        for _ in range(max(int(getattr(self.args, "gradient_accumulation_steps", 1)), 1) - 1):
            self._call("on_substep_end")
        self._call("on_pre_optimizer_step")
        self._call("on_optimizer_step")

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

    def _log_completions(self) -> None:
        """TRL's log_completions at a training log (``grpo.api.completions``), on the main process."""
        if self.completions_table is None or not self.state.is_world_process_zero:
            return
        log_completions(self.completions_table, self.state.global_step, self.args.output_dir,
                        getattr(self.args, "num_completions_to_print", None))

    def _end_epoch(self) -> None:
        # fired after the step's checkpoint and evaluation when those follow this update (Trainer's order)
        if self.in_step:
            self.pending.append(("on_epoch_end", {}))
        else:
            self._call("on_epoch_end")
        self.epoch_open = False

    def final_weights(self) -> Path | None:
        """load_best_model_at_end: the best checkpoint (Trainer's ``_load_best_model``), None without one."""
        best = self.state.best_model_checkpoint
        if getattr(self.args, "load_best_model_at_end", False) and best and Path(best).is_dir():
            return Path(best)
        return None

    def train_end(self, last_step: int) -> None:
        if self.epoch_open:  # the run stopped inside an epoch (early stopping): Trainer still closes it
            self._call("on_epoch_end")
            self.epoch_open = False
        runtime = time.perf_counter() - self.started
        steps = max(self.state.global_step, 1)
        leftover = self._window_entry() if self.window else {}  # TRL merges unlogged steps into the summary
        leftover.pop("loss", None), leftover.pop("step", None)
        summary = {**leftover, "train_runtime": runtime, "train_samples_per_second": self.completions * steps / runtime,
                   "train_steps_per_second": steps / runtime, "total_flos": 0.0,
                   "train_loss": sum(self.losses) / len(self.losses) if self.losses else 0.0,
                   "epoch": self.state.epoch, "step": self.state.global_step}
        self._log(summary)
        best = self.state.best_model_checkpoint
        if self.save_total_limit == 1 and best and self.state.is_world_process_zero:  # Trainer's _finalize_training
            for folder in Path(best).parent.glob("checkpoint-*"):
                if folder.is_dir() and not os.path.samefile(folder, best):
                    shutil.rmtree(folder, ignore_errors=True)
        self._call("on_train_end")

    def summary(self) -> dict:
        """The last summary entry (``train_runtime``, ``train_loss``, ...), or {} before training ends."""
        for entry in reversed(self.state.log_history):
            if "train_runtime" in entry:
                return entry
        return {}
