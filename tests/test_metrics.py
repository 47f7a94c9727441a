"""MetricWriter read back with TensorBoard's own EventAccumulator, and metrics.jsonl."""

import json
import os
import time

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rl.metrics import MetricWriter


def test_events_and_jsonl_read_back(tmp_path):
    writer = MetricWriter(str(tmp_path))
    writer.write_scalars(1, {"loss": 0.5, "lr": np.float32(1e-3)})
    writer.write_scalars(2, {"loss": 0.25, "bad": float("nan")})
    values = np.arange(100, dtype=np.float32)
    writer.write_histograms(2, {"pass_rate": values}, bins=10)
    writer.write_texts(3, {"sample": "def f():\n    return 1"})
    writer.close()

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 0.5), (2, 0.25)]
    assert abs(acc.Scalars("lr")[0].value - 1e-3) < 1e-9
    (hist,) = acc.Histograms("pass_rate")
    assert hist.step == 2
    h = hist.histogram_value
    assert (h.min, h.max, h.num, h.sum) == (0.0, 99.0, 100.0, float(values.sum()))
    assert h.bucket == [10.0] * 10
    np.testing.assert_allclose(h.bucket_limit, np.linspace(0, 99, 11)[1:])
    (text,) = acc.Tensors("sample")
    assert text.step == 3
    assert text.tensor_proto.string_val[0].decode() == "def f():\n    return 1"
    assert acc.summary_metadata["sample"].plugin_data.plugin_name == "text"

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"step": 1, "loss": 0.5, "lr": float(np.float32(1e-3))},
        {"step": 2, "loss": 0.25, "bad": None}]


def test_writer_appends_across_instances(tmp_path):
    for step in range(2):
        writer = MetricWriter(str(tmp_path))
        writer.write_scalars(step, {"x": step})
        writer.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    assert os.listdir(tmp_path / "tb")


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_resume_drops_rows_after_the_resume_step(tmp_path):
    """SFT rows (steps counting SFT updates), the step-0 eval, RL steps 1-4 and a line cut
    short by a kill; resuming from the checkpoint of step 2 keeps everything up to step
    2's row and drops steps 3, 4 and the partial line."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 10, "sft/loss": 2.0}, {"step": 20, "sft/loss": 1.0},
            {"step": 0, "eval/pass_rate": 0.1}] + [{"step": s, "x": s} for s in (1, 2, 3, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "x"')
    writer = MetricWriter(str(tmp_path), resume_step=2)
    writer.write_scalars(3, {"x": 30.0})
    writer.close()
    assert _rows(path) == rows[:5] + [{"step": 3, "x": 30.0}]

    # A fresh start (no checkpoint: resume_step 0) after a kill during SFT keeps nothing
    # of the killed SFT; a run without SFT killed before its first checkpoint keeps its
    # step-0 eval (train.py does not evaluate step 0 again when eval_0.json exists).
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    MetricWriter(str(tmp_path), resume_step=0).close()
    assert path.read_text() == ""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[2:]))
    MetricWriter(str(tmp_path), resume_step=0).close()
    assert _rows(path) == rows[2:3]
    # Without resume_step (no resume information), nothing is dropped.
    MetricWriter(str(tmp_path)).close()
    assert _rows(path) == rows[2:3]


def _scalars(workdir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(os.path.join(workdir, "tb"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def test_resume_drops_events_after_the_resume_step(tmp_path):
    """The TensorBoard side of the test above: SFT at steps 10 and 20, RL steps 1-4 over
    two starts (each start has its own event file), and a record cut short by a kill.
    Resuming from step 2 shows every step once: no step 3 or 4 of the killed run."""
    first = MetricWriter(str(tmp_path), resume_step=0)
    first.write_scalars(10, {"sft/loss": 2.0})
    first.write_scalars(20, {"sft/loss": 1.0})
    first.write_scalars(1, {"x": 1.0})
    first.close()
    # Event files are named by their start's second, then by a per-process counter that
    # sorts as text (9 after 10): starts a second apart, as separate runs are.
    time.sleep(1.05)
    second = MetricWriter(str(tmp_path), resume_step=1)
    for step in (2, 3, 4):
        second.write_scalars(step, {"x": float(step)})
    second.close()
    (last,) = sorted((tmp_path / "tb").iterdir())[-1:]
    with open(last, "ab") as f:
        f.write(b"\x20\x00\x00\x00\x00\x00\x00\x00\x01\x02")  # a record cut short
    time.sleep(1.05)
    resumed = MetricWriter(str(tmp_path), resume_step=2)
    resumed.write_scalars(3, {"x": 30.0})
    resumed.close()
    assert _scalars(tmp_path) == {"sft/loss": [(10, 2.0), (20, 1.0)],
                                  "x": [(1, 1.0), (2, 2.0), (3, 30.0)]}

    # A fresh start after a kill during SFT keeps nothing of the killed SFT.
    killed = MetricWriter(str(tmp_path / "sft_only"), resume_step=0)
    killed.write_scalars(5, {"sft/loss": 3.0})
    killed.close()
    time.sleep(1.05)
    MetricWriter(str(tmp_path / "sft_only"), resume_step=0).close()
    assert _scalars(tmp_path / "sft_only") == {}
