"""verifiers environments (``pip install 'grpo[envs]'``; ``verifiers.v1``) as a grpo data source: the
environment's taskset gives the prompts, one ``Example`` per task; its harness plays the episodes
(``grpo.multiturn.verifiers_rollout``).

Source string (``data.train``, ``data.eval``), after the ``verifiers:`` prefix::

    TASKSET_ID[,env=ENV_ID][,harness=HARNESS_ID][,limit=N][,max_tokens=N][,concurrency=N][,timeout_s=S]
              [,renderer=NAME[,renderer.KEY=VALUE...]]

``TASKSET_ID`` is what ``vf.load_environment`` takes as ``--env.taskset.id``: an installed module (or package)
exporting its ``vf.Taskset`` subclass in ``__all__`` (and, optionally, the ``vf.Harness`` that plays it and an
``vf.Env``). ``env=`` pairs another ``Env`` with the taskset, ``harness=`` pins the agent's harness (default:
the taskset's own, else verifiers' ``bash``), ``limit=`` keeps the first N tasks (an infinite taskset needs
it), ``max_tokens=`` caps each model reply (verifiers' sampling setting: its ``TrainClient`` sends it, not the
agent program's own request; the run's ``rollout.max_completion_length`` bounds the whole episode),
``concurrency=`` bounds the episodes in flight at once (default 8), ``timeout_s=`` each episode's seconds (default
600; one running longer is a zero reward with a counted warning). ``renderer=`` names the ``renderers`` renderer verifiers' ``TrainClient`` renders prompts with (default:
the one its model maps to, else the chat template's, which cannot bridge a turn: ``qwen3``, ``llama3``... do),
``renderer.KEY=VALUE`` sets its config's fields (``renderer.thinking_retention=all``). The agents run in verifiers' local ``subprocess`` runtime: environments that need containers, sandboxes
or a tunnel are not supported. As with ``synthetic:``, the split is ignored.

Each Example keeps its task's index (column ``verifiers_task``); ``environment(spec)`` is the loaded
environment, built once per source string (``lru_cache``): the data and the rollouts then share one object.
"""

from __future__ import annotations

import functools
import pkgutil
from dataclasses import dataclass
from typing import Any

from grpo.data.example import DataError, Example

INSTALL_HINT = "verifiers is not installed: pip install 'grpo[envs]' (or pip install verifiers==0.4.0)"
PREFIX = "verifiers"
KEYS = ("env", "harness", "limit", "max_tokens", "concurrency", "timeout_s", "renderer")
RENDERER_PREFIX = "renderer."
TASK_COLUMN = "verifiers_task"


def require_verifiers():
    """The ``verifiers.v1`` module, or a DataError naming the extra that installs it."""
    try:
        import verifiers.v1 as vf  # optional extra (grpo[envs])
    except ImportError as error:
        if error.name not in ("verifiers", "verifiers.v1", None):  # installed, but something it needs is broken
            raise
        raise DataError(INSTALL_HINT) from None
    return vf


@dataclass(frozen=True)
class VfSpec:
    """A parsed ``verifiers:`` source."""

    taskset: str
    env: str = ""
    harness: str | None = None
    limit: int | None = None
    max_tokens: int | None = None
    concurrency: int = 8  # episodes in flight at once
    timeout_s: float = 600.0  # one episode's bound
    renderer: tuple[tuple[str, str], ...] = ()  # the renderer config's fields ("name", ...), as given


def parse_spec(spec: str, option_text: str) -> VfSpec:
    """``option_text`` (after ``verifiers:``) as a ``VfSpec``; a DataError quoting ``spec`` says what is wrong."""
    head, *items = [item.strip() for item in option_text.split(",")]
    if not head or "=" in head:
        raise DataError(f"data source {spec!r}: starts with a verifiers taskset id "
                        f"(form: {PREFIX}:TASKSET_ID[,env=ENV_ID][,harness=HARNESS_ID][,limit=N])")
    options: dict[str, Any] = {}
    renderer: dict[str, str] = {}
    for item in items:
        key, equals, value = (piece.strip() for piece in item.partition("="))
        field = "name" if key == "renderer" else key.removeprefix(RENDERER_PREFIX) if key.startswith(
            RENDERER_PREFIX) else None
        if not equals or (key not in KEYS and field is None) or not value or field == "":
            raise DataError(f"data source {spec!r}: expected one of {list(KEYS)} or {RENDERER_PREFIX}KEY as "
                            f"key=value, got {item!r}")
        if key in options or field in renderer:
            raise DataError(f"data source {spec!r}: key {key!r} given twice")
        if field is not None:
            renderer[field] = value
        else:
            options[key] = value
    if renderer and "name" not in renderer:
        raise DataError(f"data source {spec!r}: {RENDERER_PREFIX}KEY options need renderer=NAME")
    for key in ("limit", "max_tokens", "concurrency", "timeout_s"):
        if key not in options:
            continue
        kind = float if key == "timeout_s" else int
        try:
            options[key] = kind(options[key])
        except ValueError:
            raise DataError(f"data source {spec!r}: {key} must be {'a number' if kind is float else 'an integer'}, "
                            f"got {options[key]!r}") from None
        if options[key] <= 0 or (kind is int and options[key] < 1):
            raise DataError(f"data source {spec!r}: {key} must be {'positive' if kind is float else 'at least 1'}")
    return VfSpec(head, **options, renderer=tuple(renderer.items()))


def known_ids() -> dict[str, list[str]]:
    """The taskset, environment and harness ids verifiers ships; any installed module is accepted too."""
    from verifiers.v1 import envs, harnesses, tasksets  # optional extra (grpo[envs])

    return {kind: sorted(m.name for m in pkgutil.iter_modules(package.__path__))
            for kind, package in (("tasksets", tasksets), ("environments", envs), ("harnesses", harnesses))}


def is_verifiers_environment(value: Any) -> bool:
    """Whether ``value`` is a verifiers ``Env`` object (checked without importing verifiers)."""
    return any(cls.__module__.startswith("verifiers.") and cls.__name__ == "Env" for cls in type(value).__mro__)


def given_environment(env: Any, registry: dict[str, Any]) -> str:
    """The ``verifiers:`` source string that names ``env`` (an object the Python API was handed), put in
    ``registry`` (``GIVEN``) so that ``environment`` returns it instead of loading one."""
    spec = f"{PREFIX}:{env.config.env_id}"
    if registry.get(spec, env) is not env:
        raise ValueError(f"two different verifiers environments of taskset {env.config.env_id!r} in one process")
    registry[spec] = env
    return spec


GIVEN: dict[str, Any] = {}  # environments handed over as objects (given_environment), by their source string


def environment(spec: str) -> Any:
    """The ``vf.Env`` a ``verifiers:`` source names: a given one, else loaded once; an unknown id lists the
    known ones."""
    return GIVEN[spec] if spec in GIVEN else _load_environment(spec)


@functools.lru_cache(maxsize=None)
def _load_environment(spec: str) -> Any:
    _, _, option_text = spec.partition(":")
    parsed = parse_spec(spec, option_text)
    require_verifiers()
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config  # optional extra (grpo[envs])

    agent: dict[str, Any] = {"runtime": {"type": "subprocess"}}  # local only: no container, sandbox or tunnel
    if parsed.harness:
        agent["harness"] = {"id": parsed.harness}
    try:
        config = resolve_env_config({"id": parsed.env, "taskset": {"id": parsed.taskset}, "agent": agent})
        return load_environment(config)
    except ModuleNotFoundError as error:
        known = "; ".join(f"{kind}: {names}" for kind, names in known_ids().items())
        raise DataError(f"data source {spec!r}: {error}; verifiers' own {known} (any installed module exporting "
                        "its vf.Taskset / vf.Env / vf.Harness subclass in __all__ works too)") from None
    except (TypeError, ValueError, AttributeError) as error:
        raise DataError(f"data source {spec!r}: verifiers refused the environment: {error}") from None


@functools.lru_cache(maxsize=None)
def environment_tasks(spec: str, limit: int | None) -> list[Any]:
    """The first ``limit`` (else all) tasks of the environment's taskset, read once (the rollouts look the
    Examples' tasks up here); an infinite one without a limit is a DataError."""
    env = environment(spec)
    taskset = env.taskset if limit is None else env.taskset.take(limit)
    if not taskset.bounded:
        raise DataError(f"data source {spec!r}: the taskset is infinite; bound it with limit=N")
    return list(taskset)


def task_examples(tasks: list[Any], source: str) -> list[Example]:
    """One Example per task: its prompt as chat messages (its system prompt as the row's own), its index in
    column ``verifiers_task``. A task without a prompt (the user opens) has none to show: a DataError."""
    examples = []
    for index, task in enumerate(tasks):
        data, where = task.data, f"{source}#{index}"
        if data.prompt is None:
            raise DataError(f"{where}: the task has no prompt (an environment whose user opens the conversation "
                            "is not supported)")
        messages = ([{"role": "user", "content": data.prompt}] if isinstance(data.prompt, str)
                    else [{"role": m.role, "content": m.content} for m in data.prompt if m.role != "system"])
        row = {TASK_COLUMN: index, "question": messages[-1]["content"], "source": where}
        examples.append(Example(messages, None, None, where, system=data.system_prompt, row=row))
    return examples


def load_verifiers(spec: str, option_text: str, limit: int | None = None) -> list[Example]:
    """The Examples of a ``verifiers:`` source string (module docstring); ``limit`` is data.*_limit."""
    tasks = environment_tasks(spec, parse_spec(spec, option_text).limit)  # indices as the rollouts read them
    return task_examples(tasks if limit is None else tasks[:limit], spec)
