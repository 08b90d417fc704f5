#!/usr/bin/env bash
# The headline benchmark behind BENCHMARKS.md (`make bench`), sized for a 2-core CPU box.
#
# 1. Widen the demo pair into build/ without changing its function (convert/widen.py), as `make demo`:
#    target stories260K -> 98M params (hidden 768, 96 heads, 48 kv, MLP 2064, 15 layers), and two
#    drafts of the same shape (hidden 256, 32 heads, 16 kv, MLP 768, 10 layers, 8M params): the plain
#    llama2xs and the Speculative-Streaming draft (stream rows kept exact). The shipped exit adapters
#    (layers 1, 2, 3 of the small target) are widened with the target (`mirror-mlx widen-exit`): exact
#    at exit layers 1-3, 4-6 and 7-9 of the widened one.
# 2. Two settings, each labelled in the tables:
#    - "Mac analog": OPENBLAS_NUM_THREADS=1 and --pin: the target side (and mlx-lm's baselines) on one
#      core in every mode, the draft host on the other, as a Mac runs the target on the GPU and the
#      draft on the Neural Engine; its own profile cache ($CACHE/mac-analog);
#    - "defaults": this machine as a user runs it: mlx-lm with its own thread settings, our modes in
#      the core placement the product picks (tune measures mirror unpinned and split; ar and sd use
#      every core); the user's profile cache.
# 3. Per setting and draft: `mirror-mlx tune` (as a user would), then `mirror-mlx bench` on the held-out
#    TinyStories openings at each temperature: auto, mirror and sd (each mode's knobs from tune's
#    profile, never given by hand), mlx-lm's speculative decoding with the same draft (its best k), ar.
# 4. The headline table (mirror_mlx/bench/headline.py): every run side by side, each row naming its
#    setting, draft, knobs and placement; the baseline of each group is mlx_sd at its best over the
#    drafts and k.
#
# Sizes (environment): LIMIT prompts x TOKENS new tokens per run (default 10 x 48), TEMPS ("0 1"),
# PROMPT_SETS ("tinystories"; add spec_bench), DRAFTS ("llama2xs-8M ss-8M"), SETTINGS ("mac defaults"),
# TUNE_ARGS (extra `tune` flags), SWEEP (a κ x γ x ℓe grid, e.g. "kappa=1,2,4 gamma=2,3,5 exit=N/4,N/2":
# runs `bench --sweep` per setting and draft on openings the headline does not use; off by default).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
MM="$VENV/bin/mirror-mlx"
PY="$VENV/bin/python"
OUT=${OUT:-bench_out}
LIMIT=${LIMIT:-10}
TOKENS=${TOKENS:-48}
TEMPS=${TEMPS:-"0 1"}
PROMPT_SETS=${PROMPT_SETS:-"tinystories"}
DRAFTS=${DRAFTS:-"llama2xs-8M ss-8M"}
SETTINGS=${SETTINGS:-"mac defaults"}
TUNE_ARGS=${TUNE_ARGS:-}
SWEEP=${SWEEP:-}
CACHE=$("$PY" -c "from mirror_mlx.tune.profile import cache_dir; print(cache_dir())")
TARGET=build/stories-98M
WIDE_DRAFT=(--hidden 256 --heads 32 --kv-heads 16 --intermediate 768 --layers 10)

[ -f "$TARGET/model.safetensors" ] || "$MM" widen --model mirror_mlx/demo/stories260K --out "$TARGET" \
  --hidden 768 --heads 96 --kv-heads 48 --intermediate 2064 --layers 15
[ -f build/llama2xs-8M/model.safetensors ] || "$MM" widen --model mirror_mlx/demo/llama2xs --out build/llama2xs-8M \
  "${WIDE_DRAFT[@]}"
[ -f build/ss-8M/model.safetensors ] || "$MM" widen --model mirror_mlx/demo/ss_draft --out build/ss-8M "${WIDE_DRAFT[@]}"

ADAPTERS=()
for L in 1 2 3; do
  WIDE=build/stories-98M-exit$L.safetensors
  [ -f "$WIDE" ] || "$MM" widen-exit --exit-adapter "mirror_mlx/demo/stories260K_exit$L.safetensors" \
    --model mirror_mlx/demo/stories260K --widened "$TARGET" --out "$WIDE"
  ADAPTERS+=("$WIDE")
done
EXITS=$(IFS=,; echo "${ADAPTERS[*]}")

mkdir -p "$OUT"
HEADLINE=()
for SETTING in $SETTINGS; do
  if [ "$SETTING" = mac ]; then
    LABEL="Mac analog"; PIN=(--pin)
    RUN_ENV=(env OPENBLAS_NUM_THREADS=1 MIRROR_MLX_CACHE="$CACHE/mac-analog")
  else
    LABEL="defaults"; PIN=()
    RUN_ENV=(env -u OPENBLAS_NUM_THREADS MIRROR_MLX_CACHE="$CACHE")
  fi
  for D in $DRAFTS; do
    DIR="$OUT/$SETTING-$D"
    mkdir -p "$DIR"
    MODELS=(--model "$TARGET" --draft-model "build/$D" --exit-adapter "$EXITS")
    echo "== $LABEL, draft $D: tune (calibration prompts: held-out openings, disjoint from the headline's)"
    # shellcheck disable=SC2086
    "${RUN_ENV[@]}" "$MM" tune "${MODELS[@]}" "${PIN[@]}" $TUNE_ARGS | tee "$DIR/tune.txt"
    if [ -n "$SWEEP" ]; then
      echo "== $LABEL, draft $D: sweep ($SWEEP)"
      "${RUN_ENV[@]}" "$MM" bench "${MODELS[@]}" "${PIN[@]}" --out "$DIR/sweep" --prompts tinystories \
        --skip "$LIMIT" --limit 2 --max-tokens 24 --sweep "$SWEEP" >/dev/null
    fi
    for P in $PROMPT_SETS; do
      for T in $TEMPS; do
        echo "== $LABEL, draft $D: $P, temperature $T: $LIMIT prompts x $TOKENS tokens"
        "${RUN_ENV[@]}" "$MM" bench "${MODELS[@]}" "${PIN[@]}" --out "$DIR/$P-t$T" --prompts "$P" --limit "$LIMIT" \
          --max-tokens "$TOKENS" --temp "$T" --modes auto,mirror,sd,mlx_sd,ar >/dev/null
        HEADLINE+=("$LABEL=$DIR/$P-t$T")
      done
    done
  done
done

"$PY" -m mirror_mlx.bench.headline "${HEADLINE[@]}" | tee "$OUT/headline.md"
DOCS=${DOCS:-docs/bench}
mkdir -p "$DOCS"
cp "$OUT/headline.md" "$DOCS/headline.md"
for SETTING in $SETTINGS; do for D in $DRAFTS; do
  cp "$OUT/$SETTING-$D/tune.txt" "$DOCS/$SETTING-$D-tune.txt"
  for RUN in "$OUT/$SETTING-$D"/*/; do
    NAME=$SETTING-$D-$(basename "$RUN")
    cp "$RUN/results.md" "$DOCS/$NAME-results.md"
    for PNG in "$RUN"/*.png; do [ -f "$PNG" ] && cp "$PNG" "$DOCS/$NAME-$(basename "$PNG")"; done
  done
done; done
echo "wrote $OUT/headline.md and $DOCS/headline.md, *-results.md, *.png"
