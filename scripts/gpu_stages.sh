# The stage runner of scripts/gpu_check.sh and scripts/smoke_8gpu.sh (sourced, not run).
# A stage runs under its own `timeout` (which signals the stage's whole process group, torchrun's
# workers included); one that fails or runs out of time is recorded and the script goes on.
# Each stage appends "name, status, seconds, note, command" to $RUN/stages.tsv, which
# scripts/gpu_report.py turns into the report, and writes its output to $RUN/logs/<name>.log.
# STAGE_NOTE (set on the call: STAGE_NOTE="..." run_stage ...) says how a stage differs in --cpu mode.

# stages_begin SCRIPT SUFFIX GPU_TEST MISSING "$@": the common start of both scripts, run from the
# repository root with CALLER the caller's folder: their options (--name, --out, --cpu), the
# Python, the GPU check (GPU_TEST, a Python snippet that exits 0 when the GPUs are there; MISSING
# says what is not), then RUN (OUT/NAME + SUFFIX, emptied), SCRATCH (removed at exit), FAILED,
# TORCHRUN.
stages_begin() {
    local script=$1 suffix=$2 gpu_test=$3 missing=$4
    shift 4
    NAME="" OUT="" CPU=0
    while [ $# -gt 0 ]; do
        case $1 in
            --name) NAME=$2; shift 2 ;;
            --out) OUT=$2; shift 2 ;;
            --cpu) CPU=1; shift ;;
            *) echo "usage: bash scripts/$script.sh [--name NAME] [--out DIR] [--cpu]" >&2; exit 2 ;;
        esac
    done
    [ -n "$OUT" ] && OUT=$(cd "$CALLER" && realpath -m -- "$OUT")  # relative to where it was called from
    PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    if [ "$CPU" = 1 ]; then
        export OMP_NUM_THREADS=1
        OUT=${OUT:-$(mktemp -d -t "$script.XXXXXX")}
    elif ! "$PYTHON" -c "$gpu_test"; then
        echo "$script.sh: $missing to $PYTHON (on a machine without them: --cpu)" >&2
        exit 2
    fi
    OUT=${OUT:-assets/gpu}
    NAME=${NAME:-$("$PYTHON" scripts/gpu_report.py name)}$suffix
    RUN="$OUT/$NAME"
    SCRATCH=$(mktemp -d -t "${script}_jobs.XXXXXX")
    trap 'rm -rf "$SCRATCH"' EXIT
    rm -rf "$RUN"
    mkdir -p "$RUN/logs"
    FAILED=()
    TORCHRUN=("$PYTHON" -m torch.distributed.run --standalone)
    echo "$script: $([ "$CPU" = 1 ] && echo "--cpu mode" || echo "on $NAME"), results in $RUN"
}

_now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

_record_stage() {  # _record_stage NAME STATUS MILLISECONDS COMMAND
    printf '%s\t%s\t%d.%03d\t%s\t%s\n' "$1" "$2" $(( $3 / 1000 )) $(( $3 % 1000 )) "${STAGE_NOTE:-}" "$4" \
        >> "$RUN/stages.tsv"
}

run_stage() {  # run_stage NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    local log="$RUN/logs/$name.log" start rc elapsed status
    echo "== $name (at most ${limit} s): $*"
    start=$(_now_ms)
    timeout --kill-after=20 "$limit" "$@" > "$log" 2>&1
    rc=$?
    elapsed=$(( $(_now_ms) - start ))
    if [ "$rc" -eq 0 ]; then
        status=ok
    elif { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && [ "$elapsed" -ge $(( limit * 1000 )) ]; then
        status=timeout
    else
        status=failed
    fi
    _record_stage "$name" "$status" "$elapsed" "$*"
    if [ "$status" != ok ]; then
        FAILED+=("$name")
        tail -n 25 "$log" | sed 's/^/   | /'
    fi
    echo "   $status in $(( elapsed / 1000 )) s (log: $log)"
}

skip_stage() {  # skip_stage NAME COMMAND...: what --cpu mode leaves out, with the command a GPU runs
    local name=$1
    shift
    echo "== $name: skipped: needs CUDA"
    _record_stage "$name" "skipped: needs CUDA" 0 "$*"
}
