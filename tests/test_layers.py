"""The layers stay as written in docs/design.md, checked by import-linter over `.importlinter`.

The contract package imports none of its users; engines/ and registry/ never import the daemon
or the reconciler; the reconciler never imports the agent; inside the agent, the API sits above
supervision, which sits above KV and GPU memory; no package's modules import each other in a cycle
(the engine owner's parts included); no module outside the owner's package reads an owner's private
attribute; the owner, its watchers, the KV keeper, the pacer and the memory broker read and wait
for time only on the injected clock (``contract.clock``), and so do the reconciler's controller
runtime, its Kubernetes parts and its core.
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
    for package in ("contract", "guard", "agent_client", "engine_http", "engines", "registry",
                    "runtime_agent", "reconciler"):
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


TIMED = [ROOT / "runtime_agent" / "supervision", ROOT / "runtime_agent" / "kv",
         ROOT / "runtime_agent" / "cadence.py", ROOT / "runtime_agent" / "gpu" / "broker.py"]
LOOP_TIMERS = {"call_later", "call_at"}  # any loop's, however it was reached
OWN_TIME = {("time", "monotonic"), ("asyncio", "sleep"), ("asyncio", "timeout"),
            ("asyncio", "timeout_at")}


def own_time(source: str, where: str) -> list[str]:
    """Time read or waited for behind the injected clock's back: ``x.call_later``/``call_at``,
    ``time.monotonic``, ``asyncio.sleep``/``timeout``, or one of them imported by name."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Attribute) and (
                node.attr in LOOP_TIMERS or (isinstance(node.value, ast.Name)
                                             and (node.value.id, node.attr) in OWN_TIME)):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and any(
                (node.module, alias.name) in OWN_TIME for alias in node.names):
            found.append(f"{where}:{node.lineno}: from {node.module} import ...")
    return found


def test_the_owners_watchers_keeper_pacer_and_broker_take_time_from_the_injected_clock() -> None:
    sources = sorted(p for t in TIMED for p in ([t] if t.suffix else t.rglob("*.py")))
    assert len(sources) > 25
    assert [hit for p in sources for hit in own_time(p.read_text(), str(p.relative_to(ROOT)))] == []


RECONCILER = ROOT / "reconciler"
RECONCILER_TIMED = [RECONCILER / "runtime", RECONCILER / "kube", RECONCILER / "core.py",
                    RECONCILER / "context.py", RECONCILER / "observe.py", RECONCILER / "local"]
# The route publisher waits for a mark under ``asyncio.timeout``: the clock-driven wait
# (``runtime_agent.loops.wait_event``) is the agent's, which the reconciler may not import.
RECONCILER_UNTIMED = {RECONCILER / "kube" / "routes.py"}


def test_the_reconcilers_runtime_kubernetes_parts_and_core_take_time_from_the_injected_clock(
        ) -> None:
    sources = sorted(p for t in RECONCILER_TIMED for p in ([t] if t.suffix else t.rglob("*.py"))
                     if p not in RECONCILER_UNTIMED)
    assert len(sources) > 15
    assert [hit for p in sources for hit in own_time(p.read_text(), str(p.relative_to(ROOT)))] == []


def test_the_clock_check_finds_each_way_around_the_clock() -> None:
    source = ("asyncio.get_running_loop().call_later(1, f)\nloop.call_at(5, f)\n"
              "t = time.monotonic()\nawait asyncio.sleep(1)\nfrom time import monotonic\n"
              "async with asyncio.timeout(3): pass\nclock.now(); await clock.sleep(1)\n")
    assert sorted(hit.split(": ")[0] for hit in own_time(source, "t.py")) == [
        "t.py:1", "t.py:2", "t.py:3", "t.py:4", "t.py:5", "t.py:6"]
