"""A page a person can open to see what a vision-language policy did: for the latest steps, each
sampled image (embedded as a base64 PNG, so the page is one self-contained file) next to the
question, the sampled episode (model turns and the tool's replies) and its reward parts.

The page is rewritten after every step from what it has kept (the newest `keep_steps` steps,
newest first); `completions.jsonl` stays the append-only record. Knows nothing about training:
it takes examples and scored trajectories.
"""

from __future__ import annotations

import base64
import html
import io
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from leantrain.rl.trajectory import Trajectory
from leantrain.tasks import Example

_STYLE = """
body { font-family: sans-serif; margin: 1.5em; }
table { border-collapse: collapse; margin-bottom: 1.5em; }
td, th { border: 1px solid #ccc; padding: 6px; vertical-align: top; text-align: left; }
img { image-rendering: pixelated; }
pre { margin: 0; white-space: pre-wrap; }
.ok { color: #070; } .bad { color: #a00; }
"""


@dataclass(frozen=True)
class _Sample:
    image_png: str  # base64
    question: str
    answer: str
    response: str
    rewards: dict[str, float]
    reward: float


def png_base64(image: Image.Image, scale: int = 3) -> str:
    """`image` enlarged `scale` times (nearest neighbour, so glyphs stay crisp) as base64 PNG."""
    big = image.resize((image.width * scale, image.height * scale), Image.NEAREST)
    buffer = io.BytesIO()
    big.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class VisionReport:
    """Sampled images with their completions and rewards, as one HTML page.

    Args:
        path: where the page is written (e.g. `<run>/report.html`).
        per_step: groups shown per step (the first response of each).
        keep_steps: steps kept on the page, newest first.
    """

    def __init__(self, path: Path, per_step: int = 4, keep_steps: int = 10) -> None:
        self.path = Path(path)
        self.per_step = per_step
        self.steps: deque[tuple[int, list[_Sample]]] = deque(maxlen=keep_steps)

    def add(
        self, step: int, examples: Sequence[Example], trajectories: Sequence[Trajectory], group: int
    ) -> None:
        """Keep step `step`'s first response to each of its first `per_step` prompts
        (`trajectories` prompt-major, `group` per prompt) and rewrite the page."""
        samples = []
        for ex, t in zip(examples[: self.per_step], trajectories[::group], strict=False):
            image = ex.meta["image"]
            image = image[0] if isinstance(image, list) else image
            question = ex.prompt.replace("<image>", "").strip()
            samples.append(
                _Sample(png_base64(image), question, ex.answer, t.text, t.rewards, t.reward)
            )
        self.steps.appendleft((step, samples))
        self.write()

    def write(self) -> None:
        """Write the page (through a temporary file, so a reader never sees half of it)."""
        parts = [
            "<!doctype html><html><head><meta charset='utf-8'>",
            f"<title>{html.escape(str(self.path.parent))}</title><style>{_STYLE}</style></head>",
            f"<body><h1>Sampled episodes: {html.escape(str(self.path.parent))}</h1>",
        ]
        for step, samples in self.steps:
            parts.append(
                f"<h2>step {step}</h2><table><tr><th>image</th><th>question</th>"
                "<th>episode</th><th>rewards</th></tr>"
            )
            for s in samples:
                rewards = ", ".join(f"{k} {v:g}" for k, v in sorted(s.rewards.items()))
                mark = "ok" if s.rewards.get("answer", 0.0) > 0 else "bad"
                parts.append(
                    f"<tr><td><img src='data:image/png;base64,{s.image_png}'></td>"
                    f"<td>{html.escape(s.question)}<br>expected {html.escape(s.answer)}</td>"
                    f"<td><pre>{html.escape(s.response)}</pre></td>"
                    f"<td class='{mark}'>{html.escape(rewards)}<br>total {s.reward:.2f}</td></tr>"
                )
            parts.append("</table>")
        parts.append("</body></html>\n")
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(parts), encoding="utf-8")
        tmp.replace(self.path)
