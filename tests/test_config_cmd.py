"""`tlt config show` and `tlt config check`, run in this process through `tlt.cli.main`.

show: every field of every section, as TOML that loads back to the same values (each shipped preset), each field
after its description and, when it is not the default, where its value comes from (preset, environment, --set).
check: a preset file's every section validated by its config class; a bad one is exit 2 and says what is wrong.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from tlt.cli import main
from tlt.services.common.config import PRESETS_DIR, ConfigError, ServiceConfig, load_config
from tlt.services.common.config_cmd import SECTION_CLASSES, UNSET, config_class

PRESETS = sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))
FIELD = re.compile(rf"^(?:# )?(\w+) = (?:\({UNSET[1:-1]}\)$)?")  # `name = value`, or `# name = (unset)`


pytestmark = pytest.mark.usefixtures("no_tlt_environment")  # the caller's TLT_* variables: conftest.py


def _show(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["config", "show", *argv]) == 0
    return capsys.readouterr().out


def _fields(text: str) -> dict[tuple[str, str], tuple[str, list[str]]]:
    """(table, field) -> (its line, the comment lines right above it, the last one first)."""
    out: dict[tuple[str, str], tuple[str, list[str]]] = {}
    lines = text.splitlines()
    table = ""
    for i, line in enumerate(lines):
        if line.startswith("["):
            table = line.strip("[]")
            continue
        m = FIELD.match(line)
        if m is None or (line.startswith("# ") and not line.endswith(UNSET)):
            continue
        above = []
        for prev in reversed(lines[:i]):
            if not prev.startswith("# "):
                break
            above.append(prev[2:])
        out[(table, m[1])] = (line, above)
    return out


def _classes() -> dict[str, type[ServiceConfig]]:
    """Every table `show` prints -> its config class ([rollout.engine] too)."""
    out: dict[str, type[ServiceConfig]] = {}

    def walk(table: str, cls: type[ServiceConfig]) -> None:
        out[table] = cls
        for name, field in cls.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, ServiceConfig):
                walk(f"{table}.{name}", field.annotation)

    for section in SECTION_CLASSES:
        walk(section, config_class(section))
    return out


def test_every_field_of_every_config_class_has_a_description() -> None:
    missing = [f"{table}.{name}" for table, cls in _classes().items()
               for name, field in cls.model_fields.items() if not (field.description or "").strip()]
    assert not missing, missing


@pytest.mark.parametrize("preset", PRESETS)
def test_show_loads_back_to_the_same_values(preset: str, tmp_path: Path, capsys) -> None:
    """`show --preset P > my.toml`, then `show --preset my.toml`: the same values, and the services' own."""
    first = _show(capsys, "--preset", preset)
    mine = tmp_path / "my.toml"
    mine.write_text(first)
    second = _show(capsys, "--preset", str(mine))
    parsed = tomllib.loads(first)
    assert tomllib.loads(second) == parsed
    assert list(parsed) == list(SECTION_CLASSES)
    for section, values in parsed.items():
        cls = config_class(section)
        assert cls(**values) == load_config(cls, section, preset), section
    for name in (preset, str(mine)):
        assert main(["config", "check", name]) == 0
        assert capsys.readouterr().out.startswith("ok: ")


def test_every_printed_field_follows_its_description(capsys) -> None:
    fields = _fields(_show(capsys, "--preset", "1gpu"))
    wrong = []
    for table, cls in _classes().items():
        for name, field in cls.model_fields.items():
            if table != "rollout" or name not in ("engine", "spec"):  # nested sections are tables, not lines
                line, above = fields.pop((table, name), ("", []))
                comment = " ".join(reversed([c for c in above if not c.startswith("from ")]))
                if comment != " ".join((field.description or "").split()):
                    wrong.append((table, name, line, comment[:60]))
    assert not wrong, wrong
    assert not fields, f"printed lines of no field: {fields}"


def test_each_value_says_where_it_comes_from(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TLT_ROLLOUT__ENGINE__MAX_NUM_SEQS", "7")
    monkeypatch.setenv("TLT_REWARD__WORKERS", "3")
    monkeypatch.setenv("TLT_TRAINER__LR", "0.1")  # --set wins over it
    fields = _fields(_show(capsys, "--preset", "cpu-tiny", "--set", "trainer.lr=0.5",
                           "--set", "rollout.spec.threshold=3", "--set", "trainer.bf16=true"))
    expected = {
        ("rollout", "replicas"): ("replicas = 1", "from preset cpu-tiny"),
        ("rollout.engine", "max_model_len"): ("max_model_len = 1024", "from preset cpu-tiny"),
        ("rollout.engine", "max_num_seqs"): ("max_num_seqs = 7", "from environment TLT_ROLLOUT__ENGINE__MAX_NUM_SEQS"),
        ("reward", "workers"): ("workers = 3", "from environment TLT_REWARD__WORKERS"),
        ("trainer", "lr"): ("lr = 0.5", "from --set"),
        ("rollout.spec", "threshold"): ("threshold = 3", "from --set"),
        ("trainer", "bf16"): ("bf16 = true", "from --set"),
    }
    for key, (line, origin) in expected.items():
        assert fields[key][0] == line and fields[key][1][0] == origin, (key, fields[key])
    for key in (("rollout", "pin_cpus"), ("rollout.engine", "block_size"), ("trainer", "weight_decay")):  # defaults
        assert not any(c.startswith("from ") for c in fields[key][1]), (key, fields[key])


def test_one_key_of_a_dict_field_is_set_and_the_others_kept(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--set sglang.adaptive_steps.1=[1,3]` and TLT_SGLANG__ADAPTIVE_STEPS__5: the map's other keys stay (they were
    dropped: the map was the keys given, as the services would have loaded it too)."""
    from tlt.services.rollout.sglang_backend.config import SGLangBackendConfig

    monkeypatch.setenv("TLT_SGLANG__ADAPTIVE_STEPS__5", "[1]")
    shown = tomllib.loads(_show(capsys, "--set", "sglang.adaptive_steps.1=[1, 3]", "sglang"))["sglang"]
    assert shown["adaptive_steps"] == {**SGLangBackendConfig().adaptive_steps, "1": [1, 3], "5": [1]}
    monkeypatch.setenv("TLT_SGLANG__ADAPTIVE_STEPS__5", "[1, 3]")
    shown = tomllib.loads(_show(capsys, "--set", 'sglang.adaptive_steps={"1" = [3]}', "sglang"))["sglang"]
    assert shown["adaptive_steps"] == {"1": [3]}  # a whole map given replaces the map


def test_an_unset_field_is_commented_out(capsys) -> None:
    """TOML has no null: `bf16 = None` would not load back; `# bf16 = (unset)` leaves it unset."""
    text = _show(capsys, "trainer")
    assert "\n# bf16 = (unset)\n" in text and "data_path" not in tomllib.loads(text)["trainer"]
    assert list(tomllib.loads(text)) == ["trainer"]


@pytest.mark.parametrize("overrides,words", [
    (["trainer.lr=-1"], "lr=-1"),
    (["trainer.bogus=1"], "unknown field 'bogus'"),
    (["rollout.engine.dtype=fp8"], "engine.dtype='fp8'"),
    (["lr=3e-5"], "name the section"),
    (["trainr.lr=3e-5"], "unknown section 'trainr'"),
    (["trainr.lr=3e-5"], "did you mean 'trainer'?"),
    (["trainer.lr"], "must look like field=value"),
])
def test_show_refuses_a_bad_set(overrides, words, capsys) -> None:
    assert main(["config", "show", *(a for o in overrides for a in ("--set", o))]) == 2
    captured = capsys.readouterr()
    assert words in captured.err and "Traceback" not in captured.err and not captured.out, captured


def test_show_refuses_an_unknown_section_at_parsing(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["config", "show", "trainr"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "unknown section 'trainr'" in err and "did you mean 'trainer'?" in err


@pytest.mark.parametrize("text,words", [
    ("[trainr]\nsteps = 3\n", "unknown section [trainr]"),
    ("[rolout]\nreplicas = 3\n", "did you mean [rollout]?"),
    ("[trainer]\nstepz = 3\n", "unknown field 'stepz'"),
    ("[rollout.engine]\nbogus = 1\n", "unknown field 'engine.bogus'"),
    ("[trainer]\nsteps = 0\n", "steps=0"),
    ("[drafter]\ncapacity_pub = ''\n", "capacity_pub=''"),
    ("[rollout]\nreplicas = 'two'\n", "replicas='two'"),
    # each of these was accepted here and failed only later: in torch, inside a replica or a worker process
    ("[drafter]\ndevice = ''\n", "device=''"),
    ("[drafter]\ndevice = 'gpu'\n", "device='gpu'"),
    ("[drafter]\ndevice = 'cuda:1'\n", "device='cuda:1'"),  # a template: a worker used cuda:<replica> anyway
    ("[rollout.engine]\ndevice = 'cuda:x'\n", "engine.device='cuda:x'"),
    # ... a ZMQError as the rollout started, or in every replica process (features_push connects)
    ("[rollout]\ncapacity_pub = 'foo'\n", "capacity_pub='foo'"),
    ("[rollout]\ncapacity_snapshot = 'tcp://127.0.0.1'\n", "capacity_snapshot='tcp://127.0.0.1'"),
    ("[rollout]\nfeatures_push = 'tcp://127.0.0.1:*'\n", "features_push='tcp://127.0.0.1:*'"),
    ("[trainer]\ndrafter_features_address = 'drafter:5703'\n", "drafter_features_address='drafter:5703'"),
    # ... "not reachable" after the whole connect timeout (120 s), or a division by zero (no rollout server)
    ("[trainer]\nrollout_addresses = []\n", "rollout_addresses=[]"),
    ("[trainer]\nrollout_addresses = ['rollout']\n", "rollout_addresses=['rollout']"),
    ("[trainer]\nreward = 'grpc'\nreward_address = 'reward:0'\n", "reward_address='reward:0'"),
    ("[drafter]\nrollout_grpc = 'tcp://127.0.0.1:50051'\n", "rollout_grpc='tcp://127.0.0.1:50051'"),
    # ... torch.optim.AdamW's "Invalid beta parameter" as the trainer built its optimizer
    ("[trainer]\nadam_betas = [1.5, 0.999]\n", "adam_betas=[1.5, 0.999]"),
    # ... only once `tlt rollout serve` had loaded the model and checked the checkpoint
    ("[rollout]\nbackend = 'sgl'\n", "backend='sgl'"),
    # ... in every replica process, as its engine set up decode graphs
    ("[rollout.engine]\ndecode_graph_buckets = [4, 2]\n", "engine.decode_graph_buckets=[4, 2]"),
    ("[rollout.engine]\ndecode_graphs = 'emulate'\nkernels = 'torch'\n", "kernels = 'triton'"),
    ("[rollout.engine]\ndecode_graphs = 'emulate'\n", "kernels = 'triton'"),  # auto is the PyTorch path on cpu
    ("[rollout.engine]\ndecode_graphs = 'cuda'\nkernels = 'triton'\n", "CUDA device"),
    ("run = 3\n", "[run] must be a table"),
    ("[trainer\nsteps = 3\n", "not valid TOML"),
])
def test_check_refuses_a_bad_preset_file(text: str, words: str, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(text + "\n[reward]\nworkers = 2\n")  # a good section beside the bad one
    assert main(["config", "check", str(bad)]) == 2
    captured = capsys.readouterr()
    assert words in captured.err and "Traceback" not in captured.err and not captured.out, captured.err


def test_check_accepts_every_legitimate_form_of_those_values(tmp_path: Path, capsys) -> None:
    """The checks above refuse only what would fail: ports picked at bind time, '' where it means off, names that
    resolve only in a cluster, another engine class, a GPU the checking machine need not have."""
    good = tmp_path / "good.toml"
    good.write_text(
        "[rollout]\nbackend = 'my_pkg.engine:Engine'\ncapacity_pub = 'tcp://0.0.0.0:0'\ncapacity_snapshot = ''\n"
        "features_push = 'ipc:///tmp/tlt-features'\n"
        "[rollout.engine]\ndevice = 'cuda:3'\ndecode_graphs = 'cuda'\ndecode_graph_buckets = [1, 8, 64]\n"
        "[drafter]\ndevice = 'cuda'\nrollout_grpc = 'tlt-rollout-0.tlt-rollout:50051'\n"
        "[trainer]\nrollout_addresses = ['rollout:50051', '[::1]:50051', 'dns:///rollout.svc:50051']\n"
        "reward = 'task'\nreward_address = ''\ndrafter_features_address = ''\nadam_betas = [0.0, 0.95]\n"
        "[sglang]\nadaptive_steps = {'1' = [1, 3]}\nnum_steps = 1\n")
    assert main(["config", "check", str(good)]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("ok: 4 sections")
    for name, cls in (("engine", "native"), ("sglang", "sglang")):
        assert load_config(config_class("rollout"), "rollout", None, {"backend": cls}, environ={}).backend == cls, name


def test_check_reports_every_problem_and_leaves_the_environment_out(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("TLT_TRAINER__LR", "-1")  # the file is checked, not this shell
    assert main(["config", "check", "cpu-tiny"]) == 0
    assert capsys.readouterr().out.startswith("ok: 5 sections")
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainr]\nsteps = 3\n[trainer]\nsteps = 0\n[reward]\nkind = 'chess'\n")
    assert main(["config", "check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown section [trainr]" in err and "steps=0" in err and "unknown reward kind 'chess'" in err
    assert all(line.startswith((str(bad), "  ")) for line in err.splitlines()), err


def test_check_refuses_max_tokens_that_leave_no_room_for_a_prompt(tmp_path: Path, capsys) -> None:
    """[trainer] max_tokens at or above [rollout.engine] max_model_len passed `tlt config check` ("ok") and `tlt run`
    started every service, then the rollout refused each of the first step's requests (context_length_exceeded)."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer]\nmax_tokens = 2000\n[rollout.engine]\nmax_model_len = 512\n")
    assert main(["config", "check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "max_tokens=2000" in err and "max_model_len=512" in err, err
    from tlt.services.trainer.launcher import _validate

    services = {"trainer": {"max_tokens": 2000}, "rollout": {"engine": {"max_model_len": 512}}}
    with pytest.raises(ConfigError, match="max_tokens=2000"):  # `tlt run`, before anything starts
        _validate(services, {"drafter": False})
    # room left, the model's own context (0: known only once the model is loaded), or another backend: accepted
    for text in ("[trainer]\nmax_tokens = 500\n[rollout.engine]\nmax_model_len = 512\n",
                 "[trainer]\nmax_tokens = 2000\n",
                 "[trainer]\nmax_tokens = 2000\n[rollout]\nbackend = 'sglang'\n"
                 "[rollout.engine]\nmax_model_len = 512\n"):
        bad.write_text(text)
        assert main(["config", "check", str(bad)]) == 0, capsys.readouterr().err
    _validate({"trainer": {"max_tokens": 500}, "rollout": {"engine": {"max_model_len": 512}}}, {"drafter": False})


def test_show_never_prints_a_secret(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tlt config show` printed api_key and control_token as set (a terminal, a CI log, a pasted issue). It says
    they are set and where from, not what they are; its output still loads back, those fields left unset."""
    monkeypatch.setenv("TLT_ROLLOUT__API_KEY", "sk-env-secret-1")
    monkeypatch.setenv("TLT_DRAFTER__CONTROL_TOKEN", "drafter-secret-2")
    assert main(["config", "show", "--set", "rollout.control_token=set-secret-3", "--set",
                 "trainer.rollout_token=set-secret-4"]) == 0
    out = capsys.readouterr().out
    for secret in ("sk-env-secret-1", "drafter-secret-2", "set-secret-3", "set-secret-4"):
        assert secret not in out
    shown = re.findall(r"^# (\w+) = \(set, (\d+) characters; not shown\)$", out, re.M)
    assert sorted(shown) == sorted([("api_key", "15"), ("control_token", "16"), ("control_token", "12"),
                                    ("rollout_token", "12")]), shown
    monkeypatch.delenv("TLT_ROLLOUT__API_KEY")
    monkeypatch.delenv("TLT_DRAFTER__CONTROL_TOKEN")
    (tmp_path / "shown.toml").write_text(out)
    assert load_config(config_class("rollout"), "rollout", tmp_path / "shown.toml").api_key == ""


def test_a_config_error_about_a_secret_does_not_print_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A control token of the wrong type (a JSON object or `true` in TLT_DRAFTER__CONTROL_TOKEN: the environment's
    values are read as JSON) was refused with its value in the message, which `tlt config show` otherwise hides."""
    monkeypatch.setenv("TLT_DRAFTER__CONTROL_TOKEN", '{"a": "secretJSON"}')
    monkeypatch.setenv("TLT_ROLLOUT__API_KEY", "[\"sk-list-secret\"]")
    for section in ("drafter", "rollout"):
        with pytest.raises(ConfigError) as e:
            load_config(config_class(section), section=section)
        assert "secretJSON" not in str(e.value) and "sk-list-secret" not in str(e.value), e.value
        assert "not shown: a secret" in str(e.value), e.value
    monkeypatch.setenv("TLT_DRAFTER__WINDOW_TOKENS", '"many"')  # any other field still shows what it was given
    with pytest.raises(ConfigError, match="'many'"):
        load_config(config_class("drafter"), section="drafter")


def test_a_false_value_is_printed_not_taken_for_unset(capsys) -> None:
    """Only None is unset: `scale_adv_by_std = false` (Dr. GRPO, the default true) printed commented out as unset
    would load back as true, another run than the one shown."""
    text = _show(capsys, "--set", "trainer.scale_adv_by_std=false", "trainer")
    assert "\nscale_adv_by_std = false\n" in text, text
    assert tomllib.loads(text)["trainer"]["scale_adv_by_std"] is False


def test_check_refuses_max_tokens_equal_to_max_model_len(tmp_path: Path, capsys) -> None:
    """max_tokens == max_model_len leaves no token for the prompt either ('at or above'); one less is accepted."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer]\nmax_tokens = 512\n[rollout.engine]\nmax_model_len = 512\n")
    assert main(["config", "check", str(bad)]) == 2
    assert "max_tokens=512" in capsys.readouterr().err
    bad.write_text("[trainer]\nmax_tokens = 511\n[rollout.engine]\nmax_model_len = 512\n")
    assert main(["config", "check", str(bad)]) == 0, capsys.readouterr().err


def test_check_of_a_file_without_trainer_leaves_the_environment_out(tmp_path: Path, capsys, monkeypatch) -> None:
    """A file with [rollout] but no [trainer] is checked against the trainer's defaults, not this shell's
    TLT_TRAINER__* (which the file does not carry to the machine that runs it)."""
    monkeypatch.setenv("TLT_TRAINER__MAX_TOKENS", "4000")
    good = tmp_path / "good.toml"
    good.write_text("[rollout.engine]\nmax_model_len = 1024\n")
    assert main(["config", "check", str(good)]) == 0, capsys.readouterr().err
    monkeypatch.delenv("TLT_TRAINER__MAX_TOKENS")
    monkeypatch.setenv("TLT_ROLLOUT__ENGINE__MAX_MODEL_LEN", "64")
    good.write_text("[trainer]\nmax_tokens = 100\n")
    assert main(["config", "check", str(good)]) == 0, capsys.readouterr().err


def test_check_refuses_fp32_pushes_to_a_bf16_engine(tmp_path: Path, capsys) -> None:
    """push_dtype auto follows [trainer] bf16: bf16 = false pushes float32, which a bfloat16 engine refuses at the
    first push; bf16 = true pushes what it serves."""
    f = tmp_path / "p.toml"
    f.write_text("[trainer]\nbf16 = false\n[rollout.engine]\ndtype = 'bfloat16'\n")
    assert main(["config", "check", str(f)]) == 2
    err = capsys.readouterr().err
    assert "pushes float32 weights (bf16 = false)" in err and 'dtype="bfloat16"' in err, err
    f.write_text("[trainer]\nbf16 = true\n[rollout.engine]\ndtype = 'bfloat16'\n")
    assert main(["config", "check", str(f)]) == 0, capsys.readouterr().err
