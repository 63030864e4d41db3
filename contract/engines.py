"""Engine kinds and the rules for their arguments: one answer for the agent and the reconciler.

A claim (reconciler) and an activation (agent) carry the same ``engine`` and ``args``. Which
flags are the agent's own, which are forbidden, which spellings are one flag, and how many GPUs
an engine needs are answered here once, so the two sides cannot disagree (they did: for
``{"-tp": "2"}`` the reconciler counted 2 GPUs while the agent counted 1).

Everything here is pure: no I/O, no clock (the engines' flag tables, ``contract/flags/``, are package
data read once). Whether a local path exists is the agent's question.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from types import MappingProxyType

from contract.flags import arity_of, flag_problem, known_flags
from contract.numbers import whole_number


class EngineKind(enum.StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    OLLAMA = "ollama"
    SIM = "sim"  # the agent's simulated engine: vLLM's command line and HTTP API


# What a ModelClaim may name (the CRD's enum); the agent also takes ``sim``.
CLAIM_ENGINES: tuple[str, ...] = ("vllm", "sglang", "ollama")
AGENT_ENGINES: tuple[str, ...] = ("vllm", "sglang", "ollama", "sim")

TENSOR = "--tensor-parallel-size"
PIPELINE = "--pipeline-parallel-size"
DATA = "--data-parallel-size"

# Flags the agent sets itself; an activation may not pass them.
AGENT_OWNED_FLAGS = frozenset(
    {"--model", "--served-model-name", "--host", "--port", "--enable-sleep-mode"})
_OWNED: Mapping[str, frozenset[str]] = MappingProxyType({
    "vllm": AGENT_OWNED_FLAGS,
    # SGLang's --model-path is vLLM's MODEL; --enable-memory-saver is what lets it sleep, with
    # the weights kept in host memory (--enable-weights-cpu-backup); the agent reads its
    # request figures from --enable-metrics.
    "sglang": AGENT_OWNED_FLAGS | {"--model-path", "--enable-memory-saver",
                                   "--enable-weights-cpu-backup", "--enable-metrics"},
})
# kvcached manages the KV cache, so an engine must not size it from a fraction of the GPU.
_FORBIDDEN: Mapping[str, frozenset[str]] = MappingProxyType({
    "vllm": frozenset({"--gpu-memory-utilization"}),
    "sglang": frozenset({"--gpu-memory-utilization", "--mem-fraction-static"}),
})
# Other spellings of one flag, mapped to the spelling used in every comparison.
_ALIASES: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "vllm": {"-tp": TENSOR, "-pp": PIPELINE, "-dp": DATA},
    "sglang": {"--tp-size": TENSOR, "--tp": TENSOR, "--pp-size": PIPELINE, "--dp-size": DATA,
               "--dp": DATA, "--model": "--model-path"},
})
# Flags whose use widens what an engine may do on the node; refused unless the operator allows.
TRUST_REMOTE_CODE = "--trust-remote-code"

# What an Ollama activation may set, and the server setting each becomes (one server per model).
OLLAMA_ARG_ENV: Mapping[str, str] = MappingProxyType({
    "--context-length": "OLLAMA_CONTEXT_LENGTH",
    "--num-parallel": "OLLAMA_NUM_PARALLEL",
    "--models": "OLLAMA_MODELS",
    "--flash-attention": "OLLAMA_FLASH_ATTENTION",
    "--kv-cache-type": "OLLAMA_KV_CACHE_TYPE",
})
OLLAMA_ARGS = frozenset(OLLAMA_ARG_ENV)
_OLLAMA_POSITIVE = ("--context-length", "--num-parallel")
# The simulated engine's own knobs (fault injection, timings); only for simulated engines.
SIM_PREFIX = "--sim-"


def _rules_kind(engine: str) -> str:
    """The simulated engine takes vLLM's command line."""
    return "vllm" if engine == "sim" else engine


def normalise_flag(flag: str, engine: str = "vllm") -> str:
    """One spelling per flag: ``--foo_bar`` is ``--foo-bar``; short forms become long ones."""
    norm = flag.split("=", 1)[0]
    if norm.startswith("--"):
        norm = norm.replace("_", "-")
    return _ALIASES.get(_rules_kind(engine), {}).get(norm, norm)


def _positive_int(value: str) -> bool:
    return (whole_number(value) or 0) >= 1


def looks_like_flag(value: str) -> bool:
    """A value that is itself a flag (``--x``, ``-x``) would be read as one by the engine."""
    return len(value) >= 2 and value[0] == "-" and not value[1].isdigit() and value[1] != "."


def engine_args_problem(engine: str, args: Mapping[str, str], *, simulated: bool = False,
                        allow_trust_remote_code: bool = True,
                        field: str = "engine_config.args") -> str | None:
    """Why these engine arguments are invalid (reason ``InvalidEngineConfig``), or None.

    ``simulated`` admits the simulated engine's ``--sim-*`` knobs. ``field`` names the map in
    messages (``spec.engineConfig.args`` for a claim)."""
    kind = _rules_kind(engine)
    for flag, value in args.items():
        if not isinstance(flag, str) or not flag.startswith("-") or len(flag) < 2:
            return f"{field} key {flag!r} is not a flag: write it as '--{flag}'"
        if "=" in flag or any(c.isspace() or not c.isprintable() for c in flag):
            return f"{field} key {flag!r} must be the flag alone; put its value in the map's value"
        if not isinstance(value, str):
            return f"{field}[{flag!r}] must be a string (\"\" for a flag without a value)"
        if any(not c.isprintable() for c in value):
            return f"{field}[{flag!r}] contains a control character"
        if simulated and flag.startswith(SIM_PREFIX):
            continue
        if looks_like_flag(value):
            return (f"{field}[{flag!r}] is {value!r}, which is itself a flag; give each flag its "
                    "own key")
        if kind == "ollama":
            if flag not in OLLAMA_ARG_ENV:
                return (f"{flag} is not an Ollama setting; use one of "
                        f"{', '.join(sorted(OLLAMA_ARG_ENV))}")
            if flag in _OLLAMA_POSITIVE and not _positive_int(value):
                return f"{flag} must be a positive whole number, got {value!r}"
            continue
        norm = normalise_flag(flag, kind)
        if norm in _OWNED.get(kind, AGENT_OWNED_FLAGS):
            return f"{flag} is set by the runtime agent; leave it out of {field}"
        if norm in _FORBIDDEN.get(kind, frozenset()):
            return f"{flag} is not allowed: kvcached manages the KV cache"
        if norm == TRUST_REMOTE_CODE and not allow_trust_remote_code:
            return (f"{flag} runs code from the model repository on this node; the agent refuses "
                    "it unless started with --allow-trust-remote-code")
        if norm in (TENSOR, PIPELINE, DATA):
            if not _positive_int(value):
                return f"{flag} must be a positive whole number, got {value!r}"
            if norm == DATA and int(value) != 1:
                return f"{flag} must be 1: data parallelism is not supported"
        if (refused := _table_problem(flag, norm, value, kind)) is not None:
            return f"{field}: {refused}; the engine would exit at start (its own parser's flags: " \
                   f"contract/flags/{kind}.tsv)"
    if kind != "ollama":
        seen: dict[str, str] = {}
        for flag in args:
            norm = normalise_flag(flag, kind)
            if norm in seen:
                return f"{seen[norm]} and {flag} are the same flag; give it once"
            seen[norm] = flag
    return None


def _table_problem(flag: str, norm: str, value: str, kind: str) -> str | None:
    """What the engine's own parser would refuse in ``flag`` and ``value``, by its flag table:
    an unknown flag (one spelling of ours above counts as the flag it names) or a value where
    it takes none, or none where it needs one. Without the check it answered 200 and then
    exited with code 2 at every start until its restart budget was spent."""
    known = known_flags(kind)
    if not known:
        return None
    listed = arity_of(flag, known) is not None or arity_of(norm, known) is None
    return flag_problem(flag if listed else norm, value, known, kind)


def gpus_needed(engine: str, args: Mapping[str, str]) -> int:
    """GPUs one engine uses: tensor x pipeline parallel size (invalid sizes count as 1); 1 for
    Ollama, which runs on one card."""
    kind = _rules_kind(engine)
    if kind == "ollama":
        return 1
    sizes = {TENSOR: 1, PIPELINE: 1}
    for flag, value in args.items():
        norm = normalise_flag(flag, kind)
        if norm in sizes and _positive_int(value):
            sizes[norm] = int(value)
    return sizes[TENSOR] * sizes[PIPELINE]


def lora_enabled(engine: str, args: Mapping[str, str]) -> bool:
    """The engine was started to take LoRA adapters (vLLM: --enable-lora; SGLang also turns
    it on with --lora-paths)."""
    kind = _rules_kind(engine)
    if kind == "ollama":
        return False
    flags = {normalise_flag(flag, kind): value for flag, value in args.items()}
    if kind == "sglang" and "--lora-paths" in flags:
        return True
    return "--enable-lora" in flags and flags["--enable-lora"].lower() not in ("false", "0")


_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def adapter_name_problem(name: str) -> str | None:
    """A LoRA adapter name, as the AIBrix sidecar takes it and engines serve it."""
    if not _ADAPTER_NAME.fullmatch(name):
        return (f"lora_name {name!r} must be 1-128 letters, digits, '.', '_' or '-', starting "
                "with a letter or digit")
    return None


def device_count_problem(engine: str, args: Mapping[str, str], device_count: int) -> str | None:
    """Tensor x pipeline parallel size must fit the node's (Pod's) GPUs."""
    needed = gpus_needed(engine, args)
    if needed > device_count:
        return (f"tensor x pipeline parallel size is {needed}, but this node has {device_count} "
                f"GPU{'s' if device_count != 1 else ''}")
    return None


def uses_all_gpus(engine: str) -> bool:
    """vLLM and SGLang spread over tensor x pipeline cards; Ollama sits on one."""
    return _rules_kind(engine) != "ollama"


# ---- artifacts ------------------------------------------------------------------------------

HF_SCHEMES = ("huggingface://", "hf://")


def model_argument(artifact_url: str) -> str:
    """What vLLM or SGLang gets as the model: a Hugging Face repo id or a local path."""
    for scheme in HF_SCHEMES:
        if artifact_url.startswith(scheme):
            return artifact_url[len(scheme):]
    if artifact_url.startswith("file://"):
        return artifact_url[len("file://"):]
    return artifact_url


def is_local_artifact(artifact_url: str) -> bool:
    return artifact_url.startswith(("file://", "/", "./", "../"))


def ollama_tag(artifact_url: str) -> str:
    return artifact_url.removeprefix("ollama://")


def artifact_problem(engine: str, artifact_url: str,
                     staged_schemes: tuple[str, ...] = ()) -> str | None:
    """Why ``artifact_url`` cannot name this engine's model, from its text alone, or None.

    ``staged_schemes`` are schemes the agent stages itself before a start (``s3://``)."""
    if not artifact_url:
        return "artifact_url must not be empty"
    if any(not c.isprintable() or c.isspace() for c in artifact_url):
        return "artifact_url must not contain spaces or control characters"
    if _rules_kind(engine) == "ollama":
        if "://" in artifact_url and not artifact_url.startswith("ollama://"):
            return f"an Ollama artifact_url is ollama://NAME[:TAG] or NAME[:TAG]; got {artifact_url!r}"
        if not ollama_tag(artifact_url):
            return f"artifact_url {artifact_url!r} names no Ollama model"
        return None
    known = (*HF_SCHEMES, "file://", *staged_schemes)
    if "://" in artifact_url and not artifact_url.startswith(known):
        scheme = artifact_url.split("://", 1)[0]
        extra = "".join(f", {s}..." for s in staged_schemes)
        return (f"artifact_url scheme {scheme!r} is not supported; use huggingface://org/name, "
                f"hf://org/name, file:///path or a local path{extra}")
    if not model_argument(artifact_url).strip("/"):
        return f"artifact_url {artifact_url!r} names no model"
    return None
