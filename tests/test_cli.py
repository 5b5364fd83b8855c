"""The command lines as a new user meets them: every bad input is one line on stderr, exit 2, checked before any work,
and nothing written; `--help` does not import torch; the notebook runner takes parameters as typed."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

from dcinterp import notebooks
from dcinterp.devices import available_devices, check_device
from dcinterp.synth import __main__ as synth_cli
from dcinterp.synth.commands import common

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def unavailable_devices() -> list[str]:
    """Devices this machine surely lacks: one GPU past the last, an unknown type, and mps / xpu where absent."""
    have = available_devices()
    devices = [f"cuda:{sum(d.startswith('cuda') for d in have)}", "tpu"]
    devices += [name for name in ("mps", "xpu") if not any(d.startswith(name) for d in have)]
    return devices


def one_line(text: str) -> str:
    assert text.count("\n") == 1 and text.endswith("\n"), text
    return text.strip()


def exit_code(main, argv: list[str]) -> int:
    """A command line's exit status, whether `main` returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if `eval` gets as far as loading a checkpoint."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a checkpoint was loaded before the arguments were checked")

    monkeypatch.setattr(common, "load_checkpoint", forbidden)


# --------------------------------------------------------------------------------------------------
# Devices
@pytest.mark.parametrize("device", unavailable_devices())
def test_check_device_names_the_device_and_what_is_available(device):
    with pytest.raises(ValueError) as error:
        check_device(device)
    message = str(error.value)
    assert "\n" not in message and repr(device) in message
    assert message.endswith("available: " + ", ".join(available_devices()))


def test_check_device_accepts_this_machines_devices():
    assert check_device("cpu") == "cpu"
    assert check_device(None) in ("cpu", "cuda")
    for device in available_devices():
        assert check_device(device) == device


@pytest.mark.parametrize("device", unavailable_devices())
def test_eval_on_a_missing_device_is_one_line_and_exit_2(device, tmp_path, capsys, no_model_loading):
    out = tmp_path / "results"
    assert synth_cli.main(["eval", "--device", device, "--out", str(out), "--limit", "1"]) == 2
    captured = capsys.readouterr()
    line = one_line(captured.err)
    assert line.startswith("error: --device: ") and repr(device) in line and "available: cpu" in line
    assert captured.out == "" and files_under(tmp_path) == []


# --------------------------------------------------------------------------------------------------
# synth eval --out: checked before the evaluation
@pytest.mark.parametrize(
    "where, message",
    [
        ("file", "--out {out}: exists and is not a directory"),
        ("under_file", "--out {out}: {file} is a file, not a directory"),
    ],
)
def test_eval_out_that_cannot_be_written_fails_before_any_work(where, message, tmp_path, capsys, no_model_loading):
    file = tmp_path / "existing.csv"
    file.write_text("keep me\n")
    out = file if where == "file" else file / "results"
    assert synth_cli.main(["eval", "--out", str(out), "--limit", "1"]) == 2
    assert one_line(capsys.readouterr().err) == "error: " + message.format(out=out, file=file)
    assert file.read_text() == "keep me\n" and files_under(tmp_path) == ["existing.csv"]


def test_the_module_entry_point_gives_one_line_not_a_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "dcinterp.synth", "eval", "--device", "tpu", "--out", str(tmp_path / "results")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert one_line(result.stderr).startswith("error: --device: device 'tpu' is not a torch device; available: cpu")
    assert files_under(tmp_path) == []


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs a read-only file system (/proc)")
def test_eval_out_on_a_read_only_file_system(capsys, no_model_loading):
    assert synth_cli.main(["eval", "--out", "/proc/dcinterp-results", "--limit", "1"]) == 2
    assert one_line(capsys.readouterr().err).startswith("error: --out /proc/dcinterp-results: cannot write in /proc")


def test_eval_out_a_new_directory_is_not_created_when_the_input_is_bad(tmp_path, capsys):
    out = tmp_path / "new" / "results"
    assert synth_cli.main(["eval", "--out", str(out), "--data", str(tmp_path / "missing.jsonl")]) == 2
    assert one_line(capsys.readouterr().err) == f"error: {tmp_path / 'missing.jsonl'}: no such data file"
    assert files_under(tmp_path) == []


# --------------------------------------------------------------------------------------------------
# synth generate: refuses what check or eval would reject
@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--samples-per-task", "0"], "argument --samples-per-task: expected a positive integer, not '0'"),
        (["--samples-per-task", "-3"], "argument --samples-per-task: expected a positive integer, not '-3'"),
        (["--seed", "-1"], "argument --seed: expected an integer >= 0, not '-1'"),
        (["--seed", "one"], "argument --seed: expected an integer >= 0, not 'one'"),
        (["--lines", "100"], "--lines 100: check and eval read samples of 8 lines"),
        (
            ["--qk-pattern", "same-person", "--ov-transformation", "prev"],
            "no task is both same-person and prev; nothing written",
        ),
    ],
)
def test_generate_refuses_what_check_and_eval_reject(arguments, message, tmp_path, capsys):
    out = tmp_path / "fresh.jsonl"
    assert exit_code(synth_cli.main, ["generate", "--out", str(out), *arguments]) == 2
    assert message in one_line(capsys.readouterr().err)
    assert files_under(tmp_path) == []


def test_generate_out_a_directory_is_one_line(tmp_path, capsys):
    assert synth_cli.main(["generate", "--out", str(tmp_path)]) == 2
    assert one_line(capsys.readouterr().err) == f"error: --out {tmp_path}: is a directory, not a file"
    assert files_under(tmp_path) == []


def test_what_generate_writes_check_accepts(tmp_path, capsys):
    out = tmp_path / "fresh.jsonl"
    assert (
        synth_cli.main(["generate", "--seed", "3", "--tasks", "0-3", "--samples-per-task", "2", "--out", str(out)]) == 0
    )
    assert synth_cli.main(["check", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"{out}: OK (8 records, 4 tasks)"


def test_a_usage_error_is_one_line_without_the_usage_block(capsys):
    assert exit_code(synth_cli.main, ["eval", "--batch-size", "0"]) == 2
    assert (
        one_line(capsys.readouterr().err)
        == "python -m dcinterp.synth eval: error: argument --batch-size: expected a positive integer, not '0'"
    )


# --------------------------------------------------------------------------------------------------
# The notebook runner: parameters
def test_p_values_are_strings_as_typed():
    prompt = "Michelle has a burger.\nHelen: has a papaya.\n  Michelle owns a kind of"
    parameters = notebooks.parse_parameters(
        notebooks.resolve("case_study"), [("prompt", prompt), ("checkpoint", "yes"), ("dtype", "null")]
    )
    assert parameters == {"prompt": prompt, "checkpoint": "yes", "dtype": "null"}


def test_p_values_are_numbers_where_the_default_is_a_number():
    parameters = notebooks.parse_parameters(notebooks.resolve("case_study"), [("n_steps", "16")])
    assert parameters == {"n_steps": 16}
    with pytest.raises(ValueError, match=r"^-p n_steps 'many': expected an integer, like the default 32$"):
        notebooks.parse_parameters(notebooks.resolve("case_study"), [("n_steps", "many")])


def test_p_refuses_a_list_and_says_how_to_pass_one():
    """A string where the notebook expects a list would be read a character at a time: -y takes lists."""
    message = (
        "-p checkpoints '/models/a': checkpoints is a list (default ['dcpythia-synth', 'pythia-synth']); "
        "pass it with -y 'checkpoints: [/models/a]'"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        notebooks.parse_parameters(notebooks.resolve("synthetic_eval"), [("checkpoints", "/models/a")])
    parameters = notebooks.parse_parameters(notebooks.resolve("synthetic_eval"), [], ["checkpoints: [/models/a]"])
    assert parameters == {"checkpoints": ["/models/a"]}


def test_y_takes_a_yaml_mapping_and_p_wins_over_it():
    parameters = notebooks.parse_parameters(
        notebooks.resolve("synthetic_eval"),
        [("dtype", "bfloat16")],
        ["{limit: 74, checkpoints: [a, b], dtype: float16}"],
    )
    assert parameters == {"limit": 74, "checkpoints": ["a", "b"], "dtype": "bfloat16"}


@pytest.mark.parametrize(
    "arguments, message",
    [
        (
            ["-p", "chekpoint", "x"],
            "error: case_study has no parameter 'chekpoint' (its parameters: checkpoint, device,",
        ),
        (["-y", "n_step: 3"], "error: case_study has no parameter 'n_step' (its parameters: checkpoint, device,"),
        (["-y", "16"], "error: -y '16': expected a YAML mapping such as 'limit: 74'"),
        (["-y", "a: ["], "error: -y 'a: [': not YAML"),
        (["-p", "n_steps", "1.5"], "error: -p n_steps '1.5': expected an integer"),
        (["-p", "device", "tpu"], "error: -p device: device 'tpu' is not a torch device; available: cpu"),
        (
            ["--out", "{file}/case_study.ipynb"],
            "error: --out {file}/case_study.ipynb: {file} is a file, not a directory",
        ),
        (["--figures", "{file}"], "error: --figures {file}: exists and is not a directory"),
    ],
)
def test_runner_bad_input_is_one_line_exit_2_and_runs_nothing(arguments, message, tmp_path, capsys, monkeypatch):
    file = tmp_path / "a_file"
    file.write_text("keep me\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(notebooks, "run_notebook", lambda *a, **k: pytest.fail("the notebook was run"))
    arguments = [argument.format(file=file) for argument in arguments]
    assert notebooks.main(["run", "case_study", *arguments]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith(message.format(file=file)), line
    assert files_under(tmp_path) == ["a_file"] and file.read_text() == "keep me\n"


def test_runner_lists_a_notebooks_parameters(capsys):
    assert notebooks.main(["run", "head_diversity", "--help-parameters"]) == 0
    assert [line.split(" = ")[0] for line in capsys.readouterr().out.splitlines()] == [
        "checkpoints",
        "device",
        "dtype",
        "figures_dir",
    ]


# --------------------------------------------------------------------------------------------------
# The notebook runner: where things go
def test_figures_go_next_to_the_executed_notebook_unless_told(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("papermill.execute_notebook", lambda *args, **kwargs: calls.append(kwargs))
    monkeypatch.chdir(tmp_path)
    notebooks.run_notebook("head_diversity", {}, out="runs/hd.ipynb")
    notebooks.run_notebook("head_diversity", {}, out="runs/hd.ipynb", figures="figs")
    notebooks.run_notebook("head_diversity", {"figures_dir": "mine"}, out="runs/hd.ipynb")
    assert [call["parameters"]["figures_dir"] for call in calls] == [
        str(tmp_path / "runs"),
        str(tmp_path / "figs"),
        str(tmp_path / "mine"),
    ]
    assert all(call["cwd"] == str(tmp_path) for call in calls)
    assert calls[0]["kernel_manager_class"]().transport == "ipc"


TINY_NOTEBOOK = nbformat.v4.new_notebook(
    cells=[
        nbformat.v4.new_code_cell(
            'message = "hello"\nrepeat = 2\nfigures_dir = "../figures"', metadata={"tags": ["parameters"]}
        ),
        nbformat.v4.new_code_cell(
            textwrap.dedent("""\
        from pathlib import Path
        print(message * repeat)
        Path(figures_dir, "tiny.txt").write_text(message)""")
        ),
    ],
    metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
)


def test_runner_streams_cells_keeps_kernel_warnings_out_and_writes_next_to_the_notebook(tmp_path):
    notebook = tmp_path / "tiny.ipynb"
    nbformat.write(TINY_NOTEBOOK, notebook)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dcinterp.notebooks",
            "run",
            str(notebook),
            "-p",
            "message",
            "a: b\nc",
            "-p",
            "repeat",
            "3",
            "--out",
            "out/tiny_run.ipynb",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=ENV,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Executing Cell 2" in result.stdout and "a: b\nca: b\nca: b\n" in result.stdout
    assert "without encryption" not in result.stdout + result.stderr
    assert (tmp_path / "out" / "tiny.txt").read_text() == "a: b\nc"
    assert "wrote out/tiny.txt" in result.stdout.replace(str(tmp_path) + "/", "")
    assert sorted(files_under(tmp_path)) == ["out", "out/tiny.txt", "out/tiny_run.ipynb", "tiny.ipynb"]


def test_two_notebooks_run_at_once_from_one_folder_and_leave_no_sockets(tmp_path):
    """The kernels' Unix sockets lie in temporary folders of their own, removed at exit: two runs started together
    in one working directory do not take each other's sockets (jupyter_client's default names them kernel-ipc-1,
    ... in the working directory). A temporary directory too deep for a socket's path (107 bytes) is not used."""
    nbformat.write(TINY_NOTEBOOK, tmp_path / "tiny.ipynb")
    temp = tmp_path / "tmp"
    temp.mkdir()
    if len(str(temp)) < 90:
        temp = temp / ("deep" * 20)
        temp.mkdir()
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "dcinterp.notebooks", "run", "tiny.ipynb", "--out", f"out{i}/tiny.ipynb", "--quiet"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env={**ENV, "TMPDIR": str(temp)},
        )
        for i in range(2)
    ]
    for run in runs:
        _, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, stderr
    outputs = ["out0", "out0/tiny.ipynb", "out0/tiny.txt", "out1", "out1/tiny.ipynb", "out1/tiny.txt"]
    assert [name for name in files_under(tmp_path) if not name.startswith("tmp")] == [*outputs, "tiny.ipynb"]
    assert files_under(temp) == []


def test_a_failing_cell_is_one_line_and_exit_1(tmp_path, capsys, monkeypatch):
    notebook = tmp_path / "tiny.ipynb"
    nbformat.write(TINY_NOTEBOOK, notebook)
    monkeypatch.chdir(tmp_path)
    assert notebooks.main(["run", str(notebook), "-y", "{repeat: null}", "--quiet"]) == 1
    line = one_line(capsys.readouterr().err)
    # cell 3 as the executed notebook counts: papermill adds a cell with the parameters given
    assert line.startswith("error: tiny: cell 3 raised TypeError: can't multiply sequence by non-int")


# --------------------------------------------------------------------------------------------------
# --help is fast: parsing the arguments imports neither torch nor transformer_lens
@pytest.mark.parametrize(
    "module, argv",
    [
        ("dcinterp.synth", ["--help"]),
        ("dcinterp.synth", ["eval", "--help"]),
        ("dcinterp.synth", ["generate", "--help"]),
        ("dcinterp.synth", ["check", "--help"]),
        ("dcinterp.synth", ["attribute", "--help"]),
        ("dcinterp.synth", ["graph", "--help"]),
        ("dcinterp.notebooks", ["--help"]),
        ("dcinterp.notebooks", ["run", "--help"]),
        ("dcinterp.train", ["--help"]),
    ],
)
def test_help_imports_neither_torch_nor_transformer_lens(module, argv):
    script = textwrap.dedent(f"""\
        import runpy, sys
        sys.argv = [{module!r}, *{argv!r}]
        try:
            runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
        except SystemExit as exit_:
            assert exit_.code == 0, exit_.code
        print(sorted(name for name in ("torch", "transformer_lens") if name in sys.modules))""")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_the_package_still_exports_the_model():
    script = (
        "import sys, dcinterp; assert 'torch' not in sys.modules; "
        "from dcinterp import HookedDCFormer, DCFormerConfig, CheckpointError, embedded_models; "
        "print(HookedDCFormer.__module__, sorted(embedded_models()))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "dcinterp.model"
