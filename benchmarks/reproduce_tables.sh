#!/usr/bin/env bash
# Regenerate the result tables of docs/faithfulness.md and docs/model_selection.md from one commit.
#
#   bash benchmarks/reproduce_tables.sh            # seed tables, control protocols, vs cell-gears
#   TABLES="seeds_default control_mean" bash benchmarks/reproduce_tables.sh   # a subset
#
# Each table is written to benchmarks/results/<name>.md (and .json where the tool writes one),
# its first lines naming the commit and the command that made it. Work files go to $WORK
# (default /tmp/gears_tables). 1 torch thread per run, so the numbers are bit-reproducible on the
# same CPU and torch build. On 2 idle cores: seeds ~6 min, gears_paper ~10 min, vs_cell_gears
# (500 x 2k and Norman subset, 3 seeds, cell-gears included) ~40 min; the larger synthetic
# screens of vs_cell_gears.py take hours per seed and are run with its own command.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/gears_tables}
TABLES=${TABLES:-"seeds_default seeds_norman seeds_gears_paper control_mean vs_cell_gears"}
RESULTS=benchmarks/results
mkdir -p "$WORK" "$RESULTS"
commit=$(git rev-parse --short=12 HEAD)
git diff --quiet HEAD -- gears benchmarks configs || commit="$commit-dirty"

header() {  # header NAME COMMAND...
    printf '<!-- commit %s; command: %s; %s -->\n\n' "$commit" "${*:2}" "$(date -u '+%Y-%m-%d %H:%M UTC')" \
        > "$RESULTS/$1.md"
}

seeds() {  # seeds NAME ARGS...
    local name=$1
    shift
    local cmd=(python -m gears.seeds --seeds 1,2,3,4,5 "$@" train.threads=1 wandb.mode=disabled
        "out_dir=$WORK/$name")
    "${cmd[@]}"
    header "$name" "${cmd[*]}"
    cat "$WORK/$name/seeds_summary.md" >> "$RESULTS/$name.md"
    python - "$WORK/$name/seeds_summary.json" "$RESULTS/$name.json" "$commit" "${cmd[*]}" <<'PY'
import json, sys
src, dst, commit, command = sys.argv[1:]
json.dump({"commit": commit, "command": command, **json.load(open(src))}, open(dst, "w"), indent=1)
PY
}

for table in $TABLES; do
    echo "== $table"
    case $table in
        seeds_default) seeds seeds_default ;;
        seeds_norman) seeds seeds_norman --config configs/perturbench_norman.yaml ;;
        seeds_gears_paper) seeds seeds_gears_paper --config configs/gears_paper.yaml ;;
        control_mean)
            header control_mean "python benchmarks/control_mean.py [--config configs/perturbench_norman.yaml]"
            table='^(seed |mean | +[0-9]+ +[0-9]+ )'  # its table, without the data reports
            { echo '```'; echo "default synthetic screen:"
              python benchmarks/control_mean.py "out_dir=$WORK/control_mean" | grep -E "$table"
              echo; echo "real Norman subset:"
              python benchmarks/control_mean.py --config configs/perturbench_norman.yaml \
                  "out_dir=$WORK/control_mean_norman" | grep -E "$table"
              echo '```'; } | tee -a "$RESULTS/control_mean.md" ;;
        vs_cell_gears)
            # vs_cell_gears.py names its commit and command in its own .md and .json.
            python benchmarks/vs_cell_gears.py --datasets synthetic_500x2k,norman_subset \
                --seeds 1,2,3 --work "$WORK/vs_cell_gears" --json "$RESULTS/vs_cell_gears.json" \
                --out "$RESULTS/vs_cell_gears" ;;
        *) echo "unknown table $table"; exit 2 ;;
    esac
done
