#!/usr/bin/env bash
# Regenerate the tables and figures of README.md and docs/ from one commit.
#
#   bash benchmarks/reproduce_tables.sh                     # the result tables (a few hours)
#   TABLES="seeds_default control_mean" bash benchmarks/reproduce_tables.sh   # a subset
#   TABLES=all bash benchmarks/reproduce_tables.sh          # every entry below (a day or more)
#
# Each entry writes benchmarks/results/<name>.md (and .json where its tool writes one), the first
# lines naming the commit and the command that made it. Work files go to $WORK (default
# /tmp/gears_tables). Training runs take 1 torch thread, so their numbers are bit-reproducible on
# the same CPU and torch build; timings and memory depend on the machine and its load, which the
# files record: take them on an idle machine. Entries, with the page each one feeds:
#
#   seeds_default, seeds_norman  docs/faithfulness.md "Results over seeds"   ~6 min idle
#   seeds_gears_paper            docs/model_selection.md                     ~10 min
#   control_mean                 docs/faithfulness.md "Exact mean predictions"
#   vs_cell_gears                docs/faithfulness.md, 500 x 2k and the Norman subset  ~40 min
#   vs_cell_gears_large          docs/faithfulness.md, 1,000 x 6k and 2,000 x 20k  hours per seed
#   reference_cost               docs/changing_the_model.md: fast vs reference, epoch time and
#                                validation metrics (train_single.py, two runs each)
#   check_model                  docs/changing_the_model.md: python -m gears.cli.check_model's time
#   compare_contexts             docs/changing_the_model.md: the context fork against one model
#                                per line, mcfaline23, 3 split seeds  ~30 min idle
#   default_run                  docs/model_selection.md, README.md: the main job's wall time and
#                                peak memory at 1 thread
#   vcc_example                  docs/predictions.md: the synthetic VCC example's cell-eval table
#   bench_predict                docs/predictions.md: predict.py at challenge size (cells and counts)
#   counts_samplers              docs/predictions.md: the counts samplers on the vcc2026 preset
#   challenge_scores             docs/predictions.md: the 2026 example's and mcfaline23's vcc2026
#                                scores per context (vcc2026_scores.json; requirements-eval.txt)
#   bench_train                  docs/performance.md: cells/s against the bare bound
#   bench_distributed            docs/performance.md: 2 gloo processes against 1
#   bench_load                   docs/performance.md "Under load": idle and beside a busy core,
#                                default threads vs 1, 1 and 2 ranks, spinning waits (~40 min idle)
#   bench_load_waits             docs/performance.md "Governed waits", docs/mixed_precision.md: governed
#                                vs passive waits vs 1 thread, compile vs eager, 1,000 genes (~60 min)
#   bench_load_threads           docs/performance.md "Governed waits": the thread count following
#                                the load, default vs train.threads=1, idle and busy (~12 min)
#   bench_scale                  docs/large_screens.md: Norman, VCC and Replogle sizes, memory
#   suite                        docs/testing.md: the test suite's time (python -m pytest -q)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/gears_tables}
RESULTS_TABLES="seeds_default seeds_norman seeds_gears_paper control_mean vs_cell_gears"
ALL_TABLES="$RESULTS_TABLES vs_cell_gears_large reference_cost check_model compare_contexts \
default_run vcc_example bench_predict counts_samplers challenge_scores bench_train bench_distributed bench_load bench_load_waits bench_load_threads bench_scale suite"
TABLES=${TABLES:-$RESULTS_TABLES}
[ "$TABLES" = all ] && TABLES=$ALL_TABLES
RESULTS=benchmarks/results
mkdir -p "$WORK" "$RESULTS"
commit=$(git rev-parse --short=12 HEAD)
git diff --quiet HEAD -- gears benchmarks configs || commit="$commit-dirty"

header() {  # header NAME COMMAND...
    printf '<!-- commit %s; command: %s; %s; %s -->\n\n' "$commit" "${*:2}" \
        "$(date -u '+%Y-%m-%d %H:%M UTC')" "$(uname -m), $(nproc) CPUs, load $(cut -d' ' -f1 /proc/loadavg)" \
        > "$RESULTS/$1.md"
}

seeds() {  # seeds NAME ARGS...
    local name=$1
    shift
    local cmd=(python -m gears.cli.seeds --seeds 1,2,3,4,5 "$@" train.threads=1 wandb.mode=disabled
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

timed() {  # timed LOG COMMAND...: run it, append its wall time and peak RSS (GNU time) to LOG
    local log=$1
    shift
    /usr/bin/time -f "wall %e s, peak RSS %M KB: $*" -a -o "$log" "$@"
}

runs_table() {  # runs_table NAME RUN_DIR...: one row per run from its metrics.json
    python - "$@" <<'PY' | tee -a "$RESULTS/$1.md"
import json, sys
from pathlib import Path
print("| run | epoch s | train cells/s | val mse_de | val pearson_delta | test mse_de | test pearson_delta |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for run in sys.argv[2:]:
    m = json.loads((Path(run) / "metrics.json").read_text())
    val, test, t = m["val_best"], m["test"], m["timing"]
    print(f"| {Path(run).name} | {t['epoch_s']:.1f} | {t['train_cells_per_s']:.0f} | "
          f"{val['mse_de']:.4f} | {val['pearson_delta']:.3f} | {test['mse_de']:.4f} | "
          f"{test['pearson_delta']:.3f} |")
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
        vs_cell_gears_large)
            python benchmarks/vs_cell_gears.py --datasets synthetic_1000x6k,synthetic_2000x20k \
                --seeds 1,2,3 --work "$WORK/vs_cell_gears_large" \
                --json "$RESULTS/vs_cell_gears_large.json" --out "$RESULTS/vs_cell_gears_large" ;;
        reference_cost)
            # Back to back on one machine, two runs each, alternating: fast, reference, ...
            header reference_cost "python train_single.py train.epochs=1 train.threads=1 model.impl={fast,reference} [train.batching=grouped] [seed=2]"
            runs=()
            for round in 1 2; do
                for batching in random grouped; do
                    for impl in fast reference; do
                        out="$WORK/reference_cost/${impl}_${batching}_$round"
                        python train_single.py train.epochs=1 train.threads=1 wandb.mode=disabled \
                            "model.impl=$impl" "train.batching=$batching" "out_dir=$out"
                        runs+=("$out")
                    done
                done
            done
            python train_single.py train.epochs=1 train.threads=1 wandb.mode=disabled seed=2 \
                "out_dir=$WORK/reference_cost/fast_random_seed2"
            runs_table reference_cost "${runs[@]}" "$WORK/reference_cost/fast_random_seed2" ;;
        check_model)
            header check_model "python -m gears.cli.check_model"
            log="$WORK/check_model.time"
            rm -f "$log"
            timed "$log" python -m gears.cli.check_model | tee -a "$RESULTS/check_model.md"
            cat "$log" >> "$RESULTS/check_model.md" ;;
        compare_contexts)
            # compare_contexts.py names its commit and command in its .json.
            python examples/compare_contexts.py --seeds 1,2,3 --out "$WORK/compare_contexts" \
                --json "$RESULTS/compare_contexts.json" ;;
        default_run)
            header default_run "python train_single.py train.threads=1 wandb.mode=disabled"
            log="$WORK/default_run.time"
            rm -f "$log"
            timed "$log" python train_single.py train.threads=1 wandb.mode=disabled \
                "out_dir=$WORK/default_run"
            cat "$log" >> "$RESULTS/default_run.md"
            runs_table default_run "$WORK/default_run" ;;
        vcc_example)
            # docs/predictions.md's two commands on the synthetic files, cell-eval scores included.
            data="$WORK/vcc_example/data"
            run="$WORK/vcc_example/run"
            cmd1=(python train_single.py --config configs/vcc.yaml
                "data.dataset=$data/adata_Training.h5ad" "data.gene2go=$data/gene2go.tsv"
                data.gene_aliases=null train.epochs=5 "out_dir=$run" eval.cell_eval=true
                "data.data_dir=$WORK/vcc_example/cache" wandb.mode=disabled)
            cmd2=(python predict.py --model "$run/model" --counts "$data/pert_counts_Validation.csv"
                --out "$run/pred_validation.h5ad" --real "$data/adata_Validation.h5ad")
            python examples/synthetic_vcc.py "$data"
            "${cmd1[@]}"
            "${cmd2[@]}"
            header vcc_example "python examples/synthetic_vcc.py DATA; ${cmd1[*]}; ${cmd2[*]}"
            python - "$run/metrics.json" "$run/pred_validation.metrics.json" <<'PY' | tee -a "$RESULTS/vcc_example.md"
import json, sys
train, validation = (json.load(open(p)) for p in sys.argv[1:])
print("```"); print(json.dumps({"test": train.get("cell_eval"), "validation": validation}, indent=1)); print("```")
PY
            ;;
        bench_predict)
            python benchmarks/bench_predict.py --work "$WORK/bench_predict" \
                --json "$RESULTS/bench_predict.json" ;;
        counts_samplers)
            python benchmarks/counts_samplers.py --draws 3 --work "$WORK/counts_samplers" \
                --json "$RESULTS/counts_samplers.json" ;;
        challenge_scores)
            python benchmarks/vcc2026_scores.py --work "$WORK/vcc2026_scores" \
                --json "$RESULTS/vcc2026_scores.json" ;;
        bench_train)
            OMP_NUM_THREADS=1 python benchmarks/bench_train.py --threads 1 --no-memory \
                --json "$RESULTS/bench_train.json" ;;
        bench_distributed)
            python benchmarks/bench_distributed.py --json "$RESULTS/bench_distributed.json" ;;
        bench_load)  # the thread defaults themselves: no OMP_NUM_THREADS (the script clears it)
            # docs/performance.md's table: 2 runs per arm, about 11 minutes on 2 cores
            python benchmarks/bench_load.py --spinning --epochs 3 --repeats 2 \
                --work "$WORK/bench_load" --json "$RESULTS/bench_load.json" ;;
        bench_load_threads)  # the training thread count following the load, 1,000 genes
            python benchmarks/bench_load.py --genes 1000 --epochs 1 --limit-batches 100 --repeats 4 \
                --only 1r,1r_t1 --work "$WORK/bench_load_threads" \
                --json "$RESULTS/bench_load_threads.json" ;;
        bench_load_waits)  # the waits and train.compile on the report's 1,000-gene screen
            python benchmarks/bench_load.py --passive --compile --genes 1000 --epochs 2 --repeats 3 \
                --only 1r,1r_t1,1r_passive,1r_compile,2r,2r_t1 --work "$WORK/bench_load_waits" \
                --json "$RESULTS/bench_load_waits.json" ;;
        bench_scale)
            python benchmarks/bench_scale.py --cells 90000 --genes 5000 --perts 230 --nproc 2 \
                --steps 30 --compare-memory --json "$RESULTS/bench_scale_norman.json"
            python benchmarks/bench_scale.py --cells 221273 --genes 18080 --perts 150 --nproc 2 \
                --steps 10 --warmup 2 --json "$RESULTS/bench_scale_vcc.json"
            python benchmarks/bench_scale.py --cells 1000000 --genes 8000 --perts 2000 --nproc 2 \
                --steps 10 --warmup 2 --json "$RESULTS/bench_scale_replogle.json"
            # --memory-table prints its table (its --json cannot hold the list it returns)
            header bench_scale_memory "python benchmarks/bench_scale.py --memory-table --genes 18080 --batches 8 16 32 --steps 5"
            python benchmarks/bench_scale.py --memory-table --genes 18080 --batches 8 16 32 \
                --steps 5 | tee -a "$RESULTS/bench_scale_memory.md" ;;
        suite)
            header suite "python -m pytest -q"
            log="$WORK/suite.time"
            rm -f "$log"
            timed "$log" python -m pytest -q -p no:cacheprovider | tail -20 | tee -a "$RESULTS/suite.md"
            cat "$log" >> "$RESULTS/suite.md" ;;
        *) echo "unknown table $table"; exit 2 ;;
    esac
done
