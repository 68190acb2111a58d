"""`leantrain view`: the page of a real tiny run holds what the run wrote, renders in headless
Chromium with one timeline row per sequence, and `--serve` follows a growing run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from leantrain.cli import app
from leantrain.rl.config import RLConfig
from leantrain.rl.grpo import GRPORun
from leantrain.settings import load_settings
from leantrain.telemetry.view import (
    LENGTH_PERCENTILES,
    make_server,
    read_jsonl,
    run_data,
    write_page,
)

SEQUENCES = 2 * 4 * 4  # steps x prompts x group


@pytest.fixture(scope="module")
def run_dir(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("view") / "run"
    cfg = load_settings(
        RLConfig,
        None,
        **{
            "steps": 2,
            "out": out,
            "device": "cpu",
            "task.eval_size": 4,
            "sampling.max_new_tokens": 32,
            "grpo.prompts_per_step": 4,
            "grpo.group_size": 4,
            "checkpoint_every": 100,
        },
    )
    GRPORun(cfg, progress=False).run()
    return out


def test_the_data_is_what_the_run_wrote(run_dir: Path) -> None:
    data = run_data(run_dir)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in data["steps"]] == [1, 2]
    for row, record in zip(data["steps"], metrics, strict=True):
        assert row["lengths"] == pytest.approx(
            np.percentile(record["response_lengths"], LENGTH_PERCENTILES)
        )
        assert row["reward"] == record["reward"] and "response_lengths" not in row
    assert len(data["seqs"]) == SEQUENCES and [t["name"] for t in data["tracks"]] == ["trainer"]
    events = read_jsonl(run_dir / "events.jsonl")
    trainer = [e for e in events if "seq" not in e]
    total = sum(e["t1"] - e["t0"] for e in trainer)
    shown = sum(sum(v) for v in data["trainer_time"]["seconds"].values())
    assert shown == pytest.approx(total, abs=1e-3)  # every trainer second in exactly one slice
    assert data["run"]["config"]["grpo"]["group_size"] == 4
    assert data["run"]["summary"]["steps"] == 2 and len(data["completions"]) == 4


def test_a_line_cut_short_by_a_writer_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.0}]
    assert run_data(tmp_path)["steps"] == [{"step": 1, "loss": 2.0}]


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        message = "needs Debian's chromium (make test installs it: apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def headless(page: Path, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [
        chromium(),
        "--headless",
        "--no-sandbox",  # CI runs as root
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
        *flags,
        page.resolve().as_uri(),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=180, check=True)


def test_the_page_renders_one_timeline_row_per_sequence(run_dir: Path, tmp_path: Path) -> None:
    page = write_page(run_dir, tmp_path / "view.html")
    assert "http://" not in page.read_text().replace("http://www.w3.org/2000/svg", "")
    dom = headless(page, tmp_path, "--dump-dom").stdout
    assert 'id="timeline-svg"' in dom and f'data-rows="{SEQUENCES}"' in dom
    assert dom.count('<g class="seq"') == SEQUENCES
    for batch in (0, 1):  # every batch's every sequence, grouped under the trainer
        rows = dom.count(f'<g class="seq" data-track="trainer" data-batch="{batch}"')
        assert rows == SEQUENCES // 2
    for chart in ("trainer-svg", "length-svg", "reward-svg"):
        assert f'id="{chart}"' in dom, chart
    assert dom.count("<tr>") == 1 + 4  # the completions table: a header and 4 completions
    shot = tmp_path / "view.png"
    headless(page, tmp_path, f"--screenshot={shot}", "--window-size=1200,1600")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


def test_serve_follows_a_growing_run(run_dir: Path, tmp_path: Path) -> None:
    live = tmp_path / "live"
    shutil.copytree(run_dir, live)
    server = make_server(live, port=0, refresh_s=1.0)
    host, port = server.server_address[:2]
    assert host == "127.0.0.1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://{host}:{port}"
        page = _get(f"{base}/").decode()
        assert 'id="leantrain-data"' in page and "const LIVE = 1.0;" in page
        assert [r["step"] for r in json.loads(_get(f"{base}/data.json"))["steps"]] == [1, 2]
        with (live / "metrics.jsonl").open("a") as f:  # the run writes its next step
            f.write(json.dumps({"step": 3, "reward": 0.5, "response_lengths": [3, 4]}) + "\n")
        steps = json.loads(_get(f"{base}/data.json"))["steps"]
        assert [r["step"] for r in steps] == [1, 2, 3] and steps[-1]["lengths"][-1] == 4.0
        with pytest.raises(urllib.error.HTTPError):
            _get(f"{base}/nothing")
    finally:
        server.shutdown()
        server.server_close()


def test_the_command_writes_the_page_and_refuses_a_bad_folder(
    run_dir: Path, tmp_path: Path
) -> None:
    runner = CliRunner()
    out = tmp_path / "page.html"
    result = runner.invoke(app, ["view", str(run_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 10_000 and "leantrain-data" in out.read_text()
    result = runner.invoke(app, ["view", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "run folder not found" in " ".join(result.output.split())
    (tmp_path / "empty").mkdir()
    result = runner.invoke(app, ["view", str(tmp_path / "empty"), "--serve", "--port", "0"])
    assert result.exit_code == 2 and "holds no run" in " ".join(result.output.split())
