"""`python -m dcinterp.synth attribute`: head attribution over the contrast pairs' clean prompts."""

import json

import pandas as pd
import pytest
import torch

from dcinterp import HookedDCFormer
from dcinterp.attribution import head_attribution
from dcinterp.synth import contrast_pairs, tokenize_pairs
from dcinterp.synth.__main__ import main
from dcinterp.synth.commands.attribute import OUTPUTS

FAST = ["--tasks", "2,3", "--prompts", "2", "--n-steps", "8", "--batch-size", "3"]


@pytest.mark.filterwarnings("ignore:head_attribution. the scores miss")  # 8 steps: a rough integral, on purpose
def test_cli_writes_heads_prompts_summary_and_figure(tmp_path, capsys):
    assert main(["attribute", *FAST, "--out", str(tmp_path)]) == 0
    assert "completeness gap" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(OUTPUTS)
    heads = pd.read_csv(tmp_path / "heads.csv")
    assert list(heads.columns) == ["layer", "head", "score", "score[task2]", "score[task3]"]
    assert len(heads) == 3 * 4  # dcpythia-synth: 3 layers x 4 heads
    prompts = pd.read_csv(tmp_path / "prompts.csv")
    assert list(prompts["task"]) == ["task2", "task2", "task3", "task3"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["prompts"] == 4 and summary["n_steps"] == 8
    top = summary["top_heads"][0]
    assert top["score"] == heads["score"].max()
    assert heads.loc[heads["score"].idxmax(), ["layer", "head"]].tolist() == [top["layer"], top["head"]]

    # The scores are head_attribution's of the same prompts and answers (in batches of 3: to float32 rounding).
    model = HookedDCFormer.from_pretrained("dcpythia-synth")
    pairs = [p for task in (2, 3) for p in contrast_pairs(task, n=2, seed=0, tokenizer=model.tokenizer)]
    tokens = tokenize_pairs(pairs, model.tokenizer)
    expected = head_attribution(model, tokens.clean, tokens.clean_answer, position=tokens.position, n_steps=8)
    torch.testing.assert_close(
        torch.tensor(heads["score"].to_numpy(), dtype=torch.float32), expected.scores.flatten(), atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(torch.tensor(prompts["delta"].to_numpy(), dtype=torch.float32), expected.delta)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--kind", "person", "--tasks", "0"], "does not apply to task0"),
        (["--checkpoint", "/nonexistent/checkpoint"], "/nonexistent/checkpoint"),
        (["--device", "cuda:7"], "--device"),
    ],
)
def test_bad_input_is_one_line_and_nothing_is_written(tmp_path, capsys, arguments, message):
    out = tmp_path / "out"
    assert main(["attribute", *FAST, *arguments, "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1
    assert not out.exists()


OUT_OF_MEMORY = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.64 GiB of which 1.19 GiB is "
    "free. Including non-PyTorch memory, this process has 22.43 GiB memory in use. Of the allocated memory 21.90 GiB "
    "is allocated by PyTorch, and 150.00 MiB is reserved by PyTorch but unallocated. If reserved but unallocated "
    "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
    "documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)


@pytest.mark.filterwarnings("ignore:bfloat16 on the CPU")  # the dtype as a card's user gives it
@pytest.mark.parametrize(
    "arguments, remedies",
    [
        ([], "try --dtype bfloat16 (half the memory of float32), or a --batch-size below 3, or a smaller "
         "--internal-batch-size (now every step of the integral at once)"),
        (["--dtype", "bfloat16", "--batch-size", "1", "--internal-batch-size", "4"],
         "try a smaller --internal-batch-size (now 4)"),
        (["--dtype", "bfloat16", "--batch-size", "1", "--internal-batch-size", "1"], None),
    ],
)  # fmt: skip
def test_a_gpu_out_of_memory_is_one_line_naming_what_holds_less_and_nothing_is_written(
    tmp_path, capsys, monkeypatch, arguments, remedies
):
    """torch's account of the card's memory in one line, the options that would hold less as the command was given
    them, exit status 3, no output."""

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError(OUT_OF_MEMORY)

    monkeypatch.setattr("dcinterp.attribution.head_attribution_sweep", out_of_memory)
    out = tmp_path / "out"
    assert main(["attribute", *FAST, *arguments, "--out", str(out)]) == 3
    error = capsys.readouterr().err
    account = (
        "error: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.64 GiB of which "
        "1.19 GiB is free"
    )
    assert error.endswith("\n") and error.splitlines()[-1] == account + (f"; {remedies}" if remedies else "")
    assert error.count("error") == 1 and not out.exists()  # before it, the progress line on stderr


def test_bad_numbers_are_argument_errors(tmp_path):
    for arguments in (["--n-steps", "0"], ["--prompts", "-1"], ["--tasks", "999"]):
        with pytest.raises(SystemExit) as exit_:
            main(["attribute", *arguments, "--out", str(tmp_path)])
        assert exit_.value.code == 2
