"""Argument checks shared by the analysis functions: one-line ValueErrors that name the argument and its range,
and words resolved to token ids (with the piece rule stated) where a tokenizer is attached."""

from __future__ import annotations

import operator
from typing import Literal

import torch
from torch import Tensor

Piece = Literal["only", "first", "last"]


def check_index(value, n: int, name: str, what: str) -> int:
    """An integer index in -n..n-1, as 0..n-1.

    Args:
        value: a Python, numpy or 0-d tensor integer (not a bool).
        n: the number of items.
        name: the argument named in the error.
        what: the items, named in the error ("layers", "heads").

    Returns:
        The index in 0..n-1.

    Raises:
        ValueError: one line naming `name` and the valid range.
    """
    if isinstance(value, bool) or isinstance(value, Tensor) and value.numel() != 1:
        raise TypeError(f"{name} must be an integer index, not {value!r}")
    try:
        index = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer index, not {value!r}") from None
    if not -n <= index < n:
        raise ValueError(f"{name}={value!r} is out of range: the model has {what} 0..{n - 1}")
    return index % n


def check_layer(model, layer: int, name: str = "layer") -> int:
    """`layer` as a non-negative index.

    Args:
        model: the model.
        layer: the layer; negative counts from the end.
        name: the argument named in the error.

    Returns:
        The layer in 0..n_layers-1.

    Raises:
        ValueError: one line naming the valid range.
    """
    return check_index(layer, model.cfg.n_layers, name, "layers")


def check_head(model, head: int, name: str = "head") -> int:
    """`head` as a non-negative index.

    Args:
        model: the model.
        head: the head; negative counts from the end.
        name: the argument named in the error.

    Returns:
        The head in 0..n_heads-1.

    Raises:
        ValueError: one line naming the valid range.
    """
    return check_index(head, model.cfg.n_heads, name, "heads")


def check_position(position, n_pos: int, name: str = "position") -> Tensor | int:
    """Positions as non-negative indices into a prompt of `n_pos` tokens.

    Args:
        position: an int or a tensor of them; negative counts from the end.
        n_pos: the prompt's length.
        name: the argument named in the error.

    Returns:
        An int, or a tensor of positions.

    Raises:
        ValueError: not integers, or out of range.
    """
    values = torch.as_tensor(position)
    if values.dtype.is_floating_point or values.numel() == 0:
        raise ValueError(f"{name} must be integer positions, not {position!r}")
    if not ((values >= -n_pos) & (values < n_pos)).all():
        raise ValueError(f"{name}={position!r} is out of range: the prompt has positions 0..{n_pos - 1}")
    return int(values) % n_pos if values.ndim == 0 else values % n_pos


def check_key_before_query(query_pos: int, key_pos: int) -> None:
    """Check that a key position is one the query attends to.

    Args:
        query_pos: the query's position.
        key_pos: the key's position.

    Raises:
        ValueError: the key comes after the query.
    """
    if key_pos > query_pos:
        raise ValueError(f"key_pos={key_pos} comes after query_pos={query_pos}: a query attends only to keys <= it")


def check_token_ids(ids, d_vocab: int, name: str = "target") -> None:
    """Check that `ids` are token ids of a vocabulary of `d_vocab`.

    Args:
        ids: an int or a tensor of them.
        d_vocab: the vocabulary's size.
        name: the argument named in the error.

    Raises:
        ValueError: not integers, or out of the vocabulary.
    """
    values = torch.as_tensor(ids)
    if values.dtype.is_floating_point or not ((values >= 0) & (values < d_vocab)).all():
        raise ValueError(f"{name}={ids!r} is not a token id: the vocabulary has ids 0..{d_vocab - 1}")


def word_pieces(tokenizer, word: str) -> list[int]:
    """The token ids of `word` as it appears after a space, without special tokens.

    Args:
        tokenizer: a Hugging Face tokenizer.
        word: the word (" burger": "Ġburger" for byte-level BPE, "burger" for the word-level tokenizer).

    Returns:
        Its token ids.
    """
    return tokenizer(" " + word.strip(), add_special_tokens=False)["input_ids"]


def word_token(model, word: str, piece: Piece = "only", name: str = "word") -> int:
    """The one token id of `word`.

    Args:
        model: the model, with a tokenizer.
        word: the word, as it appears after a space.
        piece: "only" (a word that splits into several tokens is an error), "first" (what a model predicts first)
            or "last" (the position that has read the whole word).
        name: the argument named in the error.

    Returns:
        The token id.

    Raises:
        ValueError: no tokenizer, a word not in the vocabulary, a split word with piece="only", or a bad `piece`.
    """
    if model.tokenizer is None:
        raise ValueError(f"{name}={word!r} is a word, but the model has no tokenizer: pass a token id")
    ids = word_pieces(model.tokenizer, word)
    unk = model.tokenizer.unk_token_id
    if not ids or (unk is not None and unk in ids):
        raise ValueError(f"{name}={word!r} is not in the tokenizer's vocabulary")
    if len(ids) > 1 and piece == "only":
        pieces = model.tokenizer.convert_ids_to_tokens(ids)
        raise ValueError(f"{name}={word!r} splits into {len(ids)} tokens {pieces}: pass a token id or one piece")
    if piece not in ("only", "first", "last"):
        raise ValueError(f"piece must be 'only', 'first' or 'last', not {piece!r}")
    return ids[-1] if piece == "last" else ids[0]


def find_word(model, tokens, word: str, occurrence: int = -1, name: str = "word") -> int:
    """Position of the last piece of `word` in one prompt's tokens.

    Looks for the word's pieces after a space, then without one (a word at the start of a line).

    Args:
        model: the model, with a tokenizer.
        tokens: one prompt's token ids [pos].
        word: the word.
        occurrence: which appearance, as a list index (-1: the last).
        name: the argument named in the error.

    Returns:
        The position.

    Raises:
        ValueError: no tokenizer, a word that does not occur, or no such occurrence.
    """
    if model.tokenizer is None:
        raise ValueError(f"{name}={word!r} is a word, but the model has no tokenizer: pass a position")
    ids = torch.as_tensor(tokens).flatten().tolist()
    bare = model.tokenizer(word.strip(), add_special_tokens=False)["input_ids"]
    ends = []
    for pieces in (word_pieces(model.tokenizer, word), bare):
        n = len(pieces)
        ends += [i + n - 1 for i in range(len(ids) - n + 1) if n and ids[i : i + n] == pieces]
    ends = sorted(set(ends))
    if not ends:
        raise ValueError(f"{name}={word!r} does not occur in the prompt")
    if not -len(ends) <= occurrence < len(ends):
        raise ValueError(f"{name}={word!r} occurs {len(ends)} times, there is no occurrence {occurrence}")
    return ends[occurrence]


# --------------------------------------------------------------------------------------------------
# Non-finite numbers: a refusal that says where they appeared
class NonFiniteError(FloatingPointError):
    """An analysis met a NaN or an infinity; the message names the hook (and layer) where it first appeared."""


def first_nonfinite(model, run) -> str | None:
    """Where a non-finite number first appears when `run()` runs with every hook point watched.

    The first activation in forward order, else the first gradient in backward order (the backward runs from the last
    layer down, so that is where it started).

    Args:
        model: the model.
        run: a forward, and a backward if it takes one.

    Returns:
        The hook (and layer), or None if nowhere.
    """
    found: list[str] = []

    def watch(x, hook):
        if not isinstance(x, Tensor) or not x.is_floating_point():
            return x
        if not found and not torch.isfinite(x).all():
            found.append(f"the activation at {hook.name}")
        if x.requires_grad:

            def on_grad(g, name=hook.name):
                if not found and not torch.isfinite(g).all():
                    found.append(f"the gradient at {name}")

            x.register_hook(on_grad)
        return x

    with model.hooks(fwd_hooks=[(lambda name: True, watch)]):
        run()
    return found[0] if found else None


def check_finite(model, values: dict[str, Tensor], what: str, run) -> None:
    """Refuse NaN or infinite values, naming where the first non-finite number appeared.

    Args:
        model: the model.
        values: {argument name: tensor}.
        what: the analysis, named in the error.
        run: runs again what computed `values`, to find the place with every hook watched (see `first_nonfinite`).

    Raises:
        NonFiniteError: one of `values` is not finite.
    """
    bad = [name for name, value in values.items() if not torch.isfinite(torch.as_tensor(value)).all()]
    if not bad:
        return
    where = first_nonfinite(model, run)
    dtype = getattr(model.cfg, "dtype", None)
    place = f"it first appears in {where}" if where else "a run with every hook watched did not meet it"
    advice = (
        "float16 overflows past 65504: load the model in bfloat16 or float32"
        if dtype == torch.float16
        else "load the model in float32"
    )
    raise NonFiniteError(f"{what}: {bad[0]} is not finite in {dtype}; {place}; {advice}")


# --------------------------------------------------------------------------------------------------
# Batches of prompts
def check_tokens(model, tokens, name: str = "tokens") -> Tensor:
    """Token ids as a [batch, pos] tensor on the model's input device.

    Args:
        model: the model.
        tokens: ids [batch, pos], or [pos] for one prompt.
        name: the argument named in the error.

    Returns:
        [batch, pos].

    Raises:
        ValueError: no prompts or no positions, not 1-d or 2-d, or ids out of the vocabulary.
        TypeError: not integers.
    """
    try:
        values = torch.as_tensor(tokens)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(
            f"{name} must be token ids (a tensor [batch, pos]), not {type(tokens).__name__}: {error}"
        ) from None
    if values.dtype.is_floating_point or values.dtype == torch.bool or values.is_complex():
        raise TypeError(f"{name} must be integer token ids, not {values.dtype}")
    if values.ndim == 1:
        values = values[None]
    if values.ndim != 2:
        raise ValueError(f"{name} must be [batch, pos] token ids, not a tensor of shape {tuple(values.shape)}")
    if values.shape[0] == 0 or values.shape[1] == 0:
        raise ValueError(
            f"{name} is empty ({values.shape[0]} prompts of {values.shape[1]} tokens): pass at least one prompt"
        )
    d_vocab = model.cfg.d_vocab
    if not ((values >= 0) & (values < d_vocab)).all():
        raise ValueError(f"{name} holds ids outside the vocabulary 0..{d_vocab - 1}")
    return values.to(model.input_device)


def real_lengths(model, tokens: Tensor, lengths=None, name: str = "lengths") -> Tensor:
    """How many real tokens each prompt of a right-padded batch has.

    Args:
        model: the model.
        tokens: [batch, pos].
        lengths: the lengths as given (checked); None: every position up to the prompt's trailing run of the
            tokenizer's pad token. A model without a tokenizer or a tokenizer without a pad token: every position is
            real; pass `lengths`, e.g. `pairs.position + 1`.
        name: the argument named in the error.

    Returns:
        [batch].

    Raises:
        ValueError: bad `lengths`.
    """
    batch, n_pos = tokens.shape
    if lengths is not None:
        values = torch.as_tensor(lengths)
        if values.dtype.is_floating_point or values.shape != (batch,) or not ((values >= 1) & (values <= n_pos)).all():
            raise ValueError(f"{name} must hold one length in 1..{n_pos} per prompt ({batch} prompts), not {lengths!r}")
        return values.to(tokens.device)
    pad = getattr(model.tokenizer, "pad_token_id", None)
    if pad is None:
        return torch.full((batch,), n_pos, device=tokens.device)
    trailing = (tokens == pad).flip(-1).long().cumprod(-1).sum(-1)
    values = n_pos - trailing
    if (values == 0).any():
        raise ValueError(f"{name}: prompt {int((values == 0).nonzero()[0])} is all padding")
    return values


# --------------------------------------------------------------------------------------------------
# Positions in one prompt
def prompt_position(model, prompt: Tensor, pos: int | str, name: str) -> int:
    """A position of one prompt given as an index or a word, checked.

    Args:
        model: The model whose tokenizer reads a word.
        prompt: One prompt's token ids [1, pos].
        pos: An index (negative counts from the end) or a word (the last piece of its last occurrence).
        name: The argument's name in the one-line ValueError.

    Returns:
        The position as a non-negative index.
    """
    if isinstance(pos, str):
        return find_word(model, prompt[0], pos, name=name)
    return check_position(pos, prompt.shape[1], name)
