"""TrainingMonitor writes throughput, MFU, step time, per-rank peak memory and the layout to TensorBoard;
ProfileSteps writes a profiler trace of the chosen steps into the log directory."""

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import meshlight as ml
from meshlight.callbacks import ProfileSteps, TrainingMonitor
from meshlight.demos import AdditionDataModule, LitGPT
from meshlight.models import GPTConfig


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("monitor")
    config = GPTConfig.tiny(vocab_size=AdditionDataModule.vocab_size, max_seq_len=12, dim=32, n_layers=2)
    monitor, profile = TrainingMonitor(log_every_n_steps=2), ProfileSteps(steps=range(3, 5))
    trainer = ml.Trainer(strategy="zero1", devices=1, accelerator="cpu", max_steps=8, default_root_dir=root,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, accumulate_grad_batches=2, callbacks=[monitor, profile])
    module = LitGPT(config)
    trainer.fit(module, AdditionDataModule(3, batch_size=4, train_size=4 * 16))
    events = EventAccumulator(trainer.logger.log_dir, size_guidance={"tensors": 0})
    events.Reload()
    return trainer, module, events, profile, monitor


def test_logs_throughput_mfu_step_time_and_memory(run):
    _, module, events, _, monitor = run
    scalars = set(events.Tags()["scalars"])
    assert {"perf/step_seconds", "perf/tokens_per_second", "perf/tokens_per_second_per_device", "perf/mfu",
            "memory/peak_bytes/rank0"} <= scalars
    steps = [e.step for e in events.Scalars("perf/tokens_per_second")]
    assert steps == [2, 4, 6, 8]
    # tokens per optimizer step: 2 micro-batches × 4 sequences × 12 tokens
    seconds = events.Scalars("perf/step_seconds")[-1].value
    assert events.Scalars("perf/tokens_per_second")[-1].value == pytest.approx(96 / seconds, rel=1e-4)
    mfu = events.Scalars("perf/mfu")[-1].value
    flops = module.model.flops_per_token()
    assert mfu == pytest.approx(96 / seconds * flops / monitor.peak_flops, rel=1e-4)
    assert events.Scalars("memory/peak_bytes/rank0")[-1].value > 50e6  # a Python process with torch loaded


def test_writes_the_layout_as_text(run):
    _, _, events, _, _ = run
    assert "meshlight/layout/text_summary" in events.Tags()["tensors"]
    text = events.Tensors("meshlight/layout/text_summary")[0].tensor_proto.string_val[0].decode()
    assert text.startswith("dp=1 (ZeRO-1) · pp=1 · tp=1")


def test_profiles_the_chosen_steps_into_the_log_dir(run):
    trainer, _, _, profile, _ = run
    assert profile.trace_dir.parent == type(profile.trace_dir)(trainer.logger.log_dir)
    traces = list(profile.trace_dir.glob("rank0*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any("aten::mm" in str(e.get("name")) or "aten::addmm" in str(e.get("name")) for e in events)
