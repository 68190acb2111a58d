"""A command's torch threads: its share of the usable cores among the live leantrain commands,
followed as others start and end, unless pinned or changed by other code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from leantrain.errors import LeantrainError
from leantrain.training import threads
from leantrain.training.threads import (
    _start_time,
    claim_threads,
    fair_share,
    follow_share,
    live_processes,
)


@pytest.fixture
def fresh_claim(monkeypatch: pytest.MonkeyPatch):
    """This process unregistered, on 4 usable cores, following at every call; torch's count
    restored after."""
    monkeypatch.setattr(threads, "_claim", None)
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    monkeypatch.setattr(threads, "_FOLLOW_EVERY_S", 0.0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def register_as_command(register: Path, process: subprocess.Popen) -> None:
    (register / str(process.pid)).write_text(_start_time(process.pid) or "")


@pytest.mark.parametrize(
    ("cores", "processes", "share"), [(2, 1, 2), (2, 2, 1), (2, 3, 1), (8, 3, 2), (1, 0, 1)]
)
def test_fair_share_is_an_equal_split_of_at_least_one(cores: int, processes: int, share: int):
    assert fair_share(cores, processes) == share


def test_live_processes_drops_finished_and_reused_pids(tmp_path: Path) -> None:
    alive, finished = sleeper(), sleeper()
    try:
        register_as_command(tmp_path, alive)
        register_as_command(tmp_path, finished)
        finished.kill()
        finished.wait()
        (tmp_path / "999999999").write_text("1")  # no such process
        (tmp_path / "notes.txt").write_text("not an entry")
        assert live_processes(tmp_path) == [alive.pid]
        assert not (tmp_path / str(finished.pid)).exists()
        assert not (tmp_path / "999999999").exists()
        # the same pid with another start time: a later process that was given the pid
        (tmp_path / str(alive.pid)).write_text("12345")
        assert live_processes(tmp_path) == []
    finally:
        alive.kill()
        alive.wait()


def test_a_command_follows_its_share_as_others_start_and_end(
    tmp_path: Path, fresh_claim: None
) -> None:
    assert claim_threads(register=tmp_path) == 4
    assert (tmp_path / str(os.getpid())).exists()
    other = sleeper()
    try:
        register_as_command(tmp_path, other)
        follow_share()
        assert torch.get_num_threads() == 2
    finally:
        other.kill()
        other.wait()
    follow_share()
    assert torch.get_num_threads() == 4


def test_a_count_set_by_other_code_is_left_alone_until_it_is_back(
    tmp_path: Path, fresh_claim: None
) -> None:
    claim_threads(register=tmp_path)
    other = sleeper()
    try:
        register_as_command(tmp_path, other)
        torch.set_num_threads(3)  # e.g. the async orchestrator's split for its workers
        follow_share()
        assert torch.get_num_threads() == 3
        torch.set_num_threads(4)  # restored by that code: the share follows again
        follow_share()
        assert torch.get_num_threads() == 2
    finally:
        other.kill()
        other.wait()


def test_a_pinned_count_is_kept(
    tmp_path: Path, fresh_claim: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert claim_threads(3, register=tmp_path) == 3
    other = sleeper()
    try:
        register_as_command(tmp_path, other)
        follow_share()
        assert torch.get_num_threads() == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the environment's count is a pin too
        assert claim_threads() == 1
        follow_share()
        assert torch.get_num_threads() == 1
    finally:
        other.kill()
        other.wait()


def test_zero_threads_is_refused(tmp_path: Path, fresh_claim: None) -> None:
    with pytest.raises(LeantrainError, match="--threads must be at least 1"):
        claim_threads(0, register=tmp_path)
