"""bench.gpu_check: `all --tiny` runs every part on CPU (Pallas interpreted) and writes one
JSON object within tolerance; a failing, a hanging and an unbudgeted job are each
recorded while the others run; the helpers against hand-computed values."""

import json
import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from bench import gpu_check
from bench.gpu_check import Job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_model_flops(row_len: int, segments: int) -> float:
    """6 x matmul parameters per token + causal attention, for the tiny preset written out
    (d 128, SwiGLU 384, 2 layers, 4 query and 2 kv heads of 32, vocabulary 4096)."""
    d, inter, layers, heads, kv_heads, head_dim, vocab = 128, 384, 2, 4, 2, 32, 4096
    per_layer = d * head_dim * (heads + kv_heads) * 2 + 3 * d * inter
    params = layers * per_layer + d * vocab
    n = row_len // segments
    return 6.0 * params * row_len + 6.0 * layers * heads * head_dim * segments * n * n


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "all", "--tiny",
                           "--out", str(out), "--budget-s", "600"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    with open(out / "gpu_check.json") as f:
        result = json.load(f)
    return done, result, (out / "gpu_check.log").read_text()


def test_all_tiny_runs_every_part_and_exits_0(tiny_run):
    done, result, log = tiny_run
    assert done.returncode == 0, done.stderr[-3000:]
    names = [job.name for job in gpu_check.plan(tiny=True)]
    assert list(result["jobs"]) == names
    assert not [n for n, r in result["jobs"].items() if "error" in r]
    for name in names:
        assert f"-> {name}: " in log
    assert set(result["summary"]["goals"]) == {
        "mfu_1.7b_at_least_0.35", "decode_3x_hf_at_batch_32",
        "decode_greedy_agreement_1_at_batch_32",
        "sync_0.6b_under_3_s"}
    assert result["total_s"] <= result["budget_s"]


def test_all_tiny_kernels_within_tolerance(tiny_run):
    kernels = tiny_run[1]["jobs"]["kernels"]
    assert kernels["interpret"] is True and kernels["backend"] == "cpu" and kernels["ok"]
    cases = kernels["cases"]
    for kind, outputs in (("attention", {"out", "dq", "dk", "dv"}),
                          ("logprob", {"logp", "entropy", "d_hidden", "d_head"})):
        for dtype, tolerance in (("float32", 1e-3), ("bfloat16", 2e-2)):
            mine = {k: c for k, c in cases.items() if k.startswith(f"{kind}_{dtype}")}
            assert mine, (kind, dtype)
            for c in mine.values():
                assert outputs <= set(c) and c["tolerance"] == tolerance and c["ok"]
                assert max(c[k] for k in outputs) == c["max"] <= tolerance
    # Interpreted, float32 Pallas is the reference up to summation order.
    assert all(c["max"] < 1e-5 for k, c in cases.items() if "float32" in k)


def test_all_tiny_step_decode_and_sync_figures(tiny_run):
    jobs = tiny_run[1]["jobs"]
    for impl in ("xla", "reference"):
        step = jobs[f"step/tiny/{impl}"]
        assert step["attention"] == impl and step["finite"] and step["tokens_per_s"] > 0
        assert step["model_flops"] == pytest.approx(tiny_model_flops(256, 4))
        assert step["xla_flops"] > 0 and step["mfu"] is None  # no bf16 peak known on CPU
    losses = [jobs[f"step/tiny/{impl}"]["loss"] for impl in ("xla", "reference")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)  # same step, other attention
    decode = jobs["decode/float32"]
    assert list(decode["batches"]) == ["1", "3"] and decode["hf_torch_threads"] >= 1
    for row in decode["batches"].values():
        assert row["greedy_agreement"] == 1.0 and row["agreed_prefix"] == 1.0
        assert row["speedup_vs_hf"] == pytest.approx(
            row["embedded_tokens_per_s"] / row["hf_tokens_per_s"], rel=0.02)
    sync = jobs["sync/tiny"]
    assert len(sync["updates"]) == 2 and all(sync["outputs_changed"])
    assert all(u["export_bytes"] > 0 and u["reload_s"] > 0 for u in sync["updates"])
    assert tiny_run[1]["summary"]["figures"]["sync/tiny"]["export_bytes"] == \
        sync["updates"][1]["export_bytes"]


def test_run_all_isolates_failing_hanging_and_unbudgeted_jobs(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"value": 3}))
    jobs = [Job("good", ("json.tool", str(good), "{json}"), 30),
            Job("fails", ("json.tool", str(tmp_path / "missing.json"), "{json}"), 30),
            # Saves what it has so far, then hangs: stopped, its saved part is kept.
            Job("hangs", ("timeit", "-n", "1", "-r", "1", "-s", "import json; "
                          "json.dump({'cases': 1}, open('{json}', 'w'))",
                          "import time; time.sleep(60)"), 5),
            Job("late", ("json.tool", str(good), "{json}"), 30),
            Job("after", ("json.tool", str(good), "{json}"), 30)]
    start = time.perf_counter()
    result = gpu_check.run_all(jobs, str(tmp_path / "out"), budget_s=9.0)
    assert time.perf_counter() - start < 30
    runs = result["jobs"]
    assert runs["good"]["value"] == 3
    assert runs["fails"]["error"].startswith("exit code ") and "missing.json" in \
        runs["fails"]["error"]
    assert runs["hangs"]["error"] == "timed out after 5 s" and runs["hangs"]["seconds"] < 20
    assert runs["hangs"]["cases"] == 1
    assert runs["late"]["error"] == runs["after"]["error"] == \
        "not run: the time budget was spent"
    assert gpu_check.failed(result) == ["fails", "hangs", "late", "after"]
    with open(tmp_path / "out" / "gpu_check.json") as f:
        assert json.load(f)["jobs"] == runs
    assert "== fails" in (tmp_path / "out" / "gpu_check.log").read_text()


def test_compare_judges_against_the_dtype_tolerance():
    def run(scale):
        return lambda impl, dtype: {"x": jnp.array([1.0, -2.0, 4.0], dtype) *
                                    (scale if impl == "pallas" else 1.0)}
    assert gpu_check.compare(run(1.0), jnp.float32) == {
        "x": 0.0, "max": 0.0, "tolerance": 1e-3, "ok": True}
    assert gpu_check.compare(run(1.0005), jnp.float32)["ok"]
    assert not gpu_check.compare(run(1.002), jnp.float32)["ok"]
    assert gpu_check.compare(run(1.015625), jnp.bfloat16)["ok"]  # bf16 steps are 2^-7
    assert not gpu_check.compare(run(1.03125), jnp.bfloat16)["ok"]

    def broken(impl, dtype):
        raise RuntimeError("does not compile")
    assert gpu_check.compare(broken, jnp.float32) == {
        "error": "RuntimeError: does not compile", "ok": False}


def test_helpers_against_hand_computed_values():
    assert gpu_check.rel_err([1.0, 2.5, -4.0], [1.0, 2.0, -4.0]) == pytest.approx(0.125)
    equal, prefix = gpu_check.agreement([[1, 2, 3], [1, 5, 3]], [[1, 2, 3], [1, 2, 3]])
    assert equal == pytest.approx(5 / 6) and prefix == pytest.approx((3 + 1) / 2 / 3)
    assert gpu_check.peak_flops("NVIDIA H200") == pytest.approx(989.4e12)
    assert gpu_check.peak_flops("NVIDIA H100 PCIe") == pytest.approx(756e12)
    assert gpu_check.peak_flops("cpu") is None
    assert gpu_check.peak_flops("cpu", 100.0) == pytest.approx(1e14)
    row = gpu_check.packed_row(vocab=50, row_len=16, segments=4)
    assert row.segment_ids.tolist() == [[1] * 4 + [2] * 4 + [3] * 4 + [4] * 4]
    assert row.positions.tolist() == [[0, 1, 2, 3] * 4]
    assert row.loss_mask.tolist() == [[0, 0, 1, 1] * 4]
    assert np.all(row.seq_num_tokens == 2 * row.loss_mask)


def test_importing_it_starts_no_backend():
    """`all` imports this module and must leave the whole GPU to its jobs' processes."""
    code = ("import bench.gpu_check; from jax._src import xla_bridge; "
            "assert not xla_bridge._backends, xla_bridge._backends")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_gpu_plan_asks_for_the_shapes_it_reports():
    """The H200 plan, parsed as its jobs' processes will parse it."""
    jobs = {job.name: job for job in gpu_check.plan(tiny=False)}
    assert list(jobs)[:4] == ["kernels", "step/qwen3-0.6b/pallas", "decode/bfloat16",
                              "sync/qwen3-0.6b"]  # each part's headline first
    assert {n for n in jobs if n.startswith("step/")} == {
        f"step/{p}/{a}" for p in ("qwen3-0.6b", "qwen3-1.7b") for a in ("pallas", "xla")}
    for name, job in jobs.items():
        if job.argv[0] == "bench.weight_sync":
            assert job.argv[job.argv.index("--preset") + 1] == name.split("/")[1]
            continue
        args = gpu_check.parser().parse_args(list(job.argv[1:]))
        assert not args.tiny and args.json == "{json}"
        if args.part == "step":
            assert (args.row_len, args.segments) == (16384, 4)
            assert f"step/{args.preset}/{args.attention}" == name
        if name == "decode/bfloat16":
            assert (args.preset, args.batch_sizes, args.new_tokens) == (
                "qwen3-0.6b", "1,32,128", 256)
            assert dict(job.env)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.45"
    assert [j.name for j in gpu_check.select(list(jobs.values()), "step/qwen3-1.7b, sync")] \
        == ["sync/qwen3-0.6b", "step/qwen3-1.7b/pallas", "step/qwen3-1.7b/xla",
            "sync/qwen3-1.7b"]
    assert gpu_check.select(list(jobs.values()), "") == list(jobs.values())
    assert gpu_check.GPU_KERNELS.dims == (1024, 4096, 5120)
    assert gpu_check.GPU_KERNELS.vocab == 151936 and gpu_check.GPU_KERNELS.d_block is None


def test_summary_goals_and_failures_from_job_results():
    sync = lambda export_s, reload_s: {"export_s": export_s, "export_bytes": 10,
                                       "reload_s": reload_s, "total_s": export_s + reload_s}
    results = {
        "kernels": {"ok": False, "interpret": False, "cases": {
            "a": {"max": 0.5, "tolerance": 0.02, "ok": False},
            "b": {"error": "KernelUnavailable", "ok": False}, "c": {"max": 1e-4, "ok": True}}},
        "step/qwen3-1.7b/pallas": {"tokens_per_s": 9e3, "mfu": 0.36, "xla_mfu": 0.1,
                                   "peak_gib": 50.0},
        "decode/bfloat16": {"batches": {"32": {"speedup_vs_hf": 2.5, "greedy_agreement": 0.6}}},
        "decode/float32": {"batches": {"32": {"speedup_vs_hf": 1.0, "greedy_agreement": 1.0}}},
        # The first update includes the server's first load of a file: left out.
        "sync/qwen3-0.6b": {"updates": [sync(9.0, 9.0), sync(1.0, 1.5), sync(1.2, 1.7)]},
        "sync/qwen3-1.7b": {"error": "timed out after 75 s"},
        "step/qwen3-0.6b/xla": {"tokens_per_s": 5.0},  # a JSON without its figures
    }
    summary = gpu_check.summarize(results)
    figures = summary["figures"]
    assert figures["kernels"] == {"ok": False, "interpret": False, "worst": 0.5,
                                  "failed": ["a", "b"]}
    assert figures["sync/qwen3-0.6b"] == pytest.approx(
        {"export_s": 1.1, "export_bytes": 10, "reload_s": 1.6, "total_s": 2.7})
    assert figures["step/qwen3-0.6b/xla"]["error"].startswith("no figures in its JSON")
    assert summary["goals"] == {"mfu_1.7b_at_least_0.35": True,
                                "decode_3x_hf_at_batch_32": False,
                                "decode_greedy_agreement_1_at_batch_32": True,
                                "sync_0.6b_under_3_s": True}
    assert gpu_check.failed({"summary": summary, "jobs": results}) == [
        "sync/qwen3-1.7b", "step/qwen3-0.6b/xla", "a", "b"]
    assert set(gpu_check.summarize({})["goals"].values()) == {None}


def test_a_job_started_with_sigint_ignored_still_stops_soon_after_its_timeout(tmp_path):
    """Started from a shell's background job, the checker inherits SIGINT ignored; its
    jobs still get SIGINT as a KeyboardInterrupt, not only the SIGKILL 15 s later."""
    job = Job("hangs", ("timeit", "-n", "1", "-r", "1", "import time; time.sleep(60)"), 2)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        result, _ = gpu_check.run_job(job, str(tmp_path), 2)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert result["error"] == "timed out after 2 s" and result["seconds"] < 10
