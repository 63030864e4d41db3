#!/usr/bin/env bash
# Builds the two runtime images from this repository and, with PUSH=1, pushes them.
#
#   images/build.sh                                   # build both, tag :dev, local only
#   REGISTRY=registry.example.com/aibrix TAG="$(git rev-parse HEAD)" PUSH=1 images/build.sh
#   IMAGES=cuda images/build.sh                       # only the vLLM + kvcached image
#
# Environment:
#   REGISTRY          image name prefix, e.g. registry.example.com/aibrix (default: none)
#   TAG               image tag (default: dev)
#   PUSH              1 pushes the images after building them (default 0)
#   IMAGES            which images: "cuda ollama" (default), "cuda" or "ollama"
#   PLATFORM          target platform (default linux/amd64, the only one the bases publish)
#   CUDA_BASE_IMAGE   base of the vLLM image (Dockerfile.cuda's BASE_IMAGE ARG)
#   OLLAMA_BASE_IMAGE base of the Ollama image (images/ollama/Dockerfile's BASE_IMAGE ARG)
#   DOCKER            the docker CLI (default docker)
#   DRY_RUN           1 prints the commands without running them
#
# Uses `docker buildx build` when buildx is installed (with --push when pushing, so the
# image goes straight from the builder to the registry), and `docker build` + `docker
# push` otherwise. Every command is printed before it runs.
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
registry=${REGISTRY:-}
tag=${TAG:-dev}
push=${PUSH:-0}
images=${IMAGES:-cuda ollama}
platform=${PLATFORM:-linux/amd64}
docker_cli=${DOCKER:-docker}
dry_run=${DRY_RUN:-0}

prefix=""
if [ -n "$registry" ]; then
  prefix="${registry%/}/"
fi

run() {
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  if [ "$dry_run" != 1 ]; then
    "$@"
  fi
}

if [ "$push" = 1 ] && [ -z "$registry" ]; then
  echo "build.sh: PUSH=1 needs REGISTRY (where to push)" >&2
  exit 2
fi

# The Dockerfiles use BuildKit syntax (COPY --chmod); buildx always builds with it.
export DOCKER_BUILDKIT=1
use_buildx=0
if "$docker_cli" buildx version > /dev/null 2>&1; then
  use_buildx=1
fi
echo "build.sh: context $repo_root, tag $tag, platform $platform, buildx $([ "$use_buildx" = 1 ] && echo yes || echo no), push $push"

build() {
  # build NAME DOCKERFILE BASE_IMAGE
  local ref="${prefix}$1:${tag}" dockerfile="$repo_root/$2" base=$3
  local args=(--file "$dockerfile" --platform "$platform" --tag "$ref")
  if [ -n "$base" ]; then
    args+=(--build-arg "BASE_IMAGE=$base")
  fi
  if [ "$use_buildx" = 1 ]; then
    if [ "$push" = 1 ]; then
      args+=(--push)
    else
      args+=(--load)
    fi
    run "$docker_cli" buildx build "${args[@]}" "$repo_root"
  else
    run "$docker_cli" build "${args[@]}" "$repo_root"
    if [ "$push" = 1 ]; then
      run "$docker_cli" push "$ref"
    fi
  fi
  if [ "$dry_run" = 1 ]; then
    echo "build.sh: would build $ref"
  else
    echo "build.sh: built $ref"
  fi
}

for image in $images; do
  case "$image" in
    cuda) build warm-pool-runtime-agent Dockerfile.cuda "${CUDA_BASE_IMAGE:-}" ;;
    ollama) build warm-pool-runtime-agent-ollama images/ollama/Dockerfile "${OLLAMA_BASE_IMAGE:-}" ;;
    *) echo "build.sh: unknown image '$image' (cuda or ollama)" >&2; exit 2 ;;
  esac
done
