#!/usr/bin/env bash
# Build docker/Dockerfile.cpu, run it, ask it one /generate and one /v1/chat/completions,
# print both answers and stop the container. Run from anywhere:
#
#   docker/build-local.sh                 # docker if its daemon answers, else podman
#   ENGINE=podman PORT=30080 docker/build-local.sh
#
# Settings (environment variables):
#   ENGINE        docker | podman (default: docker if `docker info` works, else podman)
#   IMAGE         the tag built and run (default sglang-vc-cpu:local)
#   PORT          the host port the server is published on (default 30000)
#   BASE          the base image (default python:3.11-slim, Dockerfile.cpu's own)
#   SERVER_ARGS   extra launcher flags, e.g. "--dtype float32"
#   HEALTH_TIMEOUT seconds to wait for /health_generate (default 600)
#   BUILD_ONLY=1  build, print the time and size, run nothing
#   NO_CACHE=1    build the image from scratch (--no-cache; the base is kept)
#   GPU_STANDIN=1 then build docker/Dockerfile.gpu FROM a stand-in for the SGLang image
#                 (docker/gpu-standin.Dockerfile: the CPU image's venv without this
#                 project) and run and ask that image instead, on the CPU
#
# The last line it prints is "OK" when both answers came back.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
IMAGE=${IMAGE:-sglang-vc-cpu:local}
PORT=${PORT:-30000}
BASE=${BASE:-python:3.11-slim}
SERVER_ARGS=${SERVER_ARGS:-}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-600}
NAME=sglang-vc-check-$$
STATE=${STATE:-/var/tmp/sglang-vc-docker}   # where a bootstrapped base is built

# ---------------------------------------------------------------------------------------
# Environment-specific steps. Each is off where a normal Docker engine runs: it turns on
# only when its variable says so or when its probe fails here (the probe is the real
# operation, so a machine that needs no workaround gets none).
#
#   LOCAL_BASE   1: bootstrap the base with debootstrap (Debian bookworm: Python 3.11 with
#                venv, ca-certificates) from the Debian mirror the host's apt uses, import
#                it as sglang-vc-base:bookworm and build FROM it (BASE is ignored).
#                0: never. Unset: only when BASE is neither present nor pullable (no
#                registry reachable). Needs root and debootstrap. DEBIAN_MIRROR overrides
#                the mirror.
#   ULIMITS      --ulimit flags for every build step and the run. Unset: none, unless a
#                probe run fails to set its limits (podman as root raises nofile to 1048576;
#                a host whose hard limit is lower and that may not raise it refuses); then
#                the host's own hard limits (ulimit -Hn, -Hu), else nproc at 32768.
#   RUNTIME      an OCI runtime for podman (--runtime), e.g. runc where crun cannot run
#                ("cgroups in hybrid mode not supported"). Unset: the engine's default
#                (Debian 12's podman takes runc when crun is not installed).
#   HOST_CA      1: add the host's extra CA certificates (HOST_CA_DIR, default
#                /usr/local/share/ca-certificates/*.crt) to the base, for outbound TLS that
#                passes a proxy with its own certificate; pip and the model download then
#                trust them (PIP_CERT, SSL_CERT_FILE, REQUESTS_CA_BUNDLE). 0: never. Unset:
#                only when the base cannot verify https://pypi.org from a probe run and the
#                host has such certificates. The image then trusts them too.
#   WHEELS       a directory of wheels pip may install from (PIP_FIND_LINKS in the build;
#                podman only, mounted read-only: docker build has no --volume). Unset: the
#                host's PIP_FIND_LINKS where it names existing directories, so the image
#                gets what `make venv` gets on this host (e.g. a pre-staged CPU build of
#                torch); a normal machine has none. WHEELS= (empty) turns it off.
#   EXTRA_INDEX_URL  an extra pip index for the build (PIP_EXTRA_INDEX_URL there), e.g.
#                PyTorch's CPU wheels, https://download.pytorch.org/whl/cpu. Unset: none.
# ---------------------------------------------------------------------------------------

log() { printf '[build-local] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

pick_engine() {
    if [[ -n ${ENGINE:-} ]]; then
        command -v "$ENGINE" >/dev/null || die "ENGINE=$ENGINE: no such command"
    elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then
        ENGINE=docker
    elif command -v podman >/dev/null; then
        ENGINE=podman
    else
        die "neither a working docker (daemon answering) nor podman"
    fi
    log "engine: $ENGINE ($("$ENGINE" --version))"
}

image_exists() { "$ENGINE" image inspect "$1" >/dev/null 2>&1; }

bootstrap_base() {
    local tag=sglang-vc-base:bookworm
    if image_exists "$tag" && [[ ${REBUILD_BASE:-0} != 1 ]]; then
        log "base: $tag (bootstrapped earlier; REBUILD_BASE=1 redoes it)"
    else
        command -v debootstrap >/dev/null || die "LOCAL_BASE needs debootstrap (apt-get install debootstrap)"
        [[ $(id -u) == 0 ]] || die "LOCAL_BASE needs root (debootstrap)"
        local mirror=${DEBIAN_MIRROR:-}
        if [[ -z $mirror ]]; then  # the first Debian URI the host's apt uses
            mirror=$(grep -hoE '^(URIs:|deb) +[^ ]*' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list \
                2>/dev/null | awk '{print $2}' | grep -E '/debian/?$' | head -1 || true)
            mirror=${mirror:-http://deb.debian.org/debian}
        fi
        local rootfs=$STATE/rootfs
        log "base: bootstrapping Debian bookworm from $mirror into $rootfs"
        rm -rf "$rootfs" && mkdir -p "$STATE"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            bookworm "$rootfs" "$mirror" >"$STATE/debootstrap.log" 2>&1 \
            || die "debootstrap failed, see $STATE/debootstrap.log"
        tar -C "$rootfs" -c . | "$ENGINE" import - "$tag" >/dev/null
        rm -rf "$rootfs"
    fi
    BASE=$tag
}

resolve_base() {
    case ${LOCAL_BASE:-} in
        1) bootstrap_base ;;
        0) image_exists "$BASE" || "$ENGINE" pull "$BASE" || die "cannot pull $BASE" ;;
        *)
            if image_exists "$BASE"; then
                log "base: $BASE (present)"
            elif timeout 600 "$ENGINE" pull "$BASE" >&2; then
                log "base: $BASE (pulled)"
            else
                log "base: $BASE cannot be pulled (no registry reachable?): bootstrapping one"
                bootstrap_base
            fi ;;
    esac
}

probe() {  # [run options...] command...: one throw-away run of the base
    local opts=()
    while [[ ${1:-} == --* ]]; do opts+=("$1" "$2"); shift 2; done
    "$ENGINE" run --rm ${RUN_OPTS[@]+"${RUN_OPTS[@]}"} ${opts[@]+"${opts[@]}"} "$BASE" "$@"
}

resolve_run_options() {
    RUN_OPTS=()
    [[ -n ${RUNTIME:-} ]] && RUN_OPTS+=(--runtime "$RUNTIME")
    if [[ -n ${ULIMITS+set} ]]; then
        read -r -a extra <<<"$ULIMITS"
        RUN_OPTS+=(${extra[@]+"${extra[@]}"})
    else
        local out candidate
        if ! out=$(probe true 2>&1); then
            grep -q rlimit <<<"$out" || die "a probe run fails: $out"
            log "a probe run could not set its limits ($(grep -o 'error setting rlimit[^:]*' <<<"$out" | head -1))"
            # the host's hard limits; else nproc at 32768, podman build's own default
            for candidate in "$(ulimit -Hn):$(ulimit -Hu)" "$(ulimit -Hn):32768"; do
                ULIMITS="--ulimit nofile=${candidate%%:*}:${candidate%%:*} --ulimit nproc=${candidate##*:}:${candidate##*:}"
                read -r -a extra <<<"$ULIMITS"
                if out=$(probe "${extra[@]}" true 2>&1); then
                    log "using $ULIMITS"
                    RUN_OPTS+=("${extra[@]}")
                    return 0
                fi
            done
            die "a probe run fails with these limits too: $out"
        fi
    fi
}

add_host_ca() {
    local dir=${HOST_CA_DIR:-/usr/local/share/ca-certificates}
    local want=${HOST_CA:-}
    if [[ -z $want ]]; then
        local check='import urllib.request; urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=30)'
        local out
        if out=$(probe python3 -c "$check" 2>&1); then
            want=0
        elif grep -q CERTIFICATE_VERIFY_FAILED <<<"$out" && compgen -G "$dir/*.crt" >/dev/null; then
            log "the base cannot verify https://pypi.org (a proxy with its own certificate?): adding $dir/*.crt"
            want=1
        else
            log "warning: the base cannot reach https://pypi.org: $(tail -1 <<<"$out")"
            want=0
        fi
    fi
    [[ $want == 1 ]] || return 0
    compgen -G "$dir/*.crt" >/dev/null || die "HOST_CA=1 but no $dir/*.crt"
    local ctx
    ctx=$(mktemp -d)
    cp "$dir"/*.crt "$ctx/"
    cat >"$ctx/Containerfile" <<'EOF'
ARG BASE
FROM ${BASE}
COPY *.crt /usr/local/share/ca-certificates/
RUN update-ca-certificates
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
EOF
    local tag=sglang-vc-base:host-ca
    "$ENGINE" build -q ${BUILD_OPTS[@]+"${BUILD_OPTS[@]}"} --build-arg BASE="$BASE" -t "$tag" "$ctx" >/dev/null
    rm -rf "$ctx"
    BASE=$tag
}

resolve_wheels() {
    if [[ -z ${WHEELS+set} ]]; then
        WHEELS=""
        local d
        for d in ${PIP_FIND_LINKS:-}; do
            [[ -d $d ]] && WHEELS="$WHEELS $d"
        done
        WHEELS=${WHEELS# }
    fi
    [[ -n $WHEELS ]] || return 0
    if [[ $ENGINE != podman ]]; then
        log "warning: WHEELS ($WHEELS) ignored: docker build cannot mount a directory"
        return 0
    fi
    local d
    for d in $WHEELS; do
        BUILD_OPTS+=(--volume "$d:$d:ro")
    done
    BUILD_OPTS+=(--build-arg "PIP_FIND_LINKS=$WHEELS")
    log "wheels for the build: $WHEELS (PIP_FIND_LINKS)"
}

pick_engine
resolve_base
resolve_run_options
# what build steps need of the same: the runtime (podman) and the limits
BUILD_OPTS=()
[[ -n ${RUNTIME:-} ]] && BUILD_OPTS+=(--runtime "$RUNTIME")
[[ -n ${ULIMITS:-} ]] && { read -r -a extra <<<"$ULIMITS"; BUILD_OPTS+=("${extra[@]}"); }
[[ $ENGINE == podman ]] && BUILD_OPTS+=(--pull=never)  # the base is resolved above
add_host_ca
resolve_wheels
[[ -n ${EXTRA_INDEX_URL:-} ]] && BUILD_OPTS+=(--build-arg "PIP_EXTRA_INDEX_URL=$EXTRA_INDEX_URL")

build() {  # dockerfile tag [build options...]: builds, prints the time and the size
    local file=$1 tag=$2 start size
    shift 2
    log "building $tag from $file"
    start=$(date +%s)
    "$ENGINE" build ${BUILD_OPTS[@]+"${BUILD_OPTS[@]}"} "$@" -f "$ROOT/$file" -t "$tag" "$ROOT" >&2
    size=$("$ENGINE" image inspect --format '{{.Size}}' "$tag")
    echo "build $tag: $(( $(date +%s) - start )) s; image size $(( size / 1000000 )) MB"
}
no_cache=()
[[ ${NO_CACHE:-0} == 1 ]] && no_cache=(--no-cache)
build docker/Dockerfile.cpu "$IMAGE" ${no_cache[@]+"${no_cache[@]}"} --build-arg BASE="$BASE"
if [[ ${GPU_STANDIN:-0} == 1 ]]; then
    build docker/gpu-standin.Dockerfile sglang-vc-gpu-standin:local --build-arg CPU_IMAGE="$IMAGE"
    IMAGE=sglang-vc-gpu:standin
    build docker/Dockerfile.gpu "$IMAGE" ${no_cache[@]+"${no_cache[@]}"} --build-arg BASE=sglang-vc-gpu-standin:local
fi
[[ ${BUILD_ONLY:-0} == 1 ]] && exit 0

# --- run it, ask it, stop it ---
if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
    die "port $PORT is in use (PORT=... picks another)"
fi
stop() {
    if "$ENGINE" container inspect "$NAME" >/dev/null 2>&1; then
        log "stopping $NAME"
        "$ENGINE" stop -t 30 "$NAME" >/dev/null || true
        log "stopped: exit code $("$ENGINE" container inspect --format '{{.State.ExitCode}}' "$NAME" 2>/dev/null)"
        "$ENGINE" rm -f "$NAME" >/dev/null 2>&1 || true
    fi
}
trap stop EXIT
read -r -a server_args <<<"$SERVER_ARGS"
"$ENGINE" run -d --name "$NAME" ${RUN_OPTS[@]+"${RUN_OPTS[@]}"} -p "127.0.0.1:$PORT:30000" \
    "$IMAGE" ${server_args[@]+"${server_args[@]}"} >/dev/null
URL=http://127.0.0.1:$PORT
log "started $NAME, waiting for $URL/health_generate (up to $HEALTH_TIMEOUT s)"
start=$(date +%s)
until curl -sf -m 60 "$URL/health_generate" >/dev/null 2>&1; do
    if [[ $("$ENGINE" container inspect --format '{{.State.Running}}' "$NAME" 2>/dev/null) != true ]]; then
        "$ENGINE" logs --tail 40 "$NAME" >&2 || true
        die "the container stopped before answering"
    fi
    if (( $(date +%s) - start > HEALTH_TIMEOUT )); then
        "$ENGINE" logs --tail 40 "$NAME" >&2 || true
        die "no healthy answer in $HEALTH_TIMEOUT s"
    fi
    sleep 3
done
echo "healthy after $(( $(date +%s) - start )) s"

post() {  # path, body: prints the response body, fails on a non-200
    curl -sS -f -m 300 "$URL$1" -H 'Content-Type: application/json' -d "$2"
}
gen=$(post /generate '{"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}')
echo "generate: $gen"
chat=$(post /v1/chat/completions '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16, "temperature": 0}')
echo "chat: $chat"
python3 - "$gen" "$chat" <<'EOF' || true
import json, sys
print("generate text:", json.dumps(json.loads(sys.argv[1])["text"]))
print("chat content:", json.dumps(json.loads(sys.argv[2])["choices"][0]["message"]["content"]))
EOF
stop
trap - EXIT
echo OK
