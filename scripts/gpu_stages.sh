# The stage runner of scripts/gpu_check.sh and scripts/smoke_8gpu.sh (sourced, not run).
#
# What a run leaves in OUT (--out), made for a node that copies back a few files: NAME.json, the
# report (scripts/gpu_report.py), and NAME.tar.gz, the run folder NAME/ packed (every stage's log,
# the benchmarks' JSONs and plots, the jobs' metrics, stages.tsv, machine.json). Nothing else,
# nothing in a subfolder. Both are rewritten after every stage (written beside the last and
# renamed over it), so a run killed at any point leaves the stages it finished; a TERM, INT or
# HUP (a slot's end, `timeout`) also stops the running stage, records it as "interrupted" and
# writes both once more. The run folder itself and the jobs' dump folders (checkpoints off,
# exports on) live in a temporary folder, removed at the end.
#
# The budget (--budget-s, from the script's start): a stage whose limit is more than what is
# left is recorded as "not run: budget" and the next one is considered, so the stages are listed
# most valuable first and the budget, not the stage limits, keeps the run inside its slot. The
# default, 540 s, leaves a 10-minute slot a minute for the kill margin and the last report; with
# --cpu it is 1800 s (CI has no slot: there the stage limits, 3x a 2-core machine's times, rule).
# A stage runs under `timeout LIMIT` (which signals the stage's whole process group, torchrun's
# workers included) and is killed 5 s later if it has not stopped; one that fails or runs out of
# time is recorded and the next one runs. Each stage appends "name, status, seconds, note,
# command" to $RUN/stages.tsv and writes its output to $RUN/logs/<name>.log. STAGE_NOTE (set on
# the call: STAGE_NOTE="..." run_stage ...) says how a stage differs in --cpu mode.
#
# --wheels DIR (a node without a package index; DIR from scripts/gpu_wheels.sh): the first stage,
# "wheels", installs DIR's wheels for the running Python with pip --no-index --no-deps into a
# private folder, which a sitecustomize puts on sys.path *after* the interpreter's own
# site-packages: where the node has a package (torch, triton, numpy, ...), the node's copy is the
# one imported. The sitecustomize then runs the one it hides, if the interpreter has one.

# stages_begin SCRIPT SUFFIX GPU_TEST MISSING "$@": the common start of both scripts, run from the
# repository root with CALLER the caller's folder: their options, the Python (PYTHON, default
# .venv/bin/python, else python3), the GPU check (GPU_TEST, a Python snippet that exits 0 when the
# GPUs are there; MISSING says what is not), the wheels, then NAME, OUT, RUN (the run folder),
# SCRATCH (removed at exit), FAILED, TORCHRUN, and a first report (the machine, no stage yet).
stages_begin() {
    local script=$1 suffix=$2 gpu_test=$3 missing=$4
    shift 4
    local usage="usage: bash scripts/$script.sh [--name NAME] [--out DIR] [--budget-s SECONDS] [--wheels DIR] [--cpu]"
    NAME="" OUT="" CPU=0 BUDGET_S="" WHEELS=""
    while [ $# -gt 0 ]; do
        case $1 in
            --name) NAME=$2; shift 2 ;;
            --out) OUT=$2; shift 2 ;;
            --budget-s) BUDGET_S=$2; shift 2 ;;
            --wheels) WHEELS=$2; shift 2 ;;
            --cpu) CPU=1; shift ;;
            *) echo "$usage" >&2; exit 2 ;;
        esac
    done
    # Relative to where the script was called from.
    [ -n "$OUT" ] && OUT=$(cd "$CALLER" && realpath -m -- "$OUT")
    [ -n "$WHEELS" ] && WHEELS=$(cd "$CALLER" && realpath -m -- "$WHEELS")
    BUDGET_S=${BUDGET_S:-$([ "$CPU" = 1 ] && echo 1800 || echo 540)}
    SCRIPT=$script
    PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
    SCRATCH=$(mktemp -d -t "$script.XXXXXX")
    trap 'rm -rf "$SCRATCH"' EXIT
    [ -n "$WHEELS" ] && _behind_site_packages "$SCRATCH/wheels"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    if [ "$CPU" = 1 ]; then
        export OMP_NUM_THREADS=1
        OUT=${OUT:-$(mktemp -d -t "$script.out.XXXXXX")}
    fi
    OUT=${OUT:-assets/gpu}
    local default_name  # the GPU's, from the probe that writes machine.json (torch, triton, the device)
    default_name=$("$PYTHON" scripts/gpu_report.py machine --out "$SCRATCH/machine.json")
    NAME=${NAME:-${default_name:-unknown}}$suffix
    RUN="$SCRATCH/$NAME"
    mkdir -p "$RUN/logs" "$OUT"
    mv "$SCRATCH/machine.json" "$RUN/" 2> /dev/null
    rm -f "$OUT/$NAME.json" "$OUT/$NAME.tar.gz"
    FAILED=() NOT_RUN=() STAGE_PID=""
    REPORT=(scripts/gpu_report.py write --run "$RUN" --out "$OUT/$NAME.json" --script "$script"
            --budget-s "$BUDGET_S" $([ "$CPU" = 1 ] && echo --cpu)
            ${WHEELS:+--wheels "$WHEELS" --wheels-site "$SCRATCH/wheels"})
    TORCHRUN=("$PYTHON" -m torch.distributed.run --standalone)
    trap '_interrupted 1' HUP
    trap '_interrupted 2' INT
    trap '_interrupted 15' TERM
    echo "$script: $([ "$CPU" = 1 ] && echo "--cpu mode" || echo "on $NAME"), budget $BUDGET_S s," \
        "results in $OUT/$NAME.json and $OUT/$NAME.tar.gz"
    _publish
    if [ "$CPU" = 0 ] && ! "$PYTHON" -c "$gpu_test"; then
        echo "$script.sh: $missing to $PYTHON (on a machine without them: --cpu)" >&2
        exit 2
    fi
    if [ -n "$WHEELS" ]; then
        # No index and none of the node's pip configuration (which may name an index or
        # constraints): DIR's files only, the one of each name that fits this Python.
        local names
        names=$(find "$WHEELS" -maxdepth 1 -name '*.whl' -printf '%f\n' | cut -d- -f1 | sort -u)
        STAGE_NOTE="$(find "$WHEELS" -maxdepth 1 -name '*.whl' | wc -l) wheels in $WHEELS" \
        run_stage wheels 60 env PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip install --no-index --no-deps \
            --disable-pip-version-check --no-warn-script-location --find-links "$WHEELS" \
            --target "$SCRATCH/wheels" $names
        # Probe again with the wheels in place: the attention paths this torch gives the
        # project (ops/flash.py's kernel_paths) need the project importable.
        "$PYTHON" scripts/gpu_report.py machine --out "$RUN/machine.json" > /dev/null
    fi
}

# _behind_site_packages DIR: DIR on every Python process's sys.path after the interpreter's own
# site-packages, through a sitecustomize in a folder of its own at the front of PYTHONPATH.
_behind_site_packages() {
    local site=$SCRATCH/site
    mkdir -p "$site" "$1"
    cat > "$site/sitecustomize.py" << EOF
"""Written by scripts/gpu_stages.sh: the offline wheels after the interpreter's own packages on
sys.path (the node's torch and triton win), then the sitecustomize this one hides, if any."""
import importlib.machinery, importlib.util, os, site, sys

site.addsitedir("$1")
_hidden = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))])
if _hidden is not None:
    _hidden.loader.exec_module(importlib.util.module_from_spec(_hidden))
EOF
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
}

_now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

_record_stage() {  # _record_stage NAME STATUS MILLISECONDS COMMAND
    printf '%s\t%s\t%d.%03d\t%s\t%s\n' "$1" "$2" $(( $3 / 1000 )) $(( $3 % 1000 )) "${STAGE_NOTE:-}" "$4" \
        >> "$RUN/stages.tsv"
}

# _publish [--finished]: the report and the packed run folder in OUT, each written beside the last
# one and renamed over it (a kill while writing leaves the previous pair).
_publish() {
    "$PYTHON" "${REPORT[@]}" --elapsed-s "$SECONDS" "$@" > "$SCRATCH/report.out" 2>&1 || cat "$SCRATCH/report.out" >&2
    tar -czf "$OUT/.$NAME.tar.gz.part" -C "$SCRATCH" "$NAME" && mv -f "$OUT/.$NAME.tar.gz.part" "$OUT/$NAME.tar.gz"
}

# TERM, INT or HUP: stop the running stage (`timeout` passes the signal to its process group and
# kills it 5 s later), record it as interrupted, publish, exit 128 + the signal's number.
_interrupted() {
    trap '' HUP INT TERM
    echo "$SCRIPT: interrupted (signal $1)" >&2
    if [ -n "$STAGE_PID" ]; then
        kill -TERM "$STAGE_PID" 2> /dev/null
        wait "$STAGE_PID"
        _record_stage "$STAGE_NAME" interrupted $(( $(_now_ms) - STAGE_START )) "$STAGE_COMMAND"
    fi
    _publish
    exit $(( 128 + $1 ))
}

run_stage() {  # run_stage NAME LIMIT_SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    local left=$(( BUDGET_S - SECONDS )) log="$RUN/logs/$name.log" rc elapsed status
    if [ "$limit" -gt "$left" ]; then
        echo "== $name: not run: budget (its limit is $limit s, $left s of the budget left)"
        _record_stage "$name" "not run: budget" 0 "$*"
        NOT_RUN+=("$name")
        _publish
        return
    fi
    echo "== $name (at most $limit s): $*"
    STAGE_NAME=$name STAGE_COMMAND="$*" STAGE_START=$(_now_ms)
    # In the background so that a trapped signal interrupts the wait at once.
    timeout --kill-after=5 "$limit" "$@" > "$log" 2>&1 &
    STAGE_PID=$!
    wait "$STAGE_PID"
    rc=$?
    STAGE_PID=""
    elapsed=$(( $(_now_ms) - STAGE_START ))
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
    echo "   $status in $(( elapsed / 1000 )) s"
    _publish
}

skip_stage() {  # skip_stage NAME COMMAND...: what --cpu mode leaves out, with the command a GPU runs
    local name=$1
    shift
    echo "== $name: skipped: needs CUDA"
    _record_stage "$name" "skipped: needs CUDA" 0 "$*"
    _publish
}

stages_end() {  # the last report, its table printed; exits 1 if a stage failed or was not run
    _publish --finished
    cat "$SCRATCH/report.out"
    [ ${#FAILED[@]} -gt 0 ] && echo "$SCRIPT: failed: ${FAILED[*]}" >&2
    [ ${#NOT_RUN[@]} -gt 0 ] && echo "$SCRIPT: not run (budget): ${NOT_RUN[*]}" >&2
    [ ${#FAILED[@]} -eq 0 ] && [ ${#NOT_RUN[@]} -eq 0 ]
    exit $?
}
