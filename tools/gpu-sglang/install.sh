# gpu-sglang, device side: install the bundle and the project, then export the environment.
# Source it, from the project checkout's root on the device (one call, `carry: [".gpu/sglang"]`):
#   source .gpu/sglang/install.sh [BUNDLE_DIR [PROJECT_DIR]] && <your command>
# BUNDLE_DIR defaults to this file's folder, PROJECT_DIR to the current directory.
#  * unpacks SGLang 0.5.17 and its dependencies into /tmp/sgsite (skipped when a warm machine
#    already holds this bundle there);
#  * installs the project and the posix-ipc wheel into /tmp/sgsite with
#    pip --no-deps --no-index --no-build-isolation (console scripts kvctl, kvcached, and
#    kvcached_sglang.pth, the SGLang patch's delivery);
#  * writes /tmp/sgsite/sitecustomize.py, which makes /tmp/sgsite a site directory in every
#    interpreter (a PYTHONPATH entry's .pth files are not read otherwise, and SGLang spawns its
#    scheduler: kvcached_sglang.pth must run there), then runs the image's own sitecustomize;
#  * writes /tmp/gpu-sglang/env.sh (environment + gs_serve/gs_wait/gs_stop), sources it and
#    prints it. A later call on the same warm machine can run `source /tmp/gpu-sglang/install.sh`
#    with nothing carried (the project is reinstalled from the current directory each time;
#    GS_NO_PROJECT=1 skips that).
# /tmp/sgsite, not gpu-vllm's /tmp/site: both bundles can live on one machine (one server each).
# Never exits the calling shell: it returns non-zero on failure.

_gs_now() { if [ -n "${EPOCHREALTIME:-}" ]; then echo "${EPOCHREALTIME/,/.}"; else date +%s.%N; fi; }
_gs_dt() { awk -v a="$1" -v b="$(_gs_now)" 'BEGIN { printf "%.1f", b - a }'; }

_gs_install() {
    local here bundle proj site=/tmp/sgsite state=/tmp/gpu-sglang t0 t1 py want have
    t0=$(_gs_now)
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd) || return 1
    bundle=$(cd "${1:-$here}" && pwd) || { echo "gpu-sglang: no bundle dir ${1:-$here}" >&2; return 1; }
    proj=$(cd "${2:-$PWD}" && pwd) || { echo "gpu-sglang: no project dir $2" >&2; return 1; }
    py=$(command -v python3) || { echo "gpu-sglang: no python3" >&2; return 1; }
    mkdir -p "$state" || return 1

    # 1. SGLang + dependencies (skipped when /tmp/sgsite already holds this bundle)
    have=$(cat "$site/.gpu-sglang-id" 2>/dev/null)
    if [ -f "$bundle/site.tar.xz" ]; then
        want=$(cat "$bundle/BUNDLE_ID" 2>/dev/null || echo unknown)
    elif [ -n "$have" ]; then
        want=$have
    else
        echo "gpu-sglang: no site.tar.xz in $bundle and nothing in $site yet: carry the bundle" >&2; return 1
    fi
    if [ "$want" = "$have" ]; then
        echo "gpu-sglang: $site already holds bundle $have: unpack skipped"
    else
        rm -rf "$site" && mkdir -p "$site" || return 1
        if command -v xz >/dev/null; then
            tar -xJf "$bundle/site.tar.xz" -C "$site" || { echo "gpu-sglang: untar failed" >&2; return 1; }
        else
            "$py" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="tar")' \
                "$bundle/site.tar.xz" "$site" || return 1
        fi
        echo "$want" > "$site/.gpu-sglang-id"
        echo "gpu-sglang: unpacked bundle $want into $site ($(du -sm "$site" | cut -f1) MB) in $(_gs_dt "$t0") s"
    fi
    if [ "$bundle" != "$state" ]; then   # keep the small files for later calls on this machine
        cp -f "$bundle"/install.sh "$bundle"/selftest.sh "$bundle"/*.py "$bundle"/BUNDLE_ID "$state/" 2>/dev/null
        cp -f "$bundle"/posix_ipc-*.whl "$state/" 2>/dev/null
    fi

    # 2. the project (and posix-ipc), with its console scripts and kvcached_sglang.pth
    t1=$(_gs_now)
    if [ -n "${GS_NO_PROJECT:-}" ]; then
        echo "gpu-sglang: GS_NO_PROJECT set: project not installed"
    elif [ -f "$proj/pyproject.toml" ] || [ -f "$proj/setup.py" ]; then
        local name whl
        whl=$(ls "$bundle"/posix_ipc-*.whl "$state"/posix_ipc-*.whl 2>/dev/null | head -1)
        name=$(cd "$proj" && "$py" -c 'import re,tomllib;print(re.sub(r"[-_.]+","_",tomllib.load(open("pyproject.toml","rb"))["project"]["name"]))' 2>/dev/null)
        [ -n "$name" ] && rm -rf "$site/$name"-*.dist-info "$site/$name" "$site/bin" "$site"/kvcached_sglang.pth
        # built from a copy, so a stale build/ (kept on a warm machine) can't bring back deleted
        # modules, and nothing is written into the checkout
        rm -rf "$state/src" && mkdir -p "$state/src" || return 1
        tar -C "$proj" --anchored --exclude='./.*' --exclude=./build --exclude=./dist \
            --no-anchored --exclude='*.egg-info' --exclude=__pycache__ -cf - . | tar -C "$state/src" -xf - || return 1
        if ! PYTHONPATH= "$py" -m pip install -q --no-deps --no-index --no-build-isolation --no-compile \
            --disable-pip-version-check --root-user-action=ignore --target "$site" --upgrade \
            "$state/src" $whl > "$state/pip.log" 2>&1; then
            cat "$state/pip.log" >&2; echo "gpu-sglang: pip install of $proj failed" >&2; return 1
        fi
        [ -f "$site/kvcached_sglang.pth" ] ||
            { echo "gpu-sglang: the project's wheel put no kvcached_sglang.pth into $site" >&2; return 1; }
        echo "gpu-sglang: installed ${name:-the project} from $proj (+ $(basename "${whl:-no posix-ipc wheel}")) in $(_gs_dt "$t1") s"
    else
        echo "gpu-sglang: no pyproject.toml or setup.py in $proj: project not installed"
    fi
    cat > "$site/sitecustomize.py" <<'PYEOF'
# gpu-sglang: /tmp/sgsite is on PYTHONPATH, whose .pth files Python does not read; make it a site
# directory so kvcached_sglang.pth runs in every interpreter (SGLang spawns its scheduler and
# detokenizer), then run the sitecustomize this one shadows, if the image has one.
import os as _os
import site as _site
import sys as _sys

_here = _os.path.dirname(_os.path.abspath(__file__))
_site.addsitedir(_here)
for _p in list(_sys.path):
    _f = _os.path.join(_p or ".", "sitecustomize.py")
    if _os.path.abspath(_p or ".") != _here and _os.path.isfile(_f):
        with open(_f) as _src:
            exec(compile(_src.read(), _f, "exec"), {"__name__": "sitecustomize", "__file__": _f})
        break
PYEOF

    # 3. environment, and helpers for servers (setsid, so each is stopped by its process group)
    cat > "$state/env.sh" <<'ENVEOF'
case ":${PYTHONPATH:-}:" in *:/tmp/sgsite:*) ;; *) export PYTHONPATH=/tmp/sgsite${PYTHONPATH:+:$PYTHONPATH} ;; esac
case ":$PATH:" in *:/tmp/sgsite/bin:*) ;; *) export PATH=/tmp/sgsite/bin:$PATH ;; esac
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 SGLANG_IS_FLASHINFER_AVAILABLE=false
# SGLang's JIT kernels (rope, ...) are built by tvm-ffi, which links -lcudart from $CUDA_HOME and
# otherwise takes the folder above the nvcc on PATH (a wrapper script there has no lib64).
if [ -z "${CUDA_HOME:-}" ]; then for _d in /usr/local/cuda /usr/local/cuda-13*; do
  [ -x "$_d/bin/nvcc" ] && [ -e "$_d/lib64/libcudart.so" ] && { export CUDA_HOME=$_d; break; }; done; fi
# The arguments every bundle server needs (what the bundle carries): Triton attention (no FA3),
# torch sampling (no FlashInfer kernels), no grammar backend (no xgrammar library).
GS_ARGS="--attention-backend triton --sampling-backend pytorch --grammar-backend none"
# gs_serve NAME PORT [launch_server args]: start SGLang's HTTP server in its own process group
#   with $GS_ARGS, log to ${GS_LOGS:-${OUT:-/tmp/gpu-sglang/logs}}/NAME.log (VAR=value before it sets env)
# gs_wait NAME PORT [TIMEOUT_S=300]: wait for /health (fails at once if the server died)
# gs_stop NAME: SIGTERM its process group, SIGKILL what is left after 30 s; fails if any is left
gs_serve() { local n=$1 p=$2 d=${GS_LOGS:-${OUT:-/tmp/gpu-sglang/logs}}; shift 2; mkdir -p "$d"
  setsid python3 -m sglang.launch_server --host 127.0.0.1 --port "$p" $GS_ARGS "$@" > "$d/$n.log" 2>&1 < /dev/null &
  echo $! > "/tmp/gpu-sglang/$n.pid"; echo "gs_serve: $n pid $! port $p log $d/$n.log"; }
gs_wait() { python3 /tmp/gpu-sglang/client.py wait "$2" "${3:-300}" "$(cat "/tmp/gpu-sglang/$1.pid")"; }
_gs_live() { local f s n=0; for f in /proc/[0-9]*/stat; do   # live (not zombie) members of group $1
  read -r s < "$f" 2>/dev/null || continue; s=${s##*) }; set -- $1 $s
  [ "$4" = "$1" ] && [ "$2" != Z ] && n=$((n + 1)); done; echo $n; }
gs_stop() { local pid i; pid=$(cat "/tmp/gpu-sglang/$1.pid" 2>/dev/null) || return 0
  kill -TERM -- "-$pid" 2>/dev/null
  for i in $(seq 60); do [ "$(_gs_live "$pid")" = 0 ] && break; sleep 0.5; done
  [ "$(_gs_live "$pid")" = 0 ] || { kill -KILL -- "-$pid" 2>/dev/null; sleep 1; }
  rm -f "/tmp/gpu-sglang/$1.pid"; [ "$(_gs_live "$pid")" = 0 ]; }
ENVEOF
    . "$state/env.sh"
    echo "gpu-sglang: ready in $(_gs_dt "$t0") s. Environment (also in $state/env.sh, with gs_serve/gs_wait/gs_stop):"
    sed -n '1,3p' "$state/env.sh"; echo "CUDA_HOME=${CUDA_HOME:-(unset)}"
}

if (return 0 2>/dev/null); then
    _gs_install "$@"
else
    _gs_install "$@"; exit $?
fi
