"""Config files run what they say: every option of every file dry-runs, builds the
preset the file is named after and changes only the keys it names; derived keys
follow overrides; numeric keys are range-checked; no key is dead; reading a config
imports no JAX."""

import ast
import dataclasses
import glob
import importlib
import json
import os
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

import train
from configs import common
from models import loading, qwen3
from rl import learner
from rl.batch import pack_arrays
from rl.rollout import RolloutConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
               if os.path.basename(p) not in ("common.py", "__init__.py"))

# The preset each recipe file is named after.
PRESET = {"grpo_swe.py": "qwen3-14b", "ps_qwen3_14b_swe.py": "qwen3-14b",
          "ps_qwen3_32b_swe.py": "qwen3-32b", "spo_qwen3_8b.py": "qwen3-8b",
          "default.py": "tiny"}
# Each recipe's key values, from its docstring and the seed it cites.
RECIPE = {
    "default.py": {"algo": "grpo", "ps.enabled": True, "ps.remaining_ratio": 0.75,
                   "rollout.temperature": 0.4, "learner.temperature": 0.4,
                   "learner.optim.lr": 2e-4, "learner.loss.eps_high": 0.28,
                   "env.difficulties": (0,), "rollout.max_steps": 3, "sft.explore_share": 0.75,
                   "rollout.max_context": 2048, "batch_tasks": 8, "total_steps": 24},
    "grpo_swe.py": {"algo": "grpo", "advantage": "rloo", "batch_tasks": 64, "group_size": 8,
                    "rollout.max_steps": 50, "learner.loss.eps_high": 0.28,
                    "learner.loss.kl": "none", "ps.enabled": False, "reject_degenerate": True},
    "ps_qwen3_14b_swe.py": {"algo": "grpo", "batch_tasks": 64, "group_size": 8,
                            "rollout.max_steps": 50, "ps.enabled": True, "ps.adaptive": False,
                            "ps.low": 0.3, "ps.high": 0.7, "ps.remaining_ratio": 0.25,
                            "ps.prefix_ratio": 0.25, "ps.max_share": 0.5},
    "ps_qwen3_32b_swe.py": {"algo": "grpo", "ps.enabled": True, "ps.adaptive": True,
                            "ps.ema_alpha": 0.05, "ps.step_size": 0.05, "ps.cooldown": 5,
                            "ps.band": 0.03, "total_steps": 100, "engine.sglang.tp_size": 4},
    "spo_qwen3_8b.py": {"algo": "spo", "group_size": 1, "batch_tasks": 256,
                        "spo.init_samples": 8, "spo.d_half": 0.06, "spo.rho_min": 0.875,
                        "spo.rho_max": 0.96, "spo.sampler_eps": 0.05, "rollout.max_steps": 8,
                        "learner.optim.lr": 1e-6, "learner.loss.eps_low": 0.2,
                        "learner.loss.eps_high": 0.28, "learner.loss.kl": "none",
                        "engine.sglang.tp_size": 1},
}
# Test values of each option: the first that differs from the file's default.
ALT = {"seed": (3,), "steps": (3,), "model": ("qwen3-0.6b",), "model_path": ("/models/Other",),
       "train": ("other_train.jsonl",), "eval": ("other_eval.jsonl",), "tp": (1, 2),
       "servers": (1, 2)}
# Options given together with another: 2 servers x tp 4 would leave the learner no GPU.
COMPANION = {("ps_qwen3_32b_swe.py", "servers"): ",tp=2",
             ("spo_qwen3_8b.py", "tp"): ",servers=2"}
# default.py's default family (budget0 rendered whole, at its gate's rate): the keys an
# option that names another family (or smoke, which keeps the planted one) may change.
FAMILY = {"env.difficulties", "sft.imperfect_share", "rollout.temperature",
          "learner.temperature", "sft.explore_share", "sft.max_steps", "rollout.max_steps",
          "rollout.max_context", "engine.max_len", "learner.row_buckets",
          "learner.optim.lr", "batch_tasks", "total_steps"}
# The keys each option may change (with its companion); every other key keeps its value.
CHANGES = {
    "smoke": FAMILY | {"batch_tasks", "ckpt_every", "env.eval_tasks", "env.train_tasks",
                       "eval_every", "group_size", "learner.row_buckets", "model.hidden_size",
                       "model.intermediate_size", "model.num_heads", "model.num_kv_heads",
                       "model.num_layers", "rollout.max_response_tokens", "rollout.max_steps",
                       "rollout.max_turn_tokens", "sft.batch_size", "sft.num_demos",
                       "sft.steps", "spo.in_flight", "tokenizer.bpe_vocab_size",
                       "total_steps"},
    "planted": FAMILY,
    "baseline": {"ps.enabled"}, "spo": {"algo", "batch_tasks", "group_size", "ps.enabled"},
    "adaptive": {"ps.adaptive"}, "seed": {"seed", "learner.seed"}, "steps": {"total_steps"},
    "graded": FAMILY | {"sft.steps", "ps.remaining_ratio"},
    "revisit": {"ps.revisit"},
    "decide": FAMILY, "budget": FAMILY, "budget0": FAMILY,
    "server": {"engine.kind", "engine.sglang.command", "engine.sglang.env",
               "engine.sglang.export_dtype",
               "engine.sglang.health_timeout_s", "engine.sglang.host_gpus",
               "engine.sglang.launch", "engine.sglang.ports", "learner.loss.old_logprobs",
               "learner.loss.tis_cap"},
    "model": {"model.preset"}, "model_path": {"model.hf_path", "tokenizer.path"},
    "train": {"env.tasks"}, "eval": {"env.tasks"},
    "tp": {"engine.sglang.tp_size", "engine.sglang.ports"},
    "servers": {"engine.sglang.ports", "engine.sglang.tp_size"},
}
# Options that the file's own default already applies.
SAME_AS_FILE = {("default.py", "whole")}  # (the default family is budget0 rendered whole)
ARCHITECTURE = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "tie_word_embeddings")


def _qwen3_params(vocab_size, hidden_size, intermediate_size, num_layers, num_heads,
                  num_kv_heads, head_dim, tie_word_embeddings, **_):
    """Qwen3ForCausalLM's parameter count: embeddings (and an untied head), per layer the
    q/k/v/o projections, q/k norms, two RMSNorms and the gated MLP, and the final norm."""
    d, q, kv = hidden_size, num_heads * head_dim, num_kv_heads * head_dim
    layer = d * q + 2 * d * kv + q * d + 2 * head_dim + 2 * d + 3 * d * intermediate_size
    head = 0 if tie_word_embeddings else d * vocab_size
    return vocab_size * d + head + num_layers * layer + d


def _module(name):
    return importlib.import_module("configs." + name.removesuffix(".py"))


def _flat(config, prefix=""):
    out = {}
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _specs():
    """(file, option or None, spec) for every file alone and with each of its options."""
    out = []
    for name in FILES:
        out.append((name, None, f"configs/{name}"))
        for option, default in _module(name).OPTIONS.items():
            if isinstance(default, bool):
                out.append((name, option, f"configs/{name}:{option}"))
            else:
                assert option in ALT, f"configs/{name} option {option!r} has no test value"
                value = next(v for v in ALT[option] if v != default)
                out.append((name, option, f"configs/{name}:{option}={value}"
                                          + COMPANION.get((name, option), "")))
    return out


def _dry_run(spec, capsys, *sets):
    argv = ["--config", os.path.join(ROOT, spec), "--workdir", "/nonexistent", "--dry_run"]
    for s in sets:
        argv += ["--set", s]
    train.main(argv)
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name,option,spec", _specs(), ids=[s for _, _, s in _specs()])
def test_every_option_dry_runs_builds_its_preset_and_keeps_the_recipe(name, option, spec,
                                                                       capsys):
    summary = _dry_run(spec, capsys)
    config = common.load_config(os.path.join(ROOT, spec))
    # The preset the file's name says (or the one the `model` option asked for).
    preset = qwen3.PRESETS[ALT["model"][0] if option == "model" else PRESET[name]]
    expected = dataclasses.asdict(preset)
    overrides = {k: v for k, v in config.model.items() if k in expected and k != "vocab_size"}
    expected.update(overrides)
    if not config.model.hf_path:  # trained from scratch: the BPE vocabulary
        expected["vocab_size"] = summary["model"]["vocab_size"]
    assert {k: summary["model"][k] for k in ARCHITECTURE} == {k: expected[k]
                                                              for k in ARCHITECTURE}
    assert summary["params"] == _qwen3_params(**summary["model"])
    # The recipe's values, and nothing but the option's own keys changed.
    flat = _flat(config)
    changed = CHANGES.get(option, set())
    for key, value in RECIPE[name].items():
        if key not in changed:
            assert flat[key] == value, (spec, key, flat[key], value)
    base = _flat(common.load_config(os.path.join(ROOT, f"configs/{name}")))
    undeclared = sorted({k for k in base if base[k] != flat[k]} - changed)
    assert not undeclared, (f"{spec} changes keys its option does not declare in "
                            f"tests/test_configs.py CHANGES: {undeclared}")
    if option is not None and (name, option) not in SAME_AS_FILE:
        assert {k for k in base if base[k] != flat[k]}, f"{spec} changed nothing"


def test_rollout_temperature_override_trains_at_it():
    """--set rollout.temperature=0.6: the sampler samples and the learner scores at 0.6
    (its log-probs are log_softmax(logits / 0.6) of the model's own logits)."""
    config = common.load_config(os.path.join(ROOT, "configs/default.py:smoke"))
    common.apply_overrides(config, common.parse_overrides(["rollout.temperature=0.6"]))
    train.check_config(config)
    assert RolloutConfig(**config.rollout).temperature == 0.6
    assert config.learner.temperature == 0.6
    assert json.loads(config.to_json_best_effort())["learner"]["temperature"] == 0.6

    cfg = loading.model_config(config.model, 512)
    model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))
    graphdef, state = learner.init_train_state(model, config.learner)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 12).astype(np.int32)
    mask = (np.arange(12) >= 4).astype(np.int32)
    batch, _ = pack_arrays([(ids, mask, np.zeros(12, np.float32))], [0.0], buckets=[16],
                           row_multiple=learner.row_multiple(config.learner))
    got = np.asarray(learner.make_compute_logprobs(graphdef, config.learner)(state.params,
                                                                               batch))[0, :12]
    hidden = model(batch.tokens, batch.positions, batch.segment_ids)
    logits = np.asarray(hidden @ model.lm_head(), np.float64)[0, :11]
    ref = jax.nn.log_softmax(logits / 0.6, axis=-1)[np.arange(11), ids[1:]]
    np.testing.assert_allclose(got[1:][mask[1:] == 1], np.asarray(ref)[mask[1:] == 1],
                               rtol=2e-4, atol=2e-4)
    at_one = jax.nn.log_softmax(logits, axis=-1)[np.arange(11), ids[1:]]
    assert np.abs(got[1:][mask[1:] == 1] - np.asarray(at_one)[mask[1:] == 1]).max() > 1e-2

    # The link goes both ways (one value), and a config that breaks it is refused.
    common.apply_overrides(config, {"learner.temperature": 0.5, "seed": 7})
    assert config.rollout.temperature == 0.5 and config.learner.seed == 7
    broken = common.load_config(os.path.join(ROOT, "configs/default.py"))
    broken.learner = common.learner_defaults()  # T=1, not linked to the sampler's 0.7
    with pytest.raises(ValueError, match="learner.temperature .* must equal rollout"):
        train.check_config(broken)


@pytest.mark.parametrize("key,value", [
    ("batch_tasks", 0), ("batch_tasks", -2), ("group_size", 0), ("rollout.temperature", -1.0),
    ("rollout.temperature", 0.0), ("rollout.top_p", 2.0), ("learner.optim.lr", -1e-4),
    ("ps.remaining_ratio", 1.5), ("ckpt_every", 0), ("eval_every", 0), ("mesh.fsdp", 0),
    ("mesh.data", -3), ("rollout.top_k", 0), ("spo.rho_min", 1.2), ("learner.loss.dual_clip", 0.5),
    ("learner.row_buckets", (512, 0)), ("sft.imperfect_share", 1.1), ("total_steps", 0),
    ("ps.max_age", 0)])
def test_out_of_range_values_are_refused_naming_the_key(key, value, capsys):
    with pytest.raises(ValueError, match=rf"{key.replace('.', '[.]')}=.*allowed"):
        _dry_run("configs/default.py", capsys, f"{key}={value!r}")


def test_cross_key_checks():
    config = common.load_config(os.path.join(ROOT, "configs/default.py"))
    with pytest.raises(ValueError, match="ps.low .* must be <= ps.high"):
        train.check_config(common.apply_overrides(config.copy_and_resolve_references(),
                                                  {"ps.low": 0.8}))
    config = common.load_config(os.path.join(ROOT, "configs/grpo_swe.py"))
    with pytest.raises(ValueError, match="tokenizer.path .* model.hf_path"):
        train.check_config(common.apply_overrides(config, {"model.hf_path": "/models/x"}))


def test_in_range_notation():
    assert common.in_range(0, "[0, 1]") and common.in_range(1, "[0, 1]")
    assert not common.in_range(0, "(0, 1]") and not common.in_range(1, "[0, 1)")
    assert common.in_range(-1, "[1, inf) | -1") and not common.in_range(0, "[1, inf) | -1")
    assert common.in_range(1e30, "(0, inf)") and not common.in_range(-1e-30, "[0, inf)")


def _all_configs():
    return [common.load_config(os.path.join(ROOT, spec)) for _, _, spec in _specs()]


def test_every_numeric_key_has_a_range_and_every_range_a_key():
    keys = set()
    missing = set()
    for config in _all_configs():
        for key, _ in common.numeric_items(config):
            keys.add(key)
            if key not in common.RANGES:
                missing.add(key)
    assert not missing, f"numeric config keys without a range in configs.common.RANGES: " \
                        f"{sorted(missing)}"
    every_key = set().union(*(_flat(c) for c in _all_configs()))
    stale = set(common.RANGES) - every_key
    assert not stale, f"configs.common.RANGES names keys no config has: {sorted(stale)}"


def _reads():
    """Names the training code reads a config key by: attribute names, string subscripts
    and .get() arguments, and the parameters / fields of whatever a section is splatted
    into (`RolloutConfig(**config.rollout)`)."""
    files = [os.path.join(ROOT, "train.py")] + [
        f for d in ("rl", "env", "inference", "models", "kernels")
        for f in glob.glob(os.path.join(ROOT, d, "**", "*.py"), recursive=True)]
    names, splatted, signatures = set(), set(), {}
    for path in files:
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                names.add(node.slice.value)
            elif isinstance(node, ast.Call):
                if (isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                        and node.args and isinstance(node.args[0], ast.Constant)):
                    names.add(node.args[0].value)
                if any(k.arg is None for k in node.keywords):
                    func = node.func
                    splatted.add(func.attr if isinstance(func, ast.Attribute) else
                                 getattr(func, "id", None))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args
                signatures.setdefault(node.name, set()).update(
                    a.arg for a in args.args + args.kwonlyargs)
            elif isinstance(node, ast.ClassDef):  # dataclass fields, __init__ parameters
                fields = signatures.setdefault(node.name, set())
                for b in node.body:
                    if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name):
                        fields.add(b.target.id)
                    elif isinstance(b, ast.FunctionDef) and b.name == "__init__":
                        fields.update(a.arg for a in b.args.args + b.args.kwonlyargs)
    for callee in splatted:
        names |= signatures.get(callee, set())
    return names


def test_every_config_key_is_read_by_the_training_code():
    """By name: a key counts as read when its last component is read anywhere (so a dead
    key that shares its name with a live one, e.g. two `seed`s, is not caught)."""
    reads = _reads()
    dead = sorted({key for config in _all_configs() for key in _flat(config)
                   if key.rsplit(".", 1)[-1] not in reads})
    assert not dead, f"config keys that nothing in train.py, rl, env, inference, models or " \
                     f"kernels reads: {dead}"


def test_config_files_import_only_ml_collections_and_configs():
    for name in [*FILES, "common.py"]:
        with open(os.path.join(ROOT, "configs", name)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""]
            else:
                continue
            for mod in mods:
                top = mod.split(".")[0]
                assert top in ("ml_collections", "configs", "__future__") or (
                    top in sys.stdlib_module_names), f"configs/{name} imports {mod}"
    # Loading every config (and option) pulls in no JAX, NumPy or project package.
    code = ("import sys; from configs import common\n"
            f"for spec in {[spec for _, _, spec in _specs()]!r}: common.load_config(spec)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('jax', 'flax', 'numpy', 'rl', 'env', 'models', 'kernels', 'inference')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


# String keys that name something open-ended (a path, a host, a command, a registry
# name checked by its owner), not one of a few choices.
FREE_TEXT = {"advantage", "distributed.coordinator", "engine.sglang.command",
             "engine.sglang.export_dir", "engine.sglang.host", "engine.sglang.python",
             "engine.sglang.router", "env.ray_address", "env.image", "env.image_template",
             "env.tasks", "model.hf_path", "rollout.system_prompt", "spo.init_values",
             "tokenizer.path"}


def test_every_string_key_has_choices_or_is_free_text():
    keys = {key for config in _all_configs() for key, value in _flat(config).items()
            if isinstance(value, str) or value is None}
    missing = keys - set(common.CHOICES) - FREE_TEXT
    assert not missing, f"string config keys without allowed values in " \
                        f"configs.common.CHOICES: {sorted(missing)}"
    every_key = set().union(*(_flat(c) for c in _all_configs()))
    assert set(common.CHOICES) <= every_key, sorted(set(common.CHOICES) - every_key)


def test_choices_agree_with_the_code_that_reads_them():
    from env import grading, sandbox
    from inference import sglang
    from kernels.logprob import api as logprob_api
    from rl import loss, rollout, tracker

    owners = {"model.preset": tuple(qwen3.PRESETS), "model.remat": tuple(qwen3.REMAT_POLICIES),
              "model.attention": qwen3.ATTENTION_IMPLS,
              "engine.sglang.sync_mode": sglang.SYNC_MODES,
              "engine.sglang.on_restart": sglang.ON_RESTART, "env.backend": sandbox.BACKENDS,
              "rollout.grading": grading.GRADINGS, "rollout.stale": rollout.STALE_POLICIES,
              "learner.loss.tis_level": loss.TIS_LEVELS,
              "learner.logprob_impl": (None, *logprob_api.IMPLEMENTATIONS),
              "learner.loss.name": tuple(loss.TOKEN_LOSSES),
              "learner.loss.agg": tuple(loss.AGGREGATIONS), "learner.loss.kl": loss.KL_KINDS,
              "spo.drift_tokens": tracker.DRIFT_TOKENS}
    for key, values in owners.items():
        assert set(common.CHOICES[key]) == set(values), key


@pytest.mark.parametrize("key", sorted(common.CHOICES))
def test_a_typo_in_an_enumerated_key_is_refused_naming_the_key(key):
    for config in _all_configs():
        if key in _flat(config):
            common.apply_overrides(config, {key: "typo"})
            with pytest.raises(ValueError, match=rf"{key.replace('.', '[.]')}='typo' "
                                                 rf"\(allowed: .*{common.CHOICES[key][-1]!r}"):
                train.check_config(config)


@pytest.mark.parametrize("override", ["env.backend=dokcer", "engine.kind=sglnag",
                                      "engine.sglang.sync_mode=paws"])
def test_dry_run_refuses_a_typo_in_the_backend_or_engine(override, capsys):
    key, value = override.split("=")
    with pytest.raises(ValueError, match=rf"{key}='{value}' \(allowed: "):
        _dry_run("configs/default.py", capsys, override)


def test_a_config_path_that_is_a_directory_or_has_no_get_config(tmp_path):
    with pytest.raises(ValueError, match=f"config '{tmp_path}' is not a Python file"):
        common.load_config(str(tmp_path))
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ValueError, match="defines no get_config"):
        common.load_config(str(empty))
