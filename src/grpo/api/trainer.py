"""``GRPOTrainer``: TRL 1.16's ``GRPOTrainer`` interface over grpo's training run.

The constructor checks everything and writes nothing: the model (a path/hub id, a ``PreTrainedModel`` or a
``PeftModel``, trained in place), ``peft_config``, the datasets, the rewards and the arguments, mapped once
to the config tree ``grpo train`` runs (``grpo.api.mapping``). ``train()`` then runs
``grpo.training.colocated.train`` with those objects (``GivenInputs``), the same path as the command line.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any

from peft import LoraConfig, PeftModel
from transformers import AutoConfig, TrainerControl, TrainerState
from transformers.trainer_utils import TrainOutput

from grpo.api.arguments import GRPOConfig
from grpo.api.attributes import TrainerAttributes
from grpo.api.callbacks import CallbackHooks
from grpo.api.checkpoints import TRAINER_STATE_FILE, resumed_checkpoint
from grpo.api.datasets import to_examples, verifiers_arguments
from grpo.api.fsdp_arguments import refuse_shards, with_launcher_fsdp
from grpo.api.mapping import to_run_config
from grpo.api.trl_batch import batch_shape, grpo_steps
from grpo.api.trl_fields import LIGER_NOTE
from grpo.api.optimizers import given_optimizers
from grpo.api.prompt_lengths import check_longest, context_length, explainer, prompt_limit
from grpo.api.rewards import build_reward_functions, reward_name, say_task_rewards
from grpo.compat import save_pretrained
from grpo.config import run_config_text
from grpo.config.rules import updates_per_step
from grpo.config.kinds import ENGINE_TRAITS, VLLM_ENGINE
from grpo.data import DataError, PromptTooLong
from grpo.data.prompts import with_template_variables
from grpo.data.reasoning_gym import is_reasoning_gym_dataset
from grpo.models.loading import load_policy, load_tokenizer, prepare_policy, resolve_device, uses_autocast
from grpo.models.wrappers import unwrap_model
from grpo.multiturn.environments import Environments, environment_methods
from grpo.multiturn.tools import tool_schema
from grpo.parallel.distributed import DistInfo
from grpo.run.plots import RunPlots, plot_run
from grpo.step.experience import local_reference
from grpo.training.colocated import train
from grpo.training.evaluator import eval_metrics
from grpo.training.inputs import GivenInputs, build_rewards, tokenizer_and_data
from grpo.training.prepare import build_evaluator, seed_process
from grpo.training.settings import logprob_pass, logprob_processing

LORA_FIELDS = {"r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout", "target_modules": "target_modules"}
PEFT_MODEL_AND_CONFIG = (
    "You passed a `PeftModel` instance together with a `peft_config` to the trainer. Please first merge and unload "
    "the existing adapter, save the resulting base model, and then pass that base model along with the new "
    "`peft_config` to the trainer.")  # TRL's words


def lora_keys(peft_config: Any) -> dict:
    """``model.lora_*`` keys of a peft ``LoraConfig``; a field grpo does not implement, set away from peft's
    default, is a ValueError naming it."""
    if not isinstance(peft_config, LoraConfig):
        raise TypeError(f"peft_config must be a peft LoraConfig, got {type(peft_config).__name__}")
    default = LoraConfig()
    ignored = {"task_type", "base_model_name_or_path", "revision", "inference_mode", "peft_type", "auto_mapping",
               *LORA_FIELDS}
    for f in dataclasses.fields(LoraConfig):
        if f.name not in ignored and getattr(peft_config, f.name) != getattr(default, f.name):
            raise ValueError(f"peft_config.{f.name}={getattr(peft_config, f.name)!r} is not supported by grpo, "
                             "which builds LoRA from r, lora_alpha, lora_dropout and target_modules")
    targets = peft_config.target_modules
    targets = sorted(targets) if isinstance(targets, (set, list, tuple)) else targets or "all-linear"
    return {"r": peft_config.r, "alpha": float(peft_config.lora_alpha), "dropout": peft_config.lora_dropout,
            "target_modules": targets}


def _eval_sets(eval_dataset: Any, pass_columns: bool) -> dict[str, list]:
    if eval_dataset is None:
        return {}
    if isinstance(eval_dataset, dict):
        return {name: to_examples(d, f"eval_dataset[{name!r}]", pass_columns=pass_columns)
                for name, d in eval_dataset.items()}
    return {"": to_examples(eval_dataset, "eval_dataset", pass_columns=pass_columns)}


class GRPOTrainer(TrainerAttributes):
    """TRL's ``GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
    reward_processing_classes, callbacks, peft_config)``; see the module docstring."""

    def __init__(self, model: Any, reward_funcs: Any = None, args: GRPOConfig | None = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 reward_processing_classes: Any = None, callbacks: list | None = None, peft_config: Any = None,
                 optimizers: tuple = (None, None), quantization_config: Any = None, tools: Any = None,
                 rollout_func: Any = None, environment_factory: Any = None):
        if quantization_config is not None:
            raise ValueError("GRPOTrainer(quantization_config=...) is not supported: use grpo_overrides "
                             "model.load_in_4bit")
        name_or_path = self._model_name(model)
        args = args or GRPOConfig(output_dir=f"{Path(name_or_path).name}-GRPO")
        train_dataset, args = verifiers_arguments(train_dataset, reward_funcs, args)  # a vf.Env: data.train
        if not isinstance(args, GRPOConfig):
            raise TypeError(f"args must be a grpo.GRPOConfig, got {type(args).__name__}")
        if args.full_determinism:  # as Trainer's __init__ does (train() does again, as every grpo process)
            seed_process(args.seed, full_determinism=True)
        lora = self._lora(model, peft_config)
        args = with_launcher_fsdp(args, os.environ)
        self.args, self.num_processes = args, int(os.environ.get("WORLD_SIZE", "1"))
        prompts_per_step, _, mini_batches = batch_shape(args, self.num_processes)
        per_step = max(args.num_iterations, 1) * mini_batches  # optimizer updates per generation (grpo step)
        limit = None if args.max_steps <= 0 else args.max_steps // per_step * prompts_per_step
        pass_columns = not args.remove_unused_columns
        self.train_set = (to_examples(train_dataset, "train_dataset", pass_columns=pass_columns, limit=limit)
                          if train_dataset is not None else None)
        self.eval_sets = _eval_sets(eval_dataset, pass_columns)
        self.train_dataset, self.eval_dataset, self.rollout_context = train_dataset, eval_dataset, None
        if self.train_set is None and "data.train" not in args.grpo_overrides:
            raise ValueError("train_dataset is required (or name grpo's data in grpo_overrides['data.train'])")
        if self.train_set is not None:
            grpo_steps(args, prompts_per_step, len(self.train_set), mini_batches)  # max_steps/epochs fit the data
        self.processing_class = processing_class or self._load_tokenizer(name_or_path, args)
        # what the run renders with: chat_template_kwargs set in a copy's template; processing_class stays as given
        self._rendering = with_template_variables(self.processing_class, args.chat_template_kwargs)
        self._take_rollout_hooks(tools, environment_factory, rollout_func)
        columns = sorted(self.train_set[0].columns()) if self.train_set else []
        if environment_factory is not None:
            columns.append("environments")  # the rollouts' instances, as TRL passes them to the rewards
        if rollout_func is not None:
            columns = None  # its extra output keys are columns too, known only when it runs
        # Without reward_funcs the config's rewards (grpo_overrides' rewards, else its task's defaults, as grpo train
        # resolves them): on grpo's data (grpo_overrides' data.train) and on a dataset object alike, whose task is
        # grpo_overrides' data.task (a reasoning-gym dataset: reasoning_gym; else gsm8k, reading the answer column).
        reasoning_gym = is_reasoning_gym_dataset(train_dataset)
        config_rewards = reward_funcs is None and not self._environment_owns_reward()
        if config_rewards and args.reward_weights is not None:
            raise ValueError("GRPOConfig.reward_weights is set but reward_funcs is None (the config's rewards, "
                             "which carry their own weights): give reward_funcs or drop reward_weights")
        if reward_funcs is None and self._environment_owns_reward():  # TRL: get_reward may be the only source
            self.reward_fns, self.reward_weights = [], []
        elif not config_rewards:
            self.reward_fns, self.reward_weights = build_reward_functions(
                reward_funcs, args.reward_weights, reward_processing_classes, columns)
        engines = (args.rollout_engine, args.grpo_overrides.get("rollout.engine"),
                   VLLM_ENGINE if args.use_vllm else None)
        fixed = any(ENGINE_TRAITS[name].fixed_context for name in engines if name in ENGINE_TRAITS)  # vLLM's
        self.context_length = context_length(self._model_config(model, name_or_path, args)) if fixed else None
        data = {"max_prompt_length": prompt_limit(self.context_length, args.max_completion_length, fixed)}
        if self.train_set:  # TRL's rows carry their own system turn, if any; the task's rewards ask for its format
            data.update(add_system_prompt=config_rewards, train=f"python:train_dataset ({len(self.train_set)} rows)")
        if reasoning_gym:
            data.update(task="reasoning_gym", add_system_prompt=True)
        self.config = to_run_config(args, num_processes=self.num_processes,
                                    train_size=len(self.train_set) if self.train_set else None,
                                    model=name_or_path, lora=lora, data=data,
                                    rewards=None if config_rewards else self._reward_specs(),
                                    rollout=self._turn_keys())
        if config_rewards:
            self.reward_fns, self.reward_weights = build_rewards(self.config)
            say_task_rewards(self.config, columns if self.train_set else None)
        if args.use_liger_kernel and int(os.environ.get("RANK", "0")) == 0:
            print(LIGER_NOTE)
        sets = {"train_dataset": self.train_set or [], **self.eval_sets}
        check_longest(self._rendering, sets, self._tool_schemas(), self.config.data.max_prompt_length,
                      self._explain)
        self.model = self._prepare_model(model)
        self.optimizer, self.lr_scheduler = given_optimizers(optimizers, self.model, self.config)  # Trainer's names
        self.state, self.control = TrainerState(), TrainerControl()
        self.callbacks = [c() if isinstance(c, type) else c for c in (callbacks or [])]
        for callback in self.callbacks:
            callback.on_init_end(self.args, self.state, self.control)

    # ---------------------------------------------------------------- construction

    def _take_rollout_hooks(self, tools: Any, environment_factory: Any, rollout_func: Any) -> None:
        """TRL's ``tools=``, ``environment_factory=`` and ``rollout_func=``, checked and kept."""
        self.tools, self.environment_factory, self.rollout_func = tools, environment_factory, rollout_func
        if tools is not None and not isinstance(tools, (list, tuple)):
            raise TypeError(f"tools must be a list of functions, got {type(tools).__name__}")
        self.environments = None  # built once: each factory's probe instance seeds the pool (TRL's one probe)
        if environment_factory is not None:
            self.environments = Environments(environment_factory)

    @staticmethod
    def _model_name(model: Any) -> str:
        if isinstance(model, (str, Path)):
            path = str(model)
            if (path.startswith((".", "/", "~")) or path.count("/") != 1) and not Path(path).expanduser().exists():
                raise ValueError(f"model {path!r} does not exist (a local folder or a hub id org/name)")
            return path
        if not hasattr(model, "config") or not hasattr(model, "forward"):
            raise TypeError(f"model must be a path, a hub id, a PreTrainedModel or a PeftModel, got "
                            f"{type(model).__name__}")
        return str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or "model")

    @staticmethod
    def _lora(model: Any, peft_config: Any) -> dict | None:
        if isinstance(model, PeftModel):
            if peft_config is not None:
                raise ValueError(PEFT_MODEL_AND_CONFIG)
            return lora_keys(model.peft_config[model.active_adapter])
        return lora_keys(peft_config) if peft_config is not None else None

    @staticmethod
    def _load_tokenizer(name_or_path: str, args: GRPOConfig):
        return load_tokenizer(name_or_path, args.trust_remote_code)

    @staticmethod
    def _model_config(model: Any, name_or_path: str, args: GRPOConfig):
        if not isinstance(model, (str, Path)):
            return model.config

        return AutoConfig.from_pretrained(name_or_path, trust_remote_code=args.trust_remote_code)

    def _explain(self, err: PromptTooLong) -> DataError:
        return explainer(self.args.grpo_overrides, self.context_length, self.args.max_completion_length)(err)

    def _tool_schemas(self) -> list[dict]:
        """Every tool's schema (the standalone tools and each environment's methods), as the rollout renders them
        (an environment's ``reset`` text is known only then, and measured there)."""
        tools = list(self.tools or [])
        if self.environments is not None:
            tools += [m for pool in self.environments.pool.values() for m in environment_methods(pool[0])]
        return [tool_schema(fn) for fn in tools]

    def _environment_owns_reward(self) -> bool:
        return self.environments is not None and bool(self.environments.reward_types)

    def _reward_specs(self) -> list[dict]:
        """The run config's ``rewards``: a dotted path where the function has one (so that ``to_yaml`` gives
        a recipe ``grpo train`` can run), else its name."""
        return [{"name": _dotted(fn.fn) or fn.name, "weight": weight}
                for fn, weight in zip(self.reward_fns, self.reward_weights)]

    def _turn_keys(self) -> dict:
        """``rollout.tools``/``environment``/``rollout_func`` naming the given objects (dotted paths where they
        have one, so that ``to_yaml`` is a runnable recipe; ``python:<name>`` otherwise)."""
        def name(obj):
            return _dotted(obj) or f"python:{getattr(obj, '__name__', type(obj).__name__)}"

        keys = {}
        if self.tools:
            keys["tools"] = [name(fn) for fn in self.tools]
        if self.environment_factory is not None:
            factory = self.environment_factory
            keys["environment"] = (name(factory) if not isinstance(factory, dict)
                                   else "python:{" + ", ".join(map(str, factory)) + "}")
        if self.rollout_func is not None:
            keys["rollout_func"] = name(self.rollout_func)
        return keys

    def _prepare_model(self, model: Any):
        if isinstance(model, (str, Path)):
            device = resolve_device(self.config.train.device)
            return load_policy(self.config.model, device, master_weights=uses_autocast(self.config.model, False))
        return prepare_policy(model, self.config.model)  # LoRA added in place when peft_config is given

    # ---------------------------------------------------------------- TRL's methods

    def train(self, resume_from_checkpoint: bool | str | None = None):
        """Train. ``resume_from_checkpoint``, as TRL's: True continues from the newest ``checkpoint-<step>`` of
        ``args.output_dir``, a path from that checkpoint, of ``output_dir`` or of another run (its
        ``trainer_state.json`` restores ``state``, the log history and best metric included). Returns
        ``TrainOutput(global_step, training_loss, metrics)``. Ctrl-C saves the last finished step and returns here."""
        checkpoint = resumed_checkpoint(resume_from_checkpoint, self.config)
        # With metric_for_best_model the hooks rotate the checkpoints, keeping the best one as Trainer does
        keeps_best = getattr(self.args, "metric_for_best_model", None) is not None
        limit = self.config.train.save_total_limit
        cfg = dataclasses.replace(self.config, train=dataclasses.replace(
            self.config.train, resume=False, resume_from=str(checkpoint) if checkpoint else None,
            save_total_limit=None if keeps_best else limit))
        state_file = checkpoint / TRAINER_STATE_FILE if checkpoint else None
        # A fresh state per train(), as Trainer's; a resumed one is the checkpoint's, its log history included.
        self.state = TrainerState.load_from_json(str(state_file)) if state_file and state_file.is_file() \
            else TrainerState()
        if self.state.best_model_checkpoint and not Path(self.state.best_model_checkpoint).is_dir():
            self.state.best_model_checkpoint = None  # as Trainer: a best checkpoint deleted since is forgotten
        self.state.save_steps, self.state.train_batch_size = self.args.save_steps, self.args.per_device_train_batch_size
        hooks = self._hooks(cfg, self.eval_sets, save_total_limit=limit if keeps_best else None)
        evaluating = self.args.eval_strategy != "no" and self.eval_sets
        given = dataclasses.replace(self._given(self.train_set, dict(self.eval_sets) if evaluating else None),
                                    policy=self.model, hooks=hooks)  # named sets: eval/<name>/...
        try:
            train(cfg, given)
        except KeyboardInterrupt:
            print(f"\ngrpo: interrupted at step {self.state.global_step}; " + (
                f"the last finished step is saved in {cfg.train.output_dir}/checkpoint-* (train(resume_from_checkpoint="
                "True) continues)" if cfg.train.save_strategy != "no" else "nothing saved (save_strategy='no')"))
        except PromptTooLong as err:  # measured when its step sampled it: earlier steps' checkpoints are kept
            raise self._explain(err) from None
        summary = hooks.summary()
        return TrainOutput(self.state.global_step, summary.get("train_loss", 0.0), summary)

    def _hooks(self, cfg, eval_sets: dict[str, list], save_total_limit: int | None = None) -> CallbackHooks:
        """The loop's callouts into ``state`` and the callbacks, evaluating ``eval_sets`` (an entry each);
        ``save_total_limit``: the checkpoints the hooks keep (None: the run prunes them itself)."""
        # TRL's epoch: the train dataset's prompts that fill whole steps (the rows read may stop at max_steps')
        sized = self.train_set is not None and hasattr(self.train_dataset, "__len__")
        per_epoch = len(self.train_dataset) // cfg.train.prompts_per_step if sized else None
        return CallbackHooks(self.args, self.state, self.control, self.callbacks, model=self.model,
                             tokenizer=self.processing_class, reward_names=[f.name for f in self.reward_fns],
                             completions_per_step=cfg.train.prompts_per_step * cfg.rollout.num_generations,
                             updates_per_step=updates_per_step(cfg), logging_steps=self._logging_updates(cfg),
                             write_trainer_state=True, eval_rows={name: len(s) for name, s in eval_sets.items()},
                             save_total_limit=save_total_limit, steps_per_epoch=per_epoch or None)

    def _given(self, train_set, eval_set):
        """The objects this trainer holds, as ``GivenInputs`` (no policy or hooks: ``train()`` adds them)."""
        return GivenInputs(tokenizer=self._rendering, train_set=train_set, eval_set=eval_set,
                           reward_fns=self.reward_fns, reward_weights=self.reward_weights, optimizer=self.optimizer,
                           scheduler=self.lr_scheduler,
                           tools=list(self.tools) if self.tools is not None else None,
                           environment_factory=self.environments, rollout_func=self._rollout_func())

    def _logging_updates(self, cfg) -> int:
        """TRL's logging_steps in updates (a float below 1: that share of max_steps, rounded up)."""
        steps = self.args.logging_steps
        return max(1, math.ceil(steps * cfg.train.max_steps * updates_per_step(cfg)) if steps < 1 else int(steps))

    def evaluate(self, eval_dataset: Any = None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """grpo's held-out evaluation of the model as it is now, the way a run evaluates
        (``grpo.training.evaluator``): greedy answer accuracy and format rate, the rewards' means, and with
        ``eval.num_samples`` k (``grpo_overrides``) mean@k / pass@k / maj@k, through the run's engine (multi-turn
        with tools or environments). Under TRL's names (``grpo.api.callbacks.trl_eval_entries``: ``{prefix}_reward``,
        ``{prefix}_rewards/<fn>/mean``, ``{prefix}_completions/mean_length``, ``{prefix}_runtime``, ...) beside
        grpo's own (``{prefix}_accuracy``); a dict of sets is logged set by set as Trainer.evaluate logs it (an entry
        and ``on_evaluate`` each, ``{prefix}_<set>_runtime``, ``{prefix}_<set>_accuracy``, ...) and its metrics
        returned merged."""
        sets = _eval_sets(eval_dataset, not self.args.remove_unused_columns) if eval_dataset is not None \
            else self.eval_sets
        if not sets:
            raise ValueError("evaluate() needs an eval_dataset (here or in the constructor)")
        refuse_shards(unwrap_model(self.model), "evaluate()")
        inputs = tokenizer_and_data(self.config, self._given(self.train_set or [], dict(sets)))
        evaluate = build_evaluator(self.config, inputs, self.model, DistInfo(), ref_logprobs=self._reference())
        started = time.perf_counter()
        try:
            results = evaluate(self.state.global_step)
        except PromptTooLong as err:
            raise self._explain(err) from None
        seconds = time.perf_counter() - started
        hooks = self._hooks(self.config, sets)
        entries = hooks.eval_entries({**eval_metrics(results), "time/eval_s": seconds}, metric_key_prefix)
        return hooks.log_evaluation(entries, metric_key_prefix)

    def _reference(self):
        """The reference log-probs ``evaluate()``'s loss pass reads for ``eval_kl`` (loss.beta > 0): a LoRA
        policy's own with the adapter off; None for a full model, whose initial weights ``train()`` held only
        while it ran (no ``eval_kl`` then, where TRL keeps a reference copy for the trainer's lifetime)."""
        cfg = self.config
        if not cfg.loss.beta or cfg.model.lora_r <= 0 or cfg.model.ref_name_or_path is not None:
            return None
        return local_reference(self.model, None, cfg.rollout.temperature, cfg.train.micro_batch_size,
                               logprob_processing(cfg, unwrap_model(self.model), self.processing_class),
                               logprob_pass(cfg))

    def save_model(self, output_dir: str | None = None) -> None:
        """The adapter (a PEFT model) or the full model, with the tokenizer, as TRL writes them."""
        refuse_shards(unwrap_model(self.model), "save_model()")
        if int(os.environ.get("RANK", "0")) != 0:  # under torchrun one rank writes, as TRL's should_save
            return
        folder = Path(output_dir or self.args.output_dir or "trainer_output")
        folder.mkdir(parents=True, exist_ok=True)
        save_pretrained(unwrap_model(self.model), folder)
        self.processing_class.save_pretrained(folder)
        run_config_text(self.config, folder / "grpo_config.yaml")

    def plot(self):
        """Draw the training curves of ``args.output_dir`` (its ``metrics.jsonl``) into ``plots/*.png``, as
        ``plot_at_end=True`` does after ``train()``; the returned ``RunPlots`` shows the summary inline when a
        notebook cell returns it. Before ``train()`` wrote any metrics: ``FileNotFoundError``/``ValueError``."""
        return RunPlots(tuple(plot_run(self.config.train.output_dir)))

    def add_callback(self, callback: Any) -> None:
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    @property
    def reward_func_names(self) -> list[str]:
        return [f.name for f in self.reward_fns]


__all__ = ["GRPOTrainer", "lora_keys", "reward_name"]


def _dotted(obj: Any) -> str | None:
    """``module:qualname`` of a module-level function or class, importable by ``grpo.multiturn.tools.load_callable``
    and the reward loader; None for lambdas, closures, methods and ``__main__``'s objects."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if module and module != "__main__" and qualname and "<" not in qualname and "." not in qualname:
        return f"{module}:{qualname}"
    return None
