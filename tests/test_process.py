"""Engine process plumbing: log tails and bounded log files."""

from __future__ import annotations

from pathlib import Path

from engines.process import tail_lines, trim_log


def test_a_log_past_its_bound_keeps_its_older_half_aside_and_starts_again(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text("".join(f"line {i}\n" for i in range(1000)))
    size = log.stat().st_size
    assert trim_log(log, size + 1) is False
    assert trim_log(log, size // 2) is True
    assert log.stat().st_size == 0
    assert (tmp_path / "engine.log.1").read_text().endswith("line 999\n")
    with log.open("a") as fh:  # the engine appends (O_APPEND) and lands at the new end
        fh.write("after\n")
    assert log.read_text() == "after\n"


def test_the_tail_skips_blank_lines_and_survives_a_missing_file(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text("a\n\nb\n  \nc\n")
    assert tail_lines(log, 2) == ["b", "c"]
    assert tail_lines(tmp_path / "nope.log") == []
