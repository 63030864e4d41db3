"""The layers stay as written in docs/design.md, checked by import-linter over `.importlinter`.

The contract package imports none of its users; engines/ and registry/ never import the daemon
or the reconciler; the reconciler never imports the agent; inside the agent, the API sits above
supervision, which sits above KV and GPU memory; no package's modules import each other in a cycle
(the engine owner's parts included); no module outside the owner's package reads an owner's private
attribute.
"""

from __future__ import annotations

import ast
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



OWNER_PACKAGE = ROOT / "runtime_agent" / "supervision" / "owner"


def owner_privates(source: str, where: str) -> list[str]:
    """``x._name`` where ``x`` is named for an owner (``owner``, ``rig.owner``, ``self._owner``)."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            continue
        base = node.value
        name = base.id if isinstance(base, ast.Name) else (
            base.attr if isinstance(base, ast.Attribute) else "")
        if "owner" in name.lower():
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_outside_the_owners_package_reads_an_owners_private_attribute() -> None:
    sources = [p for d in ("runtime_agent", "reconciler", "engines", "registry", "tests")
               for p in (ROOT / d).rglob("*.py") if OWNER_PACKAGE not in p.parents]
    assert len(sources) > 100
    assert [hit for p in sources
            for hit in owner_privates(p.read_text(), str(p.relative_to(ROOT)))] == []


def test_the_private_attribute_check_finds_what_the_owner_rig_used_to_read() -> None:
    source = "rig.owner._inbox.put_nowait(Ready(rig.owner._gen, False))\nowner.view.phase\n"
    assert owner_privates(source, "t.py") == ["t.py:1: rig.owner._inbox", "t.py:1: rig.owner._gen"]
