"""Memory of loading Hugging Face weights into a ZeRO-3 model: each rank's anonymous resident memory (``RssAnon``:
heap and anonymous mappings, not safetensors' memory-mapped file pages, which the kernel may drop) sampled every
millisecond while ``PretrainedWeights`` loads a ``save_pretrained`` folder of a Llama of ~234 MB (fp32) into the
model built on the meta device in ``configure_model`` and sharded over the ranks.

Reported per rank: the growth of ``RssAnon`` from just before the load to its peak during it, beside this rank's
shard of the weights and the largest tensor in the files. The claim measured: a rank never holds more than its shard
plus about one tensor (the growth stays within shard + largest tensor; the model is never whole on a rank).

    python benchmarks/pretrained_load.py [--nprocs 4]      # prints JSON
"""

from __future__ import annotations

from common import is_worker, main_over_world_sizes, report

CONFIG = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=8, max_position_embeddings=256, tie_word_embeddings=False, use_cache=False)


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def worker() -> None:
    import os
    import tempfile
    import threading
    import time
    from pathlib import Path

    import lightning.pytorch as pl
    import torch
    import transformers

    import meshlight as ml

    folder = Path(os.environ.get("PRETRAINED_FOLDER") or tempfile.gettempdir()) / "meshlight-pretrained-bench"
    rank = int(os.environ["RANK"])
    if rank == 0 and not (folder / "model.safetensors").exists():
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).save_pretrained(folder)
    torch.distributed.init_process_group("gloo")
    torch.distributed.barrier()  # the folder is written

    class Meta(pl.LightningModule):
        def configure_model(self) -> None:
            with torch.device("meta"):
                self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))

        def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:  # one step, after the load
            return self.model(input_ids=torch.zeros(1, 4, dtype=torch.long)).logits.mean() * 0.0

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class Sampled(ml.callbacks.PretrainedWeights):
        def _load(self, pl_module: pl.LightningModule) -> None:
            peak, done = [rss_anon()], threading.Event()
            before = peak[0]

            def sample() -> None:
                while not done.is_set():
                    peak[0] = max(peak[0], rss_anon())
                    time.sleep(0.001)

            thread = threading.Thread(target=sample)
            thread.start()
            try:
                super()._load(pl_module)
            finally:
                done.set()
                thread.join()
            self.growth = max(peak[0], rss_anon()) - before
            self.shard = sum(p.to_local().nbytes for p in pl_module.parameters())

    callback = Sampled(folder)
    trainer = ml.Trainer(strategy=ml.ZeroStrategy(stage=3), devices=int(os.environ["WORLD_SIZE"]), accelerator="cpu",
                         max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    trainer.fit(Meta(), train_dataloaders=torch.utils.data.DataLoader(range(8)))
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        sizes = {key: f.get_slice(key).get_shape() for key in f.keys()}
    whole = sum(4 * torch.Size(s).numel() for s in sizes.values())
    largest = max(4 * torch.Size(s).numel() for s in sizes.values())
    rows = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(rows, {"rank": rank, "growth_bytes": callback.growth,
                                               "shard_bytes": callback.shard})
    if rank == 0:
        report([{"world": len(rows), "model_bytes": whole, "largest_tensor_bytes": largest, **row,
                 "growth_over_shard_plus_largest": round(row["growth_bytes"] / (row["shard_bytes"] + largest), 3)}
                for row in rows])


if __name__ == "__main__":
    if is_worker():
        worker()
    else:
        main_over_world_sizes(__file__, __doc__)
