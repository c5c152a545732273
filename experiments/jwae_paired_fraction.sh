#!/usr/bin/env bash
# The jWAE paired-fraction table of docs/findings.md: SynthWorld, data.paired_fraction 1.0 / 0.5 / 0.1,
# each with and without the unpaired image-only and caption-only streams (at 1.0 there is no unpaired
# data, so one run). All runs share one cache of the frozen tower's features.
#   SW=/work/sw OUT=runs/jwae STEPS=1500 bash experiments/jwae_paired_fraction.sh
# EXTRA: more pretrain options (default: lr 1e-3, discriminator 5e-4: the paper's 1e-4 / 5e-5 learn too
# slowly for 1,500 steps); FRACTIONS="0.5 0.1" / UNPAIRED=false run a subset (shells can share the work).
set -euo pipefail
SW=${SW:-sw}; OUT=${OUT:-runs/jwae}; STEPS=${STEPS:-1500}; SEED=${SEED:-0}
PY=${PY:-python}; FRACTIONS=${FRACTIONS:-"1.0 0.5 0.1"}; EXTRA=${EXTRA:-"--lr 1e-3 --set optim.disc_lr=5e-4"}
for f in $FRACTIONS; do
  for u in ${UNPAIRED:-true false}; do
    if [ "$f" = "1.0" ] && [ "$u" = "false" ]; then continue; fi
    run=$OUT/s$SEED-f$f-unpaired-$u
    if [ ! -f "$run/model/zsprob.json" ]; then
      $PY -m zsprob pretrain --config jwae_synthetic.yaml --data synthetic --shards "$SW/pretrain" --out "$run" \
        --steps "$STEPS" --seed "$SEED" --threads 1 --no-progress --log-every 100 \
        --set data.paired_fraction="$f" --set data.unpaired="$u" --set data.feature_cache="$OUT/features-s$SEED.safetensors" $EXTRA
    fi
    if [ ! -f "$run/eval/metrics.json" ]; then
      $PY -m zsprob eval synthetic --checkpoint "$run/model" --root "$SW" --score cosine --no-analysis \
        --out "$run/eval/metrics.json" > "$run/eval.log"
    fi
    $PY - "$run" "$f" "$u" <<'PY'
import json, sys
run, f, u = sys.argv[1:]
m = json.load(open(f"{run}/eval/metrics.json"))["metrics"]
c, p = m["caption"], m["plausible"]
last = [json.loads(x) for x in open(f"{run}/metrics.jsonl") if '"loss"' in x][-1]
print(f"| {f} | {u} | {c['i2t']['r@1']:.1f} | {c['t2i']['r@1']:.1f} | {c['rsum']:.1f} | "
      f"{(p['i2t']['map_at_r'] + p['t2i']['map_at_r']) / 2:.2f} | {last['rec_img']:.3f} | {last['align']:.2f} |")
PY
  done
done
