"""Several `tuneloop` commands one after another in ONE launch (torchrun, 2 gloo ranks): the suite's way to prove
"N ranks == one process" for many features without paying a launcher and two interpreters with torch for each.

    python -m torch.distributed.run --nproc_per_node 2 tests/launch_runs.py RUNS.json RESULTS_DIR

RUNS.json is a list of {"args": [...], "env": {...}, "then_copy": [FROM, TO]}: each is `tuneloop ARGS` through
`cli.main`, with ENV set for it alone (a test hook such as TUNELOOP_TEST_SIGNAL_AT_STEP); rank 0 then copies the folder
FROM to TO if asked (a run's output_dir as it stopped, for a test to look at after the launch resumed it: the next
run cannot start before rank 0 joins its group). Each rank writes RESULTS_DIR/RUN.RANK.json with the exit code
and what it printed, as a launch of its own would have. A run that ends in an exit code (a user error, a signal's
75) lets the next one start: the ranks met that end together. An unexpected exception ends the launch: the other rank
may be anywhere, and the launcher stops it. A run that kills its process (the kill-during-save hook) ends the launch
too, and leaves no result file: the test reads that as the kill."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import traceback
from pathlib import Path


def main() -> int:
    runs = json.loads(Path(sys.argv[1]).read_text())
    results = Path(sys.argv[2])
    rank = os.environ.get("RANK", "0")
    from tuneloop.cli import main as tuneloop

    for index, run in enumerate(runs):
        env = run.get("env") or {}
        before = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        out, err = io.StringIO(), io.StringIO()
        failed = None
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = tuneloop(list(run["args"]))
            except SystemExit as exit_:  # argparse
                code = exit_.code
            except BaseException:  # a bug: said, and the launch ends (see the docstring)
                failed = traceback.format_exc()
                code = 1
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        record = {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue() + (failed or "")}
        (results / f"{index}.{rank}.json").write_text(json.dumps(record))
        if failed is not None:
            print(failed, file=sys.stderr, flush=True)
            return 1
        if run.get("then_copy") and rank == "0":
            shutil.copytree(*run["then_copy"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
