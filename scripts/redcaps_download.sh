#!/usr/bin/env bash
# RedCaps -> WebDataset shards with img2dataset (a recipe; not run by CI, needs network).
#
#   bash scripts/redcaps_download.sh /data/redcaps            # all 12M image-caption pairs
#   SUBREDDITS=pics,itookapicture bash scripts/redcaps_download.sh /data/redcaps-small
#
# Result: /data/redcaps/shards/{00000..NNNNN}.tar with KEY.jpg, KEY.txt (caption) and KEY.json
# (img2dataset metadata plus subreddit, image_id, author, created_utc, score, raw_caption),
# then train with
#   zsprob pretrain --data redcaps --shards "/data/redcaps/shards/{00000..NNNNN}.tar" ...
# (NNNNN: the last shard number; `ls /data/redcaps/shards | tail` shows it).
#
# Steps: 1. the official RedCaps v1.0 annotations (redcaps.xyz, CC-BY 4.0; images stay under
# their owners' rights and Reddit's terms); 2. JSON -> parquet tables (scripts/redcaps_prepare.py
# table); 3. img2dataset downloads, resizes (shorter side 256, enough for 224-px training; set
# IMAGE_SIZE) and writes shards of 10k samples; 4. zsprob reads every shard once and reports what
# it would skip (scripts/redcaps_prepare.py verify). Expect 10-20% of the URLs to be gone.
#
# Needs: pip install img2dataset pyarrow  (img2dataset is not a zsprob dependency).
set -euo pipefail

OUT=${1:?usage: redcaps_download.sh OUT_DIR}
PY=${PYTHON:-python}
HERE=$(cd "$(dirname "$0")" && pwd)
IMAGE_SIZE=${IMAGE_SIZE:-256}
PROCESSES=${PROCESSES:-$(nproc)}
THREADS=${THREADS:-64}
SUBREDDITS=${SUBREDDITS:-}
YEARS=${YEARS:-}
FORMAT=${FORMAT:-parquet}   # tsv works without pyarrow
ANN_URL="https://www.dropbox.com/s/cqtdpsl4hewlli1/redcaps_v1.0_annotations.zip?dl=1"

mkdir -p "$OUT"
cd "$OUT"

# 1. annotations (about 1 GB unzipped; one JSON per subreddit and year)
if [ ! -d annotations ]; then
  [ -f redcaps_v1.0_annotations.zip ] || curl -L --fail -o redcaps_v1.0_annotations.zip "$ANN_URL"
  unzip -q redcaps_v1.0_annotations.zip
fi

# 2. url/caption tables
if [ ! -d tables ]; then
  args=()
  [ -n "$SUBREDDITS" ] && args+=(--subreddits "$SUBREDDITS")
  [ -n "$YEARS" ] && args+=(--years "$YEARS")
  "$PY" "$HERE/redcaps_prepare.py" table annotations tables --format "$FORMAT" "${args[@]+"${args[@]}"}"
fi

# 3. download into WebDataset shards (resumable: img2dataset skips finished shards when re-run
#    with incremental_mode, the default)
img2dataset --url_list tables --input_format "$FORMAT" \
  --url_col url --caption_col caption \
  --save_additional_columns '["subreddit","image_id","author","created_utc","score","raw_caption"]' \
  --output_format webdataset --output_folder shards \
  --processes_count "$PROCESSES" --thread_count "$THREADS" \
  --image_size "$IMAGE_SIZE" --resize_mode keep_ratio --resize_only_if_bigger True \
  --encode_format jpg --encode_quality 90 \
  --number_sample_per_shard 10000 --retries 2 --timeout 10 --enable_wandb False

# 4. check the shards with the loader zsprob trains with
last=$(basename "$(ls shards/*.tar | sort | tail -n 1)" .tar)
"$PY" "$HERE/redcaps_prepare.py" verify "shards/{00000..${last}}.tar" --limit-batches 200
echo "shards: $OUT/shards/{00000..${last}}.tar"
