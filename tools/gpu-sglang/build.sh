#!/bin/bash
# gpu-sglang: build the one-call bundle of SGLang 0.5.17 for the H100/H200 device machine.
#
#   cd <project checkout root> && tools/gpu-sglang/build.sh [DEST]      (DEST: .gpu/sglang)
#
# Writes DEST: site.tar.xz (SGLang 0.5.17, sglang-kernel 0.4.5 cut to sm_90 without FA3/FlashMLA,
# and the packages its serving path imports that the device image lacks; README.md says what was
# left out), the posix-ipc wheel, install.sh, selftest.sh, make_model.py, client.py,
# MANIFEST.txt, BUNDLE_ID. Adds /.gpu/ to the checkout's .git/info/exclude (the project's
# .gitignore has it too). Downloads (pinned with sha256 in wheels.lock) and the built part are
# cached in ${GPU_SGLANG_CACHE:-~/.cache/gpu-sglang}: the first build takes minutes on 2 cores
# (a 383 MB download, xz -9), a second one seconds. The same inputs give byte-identical files.
# Ends with the bundle size, the checkout's travelling size and whether both fit in one device
# call (64 MiB) with 2 MiB to spare; exits 1 if not.
# Needs: bash, python3 (>= 3.9, with pip for downloads), xz, GNU tar, sha256sum, git.
set -euo pipefail
umask 022
export LC_ALL=C
T0=$(date +%s)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
CHECKOUT=$(pwd -P)
DEST_ARG=${1:-.gpu/sglang}
mkdir -p "$DEST_ARG"
DEST=$(cd "$DEST_ARG" && pwd -P)
CACHE=${GPU_SGLANG_CACHE:-$HOME/.cache/gpu-sglang}
PY=${PYTHON:-python3}
LIMIT_MIB=64 SPARE_MIB=2 BUNDLE_MAX_MIB=58
SGLANG_VERSION=0.5.17
case "$CHECKOUT/" in "$DEST"/*) echo "build.sh: DEST ($DEST) must not hold the checkout" >&2; exit 2 ;; esac

# Left out of the SGLang wheel: the diffusion server (multimodal_gen), its tests, and the three
# Rust extensions no dense-model HTTP server loads (the Rust front end: SGLANG_RUST_SERVER=1 only;
# the gRPC server; the Inkling image preprocessor).
SGLANG_DROPS="sglang/multimodal_gen sglang/test
sglang/srt/server/_core.cpython-312-x86_64-linux-gnu.so
sglang/srt/grpc/_core.cpython-312-x86_64-linux-gnu.so
sglang/srt/multimodal/_core.cpython-312-x86_64-linux-gnu.so"
# Left out of sglang-kernel: FlashAttention 3 (flash_ops, 1.1 GB: serve with
# --attention-backend triton), FlashMLA (MLA models), InfLLM-V2 (a cp310 build, loaded lazily),
# the sm_100 common ops. sm90/common_ops is cut to sm_90 and added back.
KERNEL_DROPS="sgl_kernel/flash_ops.abi3.so sgl_kernel/flashmla_ops.abi3.so
sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so sgl_kernel/sm100
sgl_kernel/sm90/common_ops.abi3.so"
# Left out of the packages: FlashInfer's JIT sources (no FlashInfer kernel is compiled: pytorch
# sampling, triton attention; sglang imports flashinfer.sampling at module level on CUDA), and
# xgrammar's compiled library (its __init__ is replaced by xgrammar_lite_init.py).
DEP_DROPS="flashinfer/data xgrammar/lib xgrammar/libxgrammar_bindings.so xgrammar/__init__.py"
FORMAT=2   # bump when the layout of the built part changes (2: sgl_kernel's FlashInfer switch)

say() { printf '%s\n' "$*"; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }

# 1. /.gpu/ ignored in the checkout
top=$(git -C "$CHECKOUT" rev-parse --show-toplevel 2>/dev/null || true)
[ -n "$top" ] && top=$(cd "$top" && pwd -P)
if [ "$top" = "$CHECKOUT" ]; then
    excl=$(git -C "$CHECKOUT" rev-parse --git-path info/exclude)
    case $excl in /*) ;; *) excl=$CHECKOUT/$excl ;; esac
    mkdir -p "$(dirname "$excl")"
    if ! grep -qxF '/.gpu/' "$excl" 2>/dev/null; then
        echo '/.gpu/' >> "$excl"
        say "added /.gpu/ to $excl"
    fi
    case "$DEST/" in
        "$CHECKOUT"/*) git -C "$CHECKOUT" check-ignore -q "$DEST/BUNDLE_ID" ||
            say "WARNING: $DEST is not ignored by git: it would travel with every call, carried or not" ;;
    esac
else
    say "note: $CHECKOUT is not the root of a git checkout: no exclude written, and its"
    say "      travelling size below counts every file under it (as when it is carried)"
fi

# 2. wheels: cached, pinned by sha256
WHL=$CACHE/wheels
mkdir -p "$WHL"
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp"
for n in 2_5 2_17 2_24 2_26 2_27 2_28 2_31 2_34; do PLAT="$PLAT --platform manylinux_${n}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
LOCK=$HERE/wheels.lock
DEPS=() SGLANG_WHL="" KERNEL_WHL="" POSIX_WHL=""
while read -r sha file; do
    case "$sha" in '#'* | '') continue ;; esac
    case "$file" in
        sglang-*) SGLANG_WHL=$file ;;
        sglang_kernel-*) KERNEL_WHL=$file ;;
        posix_ipc-*) POSIX_WHL=$file ;;
        *) DEPS+=("$file") ;;
    esac
    if [ -f "$WHL/$file" ] && [ "$(sha256sum "$WHL/$file" | cut -d' ' -f1)" = "$sha" ]; then continue; fi
    rest=${file#*-}
    spec="${file%%-*}==${rest%%-*}"
    say "downloading $spec"
    tmpd=$(mktemp -d "$WHL/.dl.XXXXXX")
    PIP_CONSTRAINT='' "$PY" -m pip download -q --no-deps $PLAT -d "$tmpd" "$spec" ||
        { rm -rf "$tmpd"; echo "build.sh: pip download $spec failed" >&2; exit 1; }
    if [ ! -f "$tmpd/$file" ] || [ "$(sha256sum "$tmpd/$file" | cut -d' ' -f1)" != "$sha" ]; then
        echo "build.sh: pip gave $(ls "$tmpd"), not $file with sha256 $sha (wheels.lock)" >&2
        rm -rf "$tmpd"; exit 1
    fi
    mv "$tmpd/$file" "$WHL/$file"; rm -rf "$tmpd"
done < "$LOCK"
[ -n "$SGLANG_WHL" ] && [ -n "$KERNEL_WHL" ] && [ -n "$POSIX_WHL" ] ||
    { echo "build.sh: wheels.lock lacks sglang, sglang_kernel or posix_ipc" >&2; exit 1; }

# 3. the built part, cached by a key over everything it is made from
KEY=$( { echo "format $FORMAT"; cat "$LOCK" "$HERE/buildtool.py" "$HERE/xgrammar_lite_init.py";
    echo "$SGLANG_DROPS"; echo "$KERNEL_DROPS"; echo "$DEP_DROPS"; } | sha256sum | cut -c1-16)
BUILT=$CACHE/built/$KEY
TARFLAGS=(--sort=name --format=gnu --mtime=@0 --owner=0 --group=0 --numeric-owner --mode=u+rwX,go+rX,go-w)
if [ -f "$BUILT/site.tar.xz" ] && [ -f "$BUILT/MANIFEST.txt" ]; then
    say "built part: cached ($BUILT)"
else
    say "building site.tar.xz (minutes on 2 cores; cached afterwards in $BUILT)"
    work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-sglang-build.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    drops=(); for d in $SGLANG_DROPS; do drops+=(--drop "$d"); done
    "$PY" "$HERE/buildtool.py" unpack "$work/site" "$WHL/$SGLANG_WHL" "${drops[@]}"
    drops=(); for d in $KERNEL_DROPS; do drops+=(--drop "$d"); done
    "$PY" "$HERE/buildtool.py" unpack "$work/site" "$WHL/$KERNEL_WHL" "${drops[@]}"
    # sgl_kernel's norms and samplers call FlashInfer's when it imports, and FlashInfer would
    # JIT-compile them from flashinfer/data (not shipped): they take sgl_kernel's own sm_90 ops.
    for f in elementwise sampling; do
        "$PY" "$HERE/buildtool.py" edit "$work/site/sgl_kernel/$f.py" "    _has_flashinfer = True" \
            "    _has_flashinfer = False  # gpu-sglang: no FlashInfer JIT sources; sgl_kernel's own ops"
    done
    "$PY" - "$WHL/$KERNEL_WHL" "$work/common_ops_full.so" <<'PYEOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("sgl_kernel/sm90/common_ops.abi3.so") as s, open(sys.argv[2], "wb") as d:
    shutil.copyfileobj(s, d, 1 << 20)
PYEOF
    mkdir -p "$work/site/sgl_kernel/sm90"
    "$PY" "$HERE/buildtool.py" cut-sm90 "$work/common_ops_full.so" "$work/site/sgl_kernel/sm90/common_ops.abi3.so"
    chmod 755 "$work/site/sgl_kernel/sm90/common_ops.abi3.so"
    rm -f "$work/common_ops_full.so"
    drops=(); for d in $DEP_DROPS; do drops+=(--drop "$d"); done
    "$PY" "$HERE/buildtool.py" unpack "$work/site" "${DEPS[@]/#/$WHL/}" "${drops[@]}"
    cp "$HERE/xgrammar_lite_init.py" "$work/site/xgrammar/__init__.py"
    chmod 644 "$work/site/xgrammar/__init__.py"
    tar -C "$work/site" "${TARFLAGS[@]}" -cf - . | xz -9 -T2 > "$work/site.tar.xz"
    {
        echo "gpu-sglang bundle: SGLang $SGLANG_VERSION for the H100/H200 device (Python 3.12, torch 2.11.0); build key $KEY"
        echo "packages in site.tar.xz:"
        (cd "$work/site" && ls -d *.dist-info | sed 's/\.dist-info$//; s/^/  /')
        echo "left out of the SGLang wheel: $(echo $SGLANG_DROPS)"
        echo "left out of sglang-kernel: $(echo $KERNEL_DROPS) (sm90/common_ops ships cut to sm_90; elementwise.py and sampling.py: _has_flashinfer = False)"
        echo "left out of the packages: $(echo $DEP_DROPS) (xgrammar/__init__.py: xgrammar_lite_init.py)"
        echo "unpacked: $(du -sm "$work/site" | cut -f1) MB"
    } > "$work/MANIFEST.txt"
    mkdir -p "$BUILT.tmp" && mv "$work/site.tar.xz" "$work/MANIFEST.txt" "$BUILT.tmp/"
    rm -rf "$BUILT" && mv "$BUILT.tmp" "$BUILT"
    rm -rf "$work"; trap - EXIT
    for old in "$CACHE"/built/*; do [ "$old" = "$BUILT" ] || rm -rf "$old"; done   # keep one build
fi

# 4. the bundle (only its own files are replaced in DEST)
FILES="site.tar.xz $POSIX_WHL install.sh selftest.sh make_model.py client.py MANIFEST.txt BUNDLE_ID"
for f in "$DEST"/*; do
    [ -e "$f" ] || continue
    b=$(basename "$f")
    case "$b" in posix_ipc-*.whl) rm -f "$f"; continue ;; esac
    case " $FILES " in *" $b "*) rm -f "$f" ;; *) say "WARNING: $f is not part of the bundle (left there; it travels too)" ;; esac
done
cp "$BUILT/site.tar.xz" "$BUILT/MANIFEST.txt" "$WHL/$POSIX_WHL" "$DEST/"
cp "$HERE/install.sh" "$HERE/selftest.sh" "$HERE/make_model.py" "$HERE/client.py" "$DEST/"
chmod 644 "$DEST"/*
sha256sum "$DEST/site.tar.xz" | cut -c1-16 > "$DEST/BUNDLE_ID"

# 5. sizes: will the bundle and the checkout go in one call?
bundle=$(find "$DEST" -type f -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }')
if [ "$top" = "$CHECKOUT" ]; then
    rel=${DEST#"$CHECKOUT"/}; [ "$rel" = "$DEST" ] && rel=""
    travel=$(git -C "$CHECKOUT" ls-files -z --cached --others --exclude-standard |
        { if [ -n "$rel" ]; then grep -zv "^$(printf '%s' "$rel" | sed 's/[].[\\*^$]/\\&/g')/" || true; else cat; fi; } |
        (cd "$CHECKOUT" && xargs -0 -r stat -c %s 2>/dev/null || true) | awk '{ s += $1 } END { print s + 0 }')
    how="tracked + untracked-not-ignored files"
else
    travel=$(find "$CHECKOUT" -path "$DEST" -prune -o -path "$CHECKOUT/.git" -prune -o -type f -printf '%s\n' |
        awk '{ s += $1 } END { print s + 0 }')
    how="every file"
fi
total=$((bundle + travel))
spare=$((LIMIT_MIB * 1048576 - total))
say ""
say "bundle    $(mib "$bundle") MiB  $DEST  (built in $(( $(date +%s) - T0 )) s; aim: <= $BUNDLE_MAX_MIB MiB)"
say "checkout  $(mib "$travel") MiB  $CHECKOUT ($how)"
if [ "$spare" -ge $((SPARE_MIB * 1048576)) ]; then
    say "together  $(mib "$total") MiB of $LIMIT_MIB MiB per device call: FITS, $(mib "$spare") MiB to spare"
else
    say "together  $(mib "$total") MiB of $LIMIT_MIB MiB per device call: DOES NOT FIT with $SPARE_MIB MiB to spare"
fi
[ "$bundle" -le $((BUNDLE_MAX_MIB * 1048576)) ] || say "WARNING: the bundle is over $BUNDLE_MAX_MIB MiB"
case "$DEST/" in
    "$CHECKOUT"/*) r=${DEST#"$CHECKOUT"/}; say "device call: carry [\"$r\"], command: source $r/install.sh && <your command>" ;;
    *) say "device call: carry DEST by its path in the repo that travels; source <it>/install.sh <it> <checkout> && ..." ;;
esac
[ "$spare" -ge $((SPARE_MIB * 1048576)) ]
