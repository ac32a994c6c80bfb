"""Config tree: TOML loading, --set overrides, validation errors that name the field."""

import re
from pathlib import Path

import pytest

from gemray.config import JobConfig, apply_overrides, load_config, to_toml

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["ml-1m.toml", "ml-latest-small.toml"])
def test_shipped_configs_load(name):
    cfg = load_config(ROOT / "configs" / name)
    assert cfg.model.num_blocks >= 1
    assert cfg.data.batch_size % cfg.data.sub_batch_size == 0


def test_ml1m_is_hstu_large_shape():
    cfg = load_config(ROOT / "configs" / "ml-1m.toml")
    m = cfg.model
    # embedding 52, not the paper's 50: FBGEMM's sharded embedding kernels need a multiple of 4
    assert (m.num_blocks, m.num_heads, m.attention_dim, m.embedding_dim) == (8, 2, 25, 52)
    assert (cfg.data.max_seq_len, m.num_negatives, m.temperature) == (200, 128, 0.05)


def test_overrides_coerce_types():
    cfg = apply_overrides(JobConfig(), ["train.epochs=3", "train.lr=5e-4", "data.bbs=false",
                                        "train.eval_ks=[5,10]", "name=x"])
    assert cfg.train.epochs == 3 and cfg.train.lr == 5e-4 and cfg.data.bbs is False
    assert cfg.train.eval_ks == [5, 10] and cfg.name == "x"
    for text in ("5,10", "[5, 10,]", " [ 5 , 10 ] "):
        assert apply_overrides(JobConfig(), [f"train.eval_ks={text}"]).train.eval_ks == [5, 10], text


def test_load_config_takes_one_override_string():
    """A single "section.key=value" string is one override (it was iterated character by character)."""
    assert load_config(None, "train.epochs=3").train.epochs == 3
    assert load_config(None, ["train.epochs=4"]).train.epochs == 4


@pytest.mark.parametrize("item,needle", [
    ("train.epochs=abc", "train.epochs"),
    ("train.epochs=0", "train.epochs"),
    ("train.nope=1", "train.nope"),
    ("nosection.x=1", "nosection"),
    ("model.negatives=hard", "model.negatives"),
    ("data.on_bad_rows=ignore", "data.on_bad_rows"),
    ("data.batch_size=100", "data.batch_size"),
    ("model.attn_dropout=0.1", "model.attn_dropout: attention dropout is not implemented"),
    ("train.epochs", "section.key=value"),
    ("name=a/b c", "name: 'a/b c' must be letters, digits"),
    ("name=../up", "name: '../up' must be"),
    ("train.eval_ks=[10,", "train.eval_ks: malformed list"),  # was read as [10]
    ("train.eval_ks=10]]]", "train.eval_ks: malformed list"),
    ("train.eval_ks=[10,50,10]", "train.eval_ks: a cut-off given twice in [10, 50, 10]"),  # was accepted
    ("train.eval_ks=[]", "train.eval_ks: give at least one cut-off K"),  # was "expected positive cut-offs, got []"
    ("train.eval_ks=[10,0]", "train.eval_ks: expected positive cut-offs, got [10, 0]"),
    ("train.adam_betas=[0.9,,0.98]", "train.adam_betas: malformed list"),
    ('model.tasks=["retrieval", ', "model.tasks: malformed TOML array"),
    ('model.tasks=[["retrieval"]]', "model.tasks: malformed list"),
])
def test_bad_overrides_name_the_field(item, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.").replace("[", r"\[")):
        apply_overrides(JobConfig(), [item])


@pytest.mark.parametrize("overrides, error, needle", [
    ([1], TypeError, "overrides[0]: 1 (int) is not a string"),
    (["train.epochs=3", None], TypeError, "overrides[1]: None (NoneType) is not a string"),
    ([b"train.epochs=3"], TypeError, "overrides[0]: b'train.epochs=3' (bytes) is not a string"),
    ({"train.epochs": 3}, TypeError, "overrides: a dict is not a list of strings; write it as ['train.epochs=3']"),
    (3, TypeError, "overrides: 3 (int) is not a list of strings"),
])
@pytest.mark.parametrize("entry", ["fit", "load_config", "apply_overrides"])
def test_overrides_that_are_not_strings_are_named_up_front(entry, overrides, error, needle):
    """``gemray.fit(cfg, overrides=[1])`` raised a bare ``TypeError: argument of type 'int' is not iterable`` from
    inside apply_overrides (a new user's finding): every entry point now names the bad element, its type and the
    form expected, with an example, before any config is read or any run starts."""
    import gemray

    call = {"fit": lambda: gemray.fit(JobConfig(), overrides=overrides, output_dir="/nonexistent/never-made"),
            "load_config": lambda: load_config(ROOT / "configs" / "nonexistent.toml", overrides),
            "apply_overrides": lambda: apply_overrides(JobConfig(), overrides)}[entry]
    with pytest.raises(error) as err:
        call()
    msg = str(err.value)
    assert msg.startswith(needle), msg
    assert "section.key=value" in msg and "e.g. overrides=['train.epochs=3', 'ray.num_workers=2']" in msg, msg


def test_set_takes_toml_arrays_as_a_config_file_writes_them():
    """--set list values as in a TOML file, quotes included (a new user copies them from a config): strings may
    hold commas (data.synthetic's feature entry could not be set before), numbers and the plain forms as before."""
    cfg = apply_overrides(JobConfig(), ['model.tasks=["retrieval", "ctr"]', "model.task_weights=[1.0, 0.5]",
                                        'data.synthetic=["users=64", "items=50", "features=category=8,author=32"]',
                                        "train.eval_ks=[5,10]", "model.context_features=[]",
                                        "model.token_features=category,author"])
    assert cfg.model.tasks == ["retrieval", "ctr"] and cfg.model.task_weights == [1.0, 0.5]
    assert cfg.data.synthetic == ["users=64", "items=50", "features=category=8,author=32"]
    assert cfg.train.eval_ks == [5, 10] and cfg.model.context_features == []
    assert cfg.model.token_features == ["category", "author"]


def test_toml_round_trip(tmp_path):
    cfg = apply_overrides(JobConfig(), ["train.epochs=7", "model.attn_activation=softmax"])
    p = tmp_path / "c.toml"
    p.write_text(to_toml(cfg))
    assert load_config(p) == cfg


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nepochs = 'many'\n")
    with pytest.raises(ValueError, match="train.epochs"):
        load_config(bad)
    bad.write_text("[train\n")
    with pytest.raises(ValueError, match="invalid TOML"):
        load_config(bad)
    # TOML has types: a quoted number or bool is refused (not parsed as --set's strings are), ints widen to
    # float, and a number where a string belongs is refused too
    for text, needle in (('[data]\nbatch_size = "64"\n', r"data\.batch_size: expected int, got '64' .*unquoted"),
                         ('[train]\nlr = "0.01"\n', r"train\.lr: expected float"),
                         ('[ray]\nuse_gpu = "true"\n', r"ray\.use_gpu: expected bool"),
                         ('name = 5\n', r"name: expected str, got 5 .*quote it"),
                         ('[train]\neval_ks = ["10"]\n', r"train\.eval_ks: expected int")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=needle):
            load_config(bad)
    bad.write_text("[train]\nlr = 1\neval_ks = [10, 50]\n")
    cfg = load_config(bad)
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float) and cfg.train.eval_ks == [10, 50]
    assert apply_overrides(JobConfig(), ["data.batch_size=64"]).data.batch_size == 64  # --set strings parse


@pytest.mark.parametrize("key, text, want", [
    ("train.lr_base_fan_in", "16.0", 16), ("train.lr_base_fan_in", "16", 16), ("train.lr_base_fan_in", "1e3", 1000),
    ("train.epochs", "2.0", 2), ("data.batch_size", "64.0", 64), ("train.eval_ks", "[10.0, 50]", [10, 50]),
])
def test_int_fields_take_integral_floats_from_toml_and_set_alike(tmp_path, key, text, want):
    """An int field takes the same numbers from a config file and from --set: ``lr_base_fan_in = 16.0`` loaded
    as 16 while ``--set train.lr_base_fan_in=16.0`` was refused (``expected int, got '16.0'``). One rule in
    _coerce for every int field (and int list element): an integral float is that integer."""
    section, name = key.split(".")
    toml = tmp_path / "c.toml"
    toml.write_text(f"[{section}]\n{name} = {text}\n")
    from_file = getattr(getattr(load_config(toml), section), name)
    from_set = getattr(getattr(load_config(None, [f"{key}={text}"]), section), name)
    assert from_file == from_set == want
    flat = [*from_file, *from_set] if isinstance(want, list) else [from_file, from_set]
    assert all(type(v) is int for v in flat), flat  # 16, not 16.0


@pytest.mark.parametrize("key, text", [
    ("train.lr_base_fan_in", "16.5"), ("train.lr_warmup_steps", "0.5"), ("train.epochs", "1e-1"),
    ("train.eval_ks", "[10.5]"), ("train.lr_base_fan_in", "inf"), ("train.lr_base_fan_in", "nan"),
])
def test_int_fields_refuse_fractional_numbers_from_toml_and_set_alike(tmp_path, key, text):
    """A fractional (or non-finite) number for an int field is refused on both paths, the key named."""
    section, name = key.split(".")
    toml = tmp_path / "c.toml"
    toml.write_text(f"[{section}]\n{name} = {text}\n")
    for load, where in ((lambda: load_config(toml), f"{re.escape(str(toml))}: "),
                        (lambda: load_config(None, [f"{key}={text}"]), "")):
        with pytest.raises(ValueError, match=rf"^{where}{re.escape(key)}: expected int, got "):
            load()


def test_unknown_section_lists_sections_and_suggests():
    """issue 22: ``--set trian.epochs=1`` names the known sections and the close match."""
    with pytest.raises(ValueError) as err:
        apply_overrides(JobConfig(), ["trian.epochs=1"])
    msg = str(err.value)
    assert "did you mean 'train'?" in msg
    for section in ("data", "model", "train", "ray", "checkpoint"):
        assert repr(section) in msg, msg


@pytest.mark.parametrize("item, suggestion", [("train.epoch=1", "epochs"), ("data.batch_sise=8", "batch_size"),
                                              # a section's key without its section (was: no suggestion)
                                              ("epochs=3", "train.epochs"), ("nme=x", "name"),
                                              # a key of another section, or a top-level one, in a section
                                              ("data.lr=0.1", "train.lr"), ("train.name=x", "name")])
def test_unknown_key_suggests_the_close_one(item, suggestion):
    with pytest.raises(ValueError, match=f"did you mean '{suggestion}'"):
        apply_overrides(JobConfig(), [item])


def test_an_empty_config_file_warns(tmp_path, caplog, monkeypatch):
    """An empty (or all-comment) config file trained ML-1M's defaults without a word (a new user's finding): one
    warning naming the file; a file that sets something says nothing."""
    monkeypatch.delenv("GEMRAY_SHARED", raising=False)  # (set, it moves the default ../shared/... paths)
    empty, some = tmp_path / "empty.toml", tmp_path / "some.toml"
    empty.write_text("# nothing yet\n")
    some.write_text("[train]\nepochs = 2\n")
    with caplog.at_level("WARNING", logger="gemray.config"):
        assert load_config(some).train.epochs == 2
        assert _config_warnings(caplog) == []
        assert load_config(empty) == JobConfig()
    assert _config_warnings(caplog) == [f"{empty} sets nothing: the defaults are used (ML-1M's data paths and the "
                                        "HSTU-large model); start from one of configs/*.toml"]


@pytest.mark.parametrize("text", ["[train]\n", "[data]\n\n[model]\n# nothing yet\n"])
def test_a_config_file_of_empty_sections_warns(tmp_path, caplog, text, monkeypatch):
    """A file of section headers with no keys sets nothing either: the same warning as an empty file."""
    monkeypatch.delenv("GEMRAY_SHARED", raising=False)  # (set, it moves the default ../shared/... paths)
    path = tmp_path / "c.toml"
    path.write_text(text)
    with caplog.at_level("WARNING", logger="gemray.config"):
        assert load_config(path) == JobConfig()
    assert _config_warnings(caplog) == [f"{path} sets nothing: the defaults are used (ML-1M's data paths and the "
                                        "HSTU-large model); start from one of configs/*.toml"]


def test_a_config_file_with_a_utf8_bom_loads(tmp_path):
    """A config saved with a UTF-8 byte-order mark (Windows Notepad does) was refused as invalid TOML: the BOM is
    not content."""
    path = tmp_path / "bom.toml"
    path.write_bytes('name = "x"\n[train]\nepochs = 3\n'.encode("utf-8-sig"))
    cfg = load_config(path)
    assert (cfg.name, cfg.train.epochs) == ("x", 3)


def test_a_config_file_not_in_utf8_names_the_file(tmp_path):
    """A config saved as UTF-16 raised a bare UnicodeDecodeError that named neither the file nor the fix."""
    path = tmp_path / "wide.toml"
    path.write_bytes('name = "x"\n'.encode("utf-16"))
    with pytest.raises(ValueError, match=r"wide\.toml: not UTF-8 text \(byte 0"):
        load_config(path)


def test_unknown_key_in_toml_suggests(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nepoch = 1\n")
    with pytest.raises(ValueError, match="did you mean 'epochs'") as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: ")  # the file is named
    path.write_text("epochs = 1\n")  # a section's key at the top level
    with pytest.raises(ValueError, match="did you mean 'train.epochs'"):
        load_config(path)


@pytest.mark.parametrize("text, suggestion, header", [
    ("data.lr = 0.1\n", "train.lr", None),  # a dotted key: no header to blame
    ("[data]\nepochs = 3\n", "train.epochs", "data"),
    ('[train]\nepochs = 1\nname = "x"\n', "name", "train"),  # a top-level key appended after the last section
    ("[train]\nepoch = 1\n", "epochs", None),  # a typo, not a misplaced key
])
def test_a_key_of_another_section_in_toml_names_it(tmp_path, text, suggestion, header):
    """A key known in another section (or at the top level) but written in this one is suggested where it belongs
    (was: the closest key of this section, or none); after a [section] header, the message says TOML puts the key
    in that section."""
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"(did you mean {suggestion!r}?)")) as err:
        load_config(path)
    if header is None:
        assert "belongs to that section" not in str(err.value)
    else:
        assert str(err.value).endswith(f"; a key written after [{header}] belongs to that section")
    assert "known:" not in str(err.value)  # a suggestion, so not the section's whole key list (~700 characters)


def test_an_unknown_key_without_a_suggestion_lists_the_sections_keys(tmp_path):
    """No key is close enough to suggest: the error lists the section's keys instead (from a file and from --set);
    with a suggestion it stays one short line."""
    path = tmp_path / "c.toml"
    path.write_text("[train]\nzzqqx = 1\n")
    with pytest.raises(ValueError, match=r"unknown key train\.zzqqx \(known: \[.*'epochs'") as err:
        load_config(path)
    assert "did you mean" not in str(err.value)
    with pytest.raises(ValueError, match=r"unknown key train\.zzqqx \(known: \[.*'epochs'"):
        apply_overrides(JobConfig(), ["train.zzqqx=1"])
    with pytest.raises(ValueError, match=r"did you mean 'epochs'\?\)$") as err:
        apply_overrides(JobConfig(), ["train.epoch=1"])
    assert len(str(err.value)) < 120


def _config_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gemray.config" and r.levelname == "WARNING"]


def test_compile_settings_without_compile_warn_and_are_kept(caplog):
    """train.compile_* at a non-default value with train.compile = false do nothing: one warning naming them
    (not an error: a config keeps them for toggling compile), made by the config and logged once by ``fit``
    (validation itself logs nothing, however often a config is validated); with compile on, or at their
    defaults, none. (The slow CLI test finds the line once on the console and once in logs/gemray.log.)"""
    caplog.set_level("WARNING", logger="gemray.config")
    cfg = load_config(ROOT / "configs" / "gem-tiny.toml",
                      ["train.compile_dynamic=all", "train.compile_optimize_ddp=true"])
    assert (cfg.train.compile, cfg.train.compile_dynamic, cfg.train.compile_optimize_ddp) == (False, "all", True)
    apply_overrides(cfg, [])  # validated again (a resume, an override)
    assert _config_warnings(caplog) == []
    msg = cfg.ineffective_settings_warning()
    assert msg.startswith('train.compile_dynamic = "all", train.compile_optimize_ddp = true have no effect '
                          "without train.compile = true"), msg

    def warning(overrides):
        return apply_overrides(JobConfig(), overrides).ineffective_settings_warning()

    assert [warning([o]).split(" has no effect without train.compile = true")[0]
            for o in ("train.compile_backend=eager", "train.compile_tower=false")] == [
        'train.compile_backend = "eager"', "train.compile_tower = false"]
    assert warning(["train.compile=true", "train.compile_dynamic=all", "train.compile_tower=false"]) is None
    assert warning(["train.compile_dynamic=auto", "train.compile_backend=inductor"]) is None  # the defaults
    # activation_checkpointing "torch" compiles the blocks with backend / dynamic / optimize_ddp: they apply
    assert warning(["train.activation_checkpointing=torch", "train.activation_memory_budget=0.5",
                    "train.compile_dynamic=all", "train.compile_backend=aot_eager"]) is None
    msg = warning(["train.activation_checkpointing=torch", "train.activation_memory_budget=0.5",
                   "train.compile_tower=false"])  # ... but never the tower
    assert msg.startswith("train.compile_tower = false has no effect") and "never the tower" in msg


def test_bbs_window_batches_off_its_default_is_warned_about():
    """data.bbs_window_batches is still read (earlier runs' config.toml list it) but training has no BBS window
    (plan_global_step balances each global step): off its default the one idle-settings warning names it; a new
    user's config setting it trained with no word (2026-12-07)."""
    msg = apply_overrides(JobConfig(), ["data.bbs_window_batches=4"]).ineffective_settings_warning()
    assert msg.startswith("data.bbs_window_batches = 4 has no effect: training balances each global step"), msg
    assert apply_overrides(JobConfig(), ["data.bbs_window_batches=8"]).ineffective_settings_warning() is None


def test_retrieval_kernel_without_effect_is_warned_about():
    """model.retrieval_kernel off its default only acts on "uniform_shared" retrieval negatives: elsewhere the same
    one warning as the other idle settings."""
    def warning(overrides):
        return apply_overrides(JobConfig(), overrides).ineffective_settings_warning()

    assert warning(["model.retrieval_kernel=triton"]) == ('model.retrieval_kernel = "triton" has no effect with '
                                                          'model.negatives = "uniform" (only "uniform_shared" reads it)')
    assert warning(["model.retrieval_kernel=auto", "model.negatives=uniform_shared"]) is None
    assert warning(["model.retrieval_kernel=reference"]) is None  # the default


def test_uvqk_kernel_under_fp8_is_warned_about():
    """The FP8 projections add their own bias: model.uvqk_kernel is not read under train.precision = "fp8"."""
    def warning(overrides):
        return apply_overrides(JobConfig(), overrides).ineffective_settings_warning()

    assert warning(["model.uvqk_kernel=triton", "train.precision=fp8"]) == (
        'model.uvqk_kernel = "triton" has no effect with train.precision = "fp8" (the FP8 projections add their own '
        'bias)')
    assert warning(["model.uvqk_kernel=triton", "train.precision=bf16"]) is None
    assert warning(["train.precision=fp8"]) is None


def test_fp8_and_budget_settings_without_effect_are_warned_about():
    """fp8_* off their defaults without precision "fp8", and a memory budget under a mode that does not read it,
    get the same one warning as the compile_* settings (joined with them); in effect, none."""
    def warning(overrides):
        return apply_overrides(JobConfig(), overrides).ineffective_settings_warning()

    msg = warning(["train.fp8_recipe=tensorwise", "train.fp8_min_dim=16"])
    assert msg == ('train.fp8_recipe = "tensorwise", train.fp8_min_dim = 16 have no effect without train.precision = '
                   '"fp8" (it is "fp32")'), msg
    assert warning(["train.precision=fp8", "train.fp8_recipe=tensorwise"]) is None
    for mode in ("none", "full", "selective"):
        msg = warning([f"train.activation_checkpointing={mode}", "train.activation_memory_budget=0.5"])
        assert msg == (f'train.activation_memory_budget = 0.5 has no effect with train.activation_checkpointing = '
                       f'"{mode}" (only "auto" and "torch" read it)'), msg
    assert warning(["train.activation_checkpointing=auto", "train.activation_memory_budget=0.5"]) is None
    both = warning(["train.compile_tower=false", "train.fp8_grad=e5m2"])
    assert both.startswith("train.compile_tower = false has no effect") and '; train.fp8_grad = "e5m2" has' in both


def test_kernel_tiles_without_the_triton_attention_is_warned_about():
    """model.kernel_tiles tunes the Triton attention kernels: idle under the reference backend, or "auto" without a
    GPU (a new user set it on CPU and saw nothing)."""
    def warning(overrides):
        return apply_overrides(JobConfig(), overrides).ineffective_settings_warning()

    tiles = 'model.kernel_tiles={"long": {"mode": {"dk_from_ds": true}}}'
    assert warning([tiles]) == ('model.kernel_tiles has no effect with model.attention_backend = "auto" and '
                                "ray.use_gpu = false (the reference attention runs; the tiles are the Triton kernels')")
    assert warning([tiles, "model.attention_backend=reference", "ray.use_gpu=true"]) == (
        'model.kernel_tiles has no effect with model.attention_backend = "reference"')
    assert warning([tiles, "ray.use_gpu=true"]) is None
    assert warning([tiles, "model.attention_backend=triton"]) is None  # CPU: the interpreter runs the kernels


def test_fp32_residual_off_without_autocast_is_warned_about():
    """model.fp32_residual = false acts only under autocast (train.precision "bf16" / "fp8")."""
    def warning(overrides):
        return apply_overrides(JobConfig(), overrides).ineffective_settings_warning()

    assert warning(["model.fp32_residual=false"]) == (
        'model.fp32_residual = false has no effect with train.precision = "fp32" (no autocast: the residual stream '
        'is float32)')
    for p in ("bf16", "fp8"):
        assert warning(["model.fp32_residual=false", f"train.precision={p}"]) is None
    assert warning(["model.fp32_residual=true"]) is None


@pytest.mark.parametrize("value", ["2", "1.5", "1024", "1048575"])
def test_budget_below_one_mib_of_bytes_is_refused(tmp_path, value):
    """train.activation_memory_budget = 2 was taken as 2 bytes (every module recomputed, the budget still 'NOT
    met'); a number between 1 and 1 MiB is refused on both paths, the key named, suggesting a fraction or bytes."""
    toml = tmp_path / "c.toml"
    toml.write_text(f"[train]\nactivation_memory_budget = {value}\n")
    for load in (lambda: load_config(toml), lambda: load_config(None, [f"train.activation_memory_budget={value}"])):
        with pytest.raises(ValueError, match=r"train.activation_memory_budget = [\d.]+ is read as bytes, and below 1 "
                                             r"MiB that is no usable budget: give a fraction 0 < f <= 1 .*\(e.g. "
                                             r"0.5\) or bytes \(e.g. 40e9\)"):
            load()
    for ok in ("1", "0.5", "0", "1048576", "40e9"):  # a fraction, off, or 1 MiB and more
        load_config(None, [f"train.activation_memory_budget={ok}"])


@pytest.mark.parametrize("override, match", [
    ("train.compile_dynamic=some", r"train.compile_dynamic: expected one of \('all', 'auto'\), got 'some'"),
    ("train.compile_backend=cudagraphs", r"train.compile_backend: expected one of"),
    ("train.compile_optimize_ddp=maybe", r"train.compile_optimize_ddp"),
])
def test_compile_settings_are_validated_with_compile_off(override, match):
    cfg = JobConfig()
    assert cfg.train.compile is False
    with pytest.raises(ValueError, match=match):
        apply_overrides(cfg, [override])


def test_fp8_recipe_defaults_to_rowwise_takes_tensorwise_and_refuses_others(tmp_path):
    assert JobConfig().train.fp8_recipe == "rowwise"  # nothing changes until tensorwise is measured on the GPU
    cfg = apply_overrides(JobConfig(), ["train.precision=fp8", "train.fp8_recipe=tensorwise"])
    assert cfg.train.fp8_recipe == "tensorwise"
    p = tmp_path / "c.toml"
    p.write_text(to_toml(cfg))
    assert load_config(p).train.fp8_recipe == "tensorwise"
    with pytest.raises(ValueError, match=r"train\.fp8_recipe: expected one of \('rowwise', 'tensorwise'\), "
                                         r"got 'blockwise'"):
        apply_overrides(JobConfig(), ["train.fp8_recipe=blockwise"])
    bad = JobConfig()
    bad.train.fp8_recipe = "Tensorwise"  # a TOML file's value goes through the same validation
    with pytest.raises(ValueError, match="train.fp8_recipe"):
        bad.validate()


def test_shared_paths_follow_gemray_shared(monkeypatch, tmp_path):
    """A config value starting with ../shared/ (the shipped configs' raw_dir) is read under $GEMRAY_SHARED when that
    is set: from a TOML file, from --set and in a JobConfig given to fit; other values, and every value without
    the variable, stay as written."""
    from gemray.config import shared_path
    from gemray.controller import run

    assert shared_path("../shared/data/ml-1m", {"GEMRAY_SHARED": "/mnt/s"}) == "/mnt/s/data/ml-1m"
    assert shared_path("../shared", {"GEMRAY_SHARED": "/mnt/s"}) == "/mnt/s"
    for value in ("../shared-other/x", "data/../shared/x", "/abs/../shared/x"):
        assert shared_path(value, {"GEMRAY_SHARED": "/mnt/s"}) == value
    assert shared_path("../shared/data/ml-1m", {"GEMRAY_SHARED": ""}) == "../shared/data/ml-1m"

    monkeypatch.delenv("GEMRAY_SHARED", raising=False)
    assert load_config(ROOT / "configs" / "ml-1m.toml").data.raw_dir == "../shared/data/ml-1m"
    monkeypatch.setenv("GEMRAY_SHARED", str(tmp_path))
    cfg = load_config(ROOT / "configs" / "ml-1m.toml",
                      ["train.ledger_dir=../shared/ledger", "train.events_path=runs/events.jsonl"])
    assert cfg.data.raw_dir == str(tmp_path / "data" / "ml-1m")
    assert cfg.data.prepared_dir == "data/ml-1m"  # not a shared path: relative to the current directory
    assert (cfg.train.ledger_dir, cfg.train.events_path) == (str(tmp_path / "ledger"), "runs/events.jsonl")
    (tmp_path / "config.toml").write_text(to_toml(cfg))  # what a run records loads back the same
    assert load_config(tmp_path / "config.toml").data.raw_dir == cfg.data.raw_dir
    assert run._load(JobConfig(), None).data.raw_dir == str(tmp_path / "data" / "ml-1m")  # fit(JobConfig())


def test_kernel_tiles_is_inline_json_or_a_file_and_says_so(tmp_path, monkeypatch):
    """model.kernel_tiles: a value starting with "{" (spaces stripped) is inline JSON, any other value a JSON file's
    path. '[1,2]' (neither) was refused as "cannot read '[1,2]': No such file or directory"; now one line names the
    key, the value and both forms. Malformed inline JSON names the key and the error's line and column."""
    from gemray.config import kernel_tiles_spec

    monkeypatch.chdir(tmp_path)
    spec = {"long": {"mode": {"dk_from_ds": True}}}
    (tmp_path / "tiles.json").write_text('{"long": {"mode": {"dk_from_ds": true}}}')
    for value in ('  {"long": {"mode": {"dk_from_ds": true}}}', "tiles.json", str(tmp_path / "tiles.json")):
        assert load_config(None, [f"model.kernel_tiles={value}"]).model.kernel_tiles == value
        assert kernel_tiles_spec(value) == spec
    both = ("expected the path of a JSON file or an inline JSON object such as "
            """'{"medium": {"mode": {"ds_store": true}}}'""")
    for value, why in (("[1,2]", f"no such file in {tmp_path}"), ("none.json", f"no such file in {tmp_path}"),
                       (str(tmp_path), "it is a folder")):
        with pytest.raises(ValueError) as e:
            load_config(None, [f"model.kernel_tiles={value}"])
        assert str(e.value) == (f"model.kernel_tiles = {value!r} is neither a JSON file ({why}) nor an inline JSON "
                                f"object (it does not start with '{{'); {both}")
    with pytest.raises(ValueError, match=r"^model\.kernel_tiles: malformed inline JSON: Unterminated string "
                                         r"starting at: line 1 column 2 \(char 1\)$"):
        load_config(None, ['model.kernel_tiles={"bad json'])
    (tmp_path / "bad.json").write_text('{"long": ')
    with pytest.raises(ValueError, match=r"^model\.kernel_tiles: malformed JSON file 'bad.json': .* line 1 column 10"):
        load_config(None, ["model.kernel_tiles=bad.json"])
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"^model\.kernel_tiles: expected a JSON object .* got list \(JSON file "):
        load_config(None, ["model.kernel_tiles=list.json"])


def test_kernel_tile_modes_and_tiles_take_json_types_only():
    """A kernel-tiles mode value must be a JSON boolean (bool("false") is True: a quoted "false" turned dk_from_ds
    on) and a tile's entries ints that are not booleans (true was taken as 1 warp); each refusal names the entry
    and shows the value as the JSON the user wrote (was Python's repr: True, 'x', None)."""
    from gemray.kernels.config import DEFAULT, apply_tiles

    on = apply_tiles({"long": {"mode": {"dk_from_ds": True, "ds_store": False}}})
    assert on.regime("long").dk_from_ds and not on.regime("long").ds_store
    assert apply_tiles({"long": {"mode": {"dk_from_ds": False}}}).regime("long").dk_from_ds is False
    for value, shown in (("false", '"false"'), ("yes", '"yes"'), (1, "1"), (0, "0"), (None, "null")):
        with pytest.raises(ValueError, match=r"^kernel tiles: long\.mode\.dk_from_ds: expected true or false, got "
                                             f"{re.escape(shown)}$"):
            apply_tiles({"long": {"mode": {"dk_from_ds": value}}})
    fwd = apply_tiles({"long": {"fwd": {"128": [64, 64, 4, 2]}}}).regime("long").tiles.get("fwd", 128)
    assert fwd == (64, 64, 4, 2)
    for tile, shown in (([128, 64, True, 3], "[128, 64, true, 3]"), ([64, 64, 4, 2.0], "[64, 64, 4, 2.0]"),
                        ([64, 64, 4], "[64, 64, 4]"), (True, "true"), ("64,64,4,2", '"64,64,4,2"'),
                        ((64, 64, 4, {1, 2}), "(64, 64, 4, {1, 2})")):  # no JSON for a set: repr
        with pytest.raises(ValueError, match=r"^kernel tiles: long\.fwd\.128: expected \[BLOCK_M, BLOCK_N, num_warps, "
                                             rf"num_stages\] \(positive ints\), got {re.escape(shown)}$"):
            apply_tiles({"long": {"fwd": {"128": tile}}})
    with pytest.raises(ValueError, match=r"^kernel tiles: long\.fwd: expected an object \{head-dim bucket: tile\}, "
                                         r"got \[64, 64, 4, 2\]$"):
        apply_tiles({"long": {"fwd": [64, 64, 4, 2]}})
    with pytest.raises(ValueError, match=r'^kernel tiles: long\.fwd: head-dim bucket "x" not in \[64, 128, 256\]$'):
        apply_tiles({"long": {"fwd": {"x": [64, 64, 4, 2]}}})
    with pytest.raises(ValueError, match=r"^kernel tiles: long: expected an object of tile kinds, got true$"):
        apply_tiles({"long": True})
    with pytest.raises(ValueError, match=r'^kernel tiles: long: unknown tile kind "bwd" \(one of \["fwd", '):
        apply_tiles({"long": {"bwd": {}}})
    with pytest.raises(ValueError, match=r'^kernel tiles: unknown regime "huge" \(one of \["short", "medium", '
                                         r'"long", "xlong"\]\)$'):
        apply_tiles({"huge": {}})
    with pytest.raises(ValueError, match=r'^kernel tiles: long\.mode: expected an object with keys from '
                                         r'\["heads_inner", .*\], got \{"dk_from_dz": true\}$'):
        apply_tiles({"long": {"mode": {"dk_from_dz": True}}})
    assert apply_tiles({}) == DEFAULT



def test_kernel_tile_mode_ws_fwd_silu_round_trips_through_json():
    """The Gluon silu forward's switch (RegimeConfig.ws_fwd_silu) is a kernel-tiles JSON mode: written as JSON and
    read back it turns on the named regime only (its tiles stay the default (BLOCK_N 64, 2 stages)), a quoted
    "true" is refused, and it is off by default; the shipped H200 tiles file turns it on where the Gluon backward
    runs (long and medium: the step -2.38 / -2.58 ms paired on an H100, 2026-12-07)."""
    import json
    from pathlib import Path

    from gemray.kernels.config import DEFAULT, MODE_FIELDS, REGIMES, apply_tiles

    assert "ws_fwd_silu" in MODE_FIELDS
    spec = json.loads(json.dumps({"xlong": {"mode": {"ws_fwd_silu": True, "ws_bwd": True}}}))
    cfg = apply_tiles(spec)
    assert cfg.regime("xlong").ws_fwd_silu and cfg.regime("xlong").ws_bwd
    assert cfg.regime("xlong").ws_fwd_silu_tiles == (64, 2)
    assert not any(cfg.regime(r).ws_fwd_silu for r in REGIMES if r != "xlong")
    assert apply_tiles({"xlong": {"mode": {"ws_fwd_silu": False}}}, cfg).regime("xlong").ws_fwd_silu is False
    with pytest.raises(ValueError, match=r'^kernel tiles: xlong\.mode\.ws_fwd_silu: expected true or false, '
                                         r'got "true"$'):
        apply_tiles({"xlong": {"mode": {"ws_fwd_silu": "true"}}})
    assert not any(DEFAULT.regime(r).ws_fwd_silu for r in REGIMES)
    shipped = apply_tiles(json.loads((Path(__file__).resolve().parents[1] / "configs" / "kernel-tiles-h200.json")
                                     .read_text()))
    assert [r for r in REGIMES if shipped.regime(r).ws_fwd_silu] == [r for r in REGIMES if shipped.regime(r).ws_bwd]
    assert shipped.regime("long").ws_fwd_silu and shipped.regime("medium").ws_fwd_silu

def test_loader_workers_is_a_count_or_auto_from_toml_and_set_alike(tmp_path):
    """data.loader_workers: "auto" (default; 1 on CUDA, 0 on the CPU) or an integer >= 0, from a TOML file (an int
    or the string "auto") and --set alike; anything else is refused naming the key. data.prefetch_batches >= 1."""
    cfg = JobConfig()
    assert cfg.data.loader_workers == "auto" and cfg.data.prefetch_batches == 2
    assert (cfg.data.resolved_loader_workers("cuda"), cfg.data.resolved_loader_workers("cpu")) == (1, 0)
    toml = tmp_path / "c.toml"
    for text, want in (("3", 3), ("0", 0), ('"auto"', "auto")):
        toml.write_text(f"[data]\nloader_workers = {text}\n")
        assert load_config(toml).data.loader_workers == want
        assert load_config(None, [f"data.loader_workers={text.strip(chr(34))}"]).data.loader_workers == want
    cfg = load_config(None, ["data.loader_workers=2", "data.prefetch_batches=4"])
    assert (cfg.data.resolved_loader_workers("cpu"), cfg.data.prefetch_batches) == (2, 4)
    toml.write_text(to_toml(cfg))
    assert load_config(toml).data.loader_workers == 2  # round trip keeps the int
    for bad in ("-1", "two", "1.5", "true"):
        with pytest.raises(ValueError, match=r"data\.loader_workers: expected an integer >= 0 or 'auto', got"):
            load_config(None, [f"data.loader_workers={bad}"])
    for bad in ('"2"', "true", "-1"):
        toml.write_text(f"[data]\nloader_workers = {bad}\n")
        with pytest.raises(ValueError, match=r"data\.loader_workers: expected"):
            load_config(toml)
    with pytest.raises(ValueError, match=r"data\.prefetch_batches: expected > 0, got 0"):
        load_config(None, ["data.prefetch_batches=0"])


def test_usable_cpus_is_the_one_affinity_count(monkeypatch):
    """gemray.config.usable_cpus, the bottom layer's count of the cores this process may use, is the one that the
    synthetic data's generation workers, `gemray bench train`'s loader record and evaluation's threads take (was:
    three copies; the synthetic data's let an OSError from the affinity mask escape, bench train's too)."""
    import os

    from gemray.config import usable_cpus
    from gemray.pipelines.synthetic import _default_workers

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert usable_cpus() == 3 and _default_workers(8) == 3 and _default_workers(2) == 2

    def unreadable(pid):
        raise OSError("no affinity mask here")

    monkeypatch.setattr(os, "sched_getaffinity", unreadable)
    assert usable_cpus() == 6 and _default_workers(8) == 6
    monkeypatch.delattr(os, "sched_getaffinity")  # not Linux
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert usable_cpus() == 1 and _default_workers(8) == 1
    copies = [str(p.relative_to(ROOT)) for folder in ("gemray", "pipelines")
              for p in sorted((ROOT / folder).rglob("*.py")) if "sched_getaffinity" in p.read_text()]
    assert copies == ["gemray/config.py"], copies
