#!/usr/bin/env bash
# Wheels the GPU machine lacks, for python 3.12 manylinux x86_64 (the device tool's machines, see
# docs/benchmarks.md "GPU check"). zsprob itself travels with the repository.
#
#   .whl/     installed with --target /tmp/site, first on PYTHONPATH for everything:
#             open_clip_torch, ftfy, wcwidth (open_clip's text cleaning), webdataset 1.x and braceexpand
#             (zsprob's shard reader), eccv_caption and ujson (COCO ground truth), faiss-cpu (zsprob index)
#   .whl-oc/  webdataset 0.2.86 alone, installed with --target /tmp/wds0286 and put first on the path of
#             open_clip's trainer subprocess only (open_clip_train's pipeline breaks on webdataset 1.x;
#             two versions in one folder would stop the install)
#
# Everything else zsprob imports at run time (torch, torchvision, timm, accelerate, transformers, tokenizers,
# numpy, scipy, scikit-learn, pandas, safetensors, click, pyyaml, matplotlib, tqdm, pillow, tensorboard,
# fsspec, regex, huggingface_hub) is on the GPU image already (/work/.library/device/KINDS.md).
#
#   bash scripts/gpu_wheels.sh [PYTHON]        # PYTHON defaults to python3; needs pip and the package index
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64)
fetch() {  # fetch DIR NAME==VERSION...
  local dir=$1; shift
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$dir" "$@"
}
rm -rf .whl .whl-oc
mkdir -p .whl .whl-oc
fetch .whl open_clip_torch==3.3.0 ftfy==6.3.1 wcwidth==0.9.4 webdataset==1.0.2 braceexpand==0.1.7 \
  eccv_caption==0.1.0 ujson==6.1.0 faiss-cpu==1.15.1
fetch .whl-oc webdataset==0.2.86
ls -l .whl .whl-oc
du -cb .whl .whl-oc | tail -1 | awk '{printf "total %.1f MiB (the device tool carries at most 64 MiB per call, the repository included)\n", $1 / 1048576}'
