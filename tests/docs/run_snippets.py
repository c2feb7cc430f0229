"""Run doc snippets in this one process, each in a fresh namespace after the preamble; print their errors as JSON.

    python tests/docs/run_snippets.py snippets.json     # [[id, code], ...] -> {id: traceback or null}
"""

import json
import sys
import traceback

from tests.docs.code_blocks import PREAMBLE

if __name__ == "__main__":
    results = {}
    for block_id, code in json.loads(open(sys.argv[1]).read()):
        namespace = {"__name__": "__main__"}
        try:
            exec(compile(PREAMBLE, "<preamble>", "exec"), namespace)
            exec(compile(code, block_id, "exec"), namespace)
            results[block_id] = None
        except BaseException:  # noqa: BLE001 — every failure is reported against its block
            results[block_id] = traceback.format_exc()
    print("RESULTS " + json.dumps(results))
