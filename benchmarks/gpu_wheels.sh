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
# The image has Python 3.12, torch 2.11 with CUDA, PyG, numpy 2.5, pandas 3.0, scipy, h5py,
# numba, matplotlib, seaborn, statsmodels; not scanpy, anndata, wandb (runs use
# wandb.mode=disabled). anndata 0.12 refuses pandas 3's text on write; 0.13 (Python >= 3.12)
# takes it, as does scanpy 1.12. The versions are the ones CI's Python 3.13 tests run with
# (requirements.txt as written). Never torch, numpy or pandas from here: the image's CUDA torch
# stays, and --install adds only what the image lacks or has older than listed.
set -euo pipefail

WHEELS=(
  scanpy==1.12.4 anndata==0.13.4 annotated-types==0.8.0 array-api-compat==1.16.0
  certifi==2026.10.19.post1 cloudpickle==3.1.3 donfig==0.8.1.post1 fast-array-utils==1.5.1
  google-crc32c==1.9.0 joblib==1.6.0 legacy-api-wrap==1.5 msgspec==0.22.0 narwhals==2.29.0
  natsort==8.4.0 numcodecs==0.17.1 packaging==26.4 patsy==1.0.3 pydantic==2.14.4
  pydantic-core==2.50.5 pydantic-settings==2.16.3 pynndescent==0.7.0 python-dotenv==1.2.4
  PyYAML==6.0.4 scikit-learn==1.9.1 scverse-misc==0.1.7 session-info2==0.4.2
  threadpoolctl==3.8.0 tqdm==4.70.1 typing-extensions==4.16.0 typing-inspection==0.4.5
  umap-learn==0.5.12 zarr==3.4.2
)

if [ "${1:-}" = "--install" ]; then
  dest=${2:?usage: gpu_wheels.sh --install DEST TARGET}
  target=${3:?usage: gpu_wheels.sh --install DEST TARGET}
  # The wheels whose distribution this Python lacks or has at an older version (anndata 0.13
  # needs typing-extensions >= 4.16, say); the image's own newer or equal ones stay in charge.
  mapfile -t missing < <(python3 - "$dest" <<'EOF'
import importlib.metadata as metadata
import sys
from pathlib import Path

try:
    from packaging.version import Version
except ImportError:
    from pip._vendor.packaging.version import Version

for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    try:
        if Version(metadata.version(name)) >= Version(version):
            continue
    except metadata.PackageNotFoundError:
        pass
    print(wheel)
EOF
  )
  if [ "${#missing[@]}" -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$target" "${missing[@]}"
  fi
  echo "installed ${#missing[@]} wheels into $target; now: export PYTHONPATH=$target"
  PYTHONPATH="$target" python3 -c "import importlib.metadata as m, anndata, scanpy, pandas; \
print(*(f'{p} {m.version(p)}' for p in ('anndata', 'scanpy', 'pandas', 'numpy', 'scipy')))"
  exit 0
fi

dest=${1:-.whl}
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" "${WHEELS[@]}"
echo "$(ls "$dest"/*.whl | wc -l) wheels in $dest ($(du -sh "$dest" | cut -f1)); carry it with the run"
