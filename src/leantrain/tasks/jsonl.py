"""`jsonl`: a user's own prompts and answers, scored by the user's own reward functions.

Each non-blank line of the file is a JSON object with string fields `prompt` and `answer`, an
optional string `solution` (a worked solution for warm-start) and any other fields, which go to
`Example.meta` and on to the reward functions. Every bad row is reported at once, by line number.

Reward functions are named "module:function" (importable from `sys.path`), as TRL takes
`reward_funcs`, optionally prefixed with the part they score: "format=my_rewards:has_format".
Each is called with keyword arguments `prompt`, `response`, `answer` and the row's extra fields
(all of them if it takes `**kwargs`, else those it names) and returns either a number, which
becomes its part ("answer" unless the prefix says otherwise), or a dict of parts such as
{"format": 1.0, "answer": 0.0}. Parts are the project's
`REWARD_PARTS`, so the usual `RewardWeights` apply; two functions may not score the same part.
Values must be finite numbers and are taken as they are (built-in tasks keep theirs in [0, 1]).
Without functions, the `answer` part is an exact match of the response's last line (stripped)
against the row's answer (stripped).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leantrain.errors import LeantrainError
from leantrain.tasks.base import REWARD_PARTS, Example, Task, check_parts

RewardFunction = Callable[..., Any]


@dataclass(frozen=True)
class _Scorer:
    """A resolved reward function, the part a number it returns goes to, and the keyword
    arguments it takes (None: any, it has **kwargs or its signature is unknown)."""

    spec: str
    part: str
    fn: RewardFunction
    takes: frozenset[str] | None

    def __call__(self, **kwargs: Any) -> Any:
        if self.takes is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self.takes}
        return self.fn(**kwargs)


@dataclass
class JsonlTask(Task):
    """Prompts and answers from a JSONL file, scored by user reward functions.

    Attributes:
        path: the JSONL file.
        reward_funcs: "[part=]module:function" names; empty means exact match on the last line.
        name: the task's name in logs.
        rows: the examples in file order (for deterministic iteration; `sample` draws from them).
    """

    path: Path
    reward_funcs: tuple[str, ...] = ()
    name: str = "jsonl"
    rows: tuple[Example, ...] = field(init=False, repr=False)
    _scorers: tuple[_Scorer, ...] = field(init=False, repr=False)
    unseen_per_seed = False  # every draw comes from the file's rows

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self.rows = load_rows(self.path)
        self._scorers = tuple(_resolve(spec) for spec in self.reward_funcs)
        parts = [s.part for s in self._scorers]
        doubled = sorted({p for p in parts if parts.count(p) > 1})
        if doubled:
            raise LeantrainError(
                f"reward_funcs: more than one function scores part(s) {doubled}; "
                f"name parts as part=module:function, one of {REWARD_PARTS}"
            )
        # What a failed scoring zeroes; a dict-returning function may add parts beyond these.
        self.parts = tuple(parts) or ("answer",)

    def sample(self, rng: random.Random) -> Example:
        return rng.choice(self.rows)

    def score(self, example: Example, response: str) -> dict[str, float]:
        if not self._scorers:
            lines = response.strip().splitlines() or [""]
            return {"answer": float(lines[-1].strip() == example.answer.strip())}
        parts: dict[str, float] = {}
        for scorer in self._scorers:
            out = scorer(
                prompt=example.prompt, response=response, answer=example.answer, **example.meta
            )
            got = check_parts(out if isinstance(out, Mapping) else {scorer.part: out}, scorer.spec)
            clash = sorted(set(got) & set(parts))
            if clash:
                raise ValueError(f"{scorer.spec} scored part(s) {clash}, already scored")
            parts.update(got)
        return parts


def load_rows(path: Path) -> tuple[Example, ...]:
    """Read and check every row of a JSONL file; one LeantrainError lists all bad lines."""
    try:
        raw_lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise LeantrainError(f"cannot read task file {path}: {exc.strerror or exc}") from exc
    rows, bad = [], []
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        try:
            rows.append(_row(raw))
        except ValueError as exc:
            bad.append(f"line {number}: {exc}")
    if bad:
        raise LeantrainError(f"{path}: {len(bad)} bad row(s): " + "; ".join(bad))
    if not rows:
        raise LeantrainError(f"{path}: no rows; expected one JSON object per line")
    return tuple(rows)


def json_object(raw: bytes | str) -> dict[str, Any]:
    """One JSONL line as a JSON object, or a ValueError saying what is wrong with it. Every
    reader of user JSONL (tasks, `zo --data`, `tune --data`, `value --data`) decodes through
    here, so a bad line is reported the same way everywhere."""
    try:
        obj = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except UnicodeDecodeError as exc:
        raise ValueError("not UTF-8") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def field_problems(
    obj: dict[str, Any], required: tuple[str, ...], strings: tuple[str, ...]
) -> list[str]:
    """What is wrong with `obj`'s fields: each `required` key missing, each of `strings` present
    but not a string."""
    problems = [f"missing field {key!r}" for key in required if key not in obj]
    problems += [
        f"field {key!r} must be a string, got {type(obj[key]).__name__}"
        for key in strings
        if key in obj and not isinstance(obj[key], str)
    ]
    return problems


def _row(raw: bytes) -> Example:
    """One line as an Example, or a ValueError saying what is wrong with it."""
    obj = json_object(raw)
    problems = field_problems(obj, ("prompt", "answer"), ("prompt", "answer", "solution"))
    if "response" in obj:  # reward functions get the policy's response under this name
        problems.append("field 'response' is reserved for the policy's response; rename it")
    if problems:
        raise ValueError(", ".join(problems))
    meta = {k: v for k, v in obj.items() if k not in ("prompt", "answer", "solution")}
    return Example(
        prompt=obj["prompt"], answer=obj["answer"], solution=obj.get("solution"), meta=meta
    )


def _resolve(spec: str) -> _Scorer:
    """Import "[part=]module:function", or a LeantrainError naming the spec."""
    part, _, target = spec.rpartition("=")
    part = part.strip() or "answer"
    module_name, _, attr = target.strip().partition(":")
    if part not in REWARD_PARTS:
        raise LeantrainError(
            f"reward function {spec!r}: part {part!r} is not one of {REWARD_PARTS}"
        )
    if not module_name or not attr:
        raise LeantrainError(f"reward function {spec!r}: expected [part=]module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an ImportError, or anything the module raises while importing
        raise LeantrainError(
            f"reward function {spec!r}: cannot import {module_name!r} "
            f"({type(exc).__name__}: {exc}); is it on PYTHONPATH?"
        ) from exc
    try:
        fn = functools.reduce(getattr, attr.split("."), module)
    except AttributeError as exc:
        raise LeantrainError(f"reward function {spec!r}: {module_name} has no {attr!r}") from exc
    if not callable(fn):
        raise LeantrainError(f"reward function {spec!r}: {attr!r} is not callable")
    return _Scorer(spec, part, fn, _keywords(fn))


def _keywords(fn: RewardFunction) -> frozenset[str] | None:
    """Names `fn` takes as keywords; None if it takes any (**kwargs) or cannot be inspected."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
