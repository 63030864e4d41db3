"""Engine flags are checked against the engine's own flag table at activation (issue 22).

An unknown flag used to answer 200, and the engine then exited with code 2 at every start
until its restart budget was spent. The tables in ``contract/flags/`` come from the real
parsers; the simulator refuses what they do not list, and so now does activation, with a 400
that names the flag.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contract.flags import flag_problem, known_flags
from runtime_agent.client import AgentError
from tests.harness import AgentProcess

VLLM = known_flags("vllm")
NAMES = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_0123456789"),
                min_size=1, max_size=30)


@pytest.mark.timeout(60)
@given(name=NAMES, value=st.sampled_from(["", "1", "abc"]))
def test_a_flag_the_table_does_not_list_is_refused_by_name(name: str, value: str) -> None:
    flag = "--" + name
    problem = flag_problem(flag, value, VLLM, "vllm")
    listed = flag in VLLM or flag.replace("_", "-") in VLLM
    if not listed:
        assert problem is not None and problem.startswith(f"{flag} is not a vllm flag")


@pytest.mark.timeout(60)
@given(flag=st.sampled_from(sorted(VLLM)), underscores=st.booleans())
def test_every_listed_flag_with_its_arity_passes(flag: str, underscores: bool) -> None:
    arity = VLLM[flag]
    value = "" if arity in ("no-value", "values*", "optional-value") else "8"
    spelled = "--" + flag[2:].replace("-", "_") if underscores and flag.startswith("--") else flag
    assert flag_problem(spelled, value, VLLM, "vllm") is None
    if arity == "no-value":
        assert "takes no value" in (flag_problem(spelled, "yes", VLLM, "vllm") or "")
    if arity == "value":
        assert "needs a value" in (flag_problem(spelled, "", VLLM, "vllm") or "")


@pytest.mark.integration
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("engine", "args", "named"), [
    ("vllm", {"--bogus-flag": ""}, "--bogus-flag is not a vllm flag"),
    ("vllm", {"--PORT": "9"}, "--PORT is not a vllm flag (did you mean --port?)"),
    ("vllm", {"--enforce-eager": "yes"}, "--enforce-eager takes no value"),
    ("vllm", {"--max-model-len": ""}, "--max-model-len needs a value"),
    ("sglang", {"--max-model-len": "64"}, "--max-model-len is not a sglang flag"),
])
def test_an_activation_with_a_flag_its_engine_refuses_is_a_400_naming_it(
    agent: AgentProcess, engine: str, args: dict[str, str], named: str,
) -> None:
    with pytest.raises(AgentError) as err:
        agent.client.activate("m", "hf://test/m", engine, args={"--sim-startup-seconds": "0.05",
                                                                **args})
    assert err.value.status == 400
    assert named in err.value.body["message"] and "contract/flags/" in err.value.body["message"]
    assert agent.client.snapshot()["models"] == []  # nothing started, no budget spent
    # The same activation spelled as the engine takes it starts.
    agent.activate_sim("ok", "--max_model_len=64", "--enforce-eager=")
    assert agent.wait_phase("ok", "active")["restart_count"] == 0
