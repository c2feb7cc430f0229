"""The layout planner against torchtitan's context-parallel runs: Llama 3 8B on 8 H100s (96 GB HBM2e, 500 W cap),
FSDP over dp × cp, full activation checkpointing, torch.compile and Float8, one sequence per data rank, sequences of
32K to 256K tokens split over cp = 1 to 8 (`benchmarks/llama3_h100_202412_torchtitan.md`, Dec 2024, tokens/s per GPU).

Each run is priced with the planner's own estimate as torchtitan ran it (dp = 8/cp, ZeRO-3, full recomputation, in
bf16) and compared as a ratio to the cp=1 run and to the run before it (target: within 25% of the published ratio),
so that what the planner leaves out alike in every run cancels. Float8 does not cancel entirely: it speeds the
linear layers and not attention, whose share of the step grows with the sequence; each ratio is also given with the
linear layers' compute priced at torchtitan's measured Float8 speedup (1.445×, ``planner.FLOAT8_SPEEDUP``). Also,
per run: the planner's memory estimate (torchtitan: about 84 GiB), and its best layout given torchtitan's batch.

Beside them, not a target: the same page's Table 6, Llama 3.1 405B on 512 H100s, TP 8 × PP 8 (1F1B, 8 microbatches
of one sequence), FSDP 8/cp, cp = 1 to 8 at 32K to 256K, compile, Float8 and async TP — the same ratios for a model
split by tp and pp as well, priced as torchtitan ran it (ZeRO-3, full recomputation).

    python benchmarks/context_parallel_planner.py      # prints JSON
"""

from __future__ import annotations

import json

from planner import FLOAT8_SPEEDUP

# (cp, sequence length) -> published tokens/s per GPU: Table 2 (Llama 3 8B, 8 GPUs) and Table 6 (405B, 512 GPUs)
PUBLISHED = {(1, 32768): 3890, (2, 65536): 2540, (4, 131072): 1071, (8, 262144): 548}
PUBLISHED_405B = {(1, 32768): 76, (2, 65536): 47, (4, 131072): 31, (8, 262144): 16}


def runs(table: str = "8b") -> list[dict]:
    """Each run of torchtitan's Table 2 (``"8b"``) or Table 6 (``"405b"``) as the planner prices it."""
    from meshlight.parallel.planner import HARDWARE, MODELS, estimate, plan

    hardware, rows = HARDWARE["h100-96gb-500w"], []
    name, world, pp, tp, published_runs = (("llama3-8b", 8, 1, 1, PUBLISHED) if table == "8b"
                                           else ("llama3-405b", 512, 8, 8, PUBLISHED_405B))
    microbatches = pp  # torchtitan's default: as many microbatches as stages, one sequence each
    for (cp, seq_len), published in published_runs.items():
        model, dp = MODELS[name].replace(seq_len=seq_len), 8 // cp
        batch = dp * microbatches
        run = estimate(model, hardware, world, batch, dp, pp, tp, 1, 3, microbatches, 1, True, cp=cp)
        # the linear layers' share of the compute: 6 FLOPs per parameter and token, 2 more recomputing the forward
        linear = 8 * model.active_params / (model.flops_per_token() + model.recompute_flops_per_token())
        float8_step = run.step_time - run.times["compute"] * linear * (1 - 1 / FLOAT8_SPEEDUP)
        best = plan(model, hardware, world, batch)[0]
        rows.append({"cp": cp, "seq_len": seq_len, "layout": run.describe(), "published": published,
                     "predicted": run.tokens_per_second_per_device,
                     "predicted_float8_linear": run.tokens_per_step / float8_step / run.world,
                     "kv_exchange_share": run.times["cp"] / run.step_time, "memory_gib": run.memory_bytes / 2**30,
                     "fits": run.fits, "planner_best": best.describe(),
                     "planner_best_tokens_per_second": best.tokens_per_second_per_device})
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Each run ÷ the cp=1 run and ÷ the run before it: published, predicted, and predicted ÷ published."""
    pairs = [(row, rows[0]) for row in rows[1:]] + [(row, before) for before, row in zip(rows[1:], rows[2:])]
    out = []
    for row, reference in pairs:
        published = row["published"] / reference["published"]
        predicted = row["predicted"] / reference["predicted"]
        float8 = row["predicted_float8_linear"] / reference["predicted_float8_linear"]
        out.append({"run": f"cp={row['cp']} {row['seq_len']}", "over": f"cp={reference['cp']} {reference['seq_len']}",
                    "published": published, "predicted": predicted, "predicted_over_published": predicted / published,
                    "float8_linear_over_published": float8 / published,
                    "within_25_percent": abs(predicted / published - 1) <= 0.25})
    return out


def main() -> None:
    rows, rows_405b = runs(), runs("405b")
    print(json.dumps({"runs": rows, "ratios": ratios(rows), "runs_405b": rows_405b, "ratios_405b": ratios(rows_405b)},
                     indent=1))


if __name__ == "__main__":
    main()
