"""Reward functions: the result type, the registry, and user functions by import path.

A reward function scores one response against its row's ground truth::

    fn(response: str, ground_truth: Any, *, prompt: str) -> RewardResult | float

``response`` is the generated text only (not the prompt); ``prompt`` is the rendered
prompt the model saw (K&K uses it to know whether ``<think>`` was pre-filled). A function
that has no ``prompt`` parameter (and no ``**kwargs``) is called as ``fn(response,
ground_truth)``, so the simplest user reward is a two-argument function returning a float.

Names resolve in one of two ways (:func:`get_reward`):

- a registered name: ``@register_reward("name")`` adds to :data:`REWARDS` (a
  :class:`~megatron_rl.config.lib.Registry`); built-ins (``kk_logic``, ``math``,
  ``toy_copy``) register through the same decorator from their task modules in
  :mod:`megatron_rl.tasks`, so they are registered once ``megatron_rl.tasks`` is imported
  (this package never imports it). A second registration raises, and an unknown name
  raises :class:`UnknownRewardError` listing the registered ones;
- ``package.module:function``: imported by path; the function must be declared a reward,
  decorated with :func:`reward` (or :func:`register_reward`), unless its module is one
  the config trusts (``data.reward_modules``); :class:`RewardLoadError` names the spec
  when the import fails, the attribute is missing or not callable, or it is not declared.

Every function has a ``failure_score``: what a sample scores when the function raised,
timed out, or returned something that is not a finite number (see :func:`call_reward`).
It is the registration's ``failure_score`` argument, or for ``module:function`` the
function's ``failure_score`` attribute if it has one, else 0.0. Likewise ``success_score``
(default 1.0): a response scoring at least this counts as correct in accuracy metrics.

Model output is data, never code: nothing here (or in the built-in rewards) calls
``eval``/``exec`` on a response, and a response is only ever passed to a function that
was declared a reward. Importable callables that would run it (``builtins:eval``,
``cProfile:run``, ``pdb:run``, ``timeit:timeit``, ...) are countless, so a list of
refused ones cannot be complete: declaring is what admits a function. Functions of
Python's ``builtins`` and of modules that run commands or code (:data:`REFUSED_MODULES`)
are refused even from a trusted module. The config itself is trusted input: naming a
module imports it (its top-level code runs), as naming a Python file to run would.
"""

from __future__ import annotations

import builtins
import dataclasses
import importlib
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.config.lib import Registry, UnknownNameError

# How much of an exception message is kept in a RewardResult (responses can be long,
# and an exception message may quote the whole response).
_MAX_ERROR_CHARS = 500

REFUSED_MODULES = frozenset(
    {"builtins", "os", "posix", "nt", "subprocess", "pty", "sys", "code", "codeop", "runpy", "importlib", "pickle",
     "marshal", "ctypes", "shutil", "multiprocessing"}
)  # fmt: skip
"""Modules (and their submodules) a ``module:function`` reward may not come from: none holds
a reward, and some functions there would run the response as code or as a command."""

REWARD_MARK = "__megatron_rl_reward__"
"""The attribute :func:`reward` and :func:`register_reward` set on a function declared a reward."""


@dataclass(kw_only=True, frozen=True)
class RewardResult:
    """The score of one response, with why it is what it is."""

    score: float
    """The reward (finite)."""

    parse_failed: bool = False
    """The answer could not be extracted or parsed (also set for exceptions and time-outs,
    which score ``failure_score``)."""

    timed_out: bool = False
    """Scoring ran past its time limit (the sample scores ``failure_score``)."""

    error: str | None = None
    """``"ExceptionType: message"`` when the function raised or misbehaved, else ``None``."""

    extras: dict[str, Any] = field(default_factory=dict)
    """Function-specific details for diagnostics (e.g. ``format_ok`` for K&K)."""


class UnknownRewardError(UnknownNameError):
    """Raised for a name no reward is registered under; lists the registered ones."""


class RewardLoadError(ValueError):
    """A ``module:function`` reward spec that cannot be loaded; the message names the spec."""


@dataclass(kw_only=True, frozen=True)
class RewardFunction:
    """A resolved reward: the callable plus how to call it and what a failure scores.

    Picklable by reference when ``fn`` is a module-level function, which is what lets
    :class:`~megatron_rl.rewards.pool.RewardPool` run it in a worker process.
    """

    name: str
    """The registered name or the ``module:function`` spec it was loaded from."""

    fn: Callable[..., Any]
    """The user-visible function."""

    failure_score: float = 0.0
    """Score of a sample whose scoring raised, timed out or returned a non-number."""

    success_score: float = 1.0
    """A response scoring at least this counts as correct in accuracy metrics (3 for
    ``kk_logic``: format and every role right)."""

    accepts_prompt: bool = True
    """Whether ``fn`` takes the ``prompt`` keyword (decided once, from its signature)."""

    def __call__(self, response: str, ground_truth: Any, *, prompt: str = "") -> Any:
        """Call the function with the arguments it accepts; no error handling (see :func:`call_reward`)."""
        if self.accepts_prompt:
            return self.fn(response, ground_truth, prompt=prompt)
        return self.fn(response, ground_truth)


REWARDS: Registry[RewardFunction] = Registry(
    "reward", unknown_error=UnknownRewardError, unknown_hint="(or give a user function as 'package.module:function')"
)
"""Registered reward functions by name (filled by :func:`register_reward`)."""


def _accepts_prompt(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` takes ``prompt=``; raise unless it takes (response, ground_truth)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature; assume the minimal form
        return False
    accepts = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()) or (
        "prompt" in sig.parameters and sig.parameters["prompt"].kind is not inspect.Parameter.POSITIONAL_ONLY
    )
    try:
        sig.bind("response", "ground_truth", **({"prompt": ""} if accepts else {}))
    except TypeError:
        raise RewardLoadError(
            f"reward {name!r}: {fn!r} must accept (response, ground_truth[, prompt=...]); signature is {sig}"
        ) from None
    return accepts


def register_reward(
    name: str, *, failure_score: float = 0.0, success_score: float = 1.0
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering a reward function under ``name``; a second registration raises.

    Example::

        @register_reward("exact_match")
        def exact_match(response, ground_truth):
            return float(response.strip() == ground_truth)
    """
    if not name or ":" in name:
        raise ValueError(f"reward name {name!r} must be non-empty and contain no ':' (that marks 'module:function')")
    if not math.isfinite(failure_score):
        raise ValueError(f"reward {name!r}: failure_score must be finite, got {failure_score!r}")

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        _mark(fn)
        REWARDS.register(
            name,
            RewardFunction(
                name=name,
                fn=fn,
                failure_score=float(failure_score),
                success_score=float(success_score),
                accepts_prompt=_accepts_prompt(fn, name),
            ),
        )
        return fn

    return wrap


def _mark(fn: Callable[..., Any]) -> None:
    try:
        setattr(fn, REWARD_MARK, True)
    except (AttributeError, TypeError):  # a builtin or a bound method: not a reward of ours to declare
        raise TypeError(f"{fn!r} cannot be declared a reward; write a Python function") from None


def reward(fn: Callable[..., Any] | None = None, *, failure_score: float | None = None,
           success_score: float | None = None):  # fmt: skip
    """Declare ``fn`` a reward function, usable as ``data.task: package.module:fn`` (without
    registering a name). ``failure_score`` / ``success_score`` set its scores (else its
    attributes of those names, or 0.0 / 1.0). Usable bare (``@reward``) or with arguments::

        @reward(failure_score=-1.0)
        def exact_match(response, ground_truth):
            return float(response.strip() == ground_truth)
    """

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        _mark(fn)
        for key, value in (("failure_score", failure_score), ("success_score", success_score)):
            if value is not None:
                setattr(fn, key, value)
        return fn

    return wrap(fn) if fn is not None else wrap


def _in_modules(module_name: str, modules: Sequence[str]) -> bool:
    return any(module_name == m or module_name.startswith(m + ".") for m in modules)


def registered_rewards() -> list[str]:
    """Names of all registered reward functions, sorted."""
    return REWARDS.names()


def import_by_path(spec: str) -> Any:
    """The object a ``package.module:attr`` spec names (``attr`` may be dotted, for
    ``module:Class.method``).

    Raises:
        RewardLoadError: naming the spec, when it is malformed, the module does not import,
            or the attribute is missing.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or ":" in attr:
        raise RewardLoadError(f"reward {spec!r}: a user reward is written 'package.module:function'")
    if module_name.partition(".")[0] in REFUSED_MODULES:
        raise RewardLoadError(
            f"reward {spec!r}: functions of {module_name!r} are refused (they could run model output as code "
            "or commands); write a reward function in a module of your own"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import-time failure of user code is the user's to see
        raise RewardLoadError(f"reward {spec!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from e
    obj: Any = module
    for part in attr.split("."):  # allow 'module:Class.method' for static/class methods
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RewardLoadError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


def reward_from_callable(spec: str, obj: Any, *, trusted_modules: Sequence[str] = ()) -> RewardFunction:
    """The :class:`RewardFunction` of user object ``obj`` loaded from ``spec``: its
    ``failure_score`` / ``success_score`` attributes if set (else 0.0 / 1.0), called with
    the arguments its signature takes. ``obj`` must be declared a reward (:func:`reward`,
    :func:`register_reward`) unless ``spec``'s module is in ``trusted_modules`` (a module
    or package name; ``data.reward_modules``).

    Raises:
        RewardLoadError: naming the spec, when ``obj`` is not callable or not declared a
            reward, a score attribute is not a finite number, or the signature cannot take
            ``(response, ground_truth)``.
    """
    module_name, _, attr = spec.partition(":")
    if not callable(obj):
        raise RewardLoadError(f"reward {spec!r}: {attr!r} is not callable (it is a {type(obj).__name__})")
    if getattr(obj, "__module__", None) in REFUSED_MODULES or getattr(obj, "__self__", None) is builtins:
        # e.g. ``mymodule:ev`` after ``ev = eval`` in mymodule
        raise RewardLoadError(
            f"reward {spec!r}: it is Python's {getattr(obj, '__name__', obj)!r}, which is refused as a reward"
        )
    if not (getattr(obj, REWARD_MARK, False) is True or _in_modules(module_name, trusted_modules)):
        raise RewardLoadError(
            f"reward {spec!r}: {attr!r} is not declared a reward, so model output is not passed to it; decorate "
            "it with @megatron_rl.rewards.reward (or register_reward), or name its module in data.reward_modules"
        )
    failure_score = getattr(obj, "failure_score", 0.0)
    if not isinstance(failure_score, (int, float)) or not math.isfinite(failure_score):
        raise RewardLoadError(f"reward {spec!r}: its failure_score attribute must be a finite number")
    success_score = getattr(obj, "success_score", 1.0)
    if not isinstance(success_score, (int, float)) or not math.isfinite(success_score):
        raise RewardLoadError(f"reward {spec!r}: its success_score attribute must be a finite number")
    return RewardFunction(
        name=spec,
        fn=obj,
        failure_score=float(failure_score),
        success_score=float(success_score),
        accepts_prompt=_accepts_prompt(obj, spec),
    )


def get_reward(name: str, *, trusted_modules: Sequence[str] = ()) -> RewardFunction:
    """Resolve a registered name or a ``module:function`` spec (declared a reward, or from
    one of ``trusted_modules``: :func:`reward_from_callable`).

    The built-in names are registered once :mod:`megatron_rl.tasks` is imported (which
    also re-exports this function, for callers that want them loaded).

    Raises:
        UnknownRewardError: no reward is registered under ``name`` (lists the registered ones).
        RewardLoadError: a ``module:function`` spec that cannot be imported or is not callable.
    """
    if ":" in name:
        return reward_from_callable(name, import_by_path(name), trusted_modules=trusted_modules)
    return REWARDS.get(name)


def as_reward(obj: RewardFunction | str | Callable[..., Any]) -> RewardFunction:
    """A :class:`RewardFunction` from a resolved one, a name/``module:function`` spec, or a
    plain function (named ``module:qualname``, ``failure_score`` attribute or 0.0)."""
    if isinstance(obj, RewardFunction):
        return obj
    if isinstance(obj, str):
        return get_reward(obj)
    if callable(obj):
        name = f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"
        failure_score = getattr(obj, "failure_score", 0.0)
        return RewardFunction(
            name=name, fn=obj, failure_score=float(failure_score), accepts_prompt=_accepts_prompt(obj, name)
        )
    raise TypeError(f"expected a reward name, 'module:function' spec or callable, got {type(obj).__name__}")


def _failure(fn: RewardFunction, error: str, **flags: bool) -> RewardResult:
    return RewardResult(score=fn.failure_score, parse_failed=True, error=error[:_MAX_ERROR_CHARS], **flags)


def timeout_result(fn: RewardFunction, timeout_s: float) -> RewardResult:
    """The result of a sample whose scoring ran past ``timeout_s`` seconds."""
    return _failure(fn, f"TimeoutError: scoring took longer than {timeout_s:g} s", timed_out=True)


def crash_result(fn: RewardFunction, error: str) -> RewardResult:
    """The result of a sample whose scoring raised or whose worker died (``error`` says how)."""
    return _failure(fn, error)


def normalize_result(fn: RewardFunction, value: Any) -> RewardResult:
    """A function's return value as a :class:`RewardResult`; a non-number or non-finite score
    becomes a failure (so a bad reward can never put NaN into the advantages)."""
    score = value.score if isinstance(value, RewardResult) else value
    if not isinstance(score, (bool, int, float)):  # bool: a pass/fail reward may return True/False
        return crash_result(
            fn, f"TypeError: reward {fn.name!r} returned a {type(score).__name__}; expected a number or RewardResult"
        )
    if not math.isfinite(score):
        return crash_result(fn, f"ValueError: reward {fn.name!r} returned a non-finite score {score!r}")
    if isinstance(value, RewardResult):
        return value if type(score) is float else dataclasses.replace(value, score=float(score))
    return RewardResult(score=float(score))


def call_reward(fn: RewardFunction, response: str, ground_truth: Any, *, prompt: str = "") -> RewardResult:
    """Score one response; never raises for a failure of ``fn`` (it scores ``failure_score``).

    An exception becomes a result with ``error`` set and ``parse_failed`` True. No time
    limit applies here: :class:`~megatron_rl.rewards.pool.RewardPool` adds one by running
    this in a worker process it can kill.
    """
    try:
        value = fn(response, ground_truth, prompt=prompt)
    except Exception as e:  # a reward function's bug must not crash the trainer
        return crash_result(fn, f"{type(e).__name__}: {e}")
    return normalize_result(fn, value)
