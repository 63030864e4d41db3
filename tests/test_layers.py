"""The layers stay as written in docs/design.md, checked by import-linter over `.importlinter`.

The contract package imports none of its users; engines/ and registry/ never import the daemon
or the reconciler; the reconciler never imports the agent; inside the agent, the API sits above
supervision, which sits above KV and GPU memory; no package's modules import each other in a cycle.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_import_contract_is_kept() -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    out = subprocess.run([str(lint), "--config", str(ROOT / ".importlinter"), "--no-cache"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_the_contracts_cover_every_package_we_ship() -> None:
    config = (ROOT / ".importlinter").read_text()
    for package in ("contract", "guard", "agent_client", "engines", "registry", "runtime_agent",
                    "reconciler"):
        assert f"    {package}\n" in config
