"""One metric writer: TensorBoard events in workdir/tb and workdir/metrics.jsonl; what a
step reports (rollout metrics, lags, histograms, the console line); one timer.

Events are written with TensorBoard's own TensorFlow-free event writer and
protos. Only process 0 writes; on other processes every call is a no-op.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping, MutableMapping, Sequence

import jax
import numpy as np
import tqdm
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto import (
    event_pb2,
    summary_pb2,
    tensor_pb2,
    tensor_shape_pb2,
    types_pb2,
)
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.summary.writer.record_writer import RecordWriter

from env.grading import error_kind
from rl import prefix
from rl.rollout import ENGINE_ERROR
from rl.types import Trajectory

log = logging.getLogger(__name__)

# checkpoint step -> (metrics.jsonl rows, TensorBoard summaries) written when it was saved
MARKS = "metrics_marks.json"


def _float(value) -> float:
    return float(np.asarray(value).item())


def histogram_proto(values, bins: int = 30) -> summary_pb2.HistogramProto:
    """TensorBoard histogram of `values` (any shape) with `bins` equal-width buckets."""
    values = np.asarray(values, np.float64).reshape(-1)
    if values.size == 0:
        raise ValueError("histogram of an empty array")
    counts, edges = np.histogram(values, bins=bins)
    return summary_pb2.HistogramProto(
        min=float(values.min()), max=float(values.max()), num=float(values.size),
        sum=float(values.sum()), sum_squares=float(np.square(values).sum()),
        bucket_limit=[float(e) for e in edges[1:]], bucket=[float(c) for c in counts])


def text_value(tag: str, text: str) -> summary_pb2.Summary.Value:
    """A text-plugin summary value (a rank-0 string tensor)."""
    tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[text.encode("utf-8")],
                                    tensor_shape=tensor_shape_pb2.TensorShapeProto())
    meta = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
    return summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=meta)


def drop_rows_after(path: str, step: int, rows: int | None = None) -> int:
    """Keeps the rows of `path` (a metrics.jsonl) up to the last one whose step is <=
    `step` (rows of later steps precede it only for the SFT warm start, whose steps
    count its own updates), or the first `rows` rows when given, and drops the rest,
    including a line cut short by a kill. The file is replaced whole (written beside
    it, then renamed). Returns the number of lines dropped."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = f.read().splitlines()
    keep = 0
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            break
        if (row["step"] <= step) if rows is None else i < rows:
            keep = i + 1
    if keep < len(lines):
        with open(path + ".tmp", "w") as f:
            f.writelines(line + "\n" for line in lines[:keep])
        os.replace(path + ".tmp", path)
        log.warning("%s: dropped %d rows written after step %d (resuming from it)", path,
                    len(lines) - keep, step)
    return len(lines) - keep


def drop_events_after(tb_dir: str, step: int, summaries: int | None = None) -> int:
    """drop_rows_after for the TensorBoard event files of `tb_dir`: in file order (one
    file per start, named by its start time), keeps the events up to the last summary
    whose step is <= `step` (none if no summary qualifies), or up to the `summaries`-th
    summary when given, rewrites the file that holds it without the rest (and without a
    record cut short by a kill), and deletes later files. Returns the number of
    summaries dropped. Without this a resumed run's steps would appear twice."""
    events = _event_files(tb_dir)
    cut = (0, 0)  # (file index, events kept in it): nothing, unless a summary qualifies
    seen = 0
    for i, (_, file_events) in enumerate(events):
        for j, (_, event) in enumerate(file_events):
            if not event.HasField("summary"):
                continue
            seen += 1
            if (event.step <= step) if summaries is None else seen <= summaries:
                cut = (i, j + 1)
    dropped = 0
    for i, (path, file_events) in enumerate(events):
        keep = len(file_events) if i < cut[0] else cut[1] if i == cut[0] else 0
        dropped += sum(e.HasField("summary") for _, e in file_events[keep:])
        if keep == 0:
            os.remove(path)
        elif keep < len(file_events) or os.path.getsize(path) != sum(
                len(record) + 16 for record, _ in file_events):  # (+ length, 2 CRCs) cut short
            with open(path + ".tmp", "wb") as f:
                writer = RecordWriter(f)
                for record, _ in file_events[:keep]:
                    writer.write(record)
            os.replace(path + ".tmp", path)
    if dropped:
        log.warning("%s: dropped %d summaries written after step %d (resuming from it)",
                    tb_dir, dropped, step)
    return dropped


def _event_files(tb_dir: str) -> list[tuple[str, list[tuple[bytes, event_pb2.Event]]]]:
    """(path, [(raw record, event)]) of each event file of `tb_dir`, in file order; raw
    records are written back byte for byte (EventFileLoader would migrate them)."""
    paths = sorted(p for p in glob.glob(os.path.join(tb_dir, "events.out.tfevents.*"))
                   if not p.endswith(".tmp"))
    return [(path, [(record, event_pb2.Event.FromString(record))
                     for record in RawEventFileLoader(path).Load()]) for path in paths]


def _count_rows(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for _ in f)


class MetricWriter:
    """Writes scalars, histograms and text for `workdir`.

    write_scalars also appends {"step": step, **scalars} as one line to
    workdir/metrics.jsonl (non-finite values become null there).
    resume_step: the checkpoint step the run restarts from, or -1 for a start without
    a checkpoint. What a killed run wrote after that checkpoint (the resumed run writes
    it again) is dropped from metrics.jsonl and the TensorBoard events: exactly the
    rows and summaries written after `mark(resume_step)` where the run marked that
    step, else those of later steps (see drop_rows_after); -1 drops everything,
    e.g. an SFT warm start cut short by a kill (it runs again from its first step).
    """

    def __init__(self, workdir: str, resume_step: int | None = None):
        self.enabled = jax.process_index() == 0
        if not self.enabled:
            return
        self._marks_path = os.path.join(workdir, MARKS)
        jsonl, tb = os.path.join(workdir, "metrics.jsonl"), os.path.join(workdir, "tb")
        os.makedirs(tb, exist_ok=True)
        self._marks = self._read_marks()
        if resume_step is not None:
            rows, summaries = self._marks.get(str(resume_step), (None, None))
            drop_rows_after(jsonl, resume_step, rows)
            drop_events_after(tb, resume_step, summaries)
            self._marks = {k: v for k, v in self._marks.items() if int(k) <= resume_step}
            self._save_marks()
        self.rows = _count_rows(jsonl)
        self.summaries = sum(e.HasField("summary") for _, events in _event_files(tb)
                             for _, e in events)
        self._events = EventFileWriter(tb)
        # Line-buffered: a crash or kill loses no written step.
        self._jsonl = open(jsonl, "a", buffering=1)  # noqa: SIM115

    def mark(self, step: int) -> None:
        """Records that a checkpoint of `step` holds everything written so far (flushed
        first): a run resumed from it keeps exactly these rows and summaries."""
        if not self.enabled:
            return
        self.flush()
        self._marks[str(int(step))] = (self.rows, self.summaries)
        self._save_marks()

    def has_row(self, step: int, key: str) -> bool:
        """Whether metrics.jsonl holds a row of `step` with `key` (True where this
        process writes nothing)."""
        if not self.enabled:
            return True
        self.flush()
        with open(self._jsonl.name) as f:
            for line in f:
                with contextlib.suppress(json.JSONDecodeError):
                    row = json.loads(line)
                    if row.get("step") == step and key in row:
                        return True
        return False

    def _read_marks(self) -> dict[str, tuple[int, int]]:
        try:
            with open(self._marks_path) as f:
                return {k: tuple(v) for k, v in json.load(f).items()}
        except FileNotFoundError:
            return {}
        except (ValueError, TypeError, AttributeError):
            log.warning("%s is unreadable: metric rows are cut by step on resume",
                        self._marks_path)
            return {}

    def _save_marks(self) -> None:
        with open(self._marks_path + ".tmp", "w") as f:
            json.dump(self._marks, f)
        os.replace(self._marks_path + ".tmp", self._marks_path)

    def _write(self, step: int, values: list[summary_pb2.Summary.Value]) -> None:
        event = event_pb2.Event(wall_time=time.time(), step=int(step),
                                summary=summary_pb2.Summary(value=values))
        self._events.add_event(event)
        self.summaries += 1

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        values = {k: _float(v) for k, v in scalars.items()}
        self._write(step, [summary_pb2.Summary.Value(tag=k, simple_value=v)
                           for k, v in values.items()])
        row = {"step": int(step), **{k: v if math.isfinite(v) else None
                                     for k, v in values.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        self.rows += 1

    def write_histograms(self, step: int, arrays: Mapping[str, np.ndarray],
                         bins: int = 30) -> None:
        if not self.enabled:
            return
        self._write(step, [summary_pb2.Summary.Value(tag=k, histo=histogram_proto(v, bins))
                           for k, v in arrays.items()])

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        if not self.enabled:
            return
        self._write(step, [text_value(k, v) for k, v in texts.items()])

    def flush(self) -> None:
        if not self.enabled:
            return
        self._events.flush()
        self._jsonl.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        self._events.close()
        self._jsonl.close()
        self.enabled = False


# ------------------------------------------------------------------ timing and progress


@contextlib.contextmanager
def timed(metrics: MutableMapping[str, float], key: str) -> Iterator[None]:
    """Adds the seconds the block took to `metrics[key]` (set when absent)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - t0


@contextlib.contextmanager
def progress(total: int, desc: str):
    """A progress bar on stderr for long phases (silent when stderr is not a terminal)."""
    bar = tqdm.tqdm(total=total, desc=desc, leave=False, file=sys.stderr,
                    disable=not sys.stderr.isatty())
    try:
        yield bar
    finally:
        bar.close()


# ------------------------------------------------------------------ what a step reports


def rollout_metrics(trajs: Sequence[Trajectory], groups: Sequence[Sequence[Trajectory]]
                    ) -> dict[str, float]:
    """Pass rate, solve_none / partial / all, statuses and lengths of one step's rollouts."""
    scored = [t for t in trajs if t.is_scored]
    m: dict[str, float] = {"rollout/trajectories": len(trajs),
                           "rollout/env_errors": len(trajs) - len(scored)}
    for t in trajs:  # by reason: a sandbox failure, or tests that never ran (and why)
        if t.is_env_error:
            key = f"rollout/env_errors_{error_kind(t.error)}"
            m[key] = m.get(key, 0) + 1
    if scored:
        m["rollout/pass_rate"] = float(np.mean([t.reward for t in scored]))
        m["rollout/steps_mean"] = float(np.mean([t.num_steps for t in scored]))
        m["rollout/generated_tokens_mean"] = float(np.mean([t.num_generated_tokens
                                                            for t in scored]))
    for status in ("finished", "max_steps", "truncated", "timeout"):
        m[f"rollout/status_{status}"] = sum(t.status == status for t in trajs)
    m["rollout/grades_cached"] = sum(t.grade_cached for t in scored)
    m["rollout/engine_errors"] = sum(t.is_env_error and t.error.startswith(ENGINE_ERROR)
                                     for t in trajs)
    fresh = prefix.fresh_pass_rate(groups)
    if fresh is not None:
        m["rollout/fresh_pass_rate"] = fresh
    rewards = [[t.reward for t in g if t.is_scored] for g in groups]
    rewards = [r for r in rewards if r]
    m["rollout/solve_none"] = sum(max(r) == 0 for r in rewards)
    m["rollout/solve_all"] = sum(min(r) == 1 for r in rewards)
    m["rollout/solve_partial"] = len(rewards) - m["rollout/solve_none"] - m["rollout/solve_all"]
    gen = [t.timings.get("generate_s", 0.0) for t in trajs]
    env = [t.timings.get("env_s", 0.0) + t.timings.get("grade_s", 0.0) for t in trajs]
    m["time/generate_s_sum"], m["time/env_s_sum"] = float(sum(gen)), float(sum(env))
    return m


def lag_metrics(lags: np.ndarray) -> dict[str, float]:
    """Mean and max of the policy versions a step's trajectories lag the learner's, and
    the count of each lag (async/lag_k)."""
    if not lags.size:
        return {}
    values, counts = np.unique(lags.astype(np.int64), return_counts=True)
    return {"async/lag_mean": float(lags.mean()), "async/lag_max": float(lags.max()),
            **{f"async/lag_{v}": float(c) for v, c in zip(values, counts, strict=True)}}


def histograms(groups: Sequence[Sequence[Trajectory]]) -> dict[str, np.ndarray]:
    """Per-task pass rates and generated lengths of one step's rollouts."""
    rates = [np.mean([t.reward for t in g if t.reward is not None]) for g in groups
             if any(t.reward is not None for t in g)]
    lengths = [t.num_generated_tokens for g in groups for t in g]
    # A step whose rollouts were all env errors has no pass rates to histogram.
    out = {"rollout/task_pass_rate": rates, "rollout/generated_tokens": lengths}
    return {k: np.asarray(v, np.float64) for k, v in out.items() if v}


def group_outcomes(groups: Sequence[Sequence[Trajectory]]) -> str:
    """One step's groups as JSON, for per-group analyses (the pass rate of every prefix
    group, say): [task id, prefix kind or null, prefix k, successes, scored] each."""
    rows = []
    for g in groups:
        scored = [t for t in g if t.is_scored]
        p = g[0].prefix if g else None
        rows.append([g[0].task_id if g else "", p.kind if p else None, p.k if p else 0,
                     int(sum(t.reward for t in scored)), len(scored)])
    return json.dumps(rows, separators=(",", ":"))


def console_line(step: int, m: Mapping[str, float]) -> str:
    """One line per RL step: pass rate, group outcomes, throughput and phase times."""
    get = lambda k, default=float("nan"): m.get(k, default)
    env_share = get("time/env_s_sum", 0.0) / max(
        get("time/env_s_sum", 0.0) + get("time/generate_s_sum", 0.0), 1e-9)
    line = (f"step {step:4d} | pass {get('rollout/pass_rate'):.3f} | "
            f"none/partial/all {get('rollout/solve_none', 0):.0f}/"
            f"{get('rollout/solve_partial', 0):.0f}/{get('rollout/solve_all', 0):.0f} | "
            f"tok/s {get('rollout/generated_tokens_per_s', 0):.0f} | "
            f"rollout {get('time/rollout_s', 0):.1f}s (env {env_share:.0%}) "
            f"learner {get('time/learner_s', 0):.1f}s sync {get('time/sync_s', 0):.2f}s")
    if "ps/prefix_tasks/too_hard" in m:
        line += (f" | prefix tasks {m['ps/prefix_tasks/too_hard']:.0f}+"
                 f"{m['ps/prefix_tasks/too_easy']:.0f}")
    if "eval/pass_rate" in m:
        line += f" | eval {m['eval/pass_rate']:.3f}"
    return line
