"""Score language models on the synthetic ICL tasks as the paper does (Sec 4.3, Table 5, Fig. 6).

A sample is 8 lines; lines 3-8 end with ` [ answer ]`. The model reads the sample's text with each
`[ answer ]` replaced by `answer` and nothing else changed (no BOS unless the tokenizer adds one
itself). The answer on line k is scored given everything before it, so with K = k - 1 = 2..7 shots.
Attention is causal, so one forward pass over the whole sample scores all six answers, and samples
can be batched with right padding.

- correct: every answer token is the argmax of the model's prediction under teacher forcing;
- nll: the negative log-likelihood of the answer's tokens, summed; perplexity pooled as `--ppl-pooling` says
  (Table 5 does not say; docs/conventions.md): "token" (default) exp(sum nll / sum tokens) over all answer tokens
  of a checkpoint; "answer" the mean over answers of each answer's perplexity exp(nll / tokens); "answer-nll"
  exp of the mean over answers of each answer's mean nll. summary.json holds all three under ppl_by_pooling.

Python: `evaluate(model, records)` and `evaluate_naive(model, records)` give one row per answer (`RESULT_COLUMNS`);
`summarize(rows)` gives accuracy and perplexity per checkpoint. The command line (`python -m dcinterp.synth eval`)
is `dcinterp.synth.commands.eval`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
from tqdm import tqdm

from .catalog import Catalog, data_dir, load_catalog
from .records import LINES_PER_SAMPLE, DatasetError, read_jsonl, sample_lines, unbracket

if TYPE_CHECKING:  # torch and the model are imported where they are used, so that `eval --help` starts fast
    import torch

    from ..model import HookedDCFormer

K_SHOTS = tuple(range(2, 8))  # answers on lines 3..8 see 2..7 earlier lines
RELEASED_DATA = "synthetic_dataset.jsonl"
RESULT_COLUMNS = [
    "checkpoint",
    "sample",
    "task",
    "qk_pattern",
    "ov_transformation",
    "k_shot",
    "answer",
    "predicted",
    "correct",
    "nll",
    "n_tokens",
]


class EvalError(ValueError):
    """Data or a checkpoint that cannot be evaluated; the one-line message names the file and line, or the
    checkpoint."""


# --------------------------------------------------------------------------------------------------
# Samples: read, check their structure, find the answers' characters
@dataclass(frozen=True)
class Sample:
    """One record of the data, with where it came from.

    Attributes:
        index: the 0-based index in the data file, or in the list of records given.
        task_id: "taskN".
        texts: the record's texts field.
        where: "FILE: line N" or "sample N", for error messages.
    """

    index: int
    task_id: str
    texts: str
    where: str


@dataclass(frozen=True)
class Answer:
    """One bracketed answer of a sample.

    Attributes:
        text: the answer.
        k_shot: the lines before the answer's line (2..7).
        start: where the answer starts in the plain text, a character index.
        end: where it ends, exclusive.
    """

    text: str
    k_shot: int
    start: int
    end: int


@dataclass(frozen=True)
class ParsedSample:
    """A sample checked, with its plain text and answers.

    Attributes:
        sample: the sample.
        plain_text: the texts with each "[ answer ]" replaced by "answer".
        answers: the six answers, in order.
    """

    sample: Sample
    plain_text: str
    answers: tuple[Answer, ...]


def load_samples(path: str | Path) -> list[Sample]:
    """The records of a JSON-lines data file, one per line.

    Args:
        path: the data file.

    Returns:
        The samples, numbered by line.

    Raises:
        EvalError: the file cannot be read or a line is not a record, naming the file and line.
    """
    try:
        records = read_jsonl(path)
    except DatasetError as error:
        raise EvalError(str(error)) from None
    return [Sample(i, r["task_id"], r["texts"], f"{path}: line {i + 1}") for i, r in enumerate(records)]


def as_samples(records) -> list[Sample]:
    """Records as samples.

    Args:
        records: Samples, kept as they are, or {"task_id", "texts"} dicts, numbered by their position in the list.

    Returns:
        The samples.

    Raises:
        EvalError: a record is neither, naming its position.
    """
    samples = []
    for i, record in enumerate(records):
        if isinstance(record, Sample):
            samples.append(record)
        elif isinstance(record, dict) and all(isinstance(record.get(key), str) for key in ("task_id", "texts")):
            samples.append(Sample(i, record["task_id"], record["texts"], f"sample {i}"))
        else:
            raise EvalError(f"sample {i}: expected a dict with string fields 'task_id' and 'texts'")
    return samples


def parse_sample(sample: Sample) -> ParsedSample:
    """The plain text and the six answers of a sample.

    Args:
        sample: the sample.

    Returns:
        The parsed sample.

    Raises:
        EvalError: the sample is not 8 lines with one "[ answer ]" ending each of lines 3-8.
    """
    n_lines = len(sample_lines(sample.texts))
    if n_lines != LINES_PER_SAMPLE:
        raise EvalError(f"{sample.where}: the sample has {n_lines} lines, expected {LINES_PER_SAMPLE}")
    try:
        plain_text, spans = unbracket(sample.texts)
    except ValueError as error:
        raise EvalError(f"{sample.where}: {error}") from None
    if not spans:
        raise EvalError(f"{sample.where}: no '[ answer ]' in the sample (lines 3-8 must each end with one)")
    answers = tuple(Answer(text, k_shot, start, end) for start, end, text, k_shot in spans)
    answer_lines = [a.k_shot + 1 for a in answers]
    if answer_lines != [k + 1 for k in K_SHOTS]:
        raise EvalError(f"{sample.where}: '[ answer ]' on lines {answer_lines}, expected one on each of lines 3-8")
    return ParsedSample(sample, plain_text, answers)


# --------------------------------------------------------------------------------------------------
# Tokens: find each answer's tokens through the tokenizer's character offsets
@dataclass(frozen=True)
class EncodedSample:
    """A parsed sample as token ids, with where each answer's tokens are.

    Attributes:
        parsed: the parsed sample.
        token_ids: the plain text's tokens.
        answer_tokens: per answer, its token positions [start, end).
    """

    parsed: ParsedSample
    token_ids: list[int]
    answer_tokens: tuple[tuple[int, int], ...]


def encode_sample(parsed: ParsedSample, model: HookedDCFormer, checkpoint: str) -> EncodedSample:
    """A parsed sample's tokens and each answer's token positions, found through character offsets.

    Args:
        parsed: the parsed sample.
        model: the model, whose tokenizer and context length are used.
        checkpoint: the checkpoint's name, for error messages.

    Returns:
        The encoded sample.

    Raises:
        EvalError: the tokenizer gives no offsets, the sample is longer than the context, a token id is outside the
            vocabulary, or an answer cannot be located in the tokens.
    """
    tokenizer = model.tokenizer
    try:
        encoding = tokenizer(parsed.plain_text, return_offsets_mapping=True)
    except NotImplementedError:
        raise EvalError(f"{checkpoint}: its tokenizer gives no character offsets (a fast one is needed)") from None
    token_ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    where = parsed.sample.where
    if len(token_ids) > model.cfg.n_ctx:
        raise EvalError(
            f"{where}: the sample is {len(token_ids)} tokens, longer than the context of "
            f"{checkpoint} ({model.cfg.n_ctx} tokens)"
        )
    if max(token_ids) >= model.cfg.d_vocab:
        raise EvalError(
            f"{checkpoint}: its tokenizer gives token id {max(token_ids)}, outside the model's "
            f"vocabulary of {model.cfg.d_vocab}"
        )
    answer_tokens = []
    for answer in parsed.answers:
        try:
            answer_tokens.append(locate_answer_tokens(parsed.plain_text, offsets, answer))
        except ValueError as error:
            raise EvalError(
                f"{where}: answer {answer.text!r} (line {answer.k_shot + 1}) cannot be located with "
                f"the tokenizer of {checkpoint}: {error}"
            ) from None
    return EncodedSample(parsed, token_ids, tuple(answer_tokens))


def locate_answer_tokens(plain_text: str, offsets: list[tuple[int, int]], answer: Answer) -> tuple[int, int]:
    """The positions [start, end) of the tokens whose characters overlap the answer's.

    A token may reach past the answer only over whitespace (a BPE's " burger" starts at the space).

    Args:
        plain_text: the sample's plain text.
        offsets: each token's character span (start, end) in the plain text.
        answer: the answer.

    Returns:
        (start, end), token positions.

    Raises:
        ValueError: no token covers the answer, its tokens are not contiguous or include other text, or it is the
            first token (nothing predicts it).
    """
    overlapping = [i for i, (start, end) in enumerate(offsets) if start < answer.end and end > answer.start]
    if not overlapping:
        raise ValueError("no token covers it")
    first, last = overlapping[0], overlapping[-1]
    if overlapping != list(range(first, last + 1)):
        raise ValueError("its tokens are not contiguous")
    outside = plain_text[offsets[first][0] : answer.start] + plain_text[answer.end : offsets[last][1]]
    if outside.strip():
        token_text = plain_text[offsets[first][0] : offsets[last][1]]
        raise ValueError(f"its tokens {token_text!r} include text outside the answer")
    if first == 0:
        raise ValueError("it is the first token, so nothing predicts it")
    return first, last + 1


# --------------------------------------------------------------------------------------------------
# Scoring
@dataclass(frozen=True)
class AnswerScore:
    """How the model did on one answer.

    Attributes:
        predicted: the argmax tokens at the answer's positions, decoded.
        correct: every answer token is the argmax.
        nll: the negative log-likelihood, summed over the answer's tokens.
        n_tokens: the answer's tokens.
    """

    predicted: str
    correct: bool
    nll: float
    n_tokens: int


def score_answer(logits: torch.Tensor, token_ids: list[int], positions: tuple[int, int], tokenizer) -> AnswerScore:
    """Scores the answer at token `positions` from a sample's logits: token i is predicted at i - 1.

    Args:
        logits: one sample's logits [pos, vocab].
        token_ids: the sample's tokens.
        positions: the answer's token positions [start, end).
        tokenizer: decodes the predicted tokens.

    Returns:
        The answer's score.
    """
    import torch

    start, end = positions
    targets = torch.tensor(token_ids[start:end], device=logits.device)
    logprobs = logits[start - 1 : end - 1].float().log_softmax(-1)
    nll = -logprobs.gather(-1, targets[:, None]).sum()
    predicted_ids = logprobs.argmax(-1)
    return AnswerScore(
        predicted=tokenizer.decode(predicted_ids.tolist()).strip(),
        correct=bool((predicted_ids == targets).all()),
        nll=float(nll),
        n_tokens=end - start,
    )


def evaluate(
    model: HookedDCFormer, records, batch_size: int = 8, name: str | None = None, progress: bool = True
) -> pd.DataFrame:
    """Scores every answer of the records: one forward pass per sample, in right-padded batches of similar length.

    Under `torchrun` / `accelerate launch` (an initialised torch.distributed group), each process scores every
    world_size-th batch and all of them return the whole frame: the batches are the ones a single process forms, so
    the rows are those one process computes (`dcinterp.distributed`).

    Args:
        model: the model, with its tokenizer.
        records: Samples or {"task_id", "texts"} dicts.
        batch_size: samples per forward pass.
        name: the checkpoint column's value; None: the model's name.
        progress: show a progress bar.

    Returns:
        One row per answer, columns RESULT_COLUMNS.

    Raises:
        EvalError: the model has no tokenizer, or a sample cannot be scored (`encode_all`).
    """
    import torch

    from ..distributed import gather, in_order, my_batches

    name = name or model.cfg.model_name
    encoded = encode_all(model, records, name)
    pad_id = pad_token_id(model)
    batches = sample_batches(encoded, batch_size)
    mine = my_batches(len(batches))
    scores: dict[int, list[AnswerScore]] = {}
    total = sum(len(batches[i]) for i in mine)
    with torch.inference_mode(), tqdm(total=total, desc=name, unit="sample", disable=not progress) as bar:
        for i in mine:
            logits = model(padded_tokens([encoded[j].token_ids for j in batches[i]], pad_id))
            scores.update(score_batch(model, encoded, batches[i], logits))
            bar.update(len(batches[i]))
    return results_frame(name, encoded, in_order(gather(scores), len(encoded), "sample"))


def sample_batches(encoded: list[EncodedSample], batch_size: int) -> list[list[int]]:
    """The samples' indices in batches, longest first.

    So each batch pads little and a too-large batch fails at once. Every process of a distributed run forms the same
    batches.

    Args:
        encoded: the encoded samples.
        batch_size: samples per batch.

    Returns:
        The batches, each a list of indices into `encoded`.
    """
    by_length = sorted(range(len(encoded)), key=lambda i: -len(encoded[i].token_ids))
    return [by_length[start : start + batch_size] for start in range(0, len(by_length), batch_size)]


def pad_token_id(model: HookedDCFormer) -> int:
    """The token that pads a batch.

    Args:
        model: the model, with its tokenizer.

    Returns:
        The tokenizer's pad token, else 0.
    """
    return model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else 0


def score_batch(
    model: HookedDCFormer, encoded: list[EncodedSample], batch: list[int], logits: torch.Tensor
) -> dict[int, list[AnswerScore]]:
    """Each sample's answers scored from its row of a batch's logits.

    Args:
        model: the model, whose tokenizer decodes the predictions.
        encoded: the encoded samples.
        batch: the indices into `encoded` of the batch's rows.
        logits: the batch's logits [batch, pos, vocab].

    Returns:
        Per sample index, its answers' scores.
    """
    scores = {}
    for row, i in enumerate(batch):
        sample = encoded[i]
        scores[i] = [
            score_answer(logits[row], sample.token_ids, positions, model.tokenizer)
            for positions in sample.answer_tokens
        ]
    return scores


def evaluate_naive(model: HookedDCFormer, records, name: str | None = None) -> pd.DataFrame:
    """The reference for `evaluate`: one forward pass per answer, over the tokens up to the answer's end only.

    Args:
        model: the model, with its tokenizer.
        records: Samples or {"task_id", "texts"} dicts.
        name: the checkpoint column's value; None: the model's name.

    Returns:
        One row per answer, columns RESULT_COLUMNS.

    Raises:
        EvalError: as `evaluate`.
    """
    import torch

    name = name or model.cfg.model_name
    encoded = encode_all(model, records, name)
    scores = []
    with torch.inference_mode():
        for sample in encoded:
            sample_scores = []
            for positions in sample.answer_tokens:
                prefix = torch.tensor([sample.token_ids[: positions[1]]])
                logits = model(prefix)[0]
                sample_scores.append(score_answer(logits, sample.token_ids, positions, model.tokenizer))
            scores.append(sample_scores)
    return results_frame(name, encoded, scores)


def encode_all(model: HookedDCFormer, records, checkpoint: str) -> list[EncodedSample]:
    """Checks every sample and finds its answers' tokens, before any forward pass.

    Args:
        model: the model, with its tokenizer.
        records: Samples or {"task_id", "texts"} dicts.
        checkpoint: the checkpoint's name, for error messages.

    Returns:
        The encoded samples, in order.

    Raises:
        EvalError: the model has no tokenizer, or a sample is malformed or cannot be tokenized.
    """
    if model.tokenizer is None:
        raise EvalError(f"{checkpoint}: the checkpoint has no tokenizer (tokenizer.json), which evaluation needs")
    return [encode_sample(parse_sample(sample), model, checkpoint) for sample in as_samples(records)]


def padded_tokens(sequences: list[list[int]], pad_id: int) -> torch.Tensor:
    """Token sequences right-padded into one tensor.

    Args:
        sequences: token ids, one list per sample.
        pad_id: the padding token.

    Returns:
        The tokens [batch, pos].
    """
    import torch

    width = max(len(s) for s in sequences)
    return torch.tensor([s + [pad_id] * (width - len(s)) for s in sequences])


def results_frame(checkpoint: str, encoded: list[EncodedSample], scores: list[list[AnswerScore]]) -> pd.DataFrame:
    """The scores as a frame, one row per answer.

    Args:
        checkpoint: the checkpoint column's value.
        encoded: the encoded samples.
        scores: per sample, its answers' scores, in the order of `encoded`.

    Returns:
        The rows, columns RESULT_COLUMNS.
    """
    catalog = load_catalog()
    rows = []
    for sample, sample_scores in zip(encoded, scores, strict=True):
        qk_pattern, ov_transformation = task_labels(catalog, sample.parsed.sample.task_id)
        for answer, score in zip(sample.parsed.answers, sample_scores, strict=True):
            rows.append(
                {
                    "checkpoint": checkpoint,
                    "sample": sample.parsed.sample.index,
                    "task": sample.parsed.sample.task_id,
                    "qk_pattern": qk_pattern,
                    "ov_transformation": ov_transformation,
                    "k_shot": answer.k_shot,
                    "answer": answer.text,
                    "predicted": score.predicted,
                    "correct": score.correct,
                    "nll": score.nll,
                    "n_tokens": score.n_tokens,
                }
            )
    return pd.DataFrame(rows, columns=RESULT_COLUMNS)


def task_labels(catalog: Catalog, task_id: str) -> tuple[str, str]:
    """The QK pattern and OV transformation of a task.

    Args:
        catalog: the task catalog.
        task_id: "taskN".

    Returns:
        (qk_pattern, ov_transformation); "unknown" for a task the catalog does not have.
    """
    task = catalog.tasks.get(task_id)
    return (task.qk_pattern, task.ov_transformation) if task else ("unknown", "unknown")


# --------------------------------------------------------------------------------------------------
# Summary
PPL_POOLINGS = ("token", "answer", "answer-nll")


def perplexity(rows: pd.DataFrame, pooling: str = "token") -> float:
    """Perplexity of the answers in `rows`.

    Args:
        rows: per-answer results with columns nll (summed per answer) and n_tokens.
        pooling: "token": pooled over answer tokens; "answer": the mean of per-answer perplexities; "answer-nll": exp
            of the mean per-answer mean NLL.

    Returns:
        The perplexity.

    Raises:
        ValueError: an unknown pooling.
    """
    if pooling == "token":
        return math.exp(rows["nll"].sum() / rows["n_tokens"].sum())
    per_answer = rows["nll"] / rows["n_tokens"]
    if pooling == "answer":
        return float(per_answer.map(math.exp).mean())
    if pooling == "answer-nll":
        return math.exp(per_answer.mean())
    raise ValueError(f"ppl pooling must be one of {PPL_POOLINGS}, not {pooling!r}")


def summarize(results: pd.DataFrame, ppl_pooling: str = "token") -> dict:
    """Accuracy and perplexity per checkpoint.

    Args:
        results: per-answer results, from `evaluate`.
        ppl_pooling: the pooling of "ppl", one of PPL_POOLINGS.

    Returns:
        Per checkpoint: accuracy, ppl, ppl_pooling, ppl_by_pooling (every pooling), and accuracy by K, task, QK
        pattern and OV transformation.

    Raises:
        ValueError: an unknown pooling.
    """
    if ppl_pooling not in PPL_POOLINGS:
        raise ValueError(f"ppl pooling must be one of {PPL_POOLINGS}, not {ppl_pooling!r}")
    summary = {}
    for checkpoint, rows in results.groupby("checkpoint", sort=False):
        summary[checkpoint] = {
            "accuracy": float(rows["correct"].mean()),
            "ppl": perplexity(rows, ppl_pooling),
            "ppl_pooling": ppl_pooling,
            "ppl_by_pooling": {pooling: perplexity(rows, pooling) for pooling in PPL_POOLINGS},
            "by_k": accuracy_by(rows, "k_shot"),
            "by_task": accuracy_by(rows, "task"),
            "by_qk_pattern": accuracy_by(rows, "qk_pattern"),
            "by_ov_transformation": accuracy_by(rows, "ov_transformation"),
        }
    return summary


def accuracy_by(rows: pd.DataFrame, column: str) -> dict[str, float]:
    """Accuracy per value of a column, in the order the values first appear.

    Args:
        rows: per-answer results.
        column: the column to group by.

    Returns:
        Accuracy by value.
    """
    return {str(value): float(group["correct"].mean()) for value, group in rows.groupby(column, sort=False)}


# --------------------------------------------------------------------------------------------------
# The data file
def resolve_data_path(data: str) -> Path:
    """The data file a command names.

    Args:
        data: "released" (the packaged dataset) or a path.

    Returns:
        The file's path.

    Raises:
        EvalError: no such file.
    """
    if data == "released":
        return data_dir() / RELEASED_DATA
    path = Path(data).expanduser()
    if not path.is_file():
        raise EvalError(f"{data}: no such data file")
    return path
