"""zllm/envs.py is the one reader of ZLLM_* environment variables: checked on the source, against
docs/configuration.md, and on how each kind of setting parses its text."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from zllm import envs

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "zllm"
DOC = ROOT / "docs" / "configuration.md"
ENV_ACCESSORS = ("os.environ", "os.getenv", "environ", "getenv")  # `from os import environ` counts too


def _zllm_names_at_module_level(tree: ast.Module) -> dict[str, str]:
    """Module constants holding a ZLLM_* name (HANG_ENV = "ZLLM_..."): reading through one is reading the variable."""
    names = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and _is_zllm_name(node.value.value):
            names.update({target.id: node.value.value for target in node.targets if isinstance(target, ast.Name)})
    return names


def _is_zllm_name(value: object) -> bool:
    return isinstance(value, str) and value.startswith("ZLLM_")


def _touches_environment(node: ast.AST) -> bool:
    """os.environ.get(...), os.environ[...], os.getenv(...), "X" in os.environ: the environment is read."""
    if isinstance(node, ast.Call):
        target = ast.unparse(node.func)
    elif isinstance(node, ast.Subscript):
        target = ast.unparse(node.value)
    elif isinstance(node, ast.Compare):
        target = " ".join(ast.unparse(c) for c in node.comparators)
    else:
        return False
    return any(target == accessor or target.startswith(accessor + ".") for accessor in ENV_ACCESSORS)


def _operands(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Call):
        return [*node.args, *(k.value for k in node.keywords)]
    if isinstance(node, ast.Subscript):
        return [node.slice]
    return [node.left]  # ast.Compare


def environment_reads(path: Path, root: Path = ROOT) -> list[str]:
    """The ZLLM_* variables this file reads from the environment itself (`file:line NAME`)."""
    tree = ast.parse(path.read_text())
    constants = _zllm_names_at_module_level(tree)
    found = []
    for node in ast.walk(tree):
        if not _touches_environment(node):
            continue
        for operand in _operands(node):
            if isinstance(operand, ast.Constant) and _is_zllm_name(operand.value):
                found.append(f"{path.relative_to(root)}:{node.lineno} {operand.value}")
            elif isinstance(operand, ast.Name) and operand.id in constants:
                found.append(f"{path.relative_to(root)}:{node.lineno} {constants[operand.id]}")
    return found


def test_no_module_but_envs_reads_a_zllm_variable():
    reads = [
        read for path in sorted(SOURCE.rglob("*.py")) if path != SOURCE / "envs.py" for read in environment_reads(path)
    ]
    assert not reads, f"read these through zllm.envs (zllm/envs.py names every setting): {reads}"


def test_the_scan_sees_every_way_of_reading(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os\nfrom os import environ\nNAME = 'ZLLM_B'\n"
        "os.environ.get('ZLLM_A')\nos.environ[NAME]\nos.getenv('ZLLM_C', '')\nenviron.get('ZLLM_D')\n"
        "'ZLLM_E' in os.environ\nos.environ.get('HOME')\n"
    )
    names = sorted(read.split()[-1] for read in environment_reads(sample, root=tmp_path))
    assert names == ["ZLLM_A", "ZLLM_B", "ZLLM_C", "ZLLM_D", "ZLLM_E"]


# ---- docs/configuration.md ---------------------------------------------------------------------


def documented_settings() -> dict[str, list[str]]:
    """The rows of the environment-variable table: name -> its cells (type, default, what it does)."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`(ZLLM_[A-Z0-9_]+)`", cells[0]) if line.startswith("|") else None
        if match:
            rows[match.group(1)] = cells[1:]
    return rows


def test_every_setting_has_a_row_in_the_docs_and_every_row_a_setting():
    assert sorted(documented_settings()) == sorted(envs.SETTINGS)


def test_the_docs_name_no_other_zllm_variable():
    mentioned = set(re.findall(r"\bZLLM_[A-Z0-9_]+", DOC.read_text()))
    assert mentioned <= set(envs.SETTINGS), sorted(mentioned - set(envs.SETTINGS))


def test_the_docs_give_each_settings_default():
    for name, cells in documented_settings().items():
        setting = envs.SETTINGS[name]
        if setting.default in (None, ""):
            continue  # the docs say what unset means in words
        text = cells[1].strip("`")
        documented = text == "on" if isinstance(setting.default, bool) else setting.parse(text)
        assert documented == setting.default, (name, cells)


# ---- parsing -----------------------------------------------------------------------------------


def test_unset_and_empty_give_the_default(monkeypatch):
    for name, setting in envs.SETTINGS.items():
        monkeypatch.delenv(name, raising=False)
        assert getattr(envs, name) == setting.default, name
        if not setting.empty_is_a_value:
            monkeypatch.setenv(name, "  ")
            assert getattr(envs, name) == setting.default, name


def test_an_empty_gemv_bound_picks_the_unbounded_kernel(monkeypatch):
    monkeypatch.setenv("ZLLM_GEMV_BOUND", "")  # benchmarks/gemv.py's comparison with the older kernel
    assert envs.ZLLM_GEMV_BOUND == ""
    monkeypatch.delenv("ZLLM_GEMV_BOUND")
    assert envs.ZLLM_GEMV_BOUND == "b6"


def test_values_are_read_when_asked_for(monkeypatch):
    monkeypatch.setenv("ZLLM_CACHE", " /tmp/zllm-cache ")
    assert envs.ZLLM_CACHE == "/tmp/zllm-cache"
    monkeypatch.setenv("ZLLM_CACHE", "/elsewhere")
    assert envs.ZLLM_CACHE == "/elsewhere"


def test_a_switch_is_off_only_at_zero(monkeypatch):
    monkeypatch.setenv("ZLLM_GEMV", "0")
    assert envs.ZLLM_GEMV is False
    for on in ("1", "yes", "off"):  # only "0" turns a switch off, as before the registry
        monkeypatch.setenv("ZLLM_GEMV", on)
        assert envs.ZLLM_GEMV is True


def test_numbers_parse_and_a_bad_one_names_the_variable(monkeypatch):
    monkeypatch.setenv("ZLLM_MOE_GEMV_PAIRS", "0")
    assert envs.ZLLM_MOE_GEMV_PAIRS == 0.0
    monkeypatch.setenv("ZLLM_TEST_FAIL_PROMPT_TOKEN", " 77 ")
    assert envs.ZLLM_TEST_FAIL_PROMPT_TOKEN == 77
    monkeypatch.setenv("ZLLM_MOE_GROUPED_MM_ROWS", "four")
    with pytest.raises(ValueError, match=r"ZLLM_MOE_GROUPED_MM_ROWS='four'"):
        _ = envs.ZLLM_MOE_GROUPED_MM_ROWS
    monkeypatch.setenv("ZLLM_TEST_FAIL_PROMPT_TOKEN", "7.5")
    with pytest.raises(ValueError, match=r"ZLLM_TEST_FAIL_PROMPT_TOKEN='7.5'"):
        _ = envs.ZLLM_TEST_FAIL_PROMPT_TOKEN


def test_the_api_key_is_kept_as_set(monkeypatch):
    monkeypatch.setenv("ZLLM_API_KEY", " s3cret ")
    assert envs.ZLLM_API_KEY == " s3cret "
    monkeypatch.setenv("ZLLM_API_KEY", "  ")  # a key of spaces is still a key: authentication stays on
    assert envs.ZLLM_API_KEY == "  "
    monkeypatch.setenv("ZLLM_API_KEY", "")
    assert envs.ZLLM_API_KEY is None


def test_the_hang_dump_setting_is_tolerant(monkeypatch, caplog):
    from zllm.procs.children import install_hang_dump

    monkeypatch.setenv("ZLLM_DEBUG_HANG_S", "soon")
    install_hang_dump()  # warns, does not raise
    assert "ZLLM_DEBUG_HANG_S='soon' is not a number of seconds" in caplog.text


def test_set_default_keeps_what_the_environment_has(monkeypatch):
    monkeypatch.setenv("ZLLM_LOG_LEVEL", "DEBUG")
    envs.set_default("ZLLM_LOG_LEVEL", "INFO")
    assert envs.ZLLM_LOG_LEVEL == "DEBUG"
    monkeypatch.delenv("ZLLM_LOG_LEVEL")
    envs.set_default("ZLLM_LOG_LEVEL", "WARNING")
    assert envs.ZLLM_LOG_LEVEL == "WARNING"
    monkeypatch.delenv("ZLLM_LOG_LEVEL")  # set_default wrote os.environ itself: leave it as found
    with pytest.raises(KeyError):
        envs.set_default("ZLLM_NO_SUCH_SETTING", "1")


def test_an_unknown_setting_is_an_attribute_error():
    with pytest.raises(AttributeError):
        _ = envs.ZLLM_NO_SUCH_SETTING


# ---- choice lists (zllm/config.py's CHOICES) ---------------------------------------------------


def documented_choices() -> dict[str, tuple[str, list[str], str]]:
    """The rows of the choices table: field -> (flag, its choices, its default)."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| `--") and len(cells) >= 4:
            field = cells[1].strip("`")
            rows[field] = (cells[0].split("`")[1], re.findall(r"`([^`]+)`", cells[2]), cells[3].strip("`"))
    return rows


def test_the_docs_list_each_fields_choices_and_default():
    from zllm.config import CHOICES, EngineConfig

    documented = documented_choices()
    assert sorted(documented) == sorted(CHOICES)
    defaults = EngineConfig(model="")
    for field, (flag, choices, default) in documented.items():
        assert tuple(choices) == CHOICES[field], (flag, choices)
        assert default == (getattr(defaults, field) or "none"), (flag, default)


def test_the_cli_offers_each_fields_choices():
    from zllm.config import CHOICES
    from zllm.launch.cli import build_parser

    offered = {action.dest: action.choices for action in build_parser()._actions}
    for field, choices in CHOICES.items():
        assert tuple(offered[field]) == choices, field


def test_a_bad_choice_names_the_field_and_its_values():
    from zllm.config import DEVICES, EngineConfig

    config = EngineConfig(model="", max_model_len=16, device="tpu")
    with pytest.raises(ValueError, match=re.escape(f"device: must be one of {DEVICES}, got 'tpu'")):
        config.validate()
