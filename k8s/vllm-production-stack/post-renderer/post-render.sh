#!/bin/sh
# Helm post-renderer for the vLLM production-stack chart: adds objfs's native sidecar to every
# engine Deployment (see kustomization.yaml). Reads the rendered manifests on stdin, writes the
# result on stdout. Needs kubectl (its built-in kustomize).
#   helm install vllm vllm/vllm-stack -f k8s/vllm-production-stack/values.yaml \
#       --post-renderer k8s/vllm-production-stack/post-renderer/post-render.sh
set -eu
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$here/kustomization.yaml" "$here/objfs-sidecar.yaml" "$work/"
cat > "$work/all.yaml"
kubectl kustomize "$work"
