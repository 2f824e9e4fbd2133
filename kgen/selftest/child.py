"""A step's own process: `python -m kgen.selftest.child STEP CONTEXT_JSON RESULT_FILE` runs one step
and writes its Outcome as JSON; `--verify-one JOB --result FILE` builds and verifies one body (the
specs step's workers). An exception inside a step is that step's failure, with its traceback."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from dataclasses import asdict
from pathlib import Path

from kgen.selftest.outcome import Context, Outcome
from kgen.selftest.specs import verify_one
from kgen.selftest.steps import BY_NAME


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kgen.selftest.child")
    p.add_argument("step", nargs="?")
    p.add_argument("context", nargs="?")
    p.add_argument("--verify-one", dest="job")
    p.add_argument("--result", type=Path)
    args = p.parse_args(argv)
    if args.job:
        args.result.write_text(json.dumps(verify_one(json.loads(args.job))))
        return 0
    ctx = Context(**json.loads(args.context))
    try:
        outcome = BY_NAME[args.step].run(ctx)
    except Exception:  # noqa: BLE001 (the step failed; the run goes on)
        traceback.print_exc()
        saved = Path(ctx.result_file)
        outcome = Outcome(**json.loads(saved.read_text())) if saved.is_file() else Outcome()  # what it had saved
        outcome.fail(f"the step raised: {traceback.format_exc().strip().splitlines()[-1][:600]}")
    ctx.save(outcome)
    print(json.dumps(asdict(outcome))[:2000], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
