#!/bin/bash
# gpu-sglang self-test, device side, after `source .gpu/sglang/install.sh`:
#   bash .gpu/sglang/selftest.sh [SHAPE]                       (SHAPE: qwen2.5-0.5b)
# 1. the imports a server needs (sglang, its scheduler and model runner, sgl_kernel's sm_90
#    ops, flashinfer.sampling, the xgrammar stand-in, kvcached), each reported on its own;
# 2. sgl_kernel's RMSNorm and SGLang's JIT rope outside a server (built by the device's nvcc);
# 3. make_model.py SHAPE with real random weights under /tmp/gs-model (timed);
# 4. SGLang's HTTP server on it natively ($GS_ARGS, --disable-cuda-graph): a completion, a chat
#    completion, one 128-token greedy stream; no `[kvcached]` line in its log;
# 5. the same with ENABLE_KVCACHED=true: kvcached's "patch on" line and elastic pools in the log,
#    `kvctl list` while it runs, the same greedy completion as natively;
# 6. each server stopped by its process group, nothing of it left, no GPU process left.
# Stage 5 runs only if the run is still under GS_BEFORE seconds (default 330).
# A server wait gives up GS_DEADLINE - 30 s after the start (default 540 s: stay under timeout_s).
# Summary: $OUT/selftest.txt (or /tmp/gpu-sglang/selftest.txt); server logs beside it.
set -u
OUTD=${OUT:-/tmp/gpu-sglang}
mkdir -p "$OUTD"
S=$OUTD/selftest.txt
: > "$S"
T0=$(date +%s)
SHAPE=${1:-qwen2.5-0.5b}
M=/tmp/gs-model
PORT=${GS_PORT:-30000}
GS=/tmp/gpu-sglang
FAIL=0
el() { echo $(( $(date +%s) - T0 )); }
say() { echo "[$(el)s] $*" | tee -a "$S"; }
bad() { FAIL=1; say "FAIL: $*"; }
command -v gs_serve >/dev/null || . "$GS/env.sh"
export GS_LOGS=$OUTD

say "selftest: $(python3 -c 'import torch; print(torch.cuda.get_device_name(0), "torch", torch.__version__)' 2>&1 | tail -1)"
for m in sglang sglang.srt.managers.scheduler sglang.srt.model_executor.model_runner \
    sglang.srt.layers.attention.triton_backend sgl_kernel flashinfer.sampling xgrammar kvcached; do
    if r=$(python3 -c "import $m as x; print(getattr(x, '__version__', '') or x.__file__)" 2>&1); then
        say "import $m: ok ($(echo "$r" | tail -1 | cut -c1-100))"
    else
        bad "import $m: $(echo "$r" | grep -E 'Error|error' | tail -1 | cut -c1-300)"
    fi
done
# The kernels a dense model's forward calls first, outside a server: sgl_kernel's RMSNorm (its own
# sm_90 op: FlashInfer's would need JIT sources the bundle lacks) against torch, and SGLang's
# fused rope, JIT-built by tvm-ffi with the device's nvcc (its build time is a server's first start).
r=$(python3 - 2>&1 <<'PYEOF'
import time, torch
from sgl_kernel import rmsnorm
from sglang.kernels.ops.attention.rope import apply_rope_with_cos_sin_cache_inplace
x = torch.randn(8, 896, device="cuda", dtype=torch.bfloat16)
w = torch.rand(896, device="cuda", dtype=torch.bfloat16)
ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w.float())
err = (rmsnorm(x, w, 1e-6).float() - ref).abs().max().item()
q = torch.randn(8, 14, 64, device="cuda", dtype=torch.bfloat16)
k = torch.randn(8, 2, 64, device="cuda", dtype=torch.bfloat16)
t = time.time()
apply_rope_with_cos_sin_cache_inplace(q, k, torch.randn(4096, 64, device="cuda"),
                                      torch.arange(8, device="cuda"), is_neox=True)
torch.cuda.synchronize()
print(f"rmsnorm max error {err:.3g}; fused rope built and ran in {time.time() - t:.1f} s")
assert err < 0.1, err
PYEOF
) && say "kernels: $(echo "$r" | tail -1) (CUDA_HOME=${CUDA_HOME:-unset})" ||
    bad "kernels: $(echo "$r" | grep -E 'Error|error|ninja|ld:' | tail -3 | cut -c1-300)"
say "make_model $SHAPE: $(python3 "$GS/make_model.py" --shape "$SHAPE" --out "$M" 2>"$OUTD/make_model.err" | tail -1)"
[ -f "$M/config.json" ] || { bad "make_model (see make_model.err)"; exit 1; }

ask() {  # ask NAME: the three requests; prints the first completion's text to $OUTD/NAME.text
    local name=$1 r
    r=$(python3 "$GS/client.py" complete "$PORT" "w17 w42 w99 w7" 16 2>&1 | tail -1)
    say "$name: complete: $r"
    echo "$r" | python3 -c 'import json,sys; print(json.loads(sys.stdin.read())["text"])' > "$OUTD/$name.text" 2>/dev/null ||
        bad "$name: completion"
    say "$name: chat: $(python3 "$GS/client.py" chat "$PORT" "w5 w6 w7" 16 2>&1 | tail -1)"
    say "$name: 128 tokens: $(python3 "$GS/client.py" complete "$PORT" "w11 w12 w13" 128 2>&1 | tail -1)"
}

serve() {  # serve NAME [env VAR=value ...]: start, ask, inspect, stop
    local name=$1 t pid left; shift
    t=$(date +%s)
    env "$@" bash -c ". $GS/env.sh; gs_serve $name $PORT --model-path $M --served-model-name m \
        --context-length 4096 --mem-fraction-static 0.3 --disable-cuda-graph --random-seed 0 \
        --enable-cache-report" > /dev/null
    left=$(( ${GS_DEADLINE:-540} - $(el) - 30 )); [ $left -gt 400 ] && left=400; [ $left -lt 30 ] && left=30
    if gs_wait "$name" "$PORT" "$left" >> "$S" 2>&1; then
        say "$name: server up in $(( $(date +%s) - t )) s"
        ask "$name"
        if [ "$name" = kvcached ]; then
            kvctl list > "$OUTD/kvctl-list.txt" 2>&1 && say "kvctl list: $(tr '\n' ' ' < "$OUTD/kvctl-list.txt" | cut -c1-300)" ||
                bad "kvctl list: $(tail -2 "$OUTD/kvctl-list.txt")"
        fi
    else
        bad "$name: server did not come up; its first errors:"
        grep -m8 -E 'Error|error|Traceback' "$OUTD/$name.log" | cut -c1-300 | tee -a "$S"
    fi
    grep -h '\[kvcached\]' "$OUTD/$name.log" | head -4 | cut -c1-300 | sed "s/^/[$(el)s] $name: kvcached says: /" | tee -a "$S"
    grep -hE 'Load weight end|KV Cache is allocated|max_total_num_tokens|attention_backend=' \
        "$OUTD/$name.log" | head -4 | sed 's/^.*\] //' | cut -c1-200 | sed "s/^/[$(el)s] $name: /" | tee -a "$S"
    pid=$(cat "$GS/$name.pid" 2>/dev/null)
    t=$(date +%s)
    if gs_stop "$name"; then say "$name: stopped (process group $pid gone) in $(( $(date +%s) - t )) s"
    else bad "$name: process group $pid still has live processes after gs_stop"; fi
}

serve native ENABLE_KVCACHED=false
grep -q '\[kvcached\]' "$OUTD/native.log" && bad "native: a [kvcached] line in a server without kvcached"
[ -s "$OUTD/native.text" ] || bad "native: no completion"

if [ "$(el)" -lt "${GS_BEFORE:-330}" ]; then
    serve kvcached ENABLE_KVCACHED=true KVCACHED_LOG_LEVEL=info KVCACHED_IPC_NAME=gs-selftest
    grep -q 'kvcached .* patch on' "$OUTD/kvcached.log" || bad "kvcached: no 'patch on' line"
    grep -q 'patch group .* failed' "$OUTD/kvcached.log" && bad "kvcached: a patch group failed"
    grep -q 'virtual budget' "$OUTD/kvcached.log" || bad "kvcached: the KV cache was not sized by kvcached (no 'virtual budget' line)"
    if [ -s "$OUTD/native.text" ] && [ -s "$OUTD/kvcached.text" ]; then
        cmp -s "$OUTD/native.text" "$OUTD/kvcached.text" && say "kvcached: greedy completion equal to native" ||
            bad "kvcached: greedy completion differs from native"
    fi
else
    say "kvcached stage skipped: $(el) s >= GS_BEFORE=${GS_BEFORE:-330}"
fi
left=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | grep -c .)
[ "$left" = 0 ] && say "no GPU process left" || bad "$left GPU process(es) left: $(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader | tr '\n' ' ')"
say "selftest: $([ $FAIL = 0 ] && echo PASSED || echo FAILED) in $(el) s"
exit $FAIL
