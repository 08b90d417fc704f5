#!/usr/bin/env bash
# The headline benchmark behind BENCHMARKS.md (`make bench`), sized for a 2-core CPU box: 28 and
# 50 min measured with other jobs sharing the cores (load average 3-7); less on a quiet machine.
#
# 1. Widen the demo pair into build/ without changing its function (convert/widen.py):
#    target stories260K -> 98M params (hidden 768, 96 heads, 48 kv, MLP 2064, 15 layers),
#    draft  llama2xs    -> 8M params  (hidden 256, 32 heads, 16 kv, MLP 768, 10 layers).
#    Exit adapters at layers 1, 2, 3 of the small target (2 is the shipped one; 1 and 3 are trained
#    once with `mirror-mlx train-exit`, EXIT_STEPS steps) are widened with it (`mirror-mlx widen-exit`).
#    Original block i sits at layer 3i and identity layers follow, so the widened adapters are exact
#    at exit layers 1-3, 4-6 and 7-9: N/4 = 3, N/3 = 5 and N/2 = 7 each have theirs (N = 15).
# 2. Sweep Mirror-SD's kappa x gamma x exit layer (with the adapter) on TinyStories openings the
#    headline runs do not use (--skip 10), and take the fastest point as the knobs for the headline runs.
# 3. `mirror-mlx tune` for the pair, so that mode auto uses a calibrated profile.
# 4. Headline: TinyStories openings and SpecBench, temperature 0 and 1, every mode in one process.
#
# Threads: OPENBLAS_NUM_THREADS=1 leaves exactly one compute thread per MLX stream (MLX's CPU
# backend has no thread pool of its own: one thread per stream, plus BLAS's). --pin puts the target
# side (and mlx-lm's baselines) on the first allowed core and the draft's worker and stream thread on
# the second, so target and draft each own one core. Sizes: LIMIT prompts x TOKENS new tokens per
# run (default 10 x 48; the sweep: 2 held-out openings x 24 tokens per grid point); override with the
# environment, e.g. LIMIT=3 TOKENS=32 make bench, or PROMPT_SETS=tinystories for the
# headline's TinyStories runs only.
set -euo pipefail
cd "$(dirname "$0")/.."
export OPENBLAS_NUM_THREADS=1
VENV=${VENV:-.venv}
MM="$VENV/bin/mirror-mlx"
PY="$VENV/bin/python"
OUT=${OUT:-bench_out}
LIMIT=${LIMIT:-10}
TOKENS=${TOKENS:-48}
SWEEP_LIMIT=${SWEEP_LIMIT:-2}
SWEEP_TOKENS=${SWEEP_TOKENS:-24}
SWEEP=${SWEEP:-"kappa=1,2,4,8 gamma=2,3,5 exit=N/4,N/3,N/2"}
EXIT_STEPS=${EXIT_STEPS:-6000}
PROMPT_SETS=${PROMPT_SETS:-"tinystories spec_bench"}
TARGET=build/stories-98M
DRAFT=build/llama2xs-8M

[ -f "$TARGET/model.safetensors" ] || "$MM" widen --model mirror_mlx/demo/stories260K --out "$TARGET" \
  --hidden 768 --heads 96 --kv-heads 48 --intermediate 2064 --layers 15
[ -f "$DRAFT/model.safetensors" ] || "$MM" widen --model mirror_mlx/demo/llama2xs --out "$DRAFT" \
  --hidden 256 --heads 32 --kv-heads 16 --intermediate 768 --layers 10

ADAPTERS=()
for L in 1 2 3; do
  SMALL=build/stories260K_exit$L.safetensors
  [ "$L" = 2 ] && SMALL=mirror_mlx/demo/stories260K_exit2.safetensors
  [ -f "$SMALL" ] || "$MM" train-exit --exit-layer "$L" --steps "$EXIT_STEPS" --out "$SMALL"
  WIDE=build/stories-98M-exit$L.safetensors
  [ -f "$WIDE" ] || "$MM" widen-exit --exit-adapter "$SMALL" --model mirror_mlx/demo/stories260K \
    --widened "$TARGET" --out "$WIDE"
  ADAPTERS+=("$WIDE")
done

MODELS=(--model "$TARGET" --draft-model "$DRAFT" --exit-adapter "$(IFS=,; echo "${ADAPTERS[*]}")")
PAIR=("${MODELS[@]}" --pin)

# mode auto reads the profile `tune` writes for this pair (user cache dir); without one it would run
# the capped quick calibration on its first call. Tune once, as the README asks a user to.
echo "== tune (calibration prompts: held-out openings, disjoint from the headline's)"
mkdir -p "$OUT"
"$MM" tune "${MODELS[@]}" --pin | tee "$OUT/tune.txt"  # pinned as the headline runs

# One run into $1.
bench() {
  local out=$1
  shift
  "$MM" bench "${PAIR[@]}" --out "$out" "$@" >/dev/null
}

echo "== sweep ($SWEEP) on $SWEEP_LIMIT held-out openings x $SWEEP_TOKENS tokens"
bench "$OUT/sweep" --prompts tinystories --skip "$LIMIT" --limit "$SWEEP_LIMIT" \
  --max-tokens "$SWEEP_TOKENS" --sweep "$SWEEP"
read -r KAPPA GAMMA EXIT < <("$PY" -c "import json,sys; b=json.load(open(sys.argv[1]))['best']; \
print(b['kappa'], b['gamma'], b['exit_layer'])" "$OUT/sweep/results.json")
echo "== knobs from the sweep: kappa=$KAPPA gamma=$GAMMA exit=$EXIT"

for PROMPTS in $PROMPT_SETS; do
  for TEMP in 0 1; do
    echo "== $PROMPTS, temperature $TEMP: $LIMIT prompts x $TOKENS tokens"
    bench "$OUT/$PROMPTS-t$TEMP" --prompts "$PROMPTS" --limit "$LIMIT" --max-tokens "$TOKENS" --temp "$TEMP" \
      --modes auto,mirror,sd,mlx_sd,ar --kappa "$KAPPA" --gamma "$GAMMA" --exit-layer "$EXIT"
  done
done

DOCS=${DOCS:-docs/bench}
mkdir -p "$DOCS"
: > "$OUT/summary.md"
for RUN in sweep $(for P in $PROMPT_SETS; do echo "$P-t0 $P-t1"; done); do
  cat "$OUT/$RUN/results.md" >> "$OUT/summary.md"
  cp "$OUT/$RUN/results.md" "$DOCS/$RUN-results.md"
  for PNG in "$OUT/$RUN"/*.png; do cp "$PNG" "$DOCS/$RUN-$(basename "$PNG")"; done
done
cp "$OUT/tune.txt" "$DOCS/tune-results.txt"
echo "wrote $OUT/summary.md and $DOCS/*-results.md, *.png"
