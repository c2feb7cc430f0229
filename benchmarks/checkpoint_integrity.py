"""What recording checksums costs a checkpoint save, and what checking them costs a load.

One process saves a model of ``--params`` fp32 parameters (with AdamW's two moments, 3 × its bytes in all) with
``meshlight.parallel.save_checkpoint``, ``--rounds`` times with checksums and as many without, interleaved, and
checks the checkpoint's files ``--rounds`` times (``damaged_files``, reading every file as one rank of a resume
does for its share). A save here moves with the disk's flushes by more than the checksums cost, so the checksums'
cost is also timed directly: the seconds spent recording them in each save, over the median save without them.
Target: under 10% of a save.

    python benchmarks/checkpoint_integrity.py [--params 50000000] [--rounds 7]    # prints JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    import torch

    import meshlight.parallel.integrity as integrity
    from meshlight.parallel.checkpoint import save_checkpoint
    from meshlight.parallel.integrity import damaged_files

    recording: list[float] = []
    record = integrity.record_checksums

    def timed_record(*args: object, **kwargs: object) -> None:
        started = time.perf_counter()
        record(*args, **kwargs)
        recording.append(time.perf_counter() - started)

    integrity.record_checksums = timed_record  # the writer calls it by the module's name

    rows = args.params // 4096
    state = {"weight": torch.randn(rows, 4096)}
    moments = {"exp_avg": torch.randn(rows, 4096), "exp_avg_sq": torch.rand(rows, 4096)}
    times: dict[str, list[float]] = {"with checksums": [], "without": [], "check": []}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            for name, checksums in (("with checksums", True), ("without", False)):
                path = Path(folder) / f"{name}-{round_}"
                started = time.perf_counter()
                save_checkpoint(path, {"state_dict": state, "optimizer_states": [moments], "global_step": round_},
                                write_metadata=True, checksums=checksums)
                times[name].append(time.perf_counter() - started)
            started = time.perf_counter()
            assert damaged_files(str(Path(folder) / f"with checksums-{round_}")) == []
            times["check"].append(time.perf_counter() - started)
    medians = {name: statistics.median(values) for name, values in times.items()}
    nbytes = 3 * rows * 4096 * 4
    print(json.dumps({
        "params": rows * 4096, "checkpoint_bytes": nbytes, "rounds": args.rounds,
        "save_seconds_with_checksums": medians["with checksums"], "save_seconds_without": medians["without"],
        "save_ab_overhead": medians["with checksums"] / medians["without"] - 1,
        "checksum_seconds_per_save": sum(recording) / args.rounds,
        "checksum_share_of_a_save": sum(recording) / args.rounds / medians["without"],
        "check_seconds": medians["check"],
        "check_over_save": medians["check"] / medians["without"], "torch": torch.__version__,
    }, indent=1))


if __name__ == "__main__":
    main()
