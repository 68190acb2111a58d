"""`visual`: numbers read from a rendered image, added up with the Python tool (Visual-ARFT's
agentic coding setting, sized for the built-in tiny VLM).

    image:   a 64x64 receipt, one glyph per 8x8 cell     prompt: "<image>total?\\n"
             RECEIPT
             AB   12
             KW    7
    episode: "<python>\\nprint(12+7)\\n</python>"       model turn 1, ends on the tool stop
             "\\n<output>\\n19\\n</output>\\n"          environment: the sandbox's stdout
             "answer: 19"                               model turn 2, then EOS

Four styles. In-domain (styles to train on): `receipt` (a header, then item lines with their
prices) and `table` (a header, then rows of one to three space-separated numbers), both black
ink on off-white paper, and `page` (no fixed layout: the numbers among a few letter words on one
to four lines anywhere, coloured ink on tinted paper). Held out (never trained on): `tags` (the
numbers on one line at a random row and column, coloured ink on a tinted card, no header, no
words: never a page, which always has a word of letters). `style` may
name several styles: each example then draws its own with the example's rng, as Visual-ARFT
trains on several kinds of images.
Every glyph sits in its own 8x8 cell, so a vision patch of the same size sees exactly one glyph.
Rendering uses Pillow's built-in bitmap font only, so a seed gives the same pixels everywhere.

With `transcribe`, the prompt asks the question first and then shows the image with the generic
reading cue, `"total?\\n<image>read?\\n"`, and the model's first turn opens with what the image
says, then the call: `"RECEIPT\\nAB 12\\nKW 7\\n<python>..."` (Visual-ARFT's think step, here the
reading). Right after the image the context is the one `read?` has on its own, so the reading is
the generic one a reading stage trains, on any layout; the call then picks the numbers out of
text.

Rewards: `format` is 1 for tool calls each followed by the environment's reply, then
`answer: N` (after the reading, with `transcribe`); `answer` is 1 when the last `answer:` is the
total; `tool` is 1 only when a tool call ran in the sandbox, exited cleanly and printed the
total: stricter than `tool_arith` (which gives it for any clean run) and than Visual-ARFT's
released code (a flat 0.9 whenever a code block appears, never run). The model cannot forge it:
its turn ends at `</python>`, so `</python>` directly followed by `<output>` only ever comes from
the environment.

Knows nothing about tokens, processors or models: an example carries its PIL image in
`meta["image"]`, and the tool calls are `tool_arith`'s (same sandbox, same reply format).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from PIL import Image, ImageDraw, ImageFont

from leantrain.errors import LeantrainError
from leantrain.tasks.base import Example, Task
from leantrain.tasks.tool_arith import (
    ANSWER,
    EPISODE_FORMAT,
    TOOL_OPEN,
    TOOL_OUTPUT,
    TOOL_STOP,
    ToolArithTask,
    ToolCall,
    worked_turns,
)

IMAGE_TOKEN = "<image>"  # where the processor puts the image's patch tokens
CELL = 8  # pixels per glyph cell (and per vision patch)
GRID = 8  # cells per side: a 64x64 image
IMAGE_SIZE = CELL * GRID
QUESTION = "total?"
READ_QUESTION = "read?"  # generic transcription (the warm start's reading stage); not a task
# With `transcribe`, an episode opens with the model's transcription of the image (text without
# a tool call in it), then the tool protocol's episode as usual.
TRANSCRIBED_FORMAT = re.compile(rf"(?:(?!{TOOL_OPEN}).)+\n(?:{EPISODE_FORMAT.pattern})", re.DOTALL)
STYLES = ("receipt", "table", "page", "tags")
# Capitals and digits fit the 8x8 cell; lowercase g, j, p, q, y and Q have descenders that would
# reach into the cell below.
GLYPHS = "0123456789ABCDEFGHIJKLMNOPRSTUVWXYZ?+"
_LETTERS = "ABCDEFGHIJKLMNOPRSTUVWXYZ"
_DIGITS = "0123456789"
_TABLE_HEADER = "TABLE"

_POOL_STRIDE = 1_000_003  # pool example i of pool_seed s renders from seed s * stride + i
# Evaluation sets of a seed: receipts and tags render from the seed itself (the sets every earlier
# run used), a style added later from a stream of its own, so that its numbers are not the
# receipts'.
_EVAL_STREAM = {"receipt": 0, "tags": 0, "table": 1, "page": 2}


def _off_white(rng: random.Random) -> tuple[int, int, int]:
    """The paper of receipts and tables: light grey to slightly yellow."""
    shade = rng.randint(235, 255)
    return (shade, shade, shade - rng.randint(0, 15))


def tinted_paper_and_ink(rng: random.Random) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Light paper of a random tint and dark ink of a random colour (pages to read)."""
    paper = tuple(rng.randint(190, 255) for _ in range(3))
    ink = tuple(rng.randint(0, 100) for _ in range(3))
    return paper, ink


def glyph_font() -> ImageFont.ImageFont:
    """Pillow's built-in bitmap font: 5x7-pixel glyphs, identical on every machine."""
    return ImageFont.load_default_imagefont()


def render_grid(
    lines: dict[int, str],
    *,
    paper: tuple[int, int, int],
    ink: tuple[int, int, int],
    offset: tuple[int, int] = (1, 0),
) -> Image.Image:
    """A 64x64 RGB image with `lines[row]` written one character per 8x8 cell from column 0
    (characters from `GLYPHS`, or spaces).

    `offset` shifts every glyph inside its cell (x in 0..2, y in 0..1): the 5x7 glyph never
    leaves the cell, so one vision patch still sees one whole glyph.
    """
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), paper)
    draw = ImageDraw.Draw(image)
    font = glyph_font()
    for row, text in lines.items():
        if not 0 <= row < GRID or len(text) > GRID:
            raise ValueError(f"line {text!r} at row {row} does not fit the {GRID}x{GRID} grid")
        for col, char in enumerate(text):
            if char not in GLYPHS + " ":
                raise ValueError(f"{char!r} is not one of the glyphs that fit a cell: {GLYPHS}")
            if char != " ":
                # The bitmap font draws a glyph's top row 2 px below the anchor: lift it by 2.
                xy = (col * CELL + offset[0], row * CELL + offset[1] - 2)
                draw.text(xy, char, font=font, fill=ink)
    return image


def text_grid(lines: dict[int, str]) -> list[str]:
    """The character in each cell, row-major (64 strings, " " for an empty cell): what a reader
    of the image sees, in the order its patches reach the language model."""
    return [(lines.get(row, "") + " " * GRID)[col] for row in range(GRID) for col in range(GRID)]


def transcript(cells: Sequence[str]) -> str:
    """What an image says, as an OCR reader writes it: its non-empty rows top to bottom, one per
    line, words separated by one space (`cells` row-major, as `text_grid` gives them)."""
    rows = ("".join(cells[row * GRID : (row + 1) * GRID]) for row in range(GRID))
    return "\n".join(" ".join(row.split()) for row in rows if row.strip())


def reading_page(rng: random.Random) -> tuple[dict[int, str], Image.Image]:
    """A random page for generic reading (OCR pretraining, no task and no question about it):
    1-4 lines at random rows, each 1-3 words of random glyphs (letters, digits, or both mixed)
    from a random column, dark ink of a random colour on light paper of a random tint, each glyph
    at a random place in its cell. Returns the lines and the image.

    Never a page of the held-out `tags` style: a page whose only line holds nothing but numbers
    is drawn again (about 1 page in 11 would otherwise be one)."""
    while True:
        lines = {}
        for row in sorted(rng.sample(range(GRID), rng.randint(1, 4))):
            alphabet = rng.choice((_LETTERS, _DIGITS, GLYPHS))
            words = [
                "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
                for _ in range(rng.randint(1, 3))
            ]
            text = " ".join(words)[:GRID].strip()
            lines[row] = " " * rng.randint(0, GRID - len(text)) + text
        only_line = next(iter(lines.values())).split() if len(lines) == 1 else None
        if not (only_line and all(word.isdigit() for word in only_line)):
            break
    paper, ink = tinted_paper_and_ink(rng)
    offset = (rng.randint(0, 2), rng.randint(0, 1))
    return lines, render_grid(lines, paper=paper, ink=ink, offset=offset)


def evaluation_examples(style: str, n: int, seed: int, **options: object) -> list[Example]:
    """`n` examples of `style` for the evaluation seed `seed` (validation or test images), with
    `VisualTask` `options`; each style from its own stream (`_EVAL_STREAM`)."""
    stream = seed + _EVAL_STREAM[style] * _POOL_STRIDE
    return VisualTask(style=style, **options).examples(n, stream)


@dataclass
class VisualTask(Task):
    """Add up the numbers in a rendered image with the Python tool.

    Attributes:
        style: `receipt`, `table` or `page` (in-domain) or `tags` (the held-out domain), or a
            list of styles to draw each example's from (with the example's rng).
        min_items: fewest numbers in an image.
        max_items: most numbers in an image (at most 3: one line of tags must fit 8 cells).
        max_value: largest number (1..99: two glyphs at most).
        max_turns: model turns per episode.
        episode_tokens: token budget of an episode after its prompt.
        timeout_s: sandbox wall-clock limit per tool call, from when its code begins.
        max_output_chars: the tool's stdout/stderr shown to the model is cut to this many chars.
        pool: 0 draws a new example every time; N > 0 draws from a fixed set of N examples
            (Visual-ARFT trains on tens of examples for many epochs).
        pool_seed: which fixed set `pool` draws from.
        transcribe: read first. The prompt puts the question before the image and asks `read?`
            of it (`total?\\n<image>read?\\n`), and the episode's first turn opens with the
            model's transcription of the image (what the page says, as `read?` asks for it),
            then the tool call: Visual-ARFT's think step, made the reading a reader does before
            adding. Right after the image the context is `read?`'s own, so a layout the task
            never trained on needs only the generic reading and picking the numbers out of
            text. `format` requires the reading.
    """

    style: str | tuple[str, ...] = "receipt"
    min_items: int = 2
    max_items: int = 3
    max_value: int = 30
    max_turns: int = 3
    episode_tokens: int = 96
    timeout_s: float = 2.0
    max_output_chars: int = 200
    pool: int = 0
    pool_seed: int = 0
    transcribe: bool = False
    name: str = "visual"
    parts = ("format", "answer", "tool")
    multi_turn = True  # rollouts are tool episodes (rl/episodes.py)
    tool_stop = TOOL_STOP
    _tools: ToolArithTask = field(init=False, repr=False)

    def __post_init__(self) -> None:
        checks = {
            "style": bool(self.styles) and set(self.styles) <= set(STYLES),
            "min_items": 1 <= self.min_items <= self.max_items,
            "max_items": 1 <= self.max_items <= 3,
            "max_value": 1 <= self.max_value <= 99,
            "max_turns": self.max_turns >= 1,
            "episode_tokens": self.episode_tokens >= 1,
            "timeout_s": self.timeout_s > 0,
            "max_output_chars": self.max_output_chars >= 1,
            "pool": self.pool >= 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise LeantrainError(
                f"visual: invalid {bad[0]}={getattr(self, bad[0])!r} (need style one of "
                f"{STYLES} or a list of them, 1 <= min_items <= max_items <= 3, "
                "1 <= max_value <= 99, max_turns >= 1, episode_tokens >= 1, "
                "timeout_s > 0, max_output_chars >= 1, pool >= 0)"
            )
        # The tool side is tool_arith's: the same sandbox call and reply format.
        self._tools = ToolArithTask(
            timeout_s=self.timeout_s, max_output_chars=self.max_output_chars
        )

    @property
    def styles(self) -> tuple[str, ...]:
        """The styles examples are drawn from (one, or several to pick from)."""
        return (self.style,) if isinstance(self.style, str) else tuple(self.style)

    def sample(self, rng: random.Random) -> Example:
        if self.pool:
            return self._render(
                random.Random(self.pool_seed * _POOL_STRIDE + rng.randrange(self.pool))
            )
        return self._render(rng)

    def _render(self, rng: random.Random) -> Example:
        """One example drawn from `rng`: its style (when there are several to pick from), numbers,
        layout, colours and image. A single style draws nothing for it, so its examples stay the
        ones it always rendered for a seed."""
        style = rng.choice(self.styles) if len(self.styles) > 1 else self.styles[0]
        values = [
            rng.randint(1, self.max_value)
            for _ in range(rng.randint(self.min_items, self.max_items))
        ]
        layout = {
            "receipt": self._receipt,
            "table": self._table,
            "page": self._page,
            "tags": self._tags,
        }[style]
        lines, paper, ink = layout(values, rng)
        offset = (rng.randint(0, 2), rng.randint(0, 1))
        cells = text_grid(lines)
        example = Example(
            prompt=self._prompt,
            answer=str(sum(values)),
            meta={
                "image": render_grid(lines, paper=paper, ink=ink, offset=offset),
                "style": style,
                "values": values,
                "expression": "+".join(map(str, values)),
                "cells": cells,
                "transcript": transcript(cells),
            },
        )
        return replace(example, solution="".join(text for text, _ in self.worked_turns(example)))

    def worked_turns(self, example: Example) -> list[tuple[str, bool]]:
        """`example` solved, as (text, written by the model) pieces (`tool_arith.worked_turns`),
        the transcription first with `transcribe`."""
        (call, by_model), *rest = worked_turns(example.meta["expression"], example.answer)
        return [(self._reading(example) + call, by_model), *rest]

    def direct_turns(self, example: Example) -> list[tuple[str, bool]]:
        """`example` answered without the tool, from the image alone (after the transcription,
        with `transcribe`), as a model that has not learnt its tool answers; one model piece."""
        answer, _ = worked_turns(example.meta["expression"], example.answer)[-1]
        return [(self._reading(example) + answer, True)]

    def _reading(self, example: Example) -> str:
        """What the model writes before its call or answer: the transcription with
        `transcribe`, else nothing."""
        return f"{example.meta['transcript']}\n" if self.transcribe else ""

    @staticmethod
    def _receipt(
        values: list[int], rng: random.Random
    ) -> tuple[dict[int, str], tuple[int, int, int], tuple[int, int, int]]:
        """A header line at a random row, then one `NAME price` line per value, the prices either
        right-aligned in a column or right after each name: black on off-white paper."""
        top = rng.randint(0, GRID - 1 - len(values))
        lines = {top: "RECEIPT"}
        in_column = rng.random() < 0.5
        for row, value in enumerate(values, start=top + 1):
            item = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(1, 3)))
            price = str(value)
            lines[row] = item.ljust(GRID - 2) + price.rjust(2) if in_column else f"{item} {price}"
        return lines, _off_white(rng), (0, 0, 0)

    @staticmethod
    def _table(
        values: list[int], rng: random.Random
    ) -> tuple[dict[int, str], tuple[int, int, int], tuple[int, int, int]]:
        """A `TABLE` header at a random row and column, then the values in reading order on
        consecutive rows of one to three space-separated numbers (each row from a random
        column): black on off-white paper. Rows of several numbers are the point (receipts only
        ever have one number per line); the header makes sure a table is never a tags card."""
        rows = [[values[0]]]
        for value in values[1:]:
            if rng.random() < 0.5:  # len(values) <= 3, so a row never holds more than three
                rows[-1].append(value)
            else:
                rows.append([value])
        top = rng.randint(0, GRID - 1 - len(rows))
        lines = {top: " " * rng.randint(0, GRID - len(_TABLE_HEADER)) + _TABLE_HEADER}
        for row, numbers in enumerate(rows, start=top + 1):
            text = " ".join(map(str, numbers))
            lines[row] = " " * rng.randint(0, GRID - len(text)) + text
        return lines, _off_white(rng), (0, 0, 0)

    @staticmethod
    def _page(
        values: list[int], rng: random.Random
    ) -> tuple[dict[int, str], tuple[int, int, int], tuple[int, int, int]]:
        """A page of no fixed layout: the values in reading order among one to three words of
        letters, on one to four lines at random rows, each line from a random column, dark ink
        of a random colour on light paper of a random tint (`tinted_paper_and_ink`). The total is
        still "add every number on the image", wherever the numbers are; the letter words make
        sure a page is never a tags card (a line of numbers only)."""
        words = [str(value) for value in values]
        for _ in range(rng.randint(1, 3)):
            letters = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(1, 3)))
            words.insert(rng.randint(0, len(words)), letters)
        texts = [words[0]]
        for word in words[1:]:
            if rng.random() < 0.5 and len(texts[-1]) + 1 + len(word) <= GRID:
                texts[-1] += f" {word}"
            else:
                texts.append(word)
        while len(texts) > 4:  # at most 6 words of at most 3 glyphs: two short lines merge
            merged = min(range(len(texts) - 1), key=lambda i: len(texts[i]) + len(texts[i + 1]))
            texts[merged : merged + 2] = [f"{texts[merged]} {texts[merged + 1]}"]
        rows = sorted(rng.sample(range(GRID), len(texts)))
        lines = {
            row: " " * rng.randint(0, GRID - len(text)) + text
            for row, text in zip(rows, texts, strict=True)
        }
        return lines, *tinted_paper_and_ink(rng)

    @staticmethod
    def _tags(
        values: list[int], rng: random.Random
    ) -> tuple[dict[int, str], tuple[int, int, int], tuple[int, int, int]]:
        """The numbers on one line, space-separated, at a random row and column: coloured ink on
        a tinted card."""
        text = " ".join(map(str, values))
        lines = {rng.randint(0, GRID - 1): " " * rng.randint(0, GRID - len(text)) + text}
        paper = tuple(rng.randint(200, 255) for _ in range(3))
        ink = tuple(rng.randint(0, 90) for _ in range(3))
        return lines, paper, ink

    @property
    def _prompt(self) -> str:
        if self.transcribe:  # the question first: right after the image, `read?`'s own context
            return f"{QUESTION}\n{IMAGE_TOKEN}{READ_QUESTION}\n"
        return f"{IMAGE_TOKEN}{QUESTION}\n"

    @property
    def _format(self) -> re.Pattern[str]:
        return TRANSCRIBED_FORMAT if self.transcribe else EPISODE_FORMAT

    def call_tool(self, turn_text: str) -> ToolCall:
        """Run the tool call that ends `turn_text` in the sandbox (as `tool_arith` does)."""
        return self._tools.call_tool(turn_text)

    def score(self, example: Example, response: str) -> dict[str, float]:
        """`response` is the episode's transcript: model turns with the environment's replies."""
        text = response.strip()
        found = ANSWER.findall(text)
        printed = [out.strip() for out in TOOL_OUTPUT.findall(text)]
        return {
            "format": float(self._format.fullmatch(text) is not None),
            "answer": float(bool(found) and found[-1] == example.answer),
            "tool": float(example.answer in printed),
        }
