"""ModelClaim and warm-pool manifests: the guide's samples, validation reasons, pool policies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]
from hypothesis import given, settings
from hypothesis import strategies as st

from contract.quantity import GiB, MiB, QuantityError, parse_quantity
from contract.reasons import INVALID_ENGINE_CONFIG, INVALID_PER_GPU
from reconciler.model.manifests import (
    DUPLICATE,
    INVALID_NAME,
    INVALID_REPLICAS,
    INVALID_SPEC,
    INVALID_YAML,
    NO_AGENTS,
    AgentRef,
    ParseResult,
    PerGPU,
    engine_args_problem,
    parse_manifests,
    parse_sources,
)
from reconciler.model.policy import POLICY_OFF, PoolPolicy, parse_pool_policy
from reconciler.model.selector import (
    LabelSelector,
    Requirement,
    SelectorError,
    parse_selector,
)

ROOT = Path(__file__).resolve().parent.parent

# The guide's warm pool, as written there (Deployment and metrics Service).
SEED_POOL = """\
# A warm pool for ModelClaim: one Pod with one GPU. Claims select it by the
# claim.model.aibrix.ai/pool label.
apiVersion: apps/v1
kind: Deployment
metadata:
  name: warm-runtime-pool
  namespace: default
  labels:
    claim.model.aibrix.ai/pool: pool-a
    claim.model.aibrix.ai/enabled: "true"
spec:
  replicas: 1
  selector:
    matchLabels:
      app: warm-runtime-pool
  template:
    metadata:
      labels:
        app: warm-runtime-pool
        claim.model.aibrix.ai/pool: pool-a
        claim.model.aibrix.ai/enabled: "true"
    spec:
      containers:
        - name: aibrix-runtime
          # The runtime agent, vLLM and kvcached. The agent starts one engine
          # process for each claim placed on this Pod. Pin the tag to the full
          # SHA of the commit your control plane runs.
          image: aibrix/kvcached-runtime:nightly
          imagePullPolicy: IfNotPresent
          ports:
            - name: runtime
              containerPort: 8080
          readinessProbe:
            httpGet:
              path: /healthz
              port: 8080
            initialDelaySeconds: 3
            periodSeconds: 5
          env:
            - name: ENABLE_KVCACHED
              # The agent must not load kvcached itself. It turns kvcached on
              # in each engine it starts.
              value: "false"
            - name: KVCACHED_AUTOPATCH
              value: "0"
            - name: AIBRIX_WEIGHT_CACHE_DIR
              value: /root/.cache/huggingface
          resources:
            requests:
              # A sleeping engine keeps its model's weights in host memory, and
              # ModelClaim does not account for host memory. Request enough for
              # all the models on this Pod asleep at once.
              memory: 16Gi
            limits:
              nvidia.com/gpu: "1"
          volumeMounts:
            - name: dshm
              mountPath: /dev/shm
            - name: hf-cache
              mountPath: /root/.cache/huggingface
            - name: engine-registry
              mountPath: /var/run/aibrix
      volumes:
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: 16Gi
        # Weights downloaded by the engines stay on the node, for the next Pod.
        - name: hf-cache
          hostPath:
            path: /var/cache/aibrix/huggingface
            type: DirectoryOrCreate
        # The agent's list of engines, which it reads again after a restart.
        - name: engine-registry
          emptyDir: {}
---
# Exposes the runtime's /metrics for the ModelClaim ServiceMonitor in
# observability/monitor/service_monitor_modelclaim_runtime.yaml.
apiVersion: v1
kind: Service
metadata:
  name: warm-runtime-pool-metrics
  namespace: default
  labels:
    app: warm-runtime-pool
    claim.model.aibrix.ai/pool: pool-a
    aibrix.ai/metrics: modelclaim-runtime
spec:
  selector:
    app: warm-runtime-pool
  ports:
    - name: runtime
      port: 8080
      targetPort: runtime
"""

# The guide's two sample claims, as written there.
SEED_CLAIMS = """\
# Two small models that share the GPU of the warm-runtime-pool sample.
apiVersion: model.aibrix.ai/v1alpha1
kind: ModelClaim
metadata:
  name: qwen3-0-6b
  namespace: default
spec:
  modelName: qwen3-0.6b
  podSelector:
    matchLabels:
      claim.model.aibrix.ai/pool: pool-a
  artifactURL: huggingface://Qwen/Qwen3-0.6B
  engine: vllm
  replicas: 1
  # What one instance needs on a GPU: its footprint besides the KV cache, and
  # the KV cache for one request of the maximum length. Both leave room to
  # spare for this model with these engine arguments.
  perGPU:
    maximumFootprint: 6Gi
    kvFloor: 1Gi
  engineConfig:
    args:
      --max-model-len: "2048"
---
apiVersion: model.aibrix.ai/v1alpha1
kind: ModelClaim
metadata:
  name: qwen25-0-5b
  namespace: default
spec:
  modelName: qwen2.5-0.5b
  podSelector:
    matchLabels:
      claim.model.aibrix.ai/pool: pool-a
  artifactURL: huggingface://Qwen/Qwen2.5-0.5B-Instruct
  engine: vllm
  replicas: 1
  perGPU:
    maximumFootprint: 6Gi
    kvFloor: 1Gi
  engineConfig:
    args:
      --max-model-len: "2048"
"""

# The policies the guide writes.
SEED_POLICIES = [
    '{"lifecycle":{"sleepAfterSeconds":60}}',
    '{"lifecycle":{"sleepAfterSeconds":300,"noWakeReserveWhileAsleep":true}}',
]

POOL_AGENTS = {"warm-runtime-pool": [AgentRef("pool-pod-0", "http://10.0.0.5:8080")]}


def claim_doc(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "modelName": "m", "podSelector": {"matchLabels": {"claim.model.aibrix.ai/pool": "p"}},
        "artifactURL": "huggingface://org/m",
        "perGPU": {"maximumFootprint": "6Gi", "kvFloor": "1Gi"},
    }
    base.update(spec)
    for key in [k for k, v in base.items() if v is None]:
        del base[key]
    return {"apiVersion": "model.aibrix.ai/v1alpha1", "kind": "ModelClaim",
            "metadata": {"name": "c"}, "spec": base}


def parse_objects(*objs: dict[str, Any]) -> ParseResult:
    return parse_manifests(yaml.safe_dump_all(objs))


def reasons(result: ParseResult) -> list[str]:
    return [p.reason for p in result.problems]


# ---- the guide's samples --------------------------------------------------------------------


def test_the_guides_sample_claims_parse_as_written() -> None:
    result = parse_manifests(SEED_CLAIMS, "modelclaims.yaml")
    assert result.problems == ()
    first, second = result.claims
    assert (first.name, first.namespace, first.model_name) == ("qwen3-0-6b", "default",
                                                              "qwen3-0.6b")
    assert first.artifact_url == "huggingface://Qwen/Qwen3-0.6B"
    assert first.engine == "vllm" and first.replicas == 1
    assert first.per_gpu == PerGPU(6 * GiB, 1 * GiB)
    assert first.per_gpu.room == 7 * GiB
    assert dict(first.engine_args) == {"--max-model-len": "2048"}
    assert first.pod_selector.matches({"claim.model.aibrix.ai/pool": "pool-a"})
    assert not first.pod_selector.matches({"claim.model.aibrix.ai/pool": "pool-b"})
    assert first.gpus_needed == 1 and first.hold_reason is None
    assert (second.name, second.model_name) == ("qwen25-0-5b", "qwen2.5-0.5b")
    assert result.placeable_claims == result.claims


def test_the_guides_warm_pool_deployment_is_a_pool_once_its_agents_are_given() -> None:
    result = parse_manifests(SEED_POOL, deployment_agents=POOL_AGENTS)
    assert result.problems == ()
    (pool,) = result.pools
    assert (pool.name, pool.namespace, pool.source_kind) == ("warm-runtime-pool", "default",
                                                             "Deployment")
    assert pool.gpus_per_agent == 1
    assert pool.policy == POLICY_OFF and pool.policy_valid
    (agent,) = pool.agents
    assert agent.url == "http://10.0.0.5:8080"
    assert agent.labels["claim.model.aibrix.ai/pool"] == "pool-a"
    assert agent.labels["claim.model.aibrix.ai/enabled"] == "true"
    assert result.ignored == ("Service/warm-runtime-pool-metrics",)


def test_the_guides_claims_select_the_guides_pool() -> None:
    pool = parse_manifests(SEED_POOL, deployment_agents=POOL_AGENTS).pools[0]
    for claim in parse_manifests(SEED_CLAIMS).claims:
        assert all(claim.pod_selector.matches(a.labels) for a in pool.agents)


def test_the_guides_pool_policies_are_valid() -> None:
    assert parse_pool_policy(SEED_POLICIES[0]) == (PoolPolicy(sleep_after_seconds=60), None)
    assert parse_pool_policy(SEED_POLICIES[1]) == (
        PoolPolicy(sleep_after_seconds=300, no_wake_reserve_while_asleep=True,
                   sleep_to_make_room_after_seconds=30), None)


def test_an_annotated_deployment_takes_its_policy_from_the_annotation() -> None:
    doc = yaml.safe_load(SEED_POOL.split("\n---\n")[0])
    doc["metadata"]["annotations"] = {"claim.model.aibrix.ai/pool-policy": SEED_POLICIES[1]}
    (pool,) = parse_objects(doc).pools
    assert pool.policy.no_wake_reserve_while_asleep and pool.policy.sleep_after_seconds == 300


def test_the_repositorys_deployed_warm_pool_is_a_pool() -> None:
    text = (ROOT / "deploy" / "warm-runtime-pool.yaml").read_text()
    result = parse_manifests(text, deployment_agents=POOL_AGENTS)
    assert [p.name for p in result.pools] == ["warm-runtime-pool"]
    assert result.problems == ()


def test_a_deployment_without_agent_urls_is_reported_and_kept_empty() -> None:
    result = parse_manifests(SEED_POOL)
    assert reasons(result) == [NO_AGENTS]
    assert result.pools[0].agents == ()


def test_a_deployment_without_the_pool_label_is_not_a_pool() -> None:
    doc = yaml.safe_load(SEED_POOL.split("\n---\n")[0])
    del doc["metadata"]["labels"]["claim.model.aibrix.ai/pool"]
    result = parse_objects(doc)
    assert result.pools == () and result.ignored == ("Deployment/warm-runtime-pool",)


# ---- our pool format ------------------------------------------------------------------------

WARM_POOL = """\
kind: WarmPool
metadata:
  name: pool-a
  labels:
    claim.model.aibrix.ai/pool: pool-a
    claim.model.aibrix.ai/enabled: "true"
spec:
  policy: {"lifecycle": {"sleepAfterSeconds": 120, "noWakeReserveWhileAsleep": true,
                         "sleepToMakeRoomAfterSeconds": 45}}
  agents:
    - name: agent-a
      url: http://10.0.0.1:8080/
    - name: agent-b
      url: http://10.0.0.2:8080
      labels: {zone: b, claim.model.aibrix.ai/enabled: "false"}
"""


def test_a_warm_pool_lists_its_agents_with_the_pools_labels_and_their_own() -> None:
    result = parse_manifests(WARM_POOL)
    assert result.problems == ()
    (pool,) = result.pools
    assert pool.key == "default/pool-a"
    a, b = pool.agents
    assert a.url == "http://10.0.0.1:8080"
    assert dict(a.labels) == {"claim.model.aibrix.ai/pool": "pool-a",
                              "claim.model.aibrix.ai/enabled": "true"}
    assert b.labels["zone"] == "b" and b.labels["claim.model.aibrix.ai/enabled"] == "false"
    assert pool.policy == PoolPolicy(120, True, 45)


def test_a_warm_pool_policy_may_be_json_text() -> None:
    doc = yaml.safe_load(WARM_POOL)
    doc["spec"]["policy"] = SEED_POLICIES[0]
    assert parse_objects(doc).pools[0].policy == PoolPolicy(sleep_after_seconds=60)


def test_an_invalid_policy_turns_the_pools_policy_off_and_keeps_the_pool() -> None:
    doc = yaml.safe_load(WARM_POOL)
    doc["spec"]["policy"] = {"lifecycle": {"sleepAfterSecond": 60}}
    result = parse_objects(doc)
    (pool,) = result.pools
    assert pool.policy == POLICY_OFF and not pool.policy_valid
    (problem,) = result.problems
    assert (problem.kind, problem.name, problem.reason) == ("WarmPool", "pool-a",
                                                           "InvalidPoolPolicy")
    assert "sleepAfterSecond" in problem.message


@pytest.mark.parametrize("agent", [
    {"name": "x"},
    {"name": "x", "url": "ftp://h"},
    {"url": "http://h:1"},
    {"name": "x", "url": "http://h:1", "labels": {"a": True}},
    {"name": "x", "url": "http://h:1", "extra": 1},
])
def test_a_warm_pool_with_a_malformed_agent_is_left_out(agent: dict[str, Any]) -> None:
    doc = yaml.safe_load(WARM_POOL)
    doc["spec"]["agents"].append(agent)
    result = parse_objects(doc)
    assert result.pools == () and reasons(result) == [INVALID_SPEC]


def test_an_agent_may_belong_to_only_one_pool() -> None:
    doc = yaml.safe_load(WARM_POOL)
    other = yaml.safe_load(WARM_POOL)
    other["metadata"]["name"] = "pool-b"
    result = parse_objects(doc, other)
    assert [p.name for p in result.pools] == ["pool-a"] and reasons(result) == [DUPLICATE]


# ---- claims ---------------------------------------------------------------------------------


def test_a_claims_model_name_namespace_and_engine_have_defaults() -> None:
    doc = claim_doc(modelName=None)
    (claim,) = parse_objects(doc).claims
    assert (claim.model_name, claim.namespace, claim.engine, claim.replicas) == (
        "c", "default", "vllm", 1)


def test_a_claim_without_per_gpu_is_kept_and_held_back_with_invalid_per_gpu() -> None:
    result = parse_objects(claim_doc(perGPU=None))
    (claim,) = result.claims
    assert claim.per_gpu is None and claim.hold_reason == INVALID_PER_GPU
    assert reasons(result) == [INVALID_PER_GPU]
    assert result.placeable_claims == ()


@pytest.mark.parametrize("spec, fragment", [
    ({"perGPU": {"maximumFootprint": "six", "kvFloor": "1Gi"}}, "spec.perGPU.maximumFootprint"),
    ({"perGPU": {"maximumFootprint": True, "kvFloor": "1Gi"}}, "spec.perGPU.maximumFootprint"),
    ({"perGPU": {"maximumFootprint": "6Gi", "kvFloor": "1Gi", "extra": "1"}}, "extra"),
    ({"perGPU": "7Gi"}, "spec.perGPU"),
    ({"engineConfig": {"args": {"--max-model-len": True}}}, "--max-model-len"),
])
def test_a_claim_of_a_shape_the_crd_refuses_is_left_out_naming_the_field(
        spec: dict[str, Any], fragment: str) -> None:
    """The CRD's schema refuses these (a quantity pattern, int-or-string values, no unknown
    fields), so the parser does too (tests/test_kube_manifests.py compares the two)."""
    result = parse_objects(claim_doc(**spec))
    assert result.claims == ()
    (problem,) = result.problems
    assert problem.reason == INVALID_SPEC and fragment in problem.message


@pytest.mark.parametrize("per_gpu", [
    {"maximumFootprint": "0", "kvFloor": "1Gi"},
    {"maximumFootprint": "6Gi", "kvFloor": "-1Gi"},
    {"maximumFootprint": "6Gi"},
])
def test_a_per_gpu_figure_that_is_missing_or_not_positive_is_invalid_per_gpu(
        per_gpu: object) -> None:
    result = parse_objects(claim_doc(perGPU=per_gpu))
    assert reasons(result) == [INVALID_PER_GPU]
    assert result.claims[0].per_gpu is None


def test_per_gpu_figures_may_be_plain_bytes_or_decimal_quantities() -> None:
    (claim,) = parse_objects(claim_doc(perGPU={"maximumFootprint": 6442450944,
                                               "kvFloor": "1G"})).claims
    assert claim.per_gpu == PerGPU(6 * GiB, 10**9)


@pytest.mark.parametrize("args", [
    {"--gpu-memory-utilization": "0.9"},
    {"--gpu_memory_utilization": "0.9"},
    {"--tensor-parallel-size": "0"},
    {"--tensor-parallel-size": "two"},
    {"--pipeline-parallel-size": "-1"},
    {"--data-parallel-size": "2"},
    {"-dp": "2"},
    {"--model": "x"},
    {"--served-model-name": "x"},
    {"--host": "0.0.0.0"},
    {"--port": "9000"},
    {"--enable-sleep-mode": ""},
    {"--enable_sleep_mode": ""},
    {"max-model-len": "2048"},
    {"--max-model-len=2048": ""},
    {"--tensor-parallel-size": "2", "-tp": "2"},
])
def test_engine_arguments_the_guide_forbids_are_invalid_engine_config(
        args: dict[str, Any]) -> None:
    result = parse_objects(claim_doc(engineConfig={"args": args}))
    (claim,) = result.claims
    assert claim.hold_reason == INVALID_ENGINE_CONFIG
    assert reasons(result) == [INVALID_ENGINE_CONFIG]


def test_a_claim_with_both_problems_reads_invalid_engine_config_first() -> None:
    result = parse_objects(claim_doc(perGPU=None,
                                     engineConfig={"args": {"--port": "1"}}))
    assert sorted(reasons(result)) == [INVALID_ENGINE_CONFIG, INVALID_PER_GPU]
    assert result.claims[0].hold_reason == INVALID_ENGINE_CONFIG


def test_parallel_sizes_set_the_gpus_a_claim_needs() -> None:
    (claim,) = parse_objects(claim_doc(engineConfig={"args": {
        "--tensor-parallel-size": "2", "--pipeline_parallel_size": "2",
        "--data-parallel-size": "1", "--enforce-eager": ""}})).claims
    assert claim.hold_reason is None and claim.gpus_needed == 4
    assert claim.engine_args["--enforce-eager"] == ""


def test_an_unquoted_number_is_taken_as_its_string() -> None:
    (claim,) = parse_objects(claim_doc(engineConfig={"args": {"--max-model-len": 2048}})).claims
    assert claim.engine_args["--max-model-len"] == "2048" and not claim.problems


def test_sglang_claims_use_sglangs_parallel_flags_and_ollama_claims_need_one_gpu() -> None:
    (sg,) = parse_objects(claim_doc(engine="sglang",
                                    engineConfig={"args": {"--tp-size": "2"}})).claims
    assert sg.gpus_needed == 2 and not sg.problems
    assert engine_args_problem("sglang", {"--mem-fraction-static": "0.8"}) is not None
    assert engine_args_problem("sglang", {"--model-path": "x"}) is not None
    (ol,) = parse_objects(claim_doc(engine="ollama", artifactURL="ollama://qwen3:0.6b",
                                    engineConfig={"args": {"--context-length": "4096"}})).claims
    assert ol.gpus_needed == 1 and not ol.problems
    assert engine_args_problem("ollama", {"--max-model-len": "1"}) is not None
    assert engine_args_problem("ollama", {"--num-parallel": "0"}) is not None


def test_replicas_outside_one_to_eight_leave_the_claim_out() -> None:
    for bad in (0, 9, True, "2"):
        result = parse_objects(claim_doc(replicas=bad))
        assert result.claims == () and reasons(result) == [INVALID_REPLICAS], bad


def test_replicas_from_one_to_eight_are_taken() -> None:
    for good in (1, 2, 8):
        (claim,) = parse_objects(claim_doc(replicas=good)).claims
        assert claim.replicas == good


def test_a_claim_name_may_have_63_characters_and_not_64() -> None:
    ok, too_long = claim_doc(), claim_doc()
    ok["metadata"]["name"] = "a" * 63
    too_long["metadata"]["name"] = "b" * 64
    ok["spec"]["modelName"] = "ok"
    result = parse_objects(ok, too_long)
    assert [c.name for c in result.claims] == ["a" * 63]
    (problem,) = result.problems
    assert (problem.reason, problem.name) == (INVALID_NAME, "b" * 64)
    assert "63" in problem.message


@pytest.mark.parametrize("spec, fragment", [
    ({"artifactURL": None}, "artifactURL"),
    ({"podSelector": None}, "podSelector"),
    ({"podSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}, "In"),
    ({"engine": "tgi"}, "engine"),
    ({"modelName": "bad name"}, "modelName"),
    ({"perGpu": {"maximumFootprint": "1Gi", "kvFloor": "1Gi"}}, "perGpu"),
])
def test_a_claim_missing_a_required_field_is_left_out_with_a_reason(
        spec: dict[str, Any], fragment: str) -> None:
    result = parse_objects(claim_doc(**spec))
    assert result.claims == ()
    (problem,) = result.problems
    assert problem.reason == INVALID_SPEC and fragment in problem.message


def test_a_claim_with_another_api_version_is_left_out() -> None:
    doc = claim_doc()
    doc["apiVersion"] = "model.aibrix.ai/v1"
    result = parse_objects(doc)
    assert result.claims == () and result.problems[0].reason == "InvalidManifest"


def test_a_broken_document_does_not_hide_the_others() -> None:
    text = SEED_CLAIMS.replace("---\n", "---\nkind: [unclosed\n---\n", 1)
    result = parse_manifests(text, "claims.yaml")
    assert [c.name for c in result.claims] == ["qwen3-0-6b", "qwen25-0-5b"]
    (problem,) = result.problems
    assert problem.reason == INVALID_YAML and problem.source.startswith("claims.yaml#line")


def test_a_claim_or_model_name_defined_twice_keeps_the_first() -> None:
    result = parse_sources([("a.yaml", SEED_CLAIMS), ("b.yaml", SEED_CLAIMS)])
    assert [c.name for c in result.claims] == ["qwen3-0-6b", "qwen25-0-5b"]
    assert reasons(result) == [DUPLICATE, DUPLICATE]
    assert all(p.source.startswith("b.yaml") for p in result.problems)
    other = claim_doc()
    other["metadata"]["name"] = "d"
    result = parse_objects(claim_doc(), other)
    assert [c.name for c in result.claims] == ["c"] and "modelName" in result.problems[0].message


def test_a_document_that_is_not_a_mapping_is_reported() -> None:
    result = parse_manifests("- a\n- b\n---\n" + SEED_CLAIMS)
    assert len(result.claims) == 2 and reasons(result) == ["InvalidManifest"]


@settings(max_examples=200)
@given(st.text())
def test_parsing_never_raises_whatever_the_text(text: str) -> None:
    parse_manifests(text)


_leaf = st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.floats(
    allow_nan=False)
_tree = st.recursive(_leaf, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
    st.sampled_from(["spec", "perGPU", "args", "podSelector", "matchLabels", "name", "url",
                     "agents", "policy", "lifecycle", "engineConfig", "metadata", "x"]),
    kids, max_size=4), max_leaves=12)


@settings(max_examples=200)
@given(st.sampled_from(["ModelClaim", "WarmPool", "Deployment"]), _tree, _tree)
def test_parsing_never_raises_whatever_the_fields(kind: str, meta: object, spec: object) -> None:
    doc = {"apiVersion": "model.aibrix.ai/v1alpha1", "kind": kind, "metadata": meta,
           "spec": spec}
    if kind == "Deployment" and isinstance(meta, dict):
        meta["labels"] = {"claim.model.aibrix.ai/pool": "p"}
    parse_manifests(yaml.safe_dump(doc), deployment_agents=POOL_AGENTS)


@pytest.mark.parametrize("labels", [7, "claim.model.aibrix.ai/pool",
                                    ["claim.model.aibrix.ai/pool"]])
def test_a_deployment_with_malformed_labels_is_not_taken_for_a_pool(labels: object) -> None:
    doc = yaml.safe_load(SEED_POOL.split("\n---\n")[0])
    doc["metadata"]["labels"] = labels
    result = parse_objects(doc)
    assert result.pools == () and result.ignored == ("Deployment/warm-runtime-pool",)


# ---- quantities -----------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("6Gi", 6 * GiB), ("512Mi", 512 * MiB), ("1G", 10**9), ("1k", 1000), ("1Ki", 1024),
    ("1.5Gi", 3 * GiB // 2), ("1e3", 1000), ("1E9", 10**9), ("1500m", 2), (".5Ki", 512),
    ("1073741824", GiB), (" 1Gi ", GiB), (42, 42), (2.5, 3), ("0", 0), ("-1Gi", -GiB),
])
def test_quantities_are_read_as_kubernetes_reads_them(text: object, expected: int) -> None:
    assert parse_quantity(text) == expected


@pytest.mark.parametrize("text", ["", "Gi", "6 Gi", "6GB", "6gi", "1e999", "0x10", True, None,
                                  [1], float("inf")])
def test_anything_else_is_not_a_quantity(text: object) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(text)


@given(st.integers(0, 2**20), st.sampled_from(["Ki", "Mi", "Gi", "Ti", "k", "M", "G", "T", ""]))
def test_a_whole_number_with_a_suffix_is_that_number_times_the_suffix(
        n: int, suffix: str) -> None:
    scale = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6,
             "G": 10**9, "T": 10**12, "": 1}[suffix]
    assert parse_quantity(f"{n}{suffix}") == n * scale


# ---- selectors ------------------------------------------------------------------------------


def test_match_expressions_have_kubernetes_meaning() -> None:
    sel = parse_selector({"matchLabels": {"pool": "a"}, "matchExpressions": [
        {"key": "zone", "operator": "In", "values": ["x", "y"]},
        {"key": "tier", "operator": "NotIn", "values": ["old"]},
        {"key": "gpu", "operator": "Exists"},
        {"key": "drain", "operator": "DoesNotExist"}]})
    assert sel.matches({"pool": "a", "zone": "x", "gpu": "h200"})
    assert sel.matches({"pool": "a", "zone": "y", "gpu": "", "tier": "new"})
    assert not sel.matches({"pool": "a", "zone": "z", "gpu": "h200"})
    assert not sel.matches({"pool": "a", "zone": "x", "gpu": "h200", "tier": "old"})
    assert not sel.matches({"pool": "a", "zone": "x"})
    assert not sel.matches({"pool": "a", "zone": "x", "gpu": "h200", "drain": "yes"})
    assert not sel.matches({"pool": "b", "zone": "x", "gpu": "h200"})
    assert "zone in (x,y)" in sel.describe()


@pytest.mark.parametrize("raw", [
    "pool=a", {"matchLabels": {"a": 1}}, {"matchLabels": {"a": "b"}, "other": 1},
    {"matchExpressions": [{"key": "a", "operator": "Has"}]},
    {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]},
    {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": []}]},
    {"matchExpressions": {"key": "a"}},
])
def test_a_malformed_selector_is_refused(raw: object) -> None:
    with pytest.raises(SelectorError):
        parse_selector(raw)


_labels = st.dictionaries(st.sampled_from("abcd"), st.sampled_from(["x", "y", "z"]), max_size=4)


@given(_labels, st.sampled_from("abcd"), st.lists(st.sampled_from(["x", "y", "z"]), min_size=1,
                                                  max_size=3))
def test_not_in_is_the_opposite_of_in_and_exists_of_does_not_exist(
        labels: dict[str, str], key: str, values: list[str]) -> None:
    assert LabelSelector().matches(labels)
    is_in = Requirement(key, "In", tuple(values)).matches(labels)
    assert Requirement(key, "NotIn", tuple(values)).matches(labels) == (not is_in)
    assert Requirement(key, "Exists").matches(labels) != Requirement(
        key, "DoesNotExist").matches(labels)


# ---- pool policies --------------------------------------------------------------------------


@pytest.mark.parametrize("raw, expected", [
    (None, POLICY_OFF), ("", POLICY_OFF), ("{}", POLICY_OFF),
    ('{"reclaim": {"anything": 1}}', POLICY_OFF),
    ({"lifecycle": {"sleepAfterSeconds": 60}, "reclaim": {"x": True}}, PoolPolicy(60)),
    ({"lifecycle": {"noWakeReserveWhileAsleep": True}}, PoolPolicy(0, True, 30)),
    ({"lifecycle": {"sleepAfterSeconds": 0, "noWakeReserveWhileAsleep": True}},
     PoolPolicy(0, True, 30)),
    ({"lifecycle": {"sleepAfterSeconds": 10, "noWakeReserveWhileAsleep": True}},
     PoolPolicy(10, True, 10)),
    ({"lifecycle": {"sleepAfterSeconds": 300, "noWakeReserveWhileAsleep": True,
                    "sleepToMakeRoomAfterSeconds": 300}}, PoolPolicy(300, True, 300)),
    ({"lifecycle": {"noWakeReserveWhileAsleep": True, "sleepToMakeRoomAfterSeconds": 5}},
     PoolPolicy(0, True, 5)),
    ({"lifecycle": {"sleepAfterSeconds": 1.5}}, PoolPolicy(1.5, False, 1.5)),
])
def test_valid_policies_take_effect_with_the_guides_defaults(raw: object,
                                                              expected: PoolPolicy) -> None:
    assert parse_pool_policy(raw) == (expected, None)


@pytest.mark.parametrize("raw, fragment", [
    ('{"lifecycle": {"sleepAfterSeconds": 60, "sleepy": 1}}', "sleepy"),
    ('{"lifecycle": {}, "extra": {}}', "extra"),
    ('{"lifecycle": {}}', "noWakeReserveWhileAsleep"),
    ('{"lifecycle": {"sleepAfterSeconds": 0}}', "noWakeReserveWhileAsleep"),
    ('{"lifecycle": {"sleepAfterSeconds": -1}}', "negative"),
    ('{"lifecycle": {"sleepAfterSeconds": "60"}}', "number"),
    ('{"lifecycle": {"sleepAfterSeconds": true}}', "number"),
    ('{"lifecycle": {"sleepAfterSeconds": NaN}}', "NaN"),
    ('{"lifecycle": {"sleepAfterSeconds": 60, "noWakeReserveWhileAsleep": "yes"}}', "true or"),
    ('{"lifecycle": {"sleepAfterSeconds": 60, "sleepToMakeRoomAfterSeconds": 10}}',
     "only with"),
    ('{"lifecycle": {"noWakeReserveWhileAsleep": true, "sleepToMakeRoomAfterSeconds": 0}}',
     "positive"),
    ('{"lifecycle": {"sleepAfterSeconds": 20, "noWakeReserveWhileAsleep": true, '
     '"sleepToMakeRoomAfterSeconds": 30}}', "no longer"),
    ('{"lifecycle": [60]}', "object"),
    ('{"reclaim": 1}', "reclaim"),
    ("[1]", "object"),
    ("{lifecycle: 1}", "JSON"),
])
def test_an_invalid_policy_is_turned_off_with_the_reason(raw: str, fragment: str) -> None:
    policy, problem = parse_pool_policy(raw)
    assert policy == POLICY_OFF
    assert problem is not None and fragment in problem


@given(st.floats(0, 1e6), st.booleans(), st.none() | st.floats(-10, 1e6))
def test_a_valid_policy_always_has_a_positive_make_room_time_within_sleep_after(
        after: float, no_reserve: bool, make_room: float | None) -> None:
    life: dict[str, Any] = {"sleepAfterSeconds": after, "noWakeReserveWhileAsleep": no_reserve}
    if make_room is not None:
        life["sleepToMakeRoomAfterSeconds"] = make_room
    policy, problem = parse_pool_policy(json.dumps({"lifecycle": life}))
    if problem is None:
        assert policy.sleep_to_make_room_after_seconds > 0
        if policy.sleep_after_seconds > 0 and policy.no_wake_reserve_while_asleep:
            assert policy.sleep_to_make_room_after_seconds <= policy.sleep_after_seconds
        assert policy.idle_sleep or policy.no_wake_reserve_while_asleep
    else:
        assert policy == POLICY_OFF
