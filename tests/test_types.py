"""The code type-checks under mypy --strict (a test, so the README's test command covers it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(360)  # a cold mypy cache on a slow machine
def test_the_packages_pass_a_strict_type_check() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "runtime_agent",
         "engines", "registry", "reconciler", "guard", "agent_client", "engine_http"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
