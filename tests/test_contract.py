"""The contract package: engine-argument, artifact and name rules, and agent and reconciler agreeing.

The last tests feed the same claims to the agent's activation check and the reconciler's
manifest parser and compare their verdicts, so the two sides cannot drift apart again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]
from hypothesis import given
from hypothesis import strategies as st

from contract.engines import (
    artifact_problem,
    device_count_problem,
    engine_args_problem,
    gpus_needed,
    normalise_flag,
)
from contract.names import (
    ipc_name_for,
    ipc_name_problem,
    model_name_problem,
    sanitise_ipc_name,
    sent_ipc_name_problem,
)
from reconciler.model.manifests import parse_manifests
from registry.record import EngineSpec
from runtime_agent.settings import Settings
from runtime_agent.supervision.engine_kinds import gpus_needed as agent_gpus_needed
from runtime_agent.supervision.engine_kinds import spec_problem

# ---- engine arguments -------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "words"), [
    ({"--model": "x"}, "set by the runtime agent"),
    ({"--served_model_name": "x"}, "set by the runtime agent"),
    ({"--port=1": ""}, "the flag alone"),
    ({"--gpu-memory-utilization": "0.5"}, "kvcached"),
    ({"--tensor-parallel-size": "0"}, "positive whole"),
    ({"-tp": "two"}, "positive whole"),
    ({"--pipeline-parallel-size": "1.5"}, "positive whole"),
    ({"--data-parallel-size": "2"}, "data parallel"),
    ({"-dp": "2"}, "data parallel"),
    ({"max-model-len": "1"}, "not a flag"),
    ({"--max-model-len": "--enforce-eager"}, "itself a flag"),
    ({"--tensor-parallel-size": "2", "-tp": "2"}, "same flag"),
    ({"--max_model_len": "1", "--max-model-len": "1"}, "same flag"),
    ({"--chat-template": "a\x00b"}, "control character"),
])
def test_invalid_vllm_arguments_are_named(args: dict[str, str], words: str) -> None:
    problem = engine_args_problem("vllm", args)
    assert problem is not None and words in problem


def test_valid_vllm_arguments_pass() -> None:
    assert engine_args_problem("vllm", {"--tensor-parallel-size": "2", "--data-parallel-size": "1",
                                        "--max-model-len": "2048", "--enforce-eager": "",
                                        "--seed": "-1"}) is None


@pytest.mark.parametrize(("args", "words"), [
    ({"--mem-fraction-static": "0.8"}, "kvcached"),
    ({"--model-path": "x"}, "set by the runtime agent"),
    ({"--model": "x"}, "set by the runtime agent"),
    ({"--enable-memory-saver": ""}, "set by the runtime agent"),
    ({"--dp-size": "2"}, "data parallel"),
    ({"--tp-size": "2", "--tp": "2"}, "same flag"),
])
def test_invalid_sglang_arguments_are_named(args: dict[str, str], words: str) -> None:
    problem = engine_args_problem("sglang", args)
    assert problem is not None and words in problem


@pytest.mark.parametrize(("args", "words"), [
    ({"--max-model-len": "1"}, "not an Ollama setting"),
    ({"--context-length": "0"}, "positive whole"),
    ({"--num-parallel": "x"}, "positive whole"),
])
def test_invalid_ollama_settings_are_named(args: dict[str, str], words: str) -> None:
    problem = engine_args_problem("ollama", args)
    assert problem is not None and words in problem


def test_the_simulators_knobs_pass_only_for_a_simulated_engine() -> None:
    knob = {"--sim-load-seconds": "--weird"}
    assert engine_args_problem("ollama", knob, simulated=True) is None
    assert engine_args_problem("ollama", knob) is not None


def test_trust_remote_code_is_refused_unless_allowed() -> None:
    args = {"--trust_remote_code": ""}
    assert engine_args_problem("vllm", args) is None
    problem = engine_args_problem("vllm", args, allow_trust_remote_code=False)
    assert problem is not None and "--allow-trust-remote-code" in problem


@pytest.mark.parametrize(("engine", "args", "gpus"), [
    ("vllm", {}, 1), ("vllm", {"-tp": "2"}, 2), ("vllm", {"--tensor_parallel_size": "2",
                                                          "-pp": "2"}, 4),
    ("sim", {"-tp": "4"}, 4), ("sglang", {"--tp-size": "2"}, 2), ("sglang", {"--tp": "8"}, 8),
    ("ollama", {"--num-parallel": "4"}, 1)])
def test_gpus_needed_counts_every_spelling_of_the_parallel_flags(
        engine: str, args: dict[str, str], gpus: int) -> None:
    assert gpus_needed(engine, args) == gpus


def test_parallel_sizes_must_fit_the_nodes_gpus() -> None:
    args = {"--tensor-parallel-size": "2", "--pipeline-parallel-size": "2"}
    assert device_count_problem("vllm", args, 4) is None
    problem = device_count_problem("vllm", args, 2)
    assert problem is not None and "is 4" in problem and "2 GPUs" in problem


def test_flags_normalise_to_one_spelling() -> None:
    assert normalise_flag("--max_model_len") == "--max-model-len"
    assert normalise_flag("-tp") == "--tensor-parallel-size"
    assert normalise_flag("--tp-size", "sglang") == "--tensor-parallel-size"
    assert normalise_flag("--port=1") == "--port"


# ---- artifacts ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("engine", "url", "ok"), [
    ("vllm", "huggingface://Qwen/Qwen3-0.6B", True), ("vllm", "hf://a/b", True),
    ("vllm", "file:///tmp", True), ("vllm", "/tmp", True), ("vllm", "s3://bucket/x", False),
    ("vllm", "hf://", False), ("vllm", "", False), ("vllm", "a b", False),
    ("ollama", "ollama://qwen3:0.6b", True), ("ollama", "qwen3", True),
    ("ollama", "hf://Qwen/Qwen3", False), ("ollama", "ollama://", False)])
def test_artifact_urls_by_their_text(engine: str, url: str, ok: bool) -> None:
    assert (artifact_problem(engine, url) is None) is ok


def test_a_staged_scheme_is_accepted_when_the_agent_stages_it() -> None:
    assert artifact_problem("vllm", "s3://bucket/m") is not None
    assert artifact_problem("vllm", "s3://bucket/m", staged_schemes=("s3://",)) is None


def test_a_local_artifact_must_exist_inside_the_operators_roots(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path, artifact_local_roots=(tmp_path / "models",))
    (tmp_path / "models" / "m").mkdir(parents=True)
    here = EngineSpec(model_name="m", artifact_url=f"file://{tmp_path}/models/m", ipc_name="m")
    gone = EngineSpec(model_name="m", artifact_url=f"{tmp_path}/models/none", ipc_name="m")
    assert spec_problem(settings, here, 1) is None
    problem = spec_problem(settings, gone, 1)
    assert problem is not None and "does not exist" in problem
    # Outside the roots, an existing path and a missing one get the same refusal.
    outside = [spec_problem(settings, EngineSpec(model_name="m", artifact_url=url, ipc_name="m"),
                            1) for url in (str(tmp_path), f"{tmp_path}/nothing-here")]
    assert outside[0] == outside[1] and "allowed roots" in (outside[0] or "")


def test_trust_remote_code_needs_the_operators_consent(tmp_path: Path) -> None:
    spec = EngineSpec(model_name="m", artifact_url="hf://o/m", ipc_name="m",
                      args={"--trust-remote-code": ""})
    assert "--allow-trust-remote-code" in (spec_problem(Settings(state_dir=tmp_path), spec, 1)
                                           or "")
    allowed = Settings(state_dir=tmp_path, allow_trust_remote_code=True)
    assert spec_problem(allowed, spec, 1) is None


# ---- names --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3-0.6b", "Qwen/Qwen3-0.6B", "qwen3:32b", "a", "m@v2"])
def test_usual_model_names_are_accepted(name: str) -> None:
    assert model_name_problem(name) is None


@pytest.mark.parametrize("name", ["", "a b", "../x", "x/../y", "-x", ".hidden", "a//b", "a/",
                                  "x" * 129, "tab\t", "ü", "a\nb", None, 3])
def test_unsafe_model_names_are_refused(name: Any) -> None:
    assert model_name_problem(name) is not None


def test_the_name_rule_names_the_field_it_checks() -> None:
    assert "spec.modelName" in (model_name_problem("", "spec.modelName") or "")


@given(st.text(min_size=1, max_size=200))
def test_derived_ipc_names_are_always_safe_and_short(name: str) -> None:
    assert ipc_name_problem(ipc_name_for(name)) is None


def test_ipc_names_follow_the_sidecar_and_kvcached() -> None:
    assert ipc_name_for("qwen3-0.6b") == "kvc_qwen3-0-6b"
    assert ipc_name_for("Qwen/Qwen3-0.6B") == "kvc_Qwen-Qwen3-0-6B"
    assert sanitise_ipc_name("kvc_qwen3-0.6b") == "kvc_qwen3-0-6b"


@pytest.mark.parametrize(("sent", "ok"), [
    ("kvc_qwen3-0.6b", True), ("kvc_qwen3:32b", True), ("plain_name", True), ("", False),
    ("../etc/passwd", False), ("a\x00b", False), ("...", False), ("x" * 256, False)])
def test_sent_ipc_names_are_sanitised_unless_unsafe(sent: str, ok: bool) -> None:
    assert (sent_ipc_name_problem(sent) is None) is ok


# ---- agent and reconciler agree ---------------------------------------------------------------

_FLAGS = ["--tensor-parallel-size", "-tp", "--tensor_parallel_size", "--pipeline-parallel-size",
          "-pp", "--data-parallel-size", "-dp", "--max-model-len", "--model", "--port",
          "--gpu-memory-utilization", "--enforce-eager", "--trust-remote-code", "--tp-size",
          "--mem-fraction-static", "--context-length", "--num-parallel", "--model-path",
          "--bogus-flag", "--PORT"]
_VALUES = ["", "1", "2", "4", "0", "x", "--y", "2048"]


def _claim_verdict(engine: str, args: dict[str, str]) -> tuple[bool, int]:
    doc = {"apiVersion": "model.aibrix.ai/v1alpha1", "kind": "ModelClaim",
           "metadata": {"name": "c"},
           "spec": {"modelName": "m", "artifactURL": "ollama://m" if engine == "ollama"
                    else "hf://org/m", "engine": engine,
                    "podSelector": {"matchLabels": {"claim.model.aibrix.ai/pool": "p"}},
                    "perGPU": {"maximumFootprint": "6Gi", "kvFloor": "1Gi"},
                    "engineConfig": {"args": args}}}
    (claim,) = parse_manifests(yaml.safe_dump(doc)).claims
    return not claim.problems, claim.gpus_needed


def _agent_verdict(engine: str, args: dict[str, str], tmp: Path) -> tuple[bool, int]:
    spec = EngineSpec(model_name="m", artifact_url="ollama://m" if engine == "ollama"
                      else "hf://org/m", engine=engine, ipc_name="kvc_m", args=args)
    # The operator's own policy (--allow-trust-remote-code) is no part of the text rules.
    settings = Settings(state_dir=tmp, allow_trust_remote_code=True)
    return spec_problem(settings, spec, 1 << 30) is None, agent_gpus_needed(spec)


@given(st.sampled_from(["vllm", "ollama"]),
       st.dictionaries(st.sampled_from(_FLAGS), st.sampled_from(_VALUES), max_size=4))
def test_the_agent_and_the_reconciler_judge_every_claim_alike(
        engine: str, args: dict[str, str]) -> None:
    tmp = Path("/nonexistent-state-dir")  # the check reads no state
    claim_ok, claim_gpus = _claim_verdict(engine, args)
    agent_ok, agent_gpus = _agent_verdict(engine, args, tmp)
    assert claim_ok == agent_ok
    if claim_ok:  # a refused claim's GPUs are never counted
        assert claim_gpus == agent_gpus


def test_minus_tp_two_is_two_gpus_on_both_sides() -> None:
    tmp = Path("/nonexistent-state-dir")
    assert _claim_verdict("vllm", {"-tp": "2"}) == (True, 2)
    assert _agent_verdict("vllm", {"-tp": "2"}, tmp) == (True, 2)


def test_a_size_reads_in_binary_units_with_one_decimal_whatever_its_scale() -> None:
    from contract.quantity import GiB, MiB, TiB, gib

    assert [gib(n) for n in (12, 1536, 512 * MiB, 7 * GiB, TiB)] == [
        "12 B", "1.5 KiB", "512.0 MiB", "7.0 GiB", "1.0 TiB"]
    assert gib(3 * GiB // 2, sep="") == "1.5GiB" and gib(-2 * GiB) == "-2.0 GiB"
