#!/usr/bin/env bash
# The Python packages a lent GPU machine lacks for this project, as wheels that travel with the
# working tree (docs/gpus_and_clusters.md has the whole recipe).
#
#   bash benchmarks/gpu_wheels.sh [DEST]                  # here, with the network: download into
#                                                         # DEST (default .whl, git-ignored), ~20 MB
#   bash benchmarks/gpu_wheels.sh --install DEST TARGET   # on the GPU machine, no network: install
#                                                         # into TARGET the wheels whose package the
#                                                         # image lacks, then PYTHONPATH=TARGET
#
# The image has Python 3.12, torch 2.11 with CUDA, PyG, numpy, pandas, scipy, h5py, numba,
# matplotlib, seaborn, statsmodels; not scanpy, anndata, wandb (runs use wandb.mode=disabled).
# The versions are the ones the CPU test suite runs with. Never torch or numpy from here: the
# image's CUDA torch stays, and --install skips every package the image already has.
set -euo pipefail

WHEELS=(
  scanpy==1.11.5 anndata==0.12.19 array-api-compat==1.16.0 cloudpickle==3.1.3
  donfig==0.8.1.post1 google-crc32c==1.9.0 joblib==1.6.0 legacy-api-wrap==1.5 narwhals==2.29.0
  natsort==8.4.0 numcodecs==0.16.6 patsy==1.0.3 pynndescent==0.7.0 PyYAML==6.0.4
  scikit-learn==1.9.1 scverse-misc==0.0.3 session-info2==0.4.1 threadpoolctl==3.8.0
  tqdm==4.70.1 umap-learn==0.5.12 zarr==3.1.6
)

if [ "${1:-}" = "--install" ]; then
  dest=${2:?usage: gpu_wheels.sh --install DEST TARGET}
  target=${3:?usage: gpu_wheels.sh --install DEST TARGET}
  # The wheels whose distribution this Python does not have (the image's own stay in charge).
  mapfile -t missing < <(python3 - "$dest" <<'EOF'
import importlib.metadata as metadata
import sys
from pathlib import Path

for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    name = wheel.name.split("-")[0]
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        print(wheel)
EOF
  )
  if [ "${#missing[@]}" -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$target" "${missing[@]}"
  fi
  echo "installed ${#missing[@]} wheels into $target; now: export PYTHONPATH=$target"
  exit 0
fi

dest=${1:-.whl}
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" "${WHEELS[@]}"
echo "$(ls "$dest"/*.whl | wc -l) wheels in $dest ($(du -sh "$dest" | cut -f1)); carry it with the run"
