"""Engine flags and their values are checked against the engine's own flag table at activation
(issue 22).

An unknown flag, or a known one with a value its parser cannot read (``--max-model-len abc``),
used to answer 200, and the engine then exited with code 2 at every start until its restart
budget was spent. The tables in ``contract/flags/`` come from the real parsers (names, arity,
value types and choices); the simulator refuses what they refuse, and so now does activation,
with a 400 that names the flag and what it takes.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contract.engines import engine_args_problem
from contract.flags import flag_problem, known_flags
from contract.flags.values import ValueType, value_types
from engines.sim.options import OptionsError, parse_options
from runtime_agent.client import AgentError
from tests.harness import ROOT, AgentProcess

VLLM = known_flags("vllm")
SGLANG = known_flags("sglang")
# What a parser of each type takes, for the property that every listed flag passes.
GOOD = {"int": "8", "float": "0.5", "str": "x", "lower": "x", "json": "{}", "json-or-str": "x",
        "size": "8", "size-or-auto": "8", "any": "x", "-": ""}


def good_value(vtype: ValueType) -> str:
    return vtype.choices[0] if vtype.choices else GOOD[vtype.word]
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
    value = "" if arity in ("no-value", "values*", "optional-value") \
        else good_value(value_types("vllm")[flag])
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
    ("vllm", {"--max-model-len": "abc"},
     "--max-model-len takes a whole number, one with a suffix such as 1k or 2M, or auto, got 'abc'"),
    ("vllm", {"--max_num_seqs": "1.5"}, "--max_num_seqs takes a whole number, got '1.5'"),
    ("vllm", {"--dtype": "fp99"}, "--dtype takes one of auto, bfloat16, float, float16, float32, "
                                  "half, got 'fp99'"),
    ("vllm", {"--max-model-len": "-1e5"}, "--max-model-len's value '-1e5' would be read as "
                                          "another flag"),
    ("sglang", {"--context-length": "1m"}, "--context-length takes a whole number, or one with"),
    ("sglang", {"--schedule-conservativeness": "lots"},
     "--schedule-conservativeness takes a number, got 'lots'"),
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


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kind", "flag", "value", "ok"), [
    ("vllm", "--max-model-len", "1k", True), ("vllm", "--max-model-len", "25.6k", True),
    ("vllm", "--max-model-len", "2K", True), ("vllm", "--max-model-len", "1.5K", False),
    ("vllm", "--max-model-len", "auto", True), ("vllm", "--max-model-len", "-1", True),
    ("vllm", "--max-model-len", "1 k", False), ("vllm", "--max-num-seqs", " 8 ", True),
    ("vllm", "--enable-prefix-caching", "", True), ("vllm", "--dtype", "half", True),
    ("vllm", "--hf-overrides", '{"a": 1}', True), ("vllm", "--hf-overrides", "{a}", False),
    ("vllm", "--hf-overrides", "plain", True), ("vllm", "--moe-backend", "TRITON", True),
    ("vllm", "--served-model-name", "None", True), ("vllm", "--max-log-len", "None", True),
    ("sglang", "--context-length", "1M", True), ("sglang", "--context-length", "1Ki", True),
    ("sglang", "--context-length", "1.5Ki", False), ("sglang", "--context-length", "1K", False),
    ("sglang", "--tp-size", "two", False), ("sglang", "--preferred-sampling-params", "[", False),
])
def test_a_value_is_judged_as_the_engines_own_parser_reads_it(
        kind: str, flag: str, value: str, ok: bool) -> None:
    known = VLLM if kind == "vllm" else SGLANG
    assert (flag_problem(flag, value, known, kind) is None) is ok, flag_problem(
        flag, value, known, kind)


HOSTILE = st.one_of(st.text(max_size=40), st.sampled_from(
    ["", "None", "nan", "-inf", "1e999", "1_000", "0x10", "-1", "-.5", "--x", "-x", "{", "[]",
     "{}", "1k", "1K", "1.5K", "1Ki", "auto", "AUTO", "9" * 5000, "\u0661", " 8 "]))
TYPED = sorted(flag for flag, vtype in value_types("vllm").items()
               if vtype.word not in ("-", "any") and flag.startswith("--"))


@pytest.mark.timeout(120)
@given(flag=st.sampled_from(TYPED), value=HOSTILE)
def test_activation_and_the_simulator_refuse_the_same_hostile_values(flag: str, value: str) -> None:
    """Whatever a value is, the simulated engine's own command line and activation agree:
    what one refuses the other does, so a spec that starts in tests starts on the real
    engine, and one refused by the engine is refused before anything starts."""
    args = {flag: value}
    refused_here = engine_args_problem("vllm", args)
    if refused_here is not None and "flag" not in refused_here and "takes" not in refused_here \
            and "would be read" not in refused_here:
        return  # the agent's own rules (owned, forbidden, sizes): not the parser's question
    argv = ["serve", "m", flag, *([value] if value != "" else [])]
    try:
        parse_options(argv, {})
        refused_there = False
    except (OptionsError, SystemExit):
        refused_there = True
    assert refused_there is (refused_here is not None), (refused_here, argv)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "said"), [
    (["--max-model-len", "abc"], "argument --max-model-len: invalid size-or-auto value: 'abc'"),
    (["--max-num-seqs", "1.5"], "argument --max-num-seqs takes a whole number, got '1.5'"),
    (["--dtype", "fp99"], "argument --dtype takes one of auto,"),
    (["--seed"], "argument --seed needs a value"),
])
def test_the_simulated_engine_exits_2_on_a_value_its_real_engine_refuses(
        args: list[str], said: str) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "engines.sim", "serve", "m", *args],
                          capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert done.returncode == 2 and said in done.stderr
