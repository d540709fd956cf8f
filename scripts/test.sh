#!/usr/bin/env bash
# Run the whole test suite (creates/refreshes .venv first). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
# pytest exits 5 when it collected nothing: that is a failure of the suite, say so.
if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
