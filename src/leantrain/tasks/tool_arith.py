"""`tool_arith`: multi-digit arithmetic that needs the Python tool, solved over several turns.

    prompt:  "calc 4821*93+1203\\n"
    episode: "<python>\\nprint(4821*93+1203)\\n</python>"   model turn 1, ends on the tool stop
             "\\n<output>\\n449556\\n</output>\\n"           environment: the sandbox's stdout
             "answer: 449556"                               model turn 2, then EOS

The model calls the tool by closing a `<python>` block; the episode runner (rl/episodes.py) stops
the turn at `</python>`, this task runs the code in the sandbox (`call_tool`) and the runner
appends the result as environment tokens. A crash, a timeout or a malformed call comes back as an
`<error>` block the model can read; nothing here raises for bad model output.

Parts: `format` is 1 for one or more tool calls each followed by its result, then `answer: N`;
`answer` is 1 when the last `answer:` is right; `tool` is 1 when some tool call really ran in the
sandbox, exited cleanly and printed something. The model cannot forge that result: its turn ends
the moment it writes `</python>`, so `</python>` directly followed by `<output>` only ever comes
from the environment.

Knows nothing about tokens or models: it sees turn text and returns text.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Literal

from leantrain.errors import LeantrainError
from leantrain.tasks.base import Example, Task
from leantrain.tasks.sandbox import run_python

TOOL_OPEN = "<python>"
TOOL_STOP = "</python>"  # the stop string that ends a model turn with a tool call
# How an episode transcript is read (here and by every task built on this tool protocol).
ANSWER = re.compile(r"answer:\s*(-?\d+)")
EPISODE_FORMAT = re.compile(
    r"(?:<python>\n.+?\n</python>\n<(output|error)>\n.*?\n</\1>\n)+answer: -?\d+", re.DOTALL
)
# The stdout of each tool call that ran cleanly (only the environment writes `</python>\n<output>`).
TOOL_OUTPUT = re.compile(re.escape(TOOL_STOP) + r"\n<output>\n(.*?)\n</output>", re.DOTALL)

ToolOutcome = Literal["ok", "error", "timeout", "malformed"]


def reply_text(output: str) -> str:
    """The environment's tokens after a tool call, as text, for a model without a chat template:
    the reply on lines of its own, so the model's next turn starts on a fresh line."""
    return f"\n{output}\n"


def worked_turns(expression: str, answer: str) -> list[tuple[str, bool]]:
    """A solved episode as (text, written by the model) pieces in order: the tool call, the
    environment's reply, the answer line. Joined, they are the example's `solution`; split, they
    say which tokens a warm start trains on (the model's) and which it only reads (the reply)."""
    return [
        (f"{TOOL_OPEN}\nprint({expression})\n{TOOL_STOP}", True),
        (reply_text(f"<output>\n{answer}\n</output>"), False),
        (f"answer: {answer}", True),
    ]


@dataclass(frozen=True)
class ToolCall:
    """One tool call of an episode and what the environment answered.

    Attributes:
        code: the program between `<python>` and `</python>`, or None when there was none.
        outcome: "ok" (ran and exited 0), "error" (raised or exited non-zero, or printed past
            the output limit), "timeout" (killed at the deadline), "malformed" (no program).
        output: the environment's reply shown to the model, e.g. "<output>\\n42\\n</output>".
    """

    code: str | None
    outcome: ToolOutcome
    output: str


@dataclass
class ToolArithTask(Task):
    """Evaluate an integer expression of 2-3 multi-digit numbers with the Python tool.

    Attributes:
        min_digits: fewest digits of a number.
        max_digits: most digits of a number.
        max_terms: numbers per expression (2..max_terms).
        max_turns: model turns per episode; an episode still calling the tool after the last one
            ends with finish reason "max_turns".
        episode_tokens: token budget of an episode after its prompt: generated plus environment
            tokens over all turns (finish reason "budget" when it runs out).
        timeout_s: sandbox wall-clock limit per tool call, from when its code begins.
        max_output_chars: the tool's stdout/stderr shown to the model is cut to this many chars.
    """

    min_digits: int = 2
    max_digits: int = 4
    max_terms: int = 3
    max_turns: int = 3
    episode_tokens: int = 256
    timeout_s: float = 2.0
    max_output_chars: int = 200
    name: str = "tool_arith"
    parts = ("format", "answer", "tool")
    multi_turn = True  # rollouts of this task are episodes (rl/episodes.py)
    tool_stop = TOOL_STOP

    def __post_init__(self) -> None:
        checks = {
            "min_digits": 1 <= self.min_digits <= self.max_digits,
            "max_terms": self.max_terms >= 2,
            "max_turns": self.max_turns >= 1,
            "episode_tokens": self.episode_tokens >= 1,
            "timeout_s": self.timeout_s > 0,
            "max_output_chars": self.max_output_chars >= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise LeantrainError(
                f"tool_arith: invalid {bad[0]}={getattr(self, bad[0])!r} (need 1 <= min_digits "
                "<= max_digits, max_terms >= 2, max_turns >= 1, episode_tokens >= 1, "
                "timeout_s > 0, max_output_chars >= 1)"
            )

    def sample(self, rng: random.Random) -> Example:
        numbers = [
            rng.randint(10 ** (digits - 1), 10**digits - 1)
            for digits in (
                rng.randint(self.min_digits, self.max_digits)
                for _ in range(rng.randint(2, self.max_terms))
            )
        ]
        expression = str(numbers[0])
        for x in numbers[1:]:
            expression += rng.choice("+-*") + str(x)
        answer = str(eval(expression))  # digits and + - * only, built just above
        return Example(
            prompt=f"calc {expression}\n",
            answer=answer,
            solution="".join(text for text, _ in worked_turns(expression, answer)),
            meta={"expression": expression},
        )

    def call_tool(self, turn_text: str) -> ToolCall:
        """Run the tool call that ends `turn_text` (a model turn that stopped on `</python>`)."""
        head, _, _ = turn_text.rpartition(TOOL_STOP)
        start = head.rfind(TOOL_OPEN)
        code = head[start + len(TOOL_OPEN) :].strip("\n") if start >= 0 else ""
        if not code.strip():
            return ToolCall(
                None,
                "malformed",
                "<error>\nmalformed tool call: write <python>code</python>\n</error>",
            )
        run = run_python(code, timeout_s=self.timeout_s)
        if run.timed_out:
            return ToolCall(
                code, "timeout", f"<error>\ntimeout after {self.timeout_s:g} s\n</error>"
            )
        if not run.ok:
            lines = (run.stderr.strip() or f"exit status {run.returncode}").splitlines()
            message = lines[-1] if not run.truncated else "output limit exceeded"
            return ToolCall(code, "error", f"<error>\n{self._cut(message)}\n</error>")
        return ToolCall(code, "ok", f"<output>\n{self._cut(run.stdout.strip())}\n</output>")

    def _cut(self, text: str) -> str:
        return text[: self.max_output_chars]

    def score(self, example: Example, response: str) -> dict[str, float]:
        """`response` is the episode's transcript: model turns with the environment's replies."""
        text = response.strip()
        found = ANSWER.findall(text)
        return {
            "format": float(EPISODE_FORMAT.fullmatch(text) is not None),
            "answer": float(bool(found) and found[-1] == example.answer),
            "tool": float(any(TOOL_OUTPUT.findall(text))),  # ran cleanly and printed something
        }
