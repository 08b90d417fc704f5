#!/usr/bin/env bash
# The headline benchmark behind BENCHMARKS.md (`make bench`), sized for a 2-core CPU box.
#
# PAIR=real (the default): SmolLM2-135M-Instruct from PyPI (`mirror-mlx real-pair`, build/real-pair:
# the target, 30 layers, and its draft: the first 6 layers under one layer trained here, docs/distill.md) on Spec-Bench's evaluation part
# (prompts.is_eval: question_id % 5 == 0, docs/spec-bench-split.md), each first turn through the target's
# chat template, LIMIT prompts per category (13 categories). `tune` calibrates on the training part.
# No exit adapter exists for it: mirror exits at the profile's layer through the target's own head.
#
# PAIR=toy: the demo pair made cost-realistic, on held-out TinyStories openings (LIMIT prompts in all):
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
#    prompts at each temperature: auto, mirror and sd (each mode's knobs from tune's profile, never
#    given by hand), mlx-lm's speculative decoding with the same draft (its best k), ar.
# 4. The headline table (mirror_mlx/bench/headline.py): every run side by side, each row naming its
#    setting, draft, knobs and placement; the baseline of each group is mlx_sd at its best over the
#    drafts and k; one table overall, then one per category; under each, the pair's cost structure
#    per setting (mirror_mlx/bench/cost.py: draft and target 1-row forward, the verify's growth with rows).
#
# Sizes (environment): LIMIT prompts (per category for PAIR=real) x TOKENS new tokens per run (default
# 10 x 48 toy, 2 x 48 real), TEMPS ("0 1"), PROMPT_SETS (toy: "tinystories", add spec_bench; real:
# "spec_bench_eval"), DRAFTS (toy: "llama2xs-8M ss-8M", ss-wide the wider SS draft; real: "draft"), SETTINGS ("mac defaults"),
# TUNE_ARGS (extra `tune` flags, e.g. --quick), SWEEP (a κ x γ x ℓe grid, e.g. "kappa=1,2,4 gamma=2,3,5
# exit=N/4,N/2": runs `bench --sweep` per setting and draft on prompts the headline does not use; off by
# default), DOCS (where the tables are copied; docs/bench/real for PAIR=real, docs/bench for toy).
# DECOMPOSE=1 adds `bench --decompose` (each piece of a step timed alone, Eq. 10 from them) to every run.
# Smoke size: PAIR=real LIMIT=1 TOKENS=8 TUNE_ARGS=--quick DOCS=docs/bench/real-smoke bash scripts/bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
MM="$VENV/bin/mirror-mlx"
PY="$VENV/bin/python"
PAIR=${PAIR:-real}
OUT=${OUT:-bench_out/$PAIR}
TEMPS=${TEMPS:-"0 1"}
SETTINGS=${SETTINGS:-"mac defaults"}
TUNE_ARGS=${TUNE_ARGS:-}
SWEEP=${SWEEP:-}
TOKENS=${TOKENS:-48}
CACHE=$("$PY" -c "from mirror_mlx.tune.profile import cache_dir; print(cache_dir())")

if [ "$PAIR" = real ]; then
  BUILD=build/real-pair
  TARGET=$BUILD/target
  LIMIT=${LIMIT:-2}
  PROMPT_SETS=${PROMPT_SETS:-"spec_bench_eval"}
  DRAFTS=${DRAFTS:-"draft"}
  N_CATS=$("$PY" -c "from mirror_mlx.prompts import load_prompts as l; print(len({p.category for p in l('spec_bench_eval')}))")
  BENCH_LIMIT=$((LIMIT * N_CATS))  # the bench takes prompts round-robin over the categories
  SWEEP_SET=spec_bench_eval
  [ -f "$TARGET/config.json" ] && [ -f "$BUILD/draft/config.json" ] || "$MM" real-pair --out "$BUILD"
  EXIT_ARGS=()
elif [ "$PAIR" = toy ]; then
  BUILD=build
  TARGET=build/stories-98M
  LIMIT=${LIMIT:-10}
  PROMPT_SETS=${PROMPT_SETS:-"tinystories"}
  DRAFTS=${DRAFTS:-"llama2xs-8M ss-8M"}
  BENCH_LIMIT=$LIMIT
  SWEEP_SET=tinystories
  WIDE_DRAFT=(--hidden 256 --heads 32 --kv-heads 16 --intermediate 768 --layers 10)
  [ -f "$TARGET/model.safetensors" ] || "$MM" widen --model mirror_mlx/demo/stories260K --out "$TARGET" \
    --hidden 768 --heads 96 --kv-heads 48 --intermediate 2064 --layers 15
  [ -f build/llama2xs-8M/model.safetensors ] || "$MM" widen --model mirror_mlx/demo/llama2xs --out build/llama2xs-8M \
    "${WIDE_DRAFT[@]}"
  [ -f build/ss-8M/model.safetensors ] || "$MM" widen --model mirror_mlx/demo/ss_draft --out build/ss-8M "${WIDE_DRAFT[@]}"
  # the SS draft again at about a quarter of the target's one-row forward (a 0.6B draft beside an 8B 4-bit
  # target on a Mac costs ~0.29 of a target step): the regime Mirror-SD is for
  [ -f build/ss-wide/model.safetensors ] || "$MM" widen --model mirror_mlx/demo/ss_draft --out build/ss-wide \
    --hidden 384 --heads 48 --kv-heads 24 --intermediate 1152 --layers 10
  ADAPTERS=()
  for L in 1 2 3; do
    WIDE=build/stories-98M-exit$L.safetensors
    [ -f "$WIDE" ] || "$MM" widen-exit --exit-adapter "mirror_mlx/demo/stories260K_exit$L.safetensors" \
      --model mirror_mlx/demo/stories260K --widened "$TARGET" --out "$WIDE"
    ADAPTERS+=("$WIDE")
  done
  EXIT_ARGS=(--exit-adapter "$(IFS=,; echo "${ADAPTERS[*]}")")
else
  echo "bench.sh: unknown PAIR=$PAIR: use PAIR=real or PAIR=toy" >&2
  exit 2
fi

mkdir -p "$OUT"
HEADLINE=()
COSTS=()
for SETTING in $SETTINGS; do
  if [ "$SETTING" = mac ]; then
    LABEL="Mac analog"; PIN=(--pin)
    RUN_ENV=(env OPENBLAS_NUM_THREADS=1 MIRROR_MLX_CACHE="$CACHE/mac-analog")
  else
    LABEL="defaults"; PIN=()
    RUN_ENV=(env -u OPENBLAS_NUM_THREADS MIRROR_MLX_CACHE="$CACHE")
  fi
  for D in $DRAFTS; do  # the pair's cost structure in this setting, printed under every table
    echo "== $LABEL: cost structure, draft $D"
    "${RUN_ENV[@]}" "$PY" -m mirror_mlx.bench.cost "$TARGET" "$BUILD/$D" | tee "$OUT/$SETTING-$D-cost.txt"
    COSTS+=(--cost "$LABEL, draft $D=$OUT/$SETTING-$D-cost.txt")
  done
  for D in $DRAFTS; do
    DIR="$OUT/$SETTING-$D"
    mkdir -p "$DIR"
    MODELS=(--model "$TARGET" --draft-model "$BUILD/$D" "${EXIT_ARGS[@]}")
    echo "== $LABEL, draft $D: tune (calibration prompts disjoint from the headline's)"
    # shellcheck disable=SC2086
    "${RUN_ENV[@]}" "$MM" tune "${MODELS[@]}" "${PIN[@]}" $TUNE_ARGS | tee "$DIR/tune.txt"
    if [ -n "$SWEEP" ]; then
      echo "== $LABEL, draft $D: sweep ($SWEEP)"
      "${RUN_ENV[@]}" "$MM" bench "${MODELS[@]}" "${PIN[@]}" --out "$DIR/sweep" --prompts "$SWEEP_SET" \
        --skip "$BENCH_LIMIT" --limit 2 --max-tokens 24 --sweep "$SWEEP" >/dev/null
    fi
    for P in $PROMPT_SETS; do
      for T in $TEMPS; do
        echo "== $LABEL, draft $D: $P, temperature $T: $BENCH_LIMIT prompts x $TOKENS tokens"
        "${RUN_ENV[@]}" "$MM" bench "${MODELS[@]}" "${PIN[@]}" --out "$DIR/$P-t$T" --prompts "$P" --limit "$BENCH_LIMIT" \
          --max-tokens "$TOKENS" --temp "$T" --modes auto,mirror,sd,mlx_sd,ar ${DECOMPOSE:+--decompose} >/dev/null
        HEADLINE+=("$LABEL=$DIR/$P-t$T")
      done
    done
  done
done

"$PY" -m mirror_mlx.bench.headline "${HEADLINE[@]}" "${COSTS[@]}" | tee "$OUT/headline.md"
DOCS=${DOCS:-docs/bench$([ "$PAIR" = real ] && echo /real)}
mkdir -p "$DOCS"
cp "$OUT/headline.md" "$DOCS/headline.md"
for SETTING in $SETTINGS; do for D in $DRAFTS; do
  cp "$OUT/$SETTING-$D/tune.txt" "$DOCS/$SETTING-$D-tune.txt"
  cp "$OUT/$SETTING-$D-cost.txt" "$DOCS/$SETTING-$D-cost.txt"
  for RUN in "$OUT/$SETTING-$D"/*/; do
    NAME=$SETTING-$D-$(basename "$RUN")
    cp "$RUN/results.md" "$DOCS/$NAME-results.md"
    for PNG in "$RUN"/*.png; do [ -f "$PNG" ] && cp "$PNG" "$DOCS/$NAME-$(basename "$PNG")"; done
  done
done; done
echo "wrote $OUT/headline.md and $DOCS/headline.md, *-results.md, *.png"
