"""Tests for maxmoe.config: loading, merging, type checks, validation and error messages.

Every ConfigError is one line that names the key, the value, where the value came from and a
fix; the tests pin that format (`config key 'K' = V (from ORIGIN): PROBLEM; FIX`).
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from maxmoe.config import DEFAULT_RULES, MESH_AXES, Config, ConfigError, describe, fail
from maxmoe.config_files import load_config, save_config
from maxmoe.validation import validate

CMD = "command line"

# A realistic preset: every section is present, with the default values. Presets normally name
# every section they touch; tests that override keys on top of it get per-key origins.
BASE_PRESET = """\
run: {name: ""}
model: {num_layers: 4}
attention: {head_dim: 32}
moe: {num_experts: 8}
mesh: {data: -1}
optimizer: {learning_rate: 0.003}
precision: {compute_dtype: bfloat16}
data: {seq_len: 128}
checkpoint: {keep: 3}
train: {steps: 200}
logging: {every_steps: 10}
"""


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


@pytest.fixture
def base(tmp_path: Path) -> str:
    return write(tmp_path, "base.yaml", BASE_PRESET)


def error(fn, *args, **kwargs) -> str:
    """Runs fn, which must raise ConfigError; returns its one-line message."""
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg, f"error message is not one line: {msg!r}"
    return msg


def check(msg: str, key: str, value, origin: str, *fragments: str) -> None:
    """The message names the key, the value (repr), the origin, and contains every fragment."""
    head = f"config key '{key}' = {value!r} (from {origin}): "
    assert msg.startswith(head), f"{msg!r} does not start with {head!r}"
    assert "; " in msg[len(head):], f"no '; fix' clause in {msg!r}"
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"


def load_validate(paths: list[str], overrides: list[str], devices: int = 8) -> dict[str, int]:
    cfg, origins = load_config(paths, overrides)
    return validate(cfg, devices, origins)


# --------------------------------------------------------------------------- dataclass shape


def _all_dataclasses(cls: type) -> list[type]:
    out = [cls]
    for tp in typing.get_type_hints(cls).values():
        if dataclasses.is_dataclass(tp):
            out += _all_dataclasses(tp)
    return out


def test_every_field_has_a_default():
    classes = _all_dataclasses(Config)
    assert len(classes) == 1 + len(dataclasses.fields(Config))  # Config + one per section
    for cls in classes:
        for f in dataclasses.fields(cls):
            has_default = (f.default is not dataclasses.MISSING
                           or f.default_factory is not dataclasses.MISSING)
            assert has_default, f"{cls.__name__}.{f.name} has no default"
        assert cls.__dataclass_params__.frozen, f"{cls.__name__} is not frozen"
    Config()  # constructible with no arguments


def test_config_is_frozen():
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.steps = 3  # type: ignore[misc]


def test_defaults_validate_on_8_and_1_devices():
    cfg, origins = load_config([])
    assert origins == {}
    assert dataclasses.replace(cfg, run=Config().run) == Config()
    assert validate(cfg, 8, origins) == {"data": 8, "fsdp": 1, "pipeline": 1, "expert": 1, "tensor": 1}
    assert validate(cfg, 1, origins)["data"] == 1


# --------------------------------------------------------------------------- merging presets


def test_presets_merge_in_order_later_file_wins(tmp_path):
    a = write(tmp_path, "a.yaml", "model: {hidden_size: 64, num_layers: 2}\ntrain: {steps: 5}\n")
    b = write(tmp_path, "b.yaml", "model: {hidden_size: 96}\ndata: {seq_len: 64}\n")
    cfg, origins = load_config([a, b])
    assert cfg.model.hidden_size == 96  # b wins
    assert cfg.model.num_layers == 2  # only in a: kept
    assert cfg.train.steps == 5
    assert cfg.data.seq_len == 64
    assert cfg.model.vocab_size == Config().model.vocab_size  # untouched keys keep defaults
    assert origins["model.hidden_size"] == b

    cfg, origins = load_config([b, a])  # order matters
    assert cfg.model.hidden_size == 64
    assert origins["model.hidden_size"] == a


def test_three_presets_each_key_from_last_file_that_sets_it(tmp_path, base):
    b = write(tmp_path, "b.yaml", "train: {steps: 10, seed: 1}\n")
    c = write(tmp_path, "c.yaml", "train: {steps: 20}\n")
    cfg, origins = load_config([base, b, c])
    assert (cfg.train.steps, cfg.train.seed) == (20, 1)
    assert origins["train.steps"] == c
    assert origins["train.seed"] == b


def test_origins_recorded_per_leaf_key(tmp_path):
    a = write(tmp_path, "a.yaml", "model: {hidden_size: 64, num_layers: 2}\n")
    b = write(tmp_path, "b.yaml", "model: {hidden_size: 96}\ndata: {seq_len: 64}\n")
    _, origins = load_config([a, b], ["train.steps=3"])
    assert origins["model.num_layers"] == a
    assert origins["model.hidden_size"] == b
    assert origins["data.seq_len"] == b
    assert origins["train.steps"] == CMD


def test_empty_preset_file_is_allowed(tmp_path):
    cfg, _ = load_config([write(tmp_path, "empty.yaml", "# nothing yet\n")])
    assert cfg.model == Config().model


def test_mesh_rules_from_file_are_read(tmp_path, base):
    rules = {k: list(v) for k, v in DEFAULT_RULES.items()}
    rules["batch"] = ["data", "fsdp"]
    f = write(tmp_path, "rules.yaml", yaml.safe_dump({"mesh": {"rules": rules}}))
    cfg, origins = load_config([base, f])
    assert cfg.mesh.rules == rules
    assert origins["mesh.rules"] == f


# --------------------------------------------------------------------------- dotted overrides


def test_overrides_win_over_files(tmp_path, base):
    f = write(tmp_path, "exp.yaml", "train: {steps: 5}\nmodel: {hidden_size: 64}\n")
    cfg, origins = load_config([base, f], ["train.steps=7"])
    assert cfg.train.steps == 7
    assert cfg.model.hidden_size == 64
    assert origins["train.steps"] == CMD
    assert origins["model.hidden_size"] == f


def test_later_override_wins():
    cfg, origins = load_config([], ["train.steps=1", "train.steps=2"])
    assert cfg.train.steps == 2


@pytest.mark.parametrize("override, section, name, expected", [
    ("train.steps=12", "train", "steps", 12),
    ("train.steps = 12", "train", "steps", 12),
    ("optimizer.learning_rate=0.5", "optimizer", "learning_rate", 0.5),
    ("optimizer.learning_rate=1.0e-4", "optimizer", "learning_rate", 1e-4),
    ("optimizer.learning_rate=2", "optimizer", "learning_rate", 2.0),  # int -> float
    ("model.scan_layers=false", "model", "scan_layers", False),
    ("checkpoint.async_save=true", "checkpoint", "async_save", True),
    ("data.source=/data/*.txt", "data", "source", "/data/*.txt"),
    ("run.name=my run", "run", "name", "my run"),
    ("run.name=a=b", "run", "name", "a=b"),  # only the first '=' splits
    ("run.name=", "run", "name", ""),
    ("mesh.data=-1", "mesh", "data", -1),
])
def test_override_parses_yaml_scalars(override, section, name, expected):
    cfg, origins = load_config([], [override])
    got = getattr(getattr(cfg, section), name)
    assert got == expected
    assert type(got) is type(expected)


def test_override_parses_lists():
    cfg, _ = load_config([], ["mesh.rules.batch=[data, fsdp]"])
    assert cfg.mesh.rules["batch"] == ["data", "fsdp"]


@pytest.mark.parametrize("where", ["override", "file"])
def test_exponent_float_without_dot_is_a_float(tmp_path, where):
    if where == "override":
        cfg, _ = load_config([], ["optimizer.learning_rate=3e-4"])
    else:
        cfg, _ = load_config([write(tmp_path, "lr.yaml", "optimizer: {learning_rate: 3e-4}\n")])
    assert cfg.optimizer.learning_rate == pytest.approx(3e-4)


def test_malformed_override_without_equals():
    msg = error(load_config, [], ["train.steps"])
    assert "'train.steps'" in msg
    assert f"(from {CMD})" in msg
    assert "key.sub=value" in msg and "train.steps=100" in msg  # the fix


# --------------------------------------------------------------------------- unknown keys


def test_unknown_top_level_key(tmp_path):
    f = write(tmp_path, "bad.yaml", "modle: {hidden_size: 64}\n")
    msg = error(load_config, [f])
    check(msg, "modle", {"hidden_size": 64}, f, "unknown key", "valid keys under 'top level' are: ")
    for name in (f.name for f in dataclasses.fields(Config)):
        assert name in msg


def test_unknown_top_level_key_from_override():
    msg = error(load_config, [], ["trian.steps=3"])
    check(msg, "trian", {"steps": 3}, CMD, "unknown key", "train")


@pytest.mark.parametrize("where", ["file", "override"])
def test_unknown_nested_key_lists_valid_keys(tmp_path, base, where):
    if where == "file":
        origin = write(tmp_path, "exp.yaml", "model: {hiden_size: 64}\n")
        paths, overrides = [base, origin], []
    else:
        origin, paths, overrides = CMD, [base], ["model.hiden_size=64"]
    msg = error(load_config, paths, overrides)
    check(msg, "model.hiden_size", 64, origin, "unknown key", "valid keys under 'model' are: ")
    for name in (f.name for f in dataclasses.fields(Config().model)):
        assert name in msg
    assert "num_heads" not in msg  # only keys of this section


def test_unknown_key_in_nested_section_of_dataclass(tmp_path, base):
    msg = error(load_config, [base], ["mesh.datta=2"])
    check(msg, "mesh.datta", 2, CMD, "valid keys under 'mesh' are: ", "data", "fsdp", "rules")


# --------------------------------------------------------------------------- types


@pytest.mark.parametrize("override, key, value, problem", [
    ("model.hidden_size='128'", "model.hidden_size", "128", "expected int, got str"),
    ("model.hidden_size=abc", "model.hidden_size", "abc", "expected int, got str"),
    ("model.hidden_size=1.5", "model.hidden_size", 1.5, "expected int, got float"),
    ("model.hidden_size=128.0", "model.hidden_size", 128.0, "expected int, got float"),
    ("model.hidden_size=true", "model.hidden_size", True, "expected int, got bool"),
    ("train.steps=[1, 2]", "train.steps", [1, 2], "expected int, got list"),
    ("optimizer.learning_rate=fast", "optimizer.learning_rate", "fast", "expected float, got str"),
    ("optimizer.learning_rate=true", "optimizer.learning_rate", True, "expected float, got bool"),
    ("model.scan_layers=1", "model.scan_layers", 1, "expected bool, got int"),
    ("run.name=123", "run.name", 123, "expected str, got int"),
])
def test_wrong_type_is_rejected(base, override, key, value, problem):
    msg = error(load_config, [base], [override])
    check(msg, key, value, CMD, problem, "; write a")


def test_wrong_type_from_file_names_the_file(tmp_path, base):
    f = write(tmp_path, "exp.yaml", "train: {steps: '10'}\n")
    check(error(load_config, [base, f]), "train.steps", "10", f, "expected int, got str")


def test_int_for_float_is_accepted_and_converted(tmp_path):
    f = write(tmp_path, "lr.yaml", "optimizer: {learning_rate: 1, grad_clip_norm: 0}\n")
    cfg, _ = load_config([f])
    assert cfg.optimizer.learning_rate == 1.0 and type(cfg.optimizer.learning_rate) is float
    assert type(cfg.optimizer.grad_clip_norm) is float


@pytest.mark.parametrize("value", ["{batch: data}", "[data]", "{batch: [1, 2]}"])
def test_bad_mesh_rules_shape(base, value):
    msg = error(load_config, [base], [f"mesh.rules={value}"])
    check(msg, "mesh.rules", yaml.safe_load(value), CMD, "logical axis -> list of mesh axes")


@pytest.mark.parametrize("text, value", [("model: 5\n", 5), ("model: [1, 2]\n", [1, 2]),
                                         ("model: fast\n", "fast")])
def test_non_mapping_section(tmp_path, text, value):
    f = write(tmp_path, "bad.yaml", text)
    check(error(load_config, [f]), "model", value, f, "expected a section (mapping)",
          "nest its keys under 'model:'")


def test_non_mapping_section_from_override(base):
    check(error(load_config, [base], ["train=3"]), "train", 3, CMD, "expected a section")


# --------------------------------------------------------------------------- files


def test_missing_file(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    msg = error(load_config, [missing])
    assert repr(missing) in msg
    assert "not found" in msg and "existing YAML file" in msg


def test_directory_is_not_a_config_file(tmp_path):
    msg = error(load_config, [str(tmp_path)])
    assert "not found" in msg


@pytest.mark.parametrize("text", ["model: {hidden_size: 64\n", "model:\n  a: 1\n b: 2\n",
                                  "model: [1, 2\n", "\tmodel: 1\n"])
def test_invalid_yaml(tmp_path, text):
    f = write(tmp_path, "broken.yaml", text)
    msg = error(load_config, [f])
    assert repr(f) in msg
    assert "not valid YAML" in msg and "fix the syntax" in msg


@pytest.mark.parametrize("text", ["- model\n- train\n", "just a string\n", "42\n"])
def test_top_level_must_be_a_mapping(tmp_path, text):
    f = write(tmp_path, "list.yaml", text)
    msg = error(load_config, [f])
    assert repr(f) in msg and "mapping" in msg


# --------------------------------------------------------------------------- mesh shape


def test_minus_one_fills_the_remaining_devices(base):
    sizes = load_validate([base], ["mesh.fsdp=2", "mesh.expert=2"])
    assert sizes == {"data": 2, "fsdp": 2, "pipeline": 1, "expert": 2, "tensor": 1}
    assert list(sizes) == list(MESH_AXES)


def test_minus_one_on_a_non_data_axis(base):
    sizes = load_validate([base], ["mesh.data=4", "mesh.fsdp=-1"])
    assert sizes == {"data": 4, "fsdp": 2, "pipeline": 1, "expert": 1, "tensor": 1}


def test_explicit_mesh_matching_device_count(base):
    sizes = load_validate([base], ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    assert sizes == {"data": 2, "fsdp": 2, "pipeline": 1, "expert": 1, "tensor": 2}


def test_mesh_product_differs_from_device_count(base):
    msg = error(load_validate, [base], ["mesh.data=2", "mesh.fsdp=2"])
    check(msg, "mesh.data", 2, CMD, "has 4 devices but 8 are present",
          "data=2 x fsdp=2 x pipeline=1 x expert=1 x tensor=1",
          "make the product of the mesh axes equal the device count")


def test_mesh_product_too_large(base):
    msg = error(load_validate, [base], ["mesh.data=4", "mesh.fsdp=4"])
    check(msg, "mesh.data", 4, CMD, "has 16 devices but 8 are present")


def test_two_minus_one_axes(base):
    msg = error(load_validate, [base], ["mesh.data=-1", "mesh.fsdp=-1"])
    check(msg, "mesh.fsdp", -1, CMD, "only one mesh axis may be -1", "give the others explicit sizes")


def test_minus_one_cannot_fill_when_other_axes_do_not_divide(base):
    """The error names the set axis that does not divide the devices, not the -1 axis."""
    msg = error(load_validate, [base], ["mesh.data=-1", "mesh.fsdp=3"])
    check(msg, "mesh.fsdp", 3, CMD, "multiply to 3, which does not divide 8 devices")
    msg = error(load_validate, [base], ["mesh.data=-1", "mesh.fsdp=2", "mesh.expert=3"])
    check(msg, "mesh.expert", 3, CMD, "multiply to 6, which does not divide 8 devices")


@pytest.mark.parametrize("size", [0, -2])
def test_mesh_axis_must_be_positive_or_minus_one(base, size):
    msg = error(load_validate, [base], [f"mesh.tensor={size}"])
    check(msg, "mesh.tensor", size, CMD, "must be >= 1 or -1")


def test_pipeline_stages_need_a_layer_per_chunk(base):
    # 4 layers = 1 dense + 3 MoE: 3 MoE layers on 2 stages is fine (chunks of 1 and 2), not 4
    assert load_validate([base], ["mesh.pipeline=2"])["pipeline"] == 2
    msg = error(load_validate, [base], ["mesh.pipeline=4"])
    check(msg, "mesh.pipeline", 4, CMD, "no run of same-kind layers (sizes [1, 3]) has a layer "
          "for each of 4 stages x 1 repeats", "lower mesh.pipeline")
    msg = error(load_validate, [base], ["mesh.pipeline=2", "model.num_layers=5",
                                        "model.pipeline_schedule=circular",
                                        "model.pipeline_repeats=4"])
    check(msg, "mesh.pipeline", 2, CMD, "2 stages x 4 repeats", "model.pipeline_repeats")


def test_pipeline_stage_layers_must_fit_the_schedule_and_a_group(base):
    msg = error(load_validate, [base], ["mesh.pipeline=2", "model.pipeline_stage_layers=[1,1,1]"])
    check(msg, "model.pipeline_stage_layers", [1, 1, 1], CMD, "needs 2 entries >= 1",
          "one layer count per chunk")
    msg = error(load_validate, [base], ["mesh.pipeline=2", "model.pipeline_stage_layers=[2,2]"])
    check(msg, "model.pipeline_stage_layers", [2, 2], CMD, "sums to 4, no run of same-kind "
          "layers has that many (sizes [1, 3])", "make it sum")
    sizes = load_validate([base], ["mesh.pipeline=2", "model.pipeline_stage_layers=[1,2]"])
    assert sizes["pipeline"] == 2


def test_circular_needs_a_microbatch_per_stage(base):
    msg = error(load_validate, [base], ["mesh.pipeline=4", "model.num_layers=9",
                                        "model.pipeline_schedule=circular",
                                        "model.pipeline_microbatches=2"])
    check(msg, "model.pipeline_microbatches", 2, CMD, "needs at least mesh.pipeline=4", ">= 4")


def test_pipeline_needs_stacked_layers(base):
    msg = error(load_validate, [base], ["mesh.pipeline=2", "model.num_layers=5",
                                        "model.scan_layers=false"])
    check(msg, "model.scan_layers", False, CMD, "mesh.pipeline=2 splits stacked layers",
          "set model.scan_layers=true")


def test_pipeline_microbatches_must_split_the_batch(base):
    msg = error(load_validate, [base], ["mesh.pipeline=2", "model.num_layers=5",
                                        "model.pipeline_microbatches=3"])
    check(msg, "data.global_batch_size", 16, "defaults", "each of the 3 pipeline microbatches",
          "use a larger multiple")
    sizes = load_validate([base], ["mesh.pipeline=2", "model.num_layers=5"])
    assert sizes["pipeline"] == 2 and sizes["data"] == 4


@pytest.mark.parametrize("where", ["file", "override"])
def test_unknown_mesh_axis_in_rules(tmp_path, base, where):
    if where == "file":
        rules = {k: list(v) for k, v in DEFAULT_RULES.items()}
        rules["batch"] = ["data", "dta"]
        origin = write(tmp_path, "rules.yaml", yaml.safe_dump({"mesh": {"rules": rules}}))
        paths, overrides = [base, origin], []
    else:
        origin, paths, overrides = CMD, [base], ["mesh.rules.batch=[data, dta]"]
    msg = error(load_validate, paths, overrides)
    check(msg, "mesh.rules.batch", ["data", "dta"], origin, "unknown mesh axis 'dta'",
          "use axes from: data, fsdp, pipeline, expert, tensor")


def test_unknown_mesh_axis_in_rules_is_named_before_the_pipeline_reads_the_rules(base):
    # the pipeline check sizes the batch shards from the rules: an unknown axis there must be
    # the config error, not a KeyError from that arithmetic
    msg = error(load_validate, [base], ["mesh.pipeline=2", "model.num_layers=5",
                                        "mesh.rules.batch=[data, dta]"])
    check(msg, "mesh.rules.batch", ["data", "dta"], CMD, "unknown mesh axis 'dta'")


def test_mesh_axis_twice_in_one_rule(base):
    msg = error(load_validate, [base], ["mesh.rules.embed=[fsdp, fsdp]"])
    check(msg, "mesh.rules.embed", ["fsdp", "fsdp"], CMD, "names a mesh axis twice",
          "list each mesh axis once")


def test_partial_rules_override_only_the_named_axes(tmp_path, base):
    f = write(tmp_path, "rules.yaml", yaml.safe_dump({"mesh": {"rules": {"vocab": []}}}))
    cfg, _ = load_config([base, f], ["mesh.rules.batch=[data]"])
    expected = {k: list(v) for k, v in DEFAULT_RULES.items()}
    expected.update(vocab=[], batch=["data"])
    assert cfg.mesh.rules == expected


# --------------------------------------------------------------------------- divisibility


@pytest.mark.parametrize("overrides, key, value, shards, logical", [
    (["attention.num_heads=6", "mesh.tensor=4"], "attention.num_heads", 6, 4, "heads"),
    (["attention.num_heads=8", "attention.num_kv_heads=2", "mesh.tensor=4"],
     "attention.num_kv_heads", 2, 4, "kv_heads"),
    (["moe.num_experts=6", "mesh.expert=4"], "moe.num_experts", 6, 4, "experts"),
    (["model.vocab_size=2049", "mesh.tensor=2"], "model.vocab_size", 2049, 2, "vocab"),
    (["model.dense_mlp_size=511", "mesh.tensor=2"], "model.dense_mlp_size", 511, 2, "mlp"),
    (["moe.expert_mlp_size=255", "mesh.tensor=2"], "moe.expert_mlp_size", 255, 2, "expert_mlp"),
    (["model.hidden_size=100", "mesh.fsdp=8"], "model.hidden_size", 100, 8, "embed"),
])
def test_sizes_must_divide_their_mesh_shards(base, overrides, key, value, shards, logical):
    msg = error(load_validate, [base], overrides)
    check(msg, key, value, CMD, f"not divisible by the {shards} shards of logical axis '{logical}'",
          f"use a multiple of {shards} or change the mesh")


def test_divisible_sizes_pass(base):
    sizes = load_validate([base], ["attention.num_heads=8", "attention.num_kv_heads=4",
                                   "mesh.tensor=4", "moe.num_experts=4", "mesh.expert=2"])
    assert sizes == {"data": 1, "fsdp": 1, "pipeline": 1, "expert": 2, "tensor": 4}


def test_top_k_cannot_exceed_experts(base):
    msg = error(load_validate, [base], ["moe.experts_per_token=9"])
    check(msg, "moe.experts_per_token", 9, CMD, "top-k cannot exceed moe.num_experts (8)",
          "lower it or add experts")
    load_validate([base], ["moe.experts_per_token=8"])  # equal is fine


def test_kv_heads_must_divide_heads(base):
    msg = error(load_validate, [base], ["attention.num_kv_heads=3"])
    check(msg, "attention.num_kv_heads", 3, CMD, "must divide attention.num_heads (4)",
          "pick a divisor")


def test_global_batch_divisible_by_batch_shards_times_grad_accum(base):
    common = ["mesh.fsdp=2", "mesh.expert=2", "train.grad_accum_steps=2"]  # 2*2*2 shards x 2
    msg = error(load_validate, [base], common + ["data.global_batch_size=24"])
    check(msg, "data.global_batch_size", 24, CMD,
          "not divisible by batch shards x grad_accum_steps (16)", "use a multiple of 16")
    assert load_validate([base], common + ["data.global_batch_size=32"])["data"] == 2


def test_grad_accum_alone_can_break_batch_divisibility(base):
    msg = error(load_validate, [base], ["data.global_batch_size=16", "train.grad_accum_steps=3"])
    check(msg, "data.global_batch_size", 16, CMD, "(24)")


def test_unknown_remat_policy(base):
    msg = error(load_validate, [base], ["model.remat_policy=selective"])
    check(msg, "model.remat_policy", "selective", CMD, "unknown policy", "none, full, dots")


@pytest.mark.parametrize("policy", ["none", "full", "dots"])
def test_known_remat_policies(base, policy):
    load_validate([base], [f"model.remat_policy={policy}"])


def test_unknown_compute_dtype(base):
    msg = error(load_validate, [base], ["precision.compute_dtype=fp8"])
    check(msg, "precision.compute_dtype", "fp8", CMD, "unknown dtype",
          "use bfloat16, float16 or float32")


@pytest.mark.parametrize("key", ["train.steps", "attention.num_heads", "data.seq_len"])
def test_sizes_must_be_positive(base, key):
    check(error(load_validate, [base], [f"{key}=0"]), key, 0, CMD, "must be >= 1")


def test_fail_without_origin_leaves_out_the_from_clause():
    """Code past loading (the data pipeline) no longer knows origins: the rest is the same."""
    with pytest.raises(ConfigError) as info:
        fail("data.seed", -1, None, "must be in [0, 2**32)", "pick another")
    assert str(info.value) == "config key 'data.seed' = -1: must be in [0, 2**32); pick another"
    assert describe("data.source", "x", "a.yaml") == "config key 'data.source' = 'x' (from a.yaml)"


def test_validation_errors_default_origin_is_defaults():
    cfg = dataclasses.replace(Config(), precision=dataclasses.replace(Config().precision,
                                                                      compute_dtype="int8"))
    check(error(validate, cfg, 8, {}), "precision.compute_dtype", "int8", "defaults")


# --------------------------------------------------------------------------- origins


def test_wrong_type_in_first_file_names_the_file(tmp_path):
    f = write(tmp_path, "exp.yaml", "train: {steps: abc}\n")
    check(error(load_config, [f]), "train.steps", "abc", f, "expected int, got str")


def test_wrong_type_override_without_presets_names_command_line():
    check(error(load_config, [], ["train.steps=abc"]), "train.steps", "abc", CMD,
          "expected int, got str")


def test_unknown_nested_key_in_first_file_names_the_file(tmp_path):
    f = write(tmp_path, "exp.yaml", "model: {hiden_size: 64}\n")
    check(error(load_config, [f]), "model.hiden_size", 64, f, "unknown key")


def test_validation_error_for_value_from_file_names_the_file(tmp_path):
    f = write(tmp_path, "exp.yaml", "attention: {num_heads: 6}\nmesh: {tensor: 4}\n")
    check(error(load_validate, [f], []), "attention.num_heads", 6, f, "not divisible")


def test_mesh_error_for_mesh_from_file_names_the_file(tmp_path):
    f = write(tmp_path, "exp.yaml", "mesh: {data: 2, fsdp: 2}\n")
    check(error(load_validate, [f], []), "mesh.data", 2, f, "has 4 devices but 8 are present")


# --------------------------------------------------------------------------- run dir


def test_run_dir_defaults_to_stem_of_last_file(tmp_path):
    a = write(tmp_path, "base.yaml", "train: {steps: 5}\n")
    b = write(tmp_path, "exp/small-moe.v2.yaml", "train: {steps: 6}\n")
    cfg, _ = load_config([a, b])
    assert cfg.run.dir == str(Path("runs") / "small-moe.v2")
    cfg, _ = load_config([b, a])
    assert cfg.run.dir == str(Path("runs") / "base")


def test_run_dir_without_files():
    cfg, _ = load_config([])
    assert cfg.run.dir == str(Path("runs") / "default")


def test_explicit_run_dir_is_kept(tmp_path):
    a = write(tmp_path, "exp.yaml", "run: {dir: /scratch/r1}\n")
    assert load_config([a])[0].run.dir == "/scratch/r1"
    assert load_config([a], ["run.dir=out"])[0].run.dir == "out"


def test_run_name_names_the_default_dir(tmp_path):
    a = write(tmp_path, "exp.yaml", "train: {steps: 5}\n")
    assert load_config([a], ["run.name=ablation"])[0].run.dir == str(Path("runs") / "ablation")


# --------------------------------------------------------------------------- save / load


def test_save_config_round_trip(tmp_path, base):
    rules = {k: list(v) for k, v in DEFAULT_RULES.items()}
    rules["batch"] = ["data", "fsdp"]
    rules_file = write(tmp_path, "rules.yaml", yaml.safe_dump({"mesh": {"rules": rules}}))
    cfg, _ = load_config([base, rules_file], [
        "train.steps=7", "optimizer.learning_rate=1.0e-4", "optimizer.eps=1.0e-12",
        "model.scan_layers=false", "run.name=rt", "data.source=/d/*.txt", "mesh.fsdp=2",
        "logging.peak_flops_per_device=9.89e+14",
    ])
    out = tmp_path / "saved" / "config.yaml"
    out.parent.mkdir()
    save_config(cfg, out)
    loaded, origins = load_config([str(out)])
    assert loaded == cfg
    assert loaded.mesh.rules == rules
    assert set(yaml.safe_load(out.read_text())) == {f.name for f in dataclasses.fields(Config)}


def test_save_config_round_trip_of_defaults(tmp_path):
    cfg, _ = load_config([])
    out = tmp_path / "config.yaml"
    save_config(cfg, out)
    assert load_config([str(out)])[0] == cfg
    assert validate(load_config([str(out)])[0], 8, {})["data"] == 8
