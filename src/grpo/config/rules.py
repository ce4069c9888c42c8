"""Cross-field rules of the config tree: each returns ``(key, why)`` for every violated rule (and
``ptx_max_length``, the one default derived from other sections).

Kept apart from ``grpo.config.schema`` (the fields, their defaults and ranges), which they read and which never
reads them; the resolver (``grpo.config.resolve``) calls ``config_problems`` once a run's values are filled in. The
rules that tie the config to its task and data are ``grpo.config.task_rules``', the loss's ``grpo.config.loss_rules``'.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import zmq

from grpo.algorithm import advantage_estimator
from grpo.algorithm.schedules import decay_arguments
from grpo.config.async_rules import in_flight_problems, partial_rollout_problems
from grpo.config.fsdp_rules import fsdp_problems
from grpo.config.kinds import TRACKERS, engine_traits
from grpo.config.loss_rules import loss_problems, loss_type_problems, routing_replay_problems
from grpo.config.speed_rules import SPEED_RULES
from grpo.config.task_rules import gold_problems, reward_problems, task_problems

if TYPE_CHECKING:
    from grpo.config.schema import RunConfig


def config_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """Cross-field rules: returns ``(key, why)`` for each violated one (empty when valid), in ``RULES``' order
    (the loader reports the first with where its key was set)."""
    return [problem for rule in RULES for problem in rule(cfg)]


def batch_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """The step's completions split into equal micro-batches (each update's: a mini-batch's)."""
    completions, k = cfg.train.prompts_per_step * cfg.rollout.num_generations, cfg.train.mini_batches
    if k == 1 and completions % cfg.train.micro_batch_size != 0:
        return [("train.micro_batch_size", (
            f"{cfg.train.micro_batch_size} does not divide the step's {completions} completions "
            f"(train.prompts_per_step {cfg.train.prompts_per_step} x rollout.num_generations "
            f"{cfg.rollout.num_generations}); gradient accumulation needs equal micro-batches"))]
    if k > 1 and cfg.train.prompts_per_step % k == 0 and (completions // k) % cfg.train.micro_batch_size != 0:
        return [("train.micro_batch_size", (
            f"{cfg.train.micro_batch_size} does not divide a mini-batch's {completions // k} completions (the step's "
            f"{completions} over train.mini_batches {k}); gradient accumulation needs equal micro-batches"))]
    return []


def mini_batch_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """train.mini_batches: whole prompt groups per mini-batch (on each decoupled trainer rank), and what cannot
    take several updates per step yet."""
    k, P = cfg.train.mini_batches, cfg.train.prompts_per_step
    if k == 1:
        return []
    if P % k:
        return [("train.mini_batches", (
            f"{k} does not divide train.prompts_per_step {P}: each mini-batch takes whole prompt groups (an "
            "update with part of a group would see some of its completions without the rest)"))]
    ranks = cfg.decoupled.trainer_ranks if cfg.train.mode == "decoupled" else 1
    if P % ranks == 0 and (P // ranks) % k:
        return [("train.mini_batches", (
            f"{k} does not divide a trainer rank's {P // ranks} prompts (train.prompts_per_step {P} over "
            f"decoupled.trainer_ranks {ranks}): each rank splits its own share into whole-group mini-batches"))]
    if cfg.train.mode == "decoupled" and cfg.decoupled.partial_rollouts:
        return [("train.mini_batches", (
            f"is {k} but decoupled.partial_rollouts is on: a partial step holds a varying number of groups, split "
            "unevenly over the trainer ranks, which a fixed number of whole-group mini-batches cannot divide yet; "
            "set train.mini_batches: 1"))]
    return []


def updates_per_step(cfg: "RunConfig") -> int:
    """Optimizer updates in one step: loss.num_iterations passes of train.mini_batches updates each. The learning
    rate schedules and TRL's global_step count these; checkpoints, evaluation and logging count steps."""
    return cfg.loss.num_iterations * cfg.train.mini_batches


def memory_saver_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """4-bit weights and 8-bit optimizer states (bitsandbytes) against LoRA and DeepSpeed."""
    problems = []
    if cfg.model.load_in_4bit and cfg.model.lora_r == 0:
        problems.append(("model.load_in_4bit", "needs model.lora_r > 0: 4-bit weights are frozen (QLoRA trains "
                                               "a LoRA adapter over them)"))
    if (cfg.model.load_in_4bit or cfg.optim.optimizer == "adamw_8bit") and cfg.train.deepspeed:
        problems.append(("train.deepspeed", "cannot be combined with model.load_in_4bit or optim.optimizer "
                                            "adamw_8bit (bitsandbytes); DeepSpeed has its own optimizer"))
    return problems


def token_budget_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """train.max_tokens_per_micro_batch: its value, and DeepSpeed's fixed accumulation."""
    budget, problems = cfg.train.max_tokens_per_micro_batch, []
    if isinstance(budget, str) and budget != "auto" or isinstance(budget, int) and budget < 1:
        problems.append(("train.max_tokens_per_micro_batch", f"must be auto, null or a token count >= 1, got "
                                                             f"{budget!r}"))
    if isinstance(budget, int) and cfg.train.deepspeed:
        problems.append(("train.max_tokens_per_micro_batch", (
            "cannot be combined with train.deepspeed: DeepSpeed steps after a fixed number of micro-batches "
            "(gradient_accumulation_steps), and a token budget makes a different number each step; drop one "
            "(auto, the default, runs fixed rows under DeepSpeed)")))
    return problems


def lora_rate_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """optim.lora_learning_rate needs LoRA parameters to apply to."""
    if cfg.optim.lora_learning_rate is not None and cfg.model.lora_r == 0:
        return [("optim.lora_learning_rate",
                 "is set but model.lora_r is 0 (full fine-tuning has no LoRA parameters)")]
    return []


def schedule_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """optim.lr_scheduler_kwargs (and the critic's) are arguments its decay takes."""
    problems = []
    for section, rate in (("optim", cfg.optim.learning_rate), ("critic", cfg.critic.learning_rate)):
        schedule = getattr(cfg, section)
        try:
            decay_arguments(schedule.lr_scheduler_type, schedule.lr_scheduler_kwargs, rate, "")
        except ValueError as err:
            problems.append((f"{section}.lr_scheduler_kwargs", str(err).removeprefix(": ")))
    return problems


def tracker_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """log.report_to names known trackers."""
    return [("log.report_to", f"unknown tracker {tracker!r}; allowed: {', '.join(TRACKERS)}")
            for tracker in cfg.log.report_to if tracker not in TRACKERS]


def decoupled_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """Staleness against the publishing interval, broadcast against LoRA, whole groups per trainer rank."""
    problems = []
    if cfg.train.mode == "decoupled" and cfg.train.max_staleness < cfg.train.sync_steps - 1:
        problems.append(("train.max_staleness", (
            f"{cfg.train.max_staleness} < train.sync_steps - 1 = {cfg.train.sync_steps - 1}: weights are "
            "published only every sync_steps, so rollouts are that stale by construction")))
    if cfg.decoupled.weight_sync == "broadcast" and cfg.model.lora_r > 0:
        problems.append(("decoupled.weight_sync", (
            f"broadcast sends full model weights, but model.lora_r is {cfg.model.lora_r}: a LoRA adapter "
            "travels through files with its adapter config; set decoupled.weight_sync: files")))
    problems += in_flight_problems(cfg) + partial_rollout_problems(cfg)
    if (cfg.train.prompts_per_step % cfg.decoupled.trainer_ranks) != 0:
        problems.append(("decoupled.trainer_ranks", (
            f"{cfg.decoupled.trainer_ranks} does not divide train.prompts_per_step "
            f"{cfg.train.prompts_per_step}: each rank trains whole prompt groups")))
    return problems


def engine_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """The off-policy check of an engine with its own weights (vLLM) against truncated sampling."""
    r = cfg.rollout
    if engine_traits(r.engine).own_weights and r.vllm_check_steps > 0 and (r.top_p < 1 or r.top_k):
        return [("rollout.vllm_check_steps", (
            f"is {r.vllm_check_steps} with rollout.top_p {r.top_p} / top_k {r.top_k}: vLLM's log-probs are then "
            "renormalised over the kept tokens while the trainer's are not, so the check would measure the "
            "truncation, not the weights; sample without top_p/top_k or set rollout.vllm_check_steps: 0"))]
    return []


EVAL_SET_NAME = re.compile(r"[A-Za-z_][\w.-]*")


def eval_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """What needs data.eval (early stopping, train.best_metric), and its set names (they become metric names and
    file names)."""
    problems = []
    if cfg.train.early_stop_accuracy is not None and cfg.data.eval is None:
        problems.append(("train.early_stop_accuracy", "needs data.eval (a held-out set to measure accuracy on)"))
    if isinstance(cfg.data.eval, dict):
        bad = [name for name in cfg.data.eval if not EVAL_SET_NAME.fullmatch(name)]
        if bad:
            problems.append(("data.eval", f"has set name(s) {bad}: a name is a word (letters, digits, _ . -; "
                                          "not starting with a digit), used in metric and file names"))
    if cfg.eval.num_generations is not None and not cfg.eval.loss_pass:
        problems.append(("eval.num_generations", "is set but eval.loss_pass is false: only the loss pass samples "
                                                 "groups of completions per held-out prompt; set eval.loss_pass: true "
                                                 "or eval.num_generations: null"))
    if cfg.train.eval_strategy == "epoch" and cfg.train.eval_steps is not None:
        problems.append(("train.eval_steps", f"is {cfg.train.eval_steps} but train.eval_strategy is epoch, which "
                                             "evaluates at the end of each epoch instead; drop one"))
    if cfg.train.load_best_at_end and cfg.train.best_metric is None:
        problems.append(("train.load_best_at_end", "needs train.best_metric: the weights it loads are those best/ "
                                                   "keeps by that metric"))
    if cfg.train.load_best_at_end and cfg.train.deepspeed:
        problems.append(("train.load_best_at_end", "cannot be combined with train.deepspeed yet: best/ holds whole "
                                                   "weights, and loading them into the engine's (under ZeRO-3 "
                                                   "partitioned) parameters is not implemented"))
    metric = cfg.train.best_metric
    if metric is not None and cfg.data.eval is None:
        problems.append(("train.best_metric", "needs data.eval (the held-out set(s) its metric is measured on)"))
    elif metric is not None and not metric.startswith("eval/"):
        problems.append(("train.best_metric", f"is {metric!r}: it must name an evaluation metric, e.g. "
                                              "eval/accuracy or eval/<set>/pass@4"))
    return problems


# model.sdpa_backends' short names -> torch.nn.attention.SDPBackend's (either spelling is accepted)
SDPA_BACKEND_NAMES = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                      "math": "MATH"}


def sdpa_backend_names(names: str) -> tuple[str, ...]:
    """``"flash,efficient"`` -> ``("FLASH_ATTENTION", "EFFICIENT_ATTENTION")``; ValueError naming the unknown
    ones and the known ones."""
    chosen = tuple(SDPA_BACKEND_NAMES.get(n.strip().lower(), n.strip().upper()) for n in names.split(",") if n.strip())
    unknown = [n for n in chosen if n not in SDPA_BACKEND_NAMES.values()]
    if unknown or not chosen:
        raise ValueError(f"{names!r}: unknown {unknown or 'none given'}; "
                         f"known: {', '.join(SDPA_BACKEND_NAMES)}")
    return chosen


def sdpa_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """model.sdpa_backends: known names, and an attention implementation that reads them."""
    m = cfg.model
    if m.sdpa_backends is None:
        return []
    try:
        sdpa_backend_names(m.sdpa_backends)
    except ValueError as err:
        return [("model.sdpa_backends", f"is {err} (or null: torch's choice)")]
    if m.attn_implementation not in (None, "sdpa"):
        return [("model.sdpa_backends", (
            f"is set but model.attn_implementation is {m.attn_implementation!r}: only the sdpa attention "
            "calls scaled_dot_product_attention, so the choice would do nothing; set attn_implementation: sdpa "
            "(or null) or sdpa_backends: null"))]
    return []


def sampler_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """The rules of dynamic sampling and the sampler importance-sampling correction."""
    problems = []
    if cfg.rollout.dynamic_sampling and not _estimator(cfg).group_baseline:
        problems.append(("rollout.dynamic_sampling", (
            f"cannot be combined with algorithm.advantage_estimator {cfg.algorithm.advantage_estimator}: its "
            "advantages come from the critic, not from a group baseline, so a completion whose group rewards are "
            "all equal still has non-zero advantages and dropping it would only waste samples (and G may be 1); "
            "use an outcome estimator")))
    if cfg.rollout.dynamic_sampling and cfg.train.mode == "colocated" and cfg.train.deepspeed:
        problems.append(("rollout.dynamic_sampling", (
            "cannot be combined with train.deepspeed in colocated mode: each rank samples as many rounds as its "
            "own prompts need, and under ZeRO-3 every forward pass of the policy gathers parameters from all "
            "ranks (a collective), so ranks with different round counts would wait on each other forever; use "
            "train.mode decoupled (the samplers run the rounds) or drop train.deepspeed")))
    if cfg.loss.sampler_is_min is not None and cfg.loss.sampler_is_min >= cfg.loss.sampler_is_cap:
        problems.append(("loss.sampler_is_min", (
            f"{cfg.loss.sampler_is_min} must be below loss.sampler_is_cap ({cfg.loss.sampler_is_cap}): the weights "
            "are bounded to [sampler_is_min, sampler_is_cap]")))
    samples_from_policy = not engine_traits(cfg.rollout.engine).own_weights
    if cfg.loss.sampler_is_correction and cfg.train.mode == "colocated" and samples_from_policy:
        problems.append(("loss.sampler_is_correction", (
            f"is on with rollout.engine {cfg.rollout.engine} in colocated mode, where the trainer's own model "
            "samples: pi_sampler is pi_old, every weight would be exactly 1 and the correction would do nothing; "
            "it is for rollout.engine vllm or train.mode decoupled")))
    return problems


def encryption_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """decoupled.encrypt needs CURVE in libzmq and a transport that runs ZeroMQ's handshake. ipc:// does
    (encrypted, if redundant on one machine); inproc:// does not, so nothing would be encrypted."""
    if not cfg.decoupled.encrypt:
        return []
    problems = []
    if not zmq.has("curve"):
        problems.append(("decoupled.encrypt", (
            f"needs CURVE, which this libzmq ({zmq.zmq_version()}) was built without; install a pyzmq wheel "
            "(its bundled libzmq has CURVE) or set decoupled.encrypt: false")))
    if cfg.decoupled.address.startswith("inproc://"):
        problems.append(("decoupled.encrypt", (
            f"is true but decoupled.address is {cfg.decoupled.address}: inproc skips ZeroMQ's security "
            "handshake, so nothing would be encrypted; use tcp:// (or ipc://) or decoupled.encrypt: false")))
    return problems


def _estimator(cfg: "RunConfig"):
    return advantage_estimator(cfg.algorithm.advantage_estimator)


def ppo_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """The rules of an estimator with a critic (gae: PPO) and its keys."""
    estimator = _estimator(cfg)
    critic = estimator.needs_critic
    problems = []
    if cfg.rollout.num_generations == 1 and estimator.group_baseline:
        problems.append(("rollout.num_generations", (
            f"is 1 but algorithm.advantage_estimator is {cfg.algorithm.advantage_estimator!r}: a group of one "
            "is its own baseline, so every advantage would be 0; use G >= 2 or the gae estimator (a critic)")))
    if cfg.algorithm.kl_penalty == "reward" and not estimator.token_level:
        problems.append(("algorithm.kl_penalty", (
            "is 'reward' but algorithm.advantage_estimator is not gae: the per-token KL reward needs "
            "per-token advantages (a critic); use kl_penalty: loss")))
    if cfg.algorithm.kl_penalty == "reward" and cfg.loss.beta == 0:
        problems.append(("algorithm.kl_penalty", "is 'reward' but loss.beta is 0: there is no penalty to put "
                                                 "in the reward; set loss.beta > 0 (PPO's kl coefficient)"))
    if not critic and cfg.critic != type(cfg.critic)():
        problems.append(("critic", (
            "is set but algorithm.advantage_estimator is not gae: only PPO (gae) has a critic; set "
            "algorithm.advantage_estimator: gae or drop the critic keys")))
    if critic and cfg.train.mode == "decoupled":
        problems.append(("algorithm.advantage_estimator", (
            "gae (PPO) runs colocated only: the decoupled sampler has no critic to compute values with; "
            "use train.mode: colocated (N ranks with torchrun) or an outcome estimator")))
    if critic and cfg.train.deepspeed:
        problems.append(("train.deepspeed", (
            "cannot be combined with algorithm.advantage_estimator gae yet: the critic trains with torch "
            "AdamW (DDP on N ranks), not a DeepSpeed engine; drop train.deepspeed")))
    return problems


def sampling_control_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """The rules of rollout.repetition_penalty / min_new_tokens / min_p (``grpo.algorithm.processing``)."""
    r, problems = cfg.rollout, []
    controls = r.repetition_penalty != 1.0 or r.min_new_tokens > 0 or r.min_p > 0.0
    if r.min_new_tokens > r.max_completion_length:
        problems.append(("rollout.min_new_tokens", (
            f"{r.min_new_tokens} > rollout.max_completion_length {r.max_completion_length}: no completion could "
            "ever end with EOS, every one would be cut off")))
    uses_server = cfg.train.mode == "decoupled" and (cfg.decoupled.ref_server or cfg.decoupled.ref_server_url)
    if controls and cfg.loss.beta > 0 and uses_server:
        problems.append(("decoupled.ref_server", (
            "cannot serve rollout.repetition_penalty / min_new_tokens / min_p yet: its protocol carries only a "
            "temperature, so its reference log-probs would be of the unprocessed distribution while the policy's "
            "are of the processed one, and the KL would measure the controls, not the policy's drift; load the "
            "reference in the samplers (decoupled.ref_server: false, no ref_server_url) or turn the controls off")))
    return problems


def ptx_problems(cfg: "RunConfig") -> list[tuple[str, str]]:
    """The rule of the PTX loss: its keys mean something only with ptx.data (its own ranges are in the schema)."""
    if cfg.ptx.data is None and cfg.ptx != type(cfg.ptx)():
        return [("ptx", "keys are set but ptx.data is null: without prompt/response pairs there is no PTX "
                        "loss; set ptx.data to an SFT file or drop the ptx keys")]
    return []


def ptx_max_length(cfg: "RunConfig") -> int:
    """ptx.max_length, whose null default is the longest sequence of the RL update (data.max_prompt_length +
    rollout.max_completion_length): one cross-field default, read by the trainer and by ``grpo memory``."""
    return cfg.ptx.max_length or cfg.data.max_prompt_length + cfg.rollout.max_completion_length


# In the order the loader reports them: the first violated rule's key is the one located in the recipe.
RULES = (batch_problems, mini_batch_problems, loss_problems, loss_type_problems, routing_replay_problems,
         ppo_problems, ptx_problems, memory_saver_problems, fsdp_problems, token_budget_problems, lora_rate_problems, schedule_problems,
         reward_problems, tracker_problems, decoupled_problems, engine_problems, sampler_problems, encryption_problems,
         sampling_control_problems, eval_problems, sdpa_problems, *SPEED_RULES, task_problems, gold_problems)
