import random

import numpy as np
import pytest

from leantrain.errors import LeantrainError
from leantrain.tasks import make_task
from leantrain.tasks.visual import (
    CELL,
    GRID,
    VisualTask,
    evaluation_examples,
    reading_page,
    text_grid,
    transcript,
)


@pytest.fixture(scope="module")
def task() -> VisualTask:
    return VisualTask(timeout_s=1.0)


def _pixels(ex) -> bytes:
    return ex.meta["image"].tobytes()


@pytest.mark.parametrize(
    "style", ["receipt", "table", "page", "tags", ("receipt", "table"), ("receipt", "page")]
)
def test_rendering_is_deterministic_for_a_seed(style):
    task = VisualTask(style=style)
    first, again = task.examples(6, seed=11), task.examples(6, seed=11)
    assert [_pixels(a) for a in first] == [_pixels(b) for b in again]
    assert [a.answer for a in first] == [b.answer for b in again]
    other = task.examples(6, seed=12)
    assert [_pixels(a) for a in first] != [_pixels(b) for b in other]


@pytest.mark.parametrize("style", ["receipt", "table", "page", "tags"])
def test_each_glyph_fills_one_cell_and_the_image_carries_the_numbers(style):
    for ex in VisualTask(style=style).examples(20, seed=3):
        image = np.asarray(ex.meta["image"]).astype(int)  # (64, 64, 3)
        assert image.shape == (GRID * CELL, GRID * CELL, 3)
        paper = np.array(max(ex.meta["image"].getcolors())[1])  # the most common colour
        cells = ex.meta["cells"]
        for index, char in enumerate(cells):
            row, col = divmod(index, GRID)
            patch = image[row * CELL : (row + 1) * CELL, col * CELL : (col + 1) * CELL]
            inked = (np.abs(patch - paper).sum(-1) > 60).any()
            assert inked == (char != " "), (style, index, char)
        # The numbers to add are in the image, in reading order, and sum to the answer.
        values = ex.meta["values"]
        assert sum(values) == int(ex.answer)
        assert [int(w) for w in transcript(cells).split() if w.isdigit()] == values
        assert ex.meta["style"] == style


def test_tags_and_receipts_are_different_styles():
    receipt = VisualTask(style="receipt").sample(random.Random(0))
    tags = VisualTask(style="tags").sample(random.Random(0))
    assert "RECEIPT" in "".join(receipt.meta["cells"])
    assert "RECEIPT" not in "".join(tags.meta["cells"])
    assert receipt.prompt == tags.prompt == "<image>total?\n"


def _is_tags_like(cells: list[str]) -> bool:
    """The held-out style's definition: a page whose only line holds nothing but numbers."""
    lines = transcript(cells).split("\n")
    return len(lines) == 1 and all(word.isdigit() for word in lines[0].split())


def test_tables_are_a_header_then_rows_of_one_to_three_numbers_never_a_tags_card():
    examples = VisualTask(style="table").examples(200, seed=8)
    numbers_per_row = set()
    for ex in examples:
        header, *rows = transcript(ex.meta["cells"]).split("\n")
        assert header == "TABLE"
        assert [int(w) for row in rows for w in row.split()] == ex.meta["values"]
        numbers_per_row |= {len(row.split()) for row in rows}
        assert not _is_tags_like(ex.meta["cells"])
        # Black ink on off-white paper, as receipts: the ink and paper are not the cards'.
        colours = {colour for _, colour in ex.meta["image"].getcolors()}
        paper = max(ex.meta["image"].getcolors())[1]
        assert (0, 0, 0) in colours and min(paper) >= 220
    assert numbers_per_row == {1, 2, 3}  # lines of several numbers are trained, not only one


def test_pages_put_the_numbers_among_words_anywhere_and_are_never_a_tags_card():
    examples = VisualTask(style="page").examples(300, seed=9)
    lines_per_page, numbers_with_words = set(), 0
    for ex in examples:
        lines = transcript(ex.meta["cells"]).split("\n")
        words = " ".join(lines).split()
        assert [int(w) for w in words if w.isdigit()] == ex.meta["values"]
        assert all(w.isdigit() or w.isalpha() for w in words)
        assert 1 <= sum(w.isalpha() for w in words) <= 3
        assert not _is_tags_like(ex.meta["cells"])
        lines_per_page.add(len(lines))
        numbers_with_words += any(
            any(w.isdigit() for w in line.split()) and any(w.isalpha() for w in line.split())
            for line in lines
        )
    assert lines_per_page == {1, 2, 3, 4}
    assert 0.2 < numbers_with_words / len(examples) < 0.9  # numbers share lines with words too
    # Pages have an evaluation stream of their own.
    pages = evaluation_examples("page", 20, 555)
    assert {ex.meta["style"] for ex in pages} == {"page"}
    receipts = evaluation_examples("receipt", 20, 555)
    assert [ex.meta["values"] for ex in receipts] != [ex.meta["values"] for ex in pages]


def test_a_style_mix_is_deterministic_covers_its_styles_and_keeps_single_styles_as_they_were():
    mixed = VisualTask(style=("receipt", "table"))
    drawn = mixed.examples(40, seed=4)
    styles = [ex.meta["style"] for ex in drawn]
    assert styles == [ex.meta["style"] for ex in mixed.examples(40, seed=4)]
    assert 10 <= styles.count("table") <= 30 and set(styles) == {"receipt", "table"}
    # Each example's style is drawn with its own rng: a pool of the mix is fixed per pool seed.
    pooled = VisualTask(style=("receipt", "table"), pool=6, pool_seed=1)
    assert {_pixels(ex) for ex in pooled.examples(50, 0)} == {
        _pixels(ex) for ex in pooled.examples(50, 3)
    }
    # A single style (named alone or in a list) draws no style: the images it always gave.
    receipts = VisualTask(style="receipt").examples(5, seed=4)
    assert [_pixels(ex) for ex in VisualTask(style=["receipt"]).examples(5, seed=4)] == [
        _pixels(ex) for ex in receipts
    ]
    # No training page of the mix is a tags card.
    assert not any(_is_tags_like(ex.meta["cells"]) for ex in mixed.examples(200, seed=5))


def test_evaluation_sets_keep_the_earlier_receipts_and_tags_and_give_tables_their_own_numbers():
    for style in ("receipt", "tags"):
        assert [_pixels(ex) for ex in evaluation_examples(style, 4, 555)] == [
            _pixels(ex) for ex in VisualTask(style=style).examples(4, 555)
        ]
    receipts = evaluation_examples("receipt", 20, 555)
    tables = evaluation_examples("table", 20, 555, max_value=30)
    assert {ex.meta["style"] for ex in tables} == {"table"}
    assert [ex.meta["values"] for ex in receipts] != [ex.meta["values"] for ex in tables]


def test_worked_solutions_score_full_marks(task):
    for ex in task.examples(10, seed=5):
        assert task.score(ex, ex.solution) == {"format": 1.0, "answer": 1.0, "tool": 1.0}


def test_transcribed_episodes_read_the_image_first_and_format_asks_for_it():
    plain, reading = VisualTask(style="tags"), VisualTask(style="tags", transcribe=True)
    for ex, ex_read in zip(plain.examples(5, seed=3), reading.examples(5, seed=3), strict=True):
        # The same image and answer; the question comes first and the image is asked `read?`
        # (the reading stage's own context), and the worked solution gains the reading.
        assert _pixels(ex) == _pixels(ex_read) and ex.answer == ex_read.answer
        assert ex.prompt == "<image>total?\n"
        assert ex_read.prompt == "total?\n<image>read?\n"
        words = " ".join(map(str, ex.meta["values"]))  # a tags card says just its numbers
        assert ex_read.meta["transcript"] == words
        assert ex_read.solution == f"{words}\n{ex.solution}"
        assert reading.score(ex_read, ex_read.solution) == {
            "format": 1.0,
            "answer": 1.0,
            "tool": 1.0,
        }
        # Without the reading, a transcribing task's format fails; the answer and tool stand.
        assert reading.score(ex, ex.solution) == {"format": 0.0, "answer": 1.0, "tool": 1.0}
        # A plain task does not take a reading before the call.
        assert plain.score(ex_read, ex_read.solution)["format"] == 0.0
        # Only the model's pieces are trained on: the reading is in the model's first turn.
        turns = reading.worked_turns(ex_read)
        assert turns[0][0].startswith(f"{words}\n<python>") and turns[0][0].endswith("</python>")
        assert [by_model for _, by_model in turns] == [True, False, True]
    assert reading.score(ex, f"\n{ex.solution}")["format"] == 0.0  # a reading of nothing
    # A failed call is not a reading; after a reading, a retry is an episode like any other.
    failed = "<python>\nprint(\n</python>\n<error>\nSyntaxError\n</error>\n"
    assert reading.score(ex, failed + ex.solution)["format"] == 0.0
    assert reading.score(ex, f"{words}\n{failed}{ex.solution}")["format"] == 1.0


def test_direct_turns_answer_without_the_tool_after_the_reading():
    plain, reading = VisualTask(), VisualTask(transcribe=True)
    ex, ex_read = plain.examples(1, seed=4)[0], reading.examples(1, seed=4)[0]
    assert plain.direct_turns(ex) == [(f"answer: {ex.answer}", True)]
    assert reading.direct_turns(ex_read) == [
        (f"{ex_read.meta['transcript']}\nanswer: {ex.answer}", True)
    ]
    # Right, but no tool: the answer counts and the tool and the episode's shape do not.
    for task, example in ((plain, ex), (reading, ex_read)):
        (text, _), *_ = task.direct_turns(example)
        assert task.score(example, text) == {"format": 0.0, "answer": 1.0, "tool": 0.0}


def _episode(task, ex, code: str) -> str:
    """The transcript the episode runner builds: the model's call, the sandbox's real reply."""
    call = f"<python>\n{code}\n</python>"
    return f"{call}\n{task.call_tool(call).output}\n"


def test_tool_reward_needs_code_that_runs_and_prints_the_right_value(task):
    ex = task.sample(random.Random(1))
    expression = ex.meta["expression"]
    right = f"answer: {ex.answer}"
    cases = {
        f"print({expression})": 1.0,  # runs, prints the total
        f"print({expression}+1)": 0.0,  # runs cleanly, wrong value
        f"print({expression}": 0.0,  # does not run: SyntaxError
        f"print(undefined_name + {expression})": 0.0,  # does not run: NameError
        "import sys; sys.exit(3)": 0.0,  # exits uncleanly
        "x = 5": 0.0,  # runs, prints nothing
    }
    for code, expected in cases.items():
        parts = task.score(ex, _episode(task, ex, code) + right)
        assert parts["tool"] == expected, code
        assert parts["answer"] == 1.0
        assert parts["format"] == 1.0
    # The right value printed by a failing run (printed, then crashed) is not a clean run.
    crashed = _episode(task, ex, f"print({expression}); 1/0")
    assert "<error>" in crashed and task.score(ex, crashed + right)["tool"] == 0.0
    # An output block the model wrote itself is not a tool run.
    forged = f"<output>\n{ex.answer}\n</output>\n{right}"
    assert task.score(ex, forged) == {"format": 0.0, "answer": 1.0, "tool": 0.0}
    # The last answer counts.
    run = _episode(task, ex, f"print({expression})")
    assert task.score(ex, run + f"answer: {ex.answer}0")["answer"] == 0.0


def test_a_pool_is_a_fixed_set_of_examples():
    pooled = VisualTask(pool=5, pool_seed=2)
    drawn = pooled.examples(60, seed=0)
    images = {_pixels(ex) for ex in drawn}
    assert len(images) == 5  # 60 draws, 5 distinct examples
    assert {_pixels(ex) for ex in VisualTask(pool=5, pool_seed=2).examples(60, seed=9)} == images
    assert images.isdisjoint(_pixels(ex) for ex in VisualTask(pool=5, pool_seed=3).examples(60, 0))


def test_options_are_checked():
    assert make_task("visual", style="tags", max_items="2").max_items == 2
    for bad in (
        {"style": "clock"},
        {"style": ["receipt", "clock"]},
        {"style": []},
        {"max_items": 4},
        {"max_value": 100},
        {"min_items": 0},
        {"pool": -1},
    ):
        with pytest.raises(LeantrainError, match="visual") as error:
            make_task("visual", **bad)
        assert f"{next(iter(bad))}=" in str(error.value)  # names the field


def test_transcript_reads_rows_top_to_bottom_one_space_between_words():
    cells = text_grid({2: "AB    12", 0: "RECEIPT", 5: "  7 30"})
    assert transcript(cells) == "RECEIPT\nAB 12\n7 30"
    receipt = VisualTask(style="receipt").sample(random.Random(4))
    assert transcript(receipt.meta["cells"]).split("\n")[0] == "RECEIPT"
    tags = VisualTask(style="tags").sample(random.Random(4))
    assert transcript(tags.meta["cells"]) == " ".join(map(str, tags.meta["values"]))


def test_reading_pages_are_deterministic_inked_where_they_say_and_never_tags():
    first = [reading_page(random.Random(seed)) for seed in range(200)]
    again = [reading_page(random.Random(seed)) for seed in range(3)]
    assert [(lines, image.tobytes()) for lines, image in first[:3]] == [
        (lines, image.tobytes()) for lines, image in again
    ]
    for lines, image in first:
        pixels = np.asarray(image).astype(int)
        paper = pixels[0, -1] if not lines.get(0, "").ljust(GRID)[-1].strip() else None
        for row, text in lines.items():
            assert 1 <= len(text.split()) <= 3 and len(text) <= GRID
            if paper is not None:  # inked cells are the non-space characters
                for col, char in enumerate(text.ljust(GRID)):
                    patch = pixels[row * CELL : (row + 1) * CELL, col * CELL : (col + 1) * CELL]
                    assert (np.abs(patch - paper).sum(-1) > 60).any() == (char != " ")
        # The held-out style (one line of numbers only) is never a reading page.
        assert not (
            len(lines) == 1 and all(w.isdigit() for w in next(iter(lines.values())).split())
        )
    # Pages hold letters, digits and several lines: generic reading, not one layout.
    words = [w for lines, _ in first for text in lines.values() for w in text.split()]
    assert any(w.isdigit() for w in words) and any(w.isalpha() for w in words)
    assert {len(lines) for lines, _ in first} == {1, 2, 3, 4}
