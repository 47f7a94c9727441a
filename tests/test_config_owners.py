"""Every config default is written once, in configs/; each section's owner takes it whole.
Typed at the door: train.py turns the run config into owners once (`train.owners`), and
no module below it imports ml_collections or takes the run config.

- A section with an owner dataclass (OWNERS): in every config, the owner's fields are the
  section's keys (less the subsections and keys another owner reads, named here), no
  field has a default, and the owner builds from the section as it is.
- A function owner (FUNCTIONS) takes the section's keys as keyword parameters without
  defaults.
- Every section has the same keys in every config file and option: a key missing from
  one would need a default in the code that reads it. UNEVEN names the sections that
  are not there yet; the list can only shrink.
- No product code reads a run config with a default: `section.get("key", ...)` or
  `getattr(config, "key", ...)`.
- A section its owner takes whole (WHOLE: a ConfigDict, read key by key) has no key that
  product code never reads.
- The model section is a preset and its overrides: `preset` and `hf_path`, then any
  Qwen3Config field (the preset holds the defaults); other keys are refused.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import inspect
import os
import re

import pytest

import train
from configs import common, default
from env import config as env_config
from env import latency
from inference import build, embedded, sglang
from models import loading, sharding
from rl import algos, distributed, learner, prefix, rollout, sft, tracker
from rl import loss as losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECS = [os.path.relpath(p, ROOT) for p in sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
         if os.path.basename(p) not in ("common.py", "__init__.py")]
SPECS += [f"configs/default.py:{name}" for name, value in default.OPTIONS.items()
          if isinstance(value, bool)]
# section -> (owner dataclass, keys of the section it does not read: subsections and keys
# with owners of their own).
OWNERS = {
    "ps": (prefix.PrefixConfig, ()),
    "spo": (tracker.SPOConfig, ()),
    "rollout": (rollout.RolloutConfig, ()),
    "env": (env_config.EnvConfig, ()),
    "env.latency": (latency.LatencyConfig, ()),
    "engine": (embedded.EmbeddedOptions, ("kind", "sglang")),  # kind: build.EngineConfig
    "engine.sglang": (sglang.SGLangConfig, ()),
    "learner": (learner.LearnerConfig, ()),
    "learner.optim": (learner.OptimConfig, ()),
    "learner.loss": (losses.LossConfig, ()),
    "sft": (sft.SFTConfig, ()),
    "tokenizer": (sft.TokenizerConfig, ()),
    "distributed": (distributed.DistributedConfig, ()),
}
# Owners with subsections build through their classmethod (each subsection's owner).
BUILDERS = {"env": env_config.EnvConfig.from_section,
            "learner": learner.LearnerConfig.from_section}
FUNCTIONS = {"mesh": (sharding.make_mesh, ("devices",))}
PRODUCT = ("train.py", "rl", "env", "inference", "models", "kernels")
# Sections whose keys differ between configs, with no owner dataclass yet. The test fails
# when one becomes even (remove it here).
UNEVEN: set[str] = set()


@pytest.fixture(scope="module")
def configs():
    return {spec: common.load_config(spec) for spec in SPECS}


def _section(config, dotted: str):
    for part in dotted.split("."):
        config = config[part]
    return config


def _sections(config, prefix: str = ""):
    for key, value in config.items():
        if isinstance(value, common.ConfigDict):
            yield prefix + key, value
            yield from _sections(value, f"{prefix}{key}.")


@pytest.mark.parametrize("section", sorted(OWNERS))
def test_an_owners_fields_are_its_sections_keys_without_defaults(configs, section):
    owner, elsewhere = OWNERS[section]
    fields = {f.name: f for f in dataclasses.fields(owner)}
    defaulted = [name for name, f in fields.items() if f.default is not dataclasses.MISSING
                 or f.default_factory is not dataclasses.MISSING]
    assert defaulted == [], f"{owner.__qualname__}: defaults in code {defaulted}"
    for spec, config in configs.items():
        keys = set(_section(config, section)) - set(elsewhere)
        assert set(fields) == keys, (spec, section, set(fields) ^ keys)
        values = {k: _section(config, section)[k] for k in keys}
        BUILDERS.get(section, lambda v: owner(**v))(values)  # builds as it is


@pytest.mark.parametrize("section", sorted(FUNCTIONS))
def test_a_function_owner_takes_its_sections_keys_without_defaults(configs, section):
    function, runtime = FUNCTIONS[section]
    params = {name: p for name, p in inspect.signature(function).parameters.items()
              if name not in runtime}
    assert [n for n, p in params.items() if p.default is not inspect.Parameter.empty] == []
    for spec, config in configs.items():
        assert set(params) == set(_section(config, section)), (spec, section)


def test_every_config_has_the_same_keys_in_each_section(configs):
    keys: dict[str, dict[str, set]] = {}
    for spec, config in configs.items():
        keys.setdefault("", {})[spec] = {k for k, v in config.items()
                                         if not isinstance(v, common.ConfigDict)}
        for name, section in _sections(config):
            if name != "model":  # a preset and its overrides (below)
                keys.setdefault(name, {})[spec] = set(section)
    uneven = set()
    for name, per_spec in keys.items():
        union = set().union(*per_spec.values())
        missing = {spec: sorted(union - k) for spec, k in per_spec.items() if union - k}
        assert set(per_spec) == set(SPECS), f"section {name} missing from some configs"
        if missing:
            uneven.add(name)
            assert name in UNEVEN, f"section {name or '(top level)'}: keys missing in {missing}"
    assert UNEVEN - uneven == set(), "even now: remove from UNEVEN"


def test_a_model_section_is_a_preset_and_its_overrides(configs):
    for spec, config in configs.items():
        assert set(config.model) >= loading.SECTION_KEYS, spec
    bad = dict(configs["configs/default.py"].model, hidden_sise=64)
    with pytest.raises(KeyError, match="hidden_sise"):
        loading.model_config(bad)


# A run config in product code: config, cfg, x_cfg, and their attributes (config.engine).
_CONFIG = re.compile(r"(^|\.)(\w*_)?(config|cfg)(\.\w+)*$")


def _defaults_in_code(source: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "get" and \
                _CONFIG.search(ast.unparse(f.value)):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(f, ast.Name) and f.id == "getattr" and len(node.args) == 3 and \
                _CONFIG.search(ast.unparse(node.args[0])):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def test_the_reader_finds_a_default_in_code():
    found = _defaults_in_code("a = config.model.get('hf_path', '')\nb = spo_cfg.get('x')\n"
                              "c = getattr(self.cfg, 'y', 1)\nd = row.get('x', 0)\n")
    assert [line.split(":")[0] for line in found] == ["1", "2", "3"]


def _product_sources() -> dict[str, str]:
    out = {}
    for part in PRODUCT:
        paths = [os.path.join(ROOT, part)] if part.endswith(".py") else glob.glob(
            os.path.join(ROOT, part, "**", "*.py"), recursive=True)
        for path in paths:
            with open(path) as f:
                out[os.path.relpath(path, ROOT)] = f.read()
    return out


def test_no_product_code_reads_a_config_key_with_a_default():
    found = [f"{path}:{hit}" for path, source in _product_sources().items()
             for hit in _defaults_in_code(source)]
    assert found == []


# Sections their owners take whole (a ConfigDict read key by key; a missing key raises).
WHOLE = ("", "distributed", "env", "learner", "learner.loss", "learner.optim", "sft",
         "tokenizer")


def _names_read(source: str) -> set[str]:
    """Attribute names, keyword names and strings of a module: every way a key is read."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            out.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.add(node.value)
    return out


def test_the_name_reader_sees_attributes_keywords_and_strings():
    assert _names_read("a = cfg.lr\nf(b=1)\nc = d['eps']\n") >= {"lr", "b", "eps"}
    assert "warmup" not in _names_read("warmup_steps = 1\n")


@pytest.mark.parametrize("section", WHOLE)
def test_every_key_of_a_section_taken_whole_is_read(configs, section):
    """A key no product code reads is a setting that does nothing."""
    read = set().union(*map(_names_read, _product_sources().values()))
    for spec, config in configs.items():
        values = _section(config, section) if section else config
        keys = {k for k, v in values.items() if not isinstance(v, common.ConfigDict)}
        assert keys - read == set(), (spec, section)


# ------------------------------------------------------------------ typed at the door

# The modules that see the run config: the config files and the entry point.
DOOR = ("configs/", "train.py")


def test_train_builds_every_sections_owner_once(configs):
    """train.owners builds every section's owner (and the engine's, whose `kind` picks
    between its two subsections' owners); the top-level keys are AlgoConfig's and
    LoopConfig's fields."""
    sections = {"name", "ps", "spo", "rollout"}  # name: the `algo` key
    top = ({"algo"} | {f.name for f in dataclasses.fields(algos.AlgoConfig)} - sections
           | {f.name for f in dataclasses.fields(train.LoopConfig)})
    for spec, config in configs.items():
        sections = train.owners(config)
        assert isinstance(sections.engine, build.EngineConfig)
        assert isinstance(sections.engine.embedded, embedded.EmbeddedOptions)
        assert sections.engine.sglang.launch == (config.engine.kind == "sglang"
                                                 and config.engine.sglang.launch), spec
        keys = {k for k, v in config.items() if not isinstance(v, common.ConfigDict)}
        assert keys == top, (spec, keys ^ top)


def _door_violations(rel: str, source: str) -> list[str]:
    """Imports of ml_collections, and parameters named `config` (the run config), in a
    module outside configs/ and train.py."""
    out = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        out += [f"{rel}:{node.lineno} imports {n}" for n in names
                if n.split(".")[0] == "ml_collections"]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            out += [f"{rel}:{node.lineno} {node.name}({p.arg})"
                    for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]
                    if p.arg in ("config", "run_config")]
    return out


def test_the_door_reader_sees_imports_and_run_config_parameters():
    source = ("import ml_collections\nfrom ml_collections import config_dict\n"
              "def f(config, cfg):\n    pass\nclass A:\n    async def g(self, *, config):\n"
              "        pass\n")
    found = _door_violations("m.py", source)
    assert [int(v.split(":")[1].split()[0]) for v in found] == [1, 2, 3, 6], found


def test_nothing_below_train_imports_ml_collections_or_takes_the_run_config():
    bad = [v for rel, source in sorted(_product_sources().items()) if not rel.startswith(DOOR)
           for v in _door_violations(rel, source)]
    assert bad == []
