#!/usr/bin/env bash
# A one-node Kubernetes 1.20.2 cluster that runs pods, for the end-to-end chart test, with no registry and no Docker:
#   control plane  etcd + kube-apiserver + kube-controller-manager (every controller) from tests/operator/k8s_testenv.sh
#   scheduler      kube-scheduler            } built from Debian's `kubernetes` source package by
#   node           kubelet (CRI: containerd) } `k8s_testenv.sh build-node`, cached with the control plane
#   runtime        containerd 1.6 and runc, Debian packages, with its own config, root and socket under RUNDIR
#   network        Debian's CNI plugins: a bridge (ibexk8s0, 10.244.0.0/24, gateway 10.244.0.1 = this host)
#   sandbox image  a static pause built from pause.c here, imported like the project image (no registry)
#   services       kube-proxy (iptables mode): pods reach the API server through the `kubernetes` Service
# Not run: cluster DNS (pods reach the host's stores by the gateway address; the client outside the cluster reaches
# the proxy Service with `kubectl port-forward`).
#
# Usage:
#   cluster.sh start RUNDIR        start everything; writes RUNDIR/env (KUBECONFIG, IBEX_CLUSTER_GATEWAY, ...)
#   cluster.sh load RUNDIR IMAGE   copy a podman image into the node's containerd (k8s.io namespace)
#   cluster.sh stop RUNDIR         stop pods, kubelet, containerd, scheduler and the control plane; unmount; remove
#                                  the bridge
# Needs root. apt-get installs containerd, containernetworking-plugins and podman when missing.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd -P)
REPO=$(cd "$HERE/../.." && pwd -P)
TESTENV=$REPO/tests/operator/k8s_testenv.sh
readonly BRIDGE=ibexk8s0 SUBNET=10.244.0.0/24 GATEWAY=10.244.0.1 NODE=ibex-node
readonly PAUSE_IMAGE=localhost/ibex-pause:1 READY_TIMEOUT_S=120

log() { printf '[cluster %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}

ensure_packages() {
	local missing=()
	command -v containerd >/dev/null || missing+=(containerd)
	[[ -x /usr/lib/cni/bridge ]] || missing+=(containernetworking-plugins)
	command -v podman >/dev/null || missing+=(podman)
	command -v gcc >/dev/null || missing+=(gcc libc6-dev)
	((${#missing[@]} == 0)) && return 0
	log "installing ${missing[*]} with apt-get"
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2
}

ctr_() { ctr --address "$RUNDIR/containerd.sock" -n k8s.io "$@"; }
kctl() { "$BIN/kubectl" --kubeconfig "$RUNDIR/kubeconfig" --request-timeout=10s "$@"; }

pid_alive() { [[ -f $RUNDIR/$1.pid ]] && kill -0 "$(<"$RUNDIR/$1.pid")" 2>/dev/null; }

stop_pid() {
	local name=$1 pid
	[[ -f $RUNDIR/$name.pid ]] || return 0
	pid=$(<"$RUNDIR/$name.pid")
	if kill -0 "$pid" 2>/dev/null && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "$RUNDIR"; then
		kill -TERM "$pid" 2>/dev/null || true
		for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
		kill -KILL "$pid" 2>/dev/null || true
		for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
	fi
	rm -f "$RUNDIR/$name.pid"
}

build_pause() {
	local cache=$1
	if [[ ! -x $cache/pause ]]; then
		gcc -O2 -static -o "$cache/pause.tmp" "$HERE/pause.c" && mv "$cache/pause.tmp" "$cache/pause"
	fi
	source "$REPO/.ci/podman-env"
	if ! podman image exists "$PAUSE_IMAGE"; then
		local dir
		dir=$(mktemp -d)
		cp "$cache/pause" "$dir/pause"
		tar -C "$dir" -cf "$dir/pause.tar" pause
		podman import --change 'ENTRYPOINT ["/pause"]' "$dir/pause.tar" "$PAUSE_IMAGE" >/dev/null
		rm -rf "$dir"
	fi
}

cmd_load() {
	local image=$1
	source "$REPO/.ci/podman-env"
	podman image exists "$image" || die "no podman image $image"
	# --all-platforms: podman's archive carries no platform index; the image is this machine's anyway
	podman save "$image" 2>/dev/null | ctr_ images import --all-platforms - >/dev/null
	local present
	present=$(ctr_ images ls -q)
	grep -qx "$image" <<<"$present" || die "$image did not arrive in containerd"
	log "loaded $image into containerd"
}

start_containerd() {
	mkdir -p "$RUNDIR/cni" "$RUNDIR/containerd"
	cat >"$RUNDIR/cni/10-ibex.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "ibex", "plugins": [
  {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": false,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$SUBNET", "gateway": "$GATEWAY"}]],
            "routes": [{"dst": "0.0.0.0/0"}],
            "dataDir": "$RUNDIR/cni-ipam"}},
  {"type": "loopback"}
]}
EOF
	cat >"$RUNDIR/containerd/config.toml" <<EOF
version = 2
root = "$RUNDIR/containerd/root"
state = "$RUNDIR/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$RUNDIR/containerd.sock"
[ttrpc]
  address = "$RUNDIR/containerd.sock.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  netns_mounts_under_state_dir = true
  # this host denies a negative oom_score_adj (the sandbox asks for -998): clamp to containerd's own
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$RUNDIR/cni"
EOF
	containerd --config "$RUNDIR/containerd/config.toml" </dev/null >"$RUNDIR/containerd.log" 2>&1 &
	echo $! >"$RUNDIR/containerd.pid"
	for _ in $(seq 100); do
		ctr_ version >/dev/null 2>&1 && return 0
		pid_alive containerd || break
		sleep 0.1
	done
	tail -n 20 "$RUNDIR/containerd.log" >&2
	die "containerd did not start"
}

start_bridge() {
	# Made here (not by the first pod) so the host's stores can listen on the gateway before any pod exists.
	ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
	ip addr show dev "$BRIDGE" | grep -q "inet $GATEWAY/" || ip addr add "$GATEWAY/24" dev "$BRIDGE"
	ip link set "$BRIDGE" up
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

start_node() {
	local kubelet_port healthz_port
	kubelet_port=$(free_port)
	healthz_port=$(free_port)
	mkdir -p "$RUNDIR/kubelet"
	cat >"$RUNDIR/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $GATEWAY
port: $kubelet_port
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $healthz_port
# the node's address is the bridge's (kubelet refuses a loopback node IP): a test machine's private network only,
# so the apiserver reaches the kubelet (logs, exec, port-forward) without client certificates
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
resolvConf: /etc/resolv.conf
serializeImagePulls: false
# a shared build machine: never evict our pods for the host's disk or memory use
evictionHard: {memory.available: "1Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
EOF
	"$BIN/kube-scheduler" --kubeconfig="$RUNDIR/kubeconfig" --leader-elect=false --port=0 \
		--bind-address=127.0.0.1 --secure-port="$(free_port)" </dev/null >"$RUNDIR/kube-scheduler.log" 2>&1 &
	echo $! >"$RUNDIR/kube-scheduler.pid"
	"$BIN/kubelet" --kubeconfig="$RUNDIR/kubeconfig" --config="$RUNDIR/kubelet/config.yaml" \
		--root-dir="$RUNDIR/kubelet/root" --cert-dir="$RUNDIR/kubelet/pki" \
		--container-runtime=remote --container-runtime-endpoint="unix://$RUNDIR/containerd.sock" \
		--hostname-override="$NODE" --node-ip="$GATEWAY" --v=1 \
		</dev/null >"$RUNDIR/kubelet.log" 2>&1 &
	echo $! >"$RUNDIR/kubelet.pid"
	# iptables mode; no oom_score_adj (denied here) and no conntrack sysctl changes
	"$BIN/kube-proxy" --kubeconfig="$RUNDIR/kubeconfig" --hostname-override="$NODE" --proxy-mode=iptables \
		--cluster-cidr="$SUBNET" --oom-score-adj=0 --conntrack-max-per-core=0 \
		--conntrack-tcp-timeout-established=0 --conntrack-tcp-timeout-close-wait=0 \
		--metrics-bind-address=127.0.0.1:$(free_port) --healthz-bind-address=127.0.0.1:$(free_port) \
		</dev/null >"$RUNDIR/kube-proxy.log" 2>&1 &
	echo $! >"$RUNDIR/kube-proxy.pid"
	local deadline=$((SECONDS + READY_TIMEOUT_S))
	until [[ $(kctl get node "$NODE" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null) == True ]]; do
		pid_alive kubelet || { tail -n 40 "$RUNDIR/kubelet.log" >&2; die "kubelet exited"; }
		pid_alive kube-scheduler || { tail -n 20 "$RUNDIR/kube-scheduler.log" >&2; die "kube-scheduler exited"; }
		pid_alive kube-proxy || { tail -n 20 "$RUNDIR/kube-proxy.log" >&2; die "kube-proxy exited"; }
		((SECONDS < deadline)) || { tail -n 40 "$RUNDIR/kubelet.log" >&2; die "node not Ready in ${READY_TIMEOUT_S} s"; }
		sleep 0.5
	done
}

cmd_start() {
	((EUID == 0)) || die "needs root (containerd, kubelet, the bridge)"
	mkdir -p "$1"
	RUNDIR=$(cd "$1" && pwd -P)
	ensure_packages
	bash "$TESTENV" build-node >&2
	BIN=$(bash "$TESTENV" bin-dir)
	local cache
	cache=$(dirname "$BIN")
	build_pause "$cache"
	start_bridge
	# Pods reach the API server as in any cluster: the `kubernetes` Service (10.0.0.1:443), whose endpoint is this
	# host's bridge address, through kube-proxy. The API server listens on every address (token auth, test port).
	IBEX_K8S_CONTROLLERS='*' IBEX_K8S_BIND_ADDRESS=0.0.0.0 IBEX_K8S_ADVERTISE_ADDRESS=$GATEWAY \
		IBEX_K8S_ENDPOINT_RECONCILER=lease bash "$TESTENV" start "$RUNDIR" >&2
	start_containerd
	cmd_load "$PAUSE_IMAGE"
	start_node
	{
		cat "$RUNDIR/env"
		printf "export IBEX_CLUSTER_GATEWAY='%s'\n" "$GATEWAY"
		printf "export IBEX_CLUSTER_NODE='%s'\n" "$NODE"
	} >"$RUNDIR/cluster.env"
	log "node $NODE Ready; KUBECONFIG=$RUNDIR/kubeconfig"
}

# The kubelet's own iptables chains (KUBE-FIREWALL, KUBE-MARK-*, canaries): not left behind on the machine.
remove_kubelet_chains() {
	local table chain
	while iptables -D INPUT -j KUBE-FIREWALL 2>/dev/null; do :; done
	while iptables -D OUTPUT -j KUBE-FIREWALL 2>/dev/null; do :; done
	for table in filter nat mangle; do
		for chain in $(iptables -t "$table" -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^KUBE-/ {print $2}'); do
			iptables -t "$table" -F "$chain" 2>/dev/null || true
		done
		for chain in $(iptables -t "$table" -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^KUBE-/ {print $2}'); do
			iptables -t "$table" -X "$chain" 2>/dev/null || true
		done
	done
}

cmd_stop() {
	[[ -d $1 ]] || return 0
	RUNDIR=$(cd "$1" && pwd -P)
	BIN=$(bash "$TESTENV" bin-dir)
	stop_pid kubelet
	stop_pid kube-proxy
	"$BIN/kube-proxy" --cleanup >/dev/null 2>&1 || true # its iptables chains
	remove_kubelet_chains
	stop_pid kube-scheduler
	if pid_alive containerd; then
		local t
		for t in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks kill -s KILL "$t" >/dev/null 2>&1 || true; done
		for t in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks delete -f "$t" >/dev/null 2>&1 || true; done
		for t in $(ctr_ containers ls -q 2>/dev/null); do ctr_ containers delete "$t" >/dev/null 2>&1 || true; done
	fi
	stop_pid containerd
	# shims of containers that were still being torn down
	local pid
	for pid in $(pgrep -f "containerd-shim-runc-v2 .*-address $RUNDIR/containerd.sock" || true); do
		kill -KILL "$pid" 2>/dev/null || true
	done
	findmnt -rn -o TARGET | grep "^$RUNDIR/" | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
	bash "$TESTENV" stop "$RUNDIR" >&2 || true
	ip link del "$BRIDGE" 2>/dev/null || true
	log "stopped ($RUNDIR)"
}

main() {
	local cmd=${1-}
	shift || true
	case $cmd in
	start) cmd_start "$@" ;;
	load)
		RUNDIR=$(cd "$1" && pwd -P)
		cmd_load "$2"
		;;
	stop) cmd_stop "$@" ;;
	*)
		printf 'usage: %s {start RUNDIR|load RUNDIR IMAGE|stop RUNDIR}\n' "$0" >&2
		exit 2
		;;
	esac
}

main "$@"
