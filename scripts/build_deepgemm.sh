#!/usr/bin/env bash
# DeepGEMM (the indexer stages' peer) from source, on the GPU machine, once per warm machine.
# From the repository root, in a device call that carries .peers (deepgemm-prebuilt.tgz, deepgemm-src.tgz):
#     bash scripts/build_deepgemm.sh        # 1-2 min with the prebuilt package, 4-7 from source; then a no-op
#     source /tmp/deepgemm/env.sh           # then, in the shell that runs the lab (.peers/prelude.sh does it)
# The source (DG_SRC_TGZ, default .peers/deepgemm-src.tgz): DeepGEMM 54e2261 with its submodules'
# parts it compiles against, cutlass f3fde58 include/ and fmt 553ec11.  No network needed.
# Steps, each leaving a marker in /tmp/deepgemm so a call cut short resumes where it stopped:
#   toolkit  find CUDA_HOME (nvcc, cuda_runtime.h) — the JIT needs it at run time
#   prebuilt .peers/deepgemm-prebuilt.tgz when there and it imports (no build), else:
#   unpack   the tarball into /tmp/deepgemm/src (after checking the headers and libraries the build needs)
#   build    `setup.py build`: the _C extension (torch's cpp_extension, offline) and the headers
#            (deep_gemm, cute, cutlass) its JIT compiles against -> /tmp/deepgemm/site
#   import   `import deep_gemm` with env.sh
#   smoke    scripts/deepgemm_smoke.py: fp8_mqa_logits and fp8_paged_mqa_logits through the lab's
#            adapter against its float64 oracle (cosine printed); their kernels are compiled
#            into DG_JIT_CACHE_DIR=/tmp/deepgemm/jit, so the bench's first call loads, not compiles
# On failure: "build_deepgemm: FAILED at <step>: ..." then the last error lines; exit 1.
# DG_FORCE=1 starts over.  The full build log comes back as $OUT/deepgemm-build.log on failure.
set -uo pipefail
DG=${DG_DIR:-/tmp/deepgemm}  # DG_DIR: elsewhere (a dry run)
TGZ=${DG_SRC_TGZ:-.peers/deepgemm-src.tgz}
REPO=$PWD
mkdir -p "$DG"
[ "${DG_FORCE:-0}" = 1 ] && rm -rf "$DG"/{.ok,.built,.unpacked,src,build,site,env.sh} && mkdir -p "$DG"
say() { echo "build_deepgemm: $*"; }
fail() {  # step, message[, log]: one clear line, then the log's last error lines
  say "FAILED at $1: $2"
  if [ -n "${3:-}" ] && [ -f "$3" ]; then
    pat='(error|fatal|undefined reference|no such file|cannot find|not found)'
    if grep -q -E -i "$pat" "$3"; then grep -E -i "$pat" "$3" | grep -v 'not a git repository' | tail -n 12; else tail -n 12 "$3"; fi | sed 's/^/    /'
    [ -n "${OUT:-}" ] && cp "$3" "$OUT/deepgemm-$1.log" 2>/dev/null
  fi
  exit 1
}

if [ -f "$DG/.ok" ] && [ -f "$DG/env.sh" ]; then
  say "already built and smoke-tested on this machine ($(cat "$DG/.ok")); source $DG/env.sh"
  exit 0
fi
T0=$SECONDS

# --- toolkit: the first candidate with nvcc and the runtime headers
cands=("${CUDA_HOME:-}" "${CUDA_PATH:-}")
if n=$(command -v nvcc); then
  cands+=("$(dirname "$(dirname "$(readlink -f "$n")")")")
  w=$(grep -o -m1 '/[^ "]*/bin/nvcc' "$n" 2>/dev/null) && cands+=("$(dirname "$(dirname "$w")")")  # a wrapper script
fi
cands+=(/usr/local/cuda /usr/local/cuda-13* /usr/local/cuda-12*)
CH=
for c in "${cands[@]}"; do
  [ -n "$c" ] && [ -x "$c/bin/nvcc" ] && [ -f "$c/include/cuda_runtime.h" ] && { CH=$c; break; }
done
[ -n "$CH" ] || fail toolkit "no CUDA toolkit (bin/nvcc + include/cuda_runtime.h) in: ${cands[*]}"
export CUDA_HOME=$CH
NVCC_V=$("$CH/bin/nvcc" --version | grep -o 'release [0-9.]*')
say "toolkit $CH ($NVCC_V), torch $(python3 -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>&1)"


# --- prebuilt: .peers/deepgemm-prebuilt.tgz, the package built on the CPU machine against the same
# torch 2.11.0+cu130 headers and libraries, CUDA 13.0 and Python 3.12 by scripts/prebuild_deepgemm.sh.
# Used when it imports here; otherwise (another torch, say) the source build below.
PRE=${DG_PREBUILT_TGZ:-.peers/deepgemm-prebuilt.tgz}
if [ ! -f "$DG/.built" ] && [ -f "$PRE" ] && [ "${DG_NO_PREBUILT:-0}" != 1 ]; then
  rm -rf "$DG/site" && mkdir -p "$DG/site" && tar -xzf "$PRE" -C "$DG/site" \
    && (cd /tmp && PYTHONPATH="$DG/site" python3 -c 'import deep_gemm') >"$DG/prebuilt.log" 2>&1
  if [ $? = 0 ]; then
    echo "prebuilt $(date -u +%H:%M:%S)" >"$DG/.built"
    say "prebuilt package imports: no build ($PRE)"
  else
    say "prebuilt package does not import ($(grep -E 'Error|error' "$DG/prebuilt.log" | tail -n 1)); building from source"
    rm -rf "$DG/site"
  fi
fi

# --- unpack
if [ ! -f "$DG/.built" ]; then
  # Headers and libraries beyond nvcc's own: ATen/cuda includes cuBLAS, cuSPARSE and cuSOLVER headers,
  # DeepGEMM nvrtc.h and links -lnvrtc -lcudart.  The toolkit's first (-I, -L); what it lacks from
  # PyTorch's pip nvidia packages (CPATH and LIBRARY_PATH come after -I and -L).
  PYNV=$(python3 -c 'import nvidia, os; print(" ".join(nvidia.__path__))' 2>/dev/null)
  PYINC=$(find $PYNV -maxdepth 3 -type d -name include 2>/dev/null | tr '\n' ':')
  export CPATH="${PYINC%:}${CPATH:+:$CPATH}"
  for h in nvrtc.h cublas_v2.h cublasLt.h cusparse.h cusolverDn.h; do
    [ -f "$CH/include/$h" ] || [ -n "$(find $PYNV -maxdepth 4 -name "$h" 2>/dev/null | head -n 1)" ] \
      || fail toolkit "$h is neither in $CH/include nor in PyTorch's nvidia packages ($PYNV)"
  done
  mkdir -p "$DG/lib"
  EXTRA_LD=" -Wl,-rpath,$CH/lib64"  # _C finds the toolkit's nvrtc at run time without LD_LIBRARY_PATH
  for lib in nvrtc cudart; do
    if ! ls "$CH"/lib64/lib$lib.so >/dev/null 2>&1; then
      real=$(find "$CH"/lib64/ "$CH"/targets/*/lib/ $PYNV -name "lib$lib.so*" 2>/dev/null | sort | head -n 1)
      [ -n "$real" ] || fail toolkit "no lib$lib.so* in $CH/lib64 nor in PyTorch's nvidia packages ($PYNV)"
      ln -sf "$real" "$DG/lib/lib$lib.so"
      EXTRA_LD="$EXTRA_LD -Wl,-rpath,$(dirname "$real")"
    fi
  done
  export LIBRARY_PATH="$DG/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  [ -f "$TGZ" ] || [ -f "$DG/.unpacked" ] || fail unpack "$TGZ is missing (carry .peers; it is put there from /tmp/coord/deepgemm-src.tgz)"
  if [ ! -f "$DG/.unpacked" ]; then  # kept on a rerun: torch's ninja then reuses a finished object
    rm -rf "$DG/src" && mkdir -p "$DG/src" && tar -xzf "$TGZ" -C "$DG/src" 2>"$DG/unpack.log" \
      || fail unpack "tar -xzf $TGZ" "$DG/unpack.log"
    touch "$DG/.unpacked"
  fi
  S="$DG/src/DeepGEMM"
  for f in setup.py csrc/python_api.cpp deep_gemm/__init__.py deep_gemm/include/deep_gemm/impls/sm90_fp8_mqa_logits.cuh \
           third-party/cutlass/include/cute/tensor.hpp third-party/fmt/include/fmt/format.h; do
    [ -f "$S/$f" ] || fail unpack "the source lacks $f"
  done

  # --- build (one C++ translation unit; MAX_JOBS for torch's ninja all the same)
  if python3 -c 'import sys, torch; v = torch.__version__.split("+")[0].split("."); sys.exit(0 if (int(v[0]), int(v[1])) >= (2, 12) else 1)'; then
    sed -i "s/'-std=c++17'/'-std=c++20'/" "$S/setup.py"  # ATen headers want C++20 from torch 2.12 on; 2.11 takes 17
  fi
  shim=
  if ! python3 -c 'import wheel.bdist_wheel' 2>/dev/null; then  # setup.py imports it; setuptools has it
    shim="$DG/shim"; mkdir -p "$shim/wheel"; : >"$shim/wheel/__init__.py"
    printf '%s\n' 'try:' '    from setuptools.command.bdist_wheel import bdist_wheel  # noqa' 'except ImportError:  # never run by `build`' \
      '    from setuptools import Command as bdist_wheel  # noqa' >"$shim/wheel/bdist_wheel.py"
  fi
  say "building _C with $(nproc) cores (log $DG/build.log) ..."
  ( cd "$S" && env DG_USE_LOCAL_VERSION=1 DG_JIT_CACHE_DIR="$DG/jit" MAX_JOBS="$(nproc)" \
      LDFLAGS="${LDFLAGS:-}$EXTRA_LD" PYTHONPATH="$S${shim:+:$shim}${PYTHONPATH:+:$PYTHONPATH}" \
      python3 setup.py build --build-base "$DG/build" ) >"$DG/build.log" 2>&1 \
    || fail build "setup.py build (after $((SECONDS - T0)) s)" "$DG/build.log"
  so=$(find "$DG/build" -path '*/deep_gemm/_C*.so' | head -n 1)
  [ -n "$so" ] || fail build "no deep_gemm/_C*.so under $DG/build" "$DG/build.log"
  rm -rf "$DG/site" && cp -a "$(dirname "$(dirname "$so")")" "$DG/site"
  for d in deep_gemm cute cutlass; do  # the JIT compiles against <package>/include
    [ -d "$DG/site/deep_gemm/include/$d" ] || fail build "the built package lacks include/$d"
  done
  date -u +%H:%M:%S >"$DG/.built"
  say "built in $((SECONDS - T0)) s: $(du -sh "$DG/site" | cut -f1) at $DG/site"
fi

# --- env.sh: what a later call on this machine sources (the JIT needs CUDA_HOME's nvcc)
cat >"$DG/env.sh" <<EOF
# DeepGEMM built by scripts/build_deepgemm.sh: source in the shell that runs the lab
export CUDA_HOME=$CH
export DG_JIT_CACHE_DIR=$DG/jit
case ":\${PYTHONPATH:-}:" in *":$DG/site:"*) ;; *) export PYTHONPATH="$DG/site\${PYTHONPATH:+:\$PYTHONPATH}" ;; esac
EOF
# shellcheck disable=SC1091
source "$DG/env.sh"

# --- import
out=$(cd /tmp && python3 -c 'import deep_gemm; print(deep_gemm.__version__, deep_gemm.__file__, "sms", deep_gemm.get_num_sms())' 2>&1) \
  || { echo "$out" >"$DG/import.log"; fail import "import deep_gemm" "$DG/import.log"; }
say "import deep_gemm: $(echo "$out" | tail -n 1)"

# --- smoke: the JIT compiles, in parallel (separate processes share the on-disk cache)
cd "$REPO" || fail smoke "cd $REPO"
export PYTHONPATH="$REPO:$PYTHONPATH"
pids=()
for mode in flat "paged 2" "paged 1" meta; do
  python3 scripts/deepgemm_smoke.py $mode >"$DG/smoke-${mode// /}.log" 2>&1 &
  pids+=($!)
done
bad=0
for p in "${pids[@]}"; do wait "$p" || bad=1; done
for mode in flat paged2 paged1 meta; do
  grep -h -E '^(FAILED|deepgemm smoke)' "$DG/smoke-$mode.log" | tail -n 1 | sed 's/^/  /'
done
if [ $bad = 1 ]; then
  cat "$DG"/smoke-*.log >"$DG/smoke.log"
  fail smoke "a smoke test failed (lines above)" "$DG/smoke.log"
fi
echo "$(date -u +%H:%M:%S) $(echo "$out" | tail -n 1 | cut -d' ' -f1)" >"$DG/.ok"
say "OK in $((SECONDS - T0)) s; JIT cache $(du -sh "$DG/jit" 2>/dev/null | cut -f1) at $DG/jit; source $DG/env.sh"
