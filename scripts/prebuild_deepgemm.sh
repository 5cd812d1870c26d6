#!/usr/bin/env bash
# Builds DeepGEMM's package on the CPU machine for the GPU machine (Python 3.12, torch 2.11.0+cu130,
# CUDA 13.0): .peers/deepgemm-prebuilt.tgz, which scripts/build_deepgemm.sh uses there when it
# imports (else it builds from source there).  Needs here: g++, the CUDA 13.0 toolkit's headers
# (nvcc not run), Python 3.12's headers (PY312_INC), pip and the network for the wheels whose
# headers and libraries the extension compiles and links against (about 1.3 GB into $W).
# From the repository root:  bash scripts/prebuild_deepgemm.sh        (~10 min on 2 loaded cores)
set -euo pipefail
W=${W:-/tmp/dgpre}
CH=${CUDA_HOME:-/usr/local/cuda-13.0}
PY312_INC=${PY312_INC:-$(ls -d /root/.pyenv/versions/3.12*/include/python3.12 2>/dev/null | head -n 1)}
TGZ=${DG_SRC_TGZ:-.peers/deepgemm-src.tgz}
OUT_TGZ=$PWD/.peers/deepgemm-prebuilt.tgz
[ -f "$PY312_INC/Python.h" ] || { echo "prebuild: no Python 3.12 headers (set PY312_INC)"; exit 1; }
mkdir -p "$W/whl" "$W/x"
pip_dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$W/whl" "$@"
}
# torch 2.11.0 (cu130 on PyPI) and the CUDA pieces its cuda-toolkit==13.0.2 requirement pins
pip_dl "torch==2.11.0" "nvidia-cublas==13.1.0.3.*" "nvidia-cusolver==12.0.4.66.*" "nvidia-cusparse==12.6.3.3.*" \
  "nvidia-cuda-runtime==13.0.96.*" "nvidia-cuda-nvrtc==13.0.88.*"
cd "$W/x"
unzip -q -o "$W"/whl/torch-2.11.0-*.whl 'torch/include/*' 'torch/lib/libc10.so' 'torch/lib/libc10_cuda.so' \
  'torch/lib/libtorch.so' 'torch/lib/libtorch_cpu.so' 'torch/lib/libtorch_cuda.so' 'torch/lib/libtorch_python.so'
for w in "$W"/whl/nvidia_*.whl; do unzip -q -o "$w" 'nvidia/cu13/include/*' || true; done  # not every wheel has headers
unzip -q -o "$W"/whl/nvidia_cuda_runtime-*.whl 'nvidia/cu13/lib/libcudart.so.13'
unzip -q -o "$W"/whl/nvidia_cuda_nvrtc-*.whl 'nvidia/cu13/lib/libnvrtc.so.13'
rm -rf "$W/src" && mkdir -p "$W/src" && tar -xzf "$OLDPWD/$TGZ" -C "$W/src"
S=$W/src/DeepGEMM
cd "$S"
# the flags torch 2.11's BuildExtension gives a CUDAExtension's .cpp (C++17 as DeepGEMM's setup.py asks)
CPATH="$W/x/nvidia/cu13/include" g++ -c -O3 -DNDEBUG -fwrapv -fPIC -std=c++17 -Wno-psabi -Wno-deprecated-declarations \
  -D_GLIBCXX_USE_CXX11_ABI=1 -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C \
  -I"$CH/include" -I"$CH/include/cccl" -Ideep_gemm/include -Ithird-party/cutlass/include -Ithird-party/fmt/include \
  -I"$W/x/torch/include" -I"$W/x/torch/include/torch/csrc/api/include" -I"$PY312_INC" \
  csrc/python_api.cpp -o "$W/python_api.o"
# nvrtc is loaded lazily by torch: _C finds libnvrtc.so.13 through its RUNPATH (the GPU machine's pip
# nvidia packages, then a toolkit); torch's own libraries are loaded by `import torch` first
RP=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/usr/local/cuda/lib64:/usr/local/cuda-13.0/lib64
g++ -shared -o "$W/_C.cpython-312-x86_64-linux-gnu.so" "$W/python_api.o" -Wl,-rpath,"$RP" \
  -L"$W/x/torch/lib" -lc10 -ltorch -ltorch_cpu -ltorch_python -lc10_cuda -ltorch_cuda \
  -L"$W/x/nvidia/cu13/lib" -l:libcudart.so.13 -l:libnvrtc.so.13
strip --strip-debug "$W/_C.cpython-312-x86_64-linux-gnu.so"
# the Python package and the headers its JIT compiles against (setup.py's build_py, no extension)
mkdir -p "$W/shim/wheel" && : >"$W/shim/wheel/__init__.py"
printf '%s\n' 'from setuptools import Command as bdist_wheel  # noqa: never run by build_py' >"$W/shim/wheel/bdist_wheel.py"
rm -rf "$W/py" && DG_SKIP_CUDA_BUILD=1 DG_JIT_CACHE_DIR=/tmp/deepgemm/jit PYTHONPATH="$S:$W/shim" \
  python3 setup.py -q build_py --build-lib "$W/py" >/dev/null
cp "$W/_C.cpython-312-x86_64-linux-gnu.so" "$W/py/deep_gemm/"
tar -czf "$OUT_TGZ" -C "$W/py" deep_gemm
echo "prebuild: $OUT_TGZ ($(du -h "$OUT_TGZ" | cut -f1)); readelf NEEDED:"
readelf -d "$W/_C.cpython-312-x86_64-linux-gnu.so" | grep -E 'NEEDED|RUNPATH'
