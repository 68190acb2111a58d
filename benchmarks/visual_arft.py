"""Visual-ARFT on the tiny VLM: accuracy before and after GRPO, in-domain and on a held-out domain,
and how often the model's tool calls really run.

The `tiny-vl` preset (a CLIP vision tower + projector in front of the tiny Llama, warm-started on
generic glyph reading, generic transcription and rendered receipts, tables and pages, reading
first and then answering, with the tool or without it; models/presets/tiny_vl.py) is trained with
GRPO (`configs/tiny-vl-tools.yaml`: decomposed rewards format / answer / tool, multi-turn
episodes with the Python tool in the sandbox) on a small fixed training set (`--train-pool`
images of the config's styles, drawn over and over for many epochs, as Visual-ARFT trains on
tens of examples), then evaluated greedily on

- in-domain: new images of the training styles (equally many of each, never in the training
  set; each style's accuracy is in `details` too);
- held-out domain: `tags` images (numbers on one line of a tinted card, no header, no item
  names), a style never trained on, neither by the warm start (its task stage trains receipts,
  tables, which always have a header, and pages, which always have a word of letters; its
  generic reading pages are never a single line of numbers) nor by GRPO.

Accuracy is the `answer` reward (exact total). `read` is a probe of where a wrong answer comes
from: the share of episodes whose first tool call adds exactly the image's numbers (the policy
read the image), against `format` (the episode's shape) and the answer itself. The tool
execution rate is the share of tool calls in the after-GRPO evaluation episodes (both test sets)
that ran in the sandbox and exited cleanly; the `tool` reward asks more (the right value
printed). Visual-ARFT's own code never runs the code.

    python benchmarks/visual_arft.py            # full: 60 steps of 16 prompts x 4, 256 test images
    python benchmarks/visual_arft.py --quick    # under 180 s on an idle 2-core CPU (tiny-vl ships)
    python benchmarks/visual_arft.py --quick --test-seed 555   # validation images: tune on these
    python benchmarks/visual_arft.py --quick --freeze-vision   # vision tower fixed during GRPO
    python benchmarks/visual_arft.py --quick --train-styles receipt,table   # GRPO on both styles
    python benchmarks/visual_arft.py --quick --config my.yaml --model <folder>   # another setup

Writes benchmarks/results/visual_arft.json with keys acc_before, acc_after, ood_acc_before,
ood_acc_after, tool_exec_rate_after (plus the details under `details`).
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from leantrain.generation import SamplingParams
from leantrain.models.presets.tiny_vl import ensure_tiny_vl
from leantrain.rl.config import RLConfig
from leantrain.rl.grpo import GRPORun
from leantrain.rl.rollout import compute_autocast, example_inputs
from leantrain.settings import load_settings
from leantrain.tasks import Example
from leantrain.tasks.visual import evaluation_examples
from leantrain.telemetry.report import write_benchmark_json

CONFIG = Path(__file__).parent.parent / "configs" / "tiny-vl-tools.yaml"
RESULTS = Path(__file__).parent / "results" / "visual_arft.json"
_TEST_SEED = 777  # the test sets' seed; the training pool is pool_seed 0 of another stream
HELD_OUT = "tags"  # the style never trained on
_CALL = re.compile(r"<python>\nprint\(([0-9+]+)\)\n</python>")  # a call that adds numbers
_READING = re.compile(r"(.*?)\n<python>", re.DOTALL)  # `transcribe`'s reading, before the call


def numbers_read(example: Example, episode_text: str) -> bool:
    """Whether the episode's first tool call adds up exactly the image's numbers, in order: the
    policy read the image right, whatever it did next."""
    call = _CALL.search(episode_text)
    return call is not None and call.group(1).split("+") == list(map(str, example.meta["values"]))


def transcribed(example: Example, episode_text: str) -> bool:
    """Whether the episode opens with an exact transcription of the image (tasks with
    `transcribe`)."""
    reading = _READING.match(episode_text)
    return reading is not None and reading.group(1) == example.meta["transcript"]


def evaluate(run: GRPORun, examples: list[Example]) -> dict:
    """Greedy episodes on `examples`: mean reward parts, the share whose tool call has the
    image's numbers (`numbers_read`), the share that opens with an exact transcription
    (`transcribed`, tasks with `transcribe`) and the share of tool calls that ran, over all of
    them and, under `by_style`, the answer accuracy, `numbers_read` and `transcribed` of each
    style among them."""
    prompts = [example_inputs(run.tokenizer, run.processor, ex)[0] for ex in examples]
    params = SamplingParams(max_new_tokens=run.config.sampling.max_new_tokens, temperature=0.0)
    with compute_autocast(run.config, run.device):
        images = run.source.image_inputs(examples)
        episodes = run.source.backend.generate(prompts, params, **images)
    parts = [run.task.score(ex, ep.text) for ex, ep in zip(examples, episodes, strict=True)]
    calls = [call.outcome for ep in episodes for call in ep.tool_calls]
    read = [numbers_read(ex, ep.text) for ex, ep in zip(examples, episodes, strict=True)]
    wrote = [transcribed(ex, ep.text) for ex, ep in zip(examples, episodes, strict=True)]
    rows_of: dict[str, list[int]] = {}  # style -> its examples' positions
    for i, ex in enumerate(examples):
        rows_of.setdefault(ex.meta["style"], []).append(i)
    return {
        **{k: statistics.fmean(p[k] for p in parts) for k in ("format", "answer", "tool")},
        "numbers_read": statistics.fmean(read),
        "transcribed": statistics.fmean(wrote),
        "tool_calls": len(calls),
        "tool_exec_rate": calls.count("ok") / max(1, len(calls)),
        "by_style": {
            style: {
                "n": len(rows),
                "answer": statistics.fmean(parts[i]["answer"] for i in rows),
                "numbers_read": statistics.fmean(read[i] for i in rows),
                "transcribed": statistics.fmean(wrote[i] for i in rows),
            }
            for style, rows in rows_of.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="under 180 s on an idle 2-core CPU")
    parser.add_argument("--steps", type=int, default=60, help="GRPO steps")
    parser.add_argument("--prompts-per-step", type=int, default=16, help="prompts per GRPO step")
    parser.add_argument("--train-pool", type=int, default=32, help="training images")
    parser.add_argument(
        "--test-size",
        type=int,
        default=256,
        help="test images per domain (in-domain: split evenly over the training styles)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (a ~1 M-parameter model gains little from more, and on a "
        "busy machine OpenMP spin-waits make a second thread cost more than it brings)",
    )
    parser.add_argument("--seed", type=int, default=0, help="GRPO run seed")
    parser.add_argument(
        "--test-seed",
        type=int,
        default=_TEST_SEED,
        help=f"seed of the test images; choose settings on another (validation) seed, report on "
        f"{_TEST_SEED}",
    )
    parser.add_argument(
        "--model", default="tiny-vl", help="the VLM to start from: the preset or a local folder"
    )
    parser.add_argument(
        "--freeze-vision",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep the vision tower fixed during GRPO (model.freeze_vision); default: the config's",
    )
    parser.add_argument(
        "--train-styles",
        default=None,
        help="comma-separated styles GRPO trains on and in-domain is tested on (e.g. "
        "receipt,table); default: the config's task.options.style",
    )
    parser.add_argument(
        "--config", type=Path, default=CONFIG, help="the GRPO run's config (an RLConfig YAML)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.prompts_per_step, args.test_size = 20, 8, 64
    torch.set_num_threads(args.threads)

    build_start = time.perf_counter()
    if args.model == "tiny-vl":
        ensure_tiny_vl()  # built once and cached; its build time is not part of the benchmark
    build_s = time.perf_counter() - build_start
    # Only an explicit flag overrides the config (model.freeze_vision, task.options.style).
    overrides = {} if args.freeze_vision is None else {"model.freeze_vision": args.freeze_vision}
    if args.train_styles is not None:
        overrides["task.options.style"] = args.train_styles.split(",")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        config = load_settings(
            RLConfig,
            args.config,
            **overrides,
            **{
                "model.name": args.model,
                "steps": args.steps,
                "seed": args.seed,
                "out": Path(tmp) / "run",
                "device": "cpu",
                "task.options.pool": args.train_pool,
                "grpo.prompts_per_step": args.prompts_per_step,
                "task.eval_size": 8,  # the run's own held-out check; the test sets are below
                "checkpoint_every": max(1, args.steps),
            },
        )
        run = GRPORun(config, progress=True)
        train_styles = run.task.styles
        if HELD_OUT in train_styles:
            parser.error(f"the config trains on {HELD_OUT!r}, the held-out style: nothing held out")
        options = {k: v for k, v in config.task.options.items() if k not in ("style", "pool")}
        per_style = args.test_size // len(train_styles)
        tests = {
            "in_domain": [
                ex
                for style in train_styles
                for ex in evaluation_examples(style, per_style, args.test_seed, **options)
            ],
            "held_out": evaluation_examples(HELD_OUT, args.test_size, args.test_seed, **options),
        }
        before = {domain: evaluate(run, examples) for domain, examples in tests.items()}
        summary = run.run()
        after = {domain: evaluate(run, examples) for domain, examples in tests.items()}
    seconds = time.perf_counter() - start
    calls_after = sum(after[d]["tool_calls"] for d in after)
    ran_after = sum(after[d]["tool_exec_rate"] * after[d]["tool_calls"] for d in after)

    trained_on = " + ".join(train_styles)
    table = Table(
        title=f"Visual-ARFT, tiny-vl: {args.steps} GRPO steps on {args.train_pool} images "
        f"({trained_on})"
    )
    columns = ("test set", "n", "acc before", "acc after", "change", "read before", "read after")
    for col in (*columns, "format after", "calls run"):
        table.add_column(col, justify="right")
    for domain in tests:
        b, a = before[domain], after[domain]
        table.add_row(
            domain.replace("_", "-"),
            str(len(tests[domain])),
            f"{b['answer']:.1%}",
            f"{a['answer']:.1%}",
            f"{(a['answer'] - b['answer']) * 100:+.1f}",
            f"{b['numbers_read']:.1%}",
            f"{a['numbers_read']:.1%}",
            f"{a['format']:.1%}",
            f"{a['tool_exec_rate']:.1%}",
        )
        if len(b["by_style"]) > 1:
            for style, bs in b["by_style"].items():
                a_s = a["by_style"][style]
                table.add_row(
                    f"  {style}",
                    str(bs["n"]),
                    f"{bs['answer']:.1%}",
                    f"{a_s['answer']:.1%}",
                    f"{(a_s['answer'] - bs['answer']) * 100:+.1f}",
                    f"{bs['numbers_read']:.1%}",
                    f"{a_s['numbers_read']:.1%}",
                    "",
                    "",
                )
    Console(width=120).print(table)  # wide enough for the style rows, in a pipe too
    print("read: the first tool call adds exactly the image's numbers; format: the episode's shape")
    if run.task.transcribe:
        for domain in tests:
            b, a = before[domain]["transcribed"], after[domain]["transcribed"]
            print(f"{domain}: exact transcription before the call {b:.1%} -> {a:.1%}")
    grpo_s = summary["seconds_total"]
    print(f"total {seconds:.0f} s (GRPO {grpo_s:.0f} s); model build or load {build_s:.1f} s")

    report = {
        "acc_before": before["in_domain"]["answer"],
        "acc_after": after["in_domain"]["answer"],
        "ood_acc_before": before["held_out"]["answer"],
        "ood_acc_after": after["held_out"]["answer"],
        "tool_exec_rate_after": ran_after / max(1, calls_after),
        "details": {
            "before": before,
            "after": after,
            "grpo_summary": summary,
            "seconds_total": round(seconds, 1),
            "seconds_model_build_or_load": round(build_s, 1),
            "config": {
                "model": config.model.name,
                "steps": args.steps,
                "train_pool": args.train_pool,
                "train_styles": list(train_styles),
                "held_out_style": HELD_OUT,
                "test_size": args.test_size,
                "prompts_per_step": config.grpo.prompts_per_step,
                "group_size": config.grpo.group_size,
                "lr": config.grpo.lr,
                "freeze_vision": config.model.freeze_vision,
                "threads": args.threads,
                "quick": args.quick,
                "seed": args.seed,
                "test_seed": args.test_seed,
            },
        },
    }
    write_benchmark_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
