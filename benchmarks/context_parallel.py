"""Context parallelism: the bytes autograd saves per rank for backward, cp ranks against one.

A GQA model (meshlight's GPT: 4 blocks, 256 wide, 8 query heads and 2 key/value heads — kv heads = heads / 4 —,
SwiGLU, rotary positions) runs one training forward on a batch of 2 sequences of ``--seq`` tokens, once whole on one
rank (cp=1) and once split over the world's ranks (cp = world, meshlight's all-gather-K/V attention). The bytes of the
tensors autograd keeps for backward (``saved_tensors_hooks``; each storage once, parameters left out) are summed per
rank; ``ratio`` is the cp run's largest rank over the cp=1 run. Backward keeps each layer's gathered K/V (the whole
sequence's, at the kv heads) rather than gathering them again: ``kv_bytes`` is their share of the cp run's bytes.

``--gpu`` (a CUDA machine; two ranks share its one GPU over gloo, so their times are contended and only their
ratio means much): a GPT of ``--gpu-layers`` blocks, 1024 wide (16 heads, 4 key/value heads), trains on one sequence
of ``--gpu-seq`` tokens in fp32, whole on rank 0 and split over both ranks with each attention method
(``allgather``, and ``ring``: torch's ring attention over the efficient CUDA kernel, its K/V passed between the
ranks by c10d all-gathers here, as gloo cannot run torch's functional collectives on CUDA tensors); the loss and the
gradients' norm against the whole sequence's, the step time and each rank's peak memory.

    python benchmarks/context_parallel.py [--nprocs 4] [--seq 1024]    # prints JSON
    python benchmarks/context_parallel.py --gpu [--gpu-seq 8192]       # on a CUDA machine
"""

from __future__ import annotations

import argparse
import json
import os

from common import is_worker, launch, report

#: the model: GQA with kv heads = heads / 4
CONFIG = dict(vocab_size=512, n_layers=4, dim=256, n_heads=8, n_kv_heads=2, mlp="swiglu", norm="rmsnorm",
              positions="rotary", bias=False)


def saved_bytes(seq: int, cp_mesh: object = None) -> dict[str, int]:
    """Bytes autograd saves for one training forward of the model on 2 sequences of ``seq`` tokens: whole (no
    ``cp_mesh``), or this rank's share under context parallelism over ``cp_mesh``."""
    import torch

    from meshlight.models import GPT, GPTConfig
    from meshlight.parallel.context import ContextParallel

    torch.manual_seed(0)
    model = GPT(GPTConfig(max_seq_len=seq, **CONFIG))
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, seq))
    context = ContextParallel(cp_mesh, model) if cp_mesh is not None else None
    local = context.split((tokens, tokens)) if context is not None else None
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes = {"total": 0, "kv_bytes": 0}
    head_dim = CONFIG["dim"] // CONFIG["n_heads"]
    gathered_kv = 2 * CONFIG["n_kv_heads"] * seq * head_dim * 4  # the whole sequence's K (or V), fp32

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            sizes["total"] += storage.nbytes()
            if cp_mesh is not None and tensor.dim() == 4 and tensor.shape[1] == CONFIG["n_kv_heads"] and (
                    storage.nbytes() == gathered_kv):
                sizes["kv_bytes"] += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if context is None:
            model(tokens)
        else:
            with context.active(local):
                model(local.batch[0])
    return sizes


def worker() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    seq = int(os.environ["CP_BENCH_SEQ"])
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    split = saved_bytes(seq, init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)))
    gathered = [None] * world
    dist.all_gather_object(gathered, split)
    whole = saved_bytes(seq) if dist.get_rank() == 0 else None
    if dist.get_rank() == 0:
        largest = max(gathered, key=lambda sizes: sizes["total"])
        report({"cp": world, "seq": seq, "model": CONFIG, "cp1_bytes": whole["total"],
                "cp_bytes_per_rank": [sizes["total"] for sizes in gathered],
                "ratio": largest["total"] / whole["total"], "kv_bytes": largest["kv_bytes"],
                "kv_share": largest["kv_bytes"] / largest["total"], "backward": "keeps the gathered K/V"})
    dist.destroy_process_group()


def gpu_worker(seq: int, layers: int) -> None:
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshlight.models import GPT, GPTConfig
    from meshlight.parallel.context import ContextParallel

    dist.init_process_group("gloo")
    cuda = torch.cuda.is_available()  # (without one: the same code on CPU, a smoke test of this script)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("cp",))
    config = GPTConfig(vocab_size=32000, max_seq_len=seq, n_layers=layers, dim=1024, n_heads=16, n_kv_heads=4,
                       mlp="swiglu", norm="rmsnorm", positions="rotary", bias=False)
    torch.manual_seed(0)
    model = GPT(config).to(device)
    tokens = torch.randint(0, config.vocab_size, (1, seq), device=device)
    targets = tokens.roll(-1, dims=1)

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def step(context: object) -> tuple[float, float, float, int]:
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        synchronize()
        started = time.perf_counter()
        if context is None:
            loss = model.loss(model(tokens), targets)
            loss.backward()
        else:
            local = context.split((tokens, targets))
            with context.active(local):
                loss = context.weighted_loss(model.loss(model(local.batch[0]), local.batch[1]), local.tokens)
                loss.backward()
            for p in model.parameters():  # the data-parallel reduction over the cp ranks (here: a plain sum)
                dist.all_reduce(p.grad, group=mesh.get_group())
        synchronize()
        seconds = time.perf_counter() - started
        norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
        return float(loss.detach()), norm, seconds, torch.cuda.max_memory_allocated(device) if cuda else 1

    def measure(context: object, repeats: int = 3) -> dict[str, object]:
        try:
            runs = [step(context) for _ in range(repeats + 1)][1:]  # the first warms up
        except Exception as error:  # noqa: BLE001 - what failed is the result
            return {"error": f"{type(error).__name__}: {str(error)[:400]}"}
        loss, norm, _, peak = runs[-1]
        return {"loss": loss, "grad_norm": norm, "step_seconds": sorted(r[2] for r in runs)[len(runs) // 2],
                "peak_bytes": peak}

    results: dict[str, object] = {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
                                  "torch": torch.__version__,
                                  "seq": seq, "layers": layers, "ranks": dist.get_world_size()}
    methods = os.environ["CP_BENCH_GPU_METHODS"].split(",")
    if "ring" in methods and cuda:
        _rotate_through_c10d()
    if dist.get_rank() == 0 and "allgather" in methods:
        results["whole"] = measure(None)
    dist.barrier()
    for method in methods:
        try:
            context = ContextParallel(mesh, model, attention=method, device=device)
        except Exception as error:  # noqa: BLE001
            results[method] = {"error": f"{type(error).__name__}: {error}"}
            continue
        measured = measure(context)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, measured)
        results[method] = gathered
    for method in ("allgather", "ring"):
        _compare(results, method)
    report(results)
    dist.destroy_process_group()


def _compare(results: dict, method: str) -> None:
    """``<method>_vs_whole``: the split run's loss and gradient norm (summed over the 2 ranks: halved) against the
    whole sequence's, its step time and largest peak over the whole run's."""
    rows, whole = results.get(method), results.get("whole", {})
    if isinstance(rows, list) and "loss" in rows[0] and "loss" in whole:
        results[f"{method}_vs_whole"] = {
            "loss_rel": abs(rows[0]["loss"] - whole["loss"]) / whole["loss"],
            "grad_norm_rel": abs(rows[0]["grad_norm"] / 2 - whole["grad_norm"]) / whole["grad_norm"],
            "step_ratio": rows[0]["step_seconds"] / whole["step_seconds"],
            "peak_ratio": max(r["peak_bytes"] for r in rows) / whole["peak_bytes"]}


def _rotate_through_c10d() -> None:
    """torch's ring attention passes K/V (and their gradients) around with functional collectives, which gloo cannot
    run on CUDA tensors (the ranks die); this one-GPU benchmark's gloo group passes them with c10d's all-gather
    instead. The attention kernels and the merging of their partial results stay torch's."""
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    def gathered(buffer: object, group: object) -> object:
        local = buffer.contiguous()
        out = local.new_empty((dist.get_world_size(group) * local.shape[0], *local.shape[1:]))
        dist.all_gather_into_tensor(out, local, group=group)
        return out

    def all_gather_exchange(self: object, buffer: object) -> None:
        self._idx += 1
        if self._aggregated_buffer is None:
            self._aggregated_buffer = gathered(buffer, self._pg)

    def all_to_all_exchange(self: object, buffer: object) -> None:  # each rank's buffer to the next rank
        size, rank = dist.get_world_size(self._pg), dist.get_rank(self._pg)
        self._buffer = gathered(buffer, self._pg).chunk(size)[(rank - 1) % size]

    ring._AllGatherRotater.exchange_buffers = all_gather_exchange
    ring._AllToAllRotater.exchange_buffers = all_to_all_exchange


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, nargs="+", default=[4])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--gpu", action="store_true", help="the CUDA runs (two ranks on GPU 0)")
    parser.add_argument("--gpu-seq", type=int, default=8192)
    parser.add_argument("--gpu-layers", type=int, default=4)
    args = parser.parse_args()
    if args.gpu:
        os.environ.update(CP_BENCH_GPU_SEQ=str(args.gpu_seq), CP_BENCH_GPU_LAYERS=str(args.gpu_layers),
                          CP_BENCH_GPU_METHODS="allgather")
        result = launch(__file__, 2)
        # torch's ring attention in a launch of its own: on a backend it cannot use the ranks may die, not raise
        os.environ["CP_BENCH_GPU_METHODS"] = "ring"
        try:
            result["ring"] = launch(__file__, 2, timeout=300)["ring"]
        except (RuntimeError, TimeoutError) as error:
            result["ring"] = {"error": str(error).strip().splitlines()[-1][:400]}
        _compare(result, "ring")
        print(json.dumps({"gpu": result}, indent=1))
        return
    os.environ["CP_BENCH_SEQ"] = str(args.seq)
    print(json.dumps({"memory": [launch(__file__, n) for n in args.nprocs]}, indent=1))


if __name__ == "__main__":
    if not is_worker():
        main()
    elif "CP_BENCH_GPU_SEQ" in os.environ:
        gpu_worker(int(os.environ["CP_BENCH_GPU_SEQ"]), int(os.environ["CP_BENCH_GPU_LAYERS"]))
    else:
        worker()
