"""TransformerLens' model API for HookedDCFormer: stacked weights, circuits, tokenizer helpers, generation.

`HookedDCFormer` (dcinterp.model) inherits these from `TransformerLensAPI`, under TransformerLens' names, so that
code written for a `HookedTransformer` runs on DCFormer: `model.W_Q[l, h]`, `model.OV`, `model.to_tokens(text)`,
`model.generate(prompt)`. dcinterp.model holds the model itself (the config-to-logits path of the paper's Eq. 4-8).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from .kv_cache import DCFormerKeyValueCache
from .processing import PROCESSING_OPTIONS

if TYPE_CHECKING:
    from .model import HookedDCFormer


class TransformerLensAPI:
    """The TransformerLens accessors of `HookedDCFormer` (a mixin: it reads `self.cfg`, `self.blocks`, ...)."""

    def tl_named_parameters(self):
        """TransformerBridge's name for the parameters under TransformerLens names (what ours already are)."""
        return self.named_parameters()

    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        return self.embed.W_E

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        return self.unembed.W_U

    @property
    def b_U(self) -> Float[Tensor, " d_vocab"]:
        """`unembed.b_U`: zeros (neither DCFormer nor Pythia has one) until `fold_ln` folds the final norm's bias."""
        return self.unembed.b_U

    def _stack(self, name: str, part: str = "attn") -> Tensor:
        """One weight of every block's `attn` or `mlp`, stacked [layer, ...]; a bias the model lacks as zeros."""
        weights = [getattr(getattr(block, part), name) for block in self.blocks]
        if weights[0] is None:
            return torch.zeros(len(weights), *self._bias_shape(name), device=self.input_device, dtype=self.cfg.dtype)
        return torch.stack(weights)

    def _bias_shape(self, name: str) -> tuple[int, ...]:
        cfg = self.cfg
        return {
            "b_Q": (cfg.n_heads, cfg.d_head),
            "b_K": (cfg.n_heads, cfg.d_head),
            "b_V": (cfg.n_heads, cfg.d_head),
            "b_O": (cfg.d_model,),
            "b_in": (cfg.d_mlp,),
            "b_out": (cfg.d_model,),
        }[name]

    @property
    def W_Q(self) -> Float[Tensor, "layer head d_model d_head"]:
        return self._stack("W_Q")

    @property
    def W_K(self) -> Float[Tensor, "layer head d_model d_head"]:
        return self._stack("W_K")

    @property
    def W_V(self) -> Float[Tensor, "layer head d_model d_head"]:
        return self._stack("W_V")

    @property
    def W_O(self) -> Float[Tensor, "layer head d_head d_model"]:
        return self._stack("W_O")

    @property
    def b_Q(self) -> Float[Tensor, "layer head d_head"]:
        return self._stack("b_Q")

    @property
    def b_K(self) -> Float[Tensor, "layer head d_head"]:
        return self._stack("b_K")

    @property
    def b_V(self) -> Float[Tensor, "layer head d_head"]:
        return self._stack("b_V")

    @property
    def b_O(self) -> Float[Tensor, "layer d_model"]:
        return self._stack("b_O")

    @property
    def W_in(self) -> Float[Tensor, "layer d_model d_mlp"]:
        return self._stack("W_in", "mlp")

    @property
    def W_gate(self) -> Float[Tensor, "layer d_model d_mlp"] | None:
        """SwiGLU's gate projection (TransformerLens' name); None for a GELU MLP."""
        return self._stack("W_gate", "mlp") if self.cfg.act_fn == "swiglu" else None

    @property
    def W_out(self) -> Float[Tensor, "layer d_mlp d_model"]:
        return self._stack("W_out", "mlp")

    @property
    def b_in(self) -> Float[Tensor, "layer d_mlp"]:
        return self._stack("b_in", "mlp")

    @property
    def b_out(self) -> Float[Tensor, "layer d_model"]:
        return self._stack("b_out", "mlp")

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> Tensor:
        """Sum of the attention and MLP output biases written into the residual stream before `layer`.

        `ActivationCache.get_full_resid_decomposition` reads it.

        Args:
            layer: the layer whose input stream is meant.
            mlp_input: add layer `layer`'s attention bias too (the stream entering its MLP in a sequential block), as
                TransformerLens.
            include_mlp_biases: include the MLPs' output biases.

        Returns:
            [d_model].
        """
        if mlp_input and layer >= self.cfg.n_layers:
            raise ValueError(f"accumulated_bias: mlp_input needs layer < n_layers ({self.cfg.n_layers}), not {layer}")
        bias = self.b_O[:layer].sum(0)
        if include_mlp_biases:
            bias = bias + self.b_out[:layer].sum(0)
        if mlp_input:
            bias = bias + self.b_O[layer]
        return bias

    @property
    def QK(self):
        """QK circuits per layer and head as a FactoredMatrix [layer, head, d_model, d_model] (rotary ignored)."""
        from transformer_lens import FactoredMatrix

        return FactoredMatrix(self.W_Q, self.W_K.transpose(-2, -1))

    @property
    def OV(self):
        """OV circuits per layer and head as a FactoredMatrix [layer, head, d_model, d_model]."""
        from transformer_lens import FactoredMatrix

        return FactoredMatrix(self.W_V, self.W_O)

    def all_composition_scores(self, mode: Literal["Q", "K", "V"]):
        """TransformerLens' composition scores (Elhage et al., 2021) between every pair of heads.

        Entry [l1, h1, l2, h2] = ||OV_1 C_2||_F / (||OV_1||_F ||C_2||_F): how much head (l2, h2)'s query, key or
        value input reads what head (l1, h1) writes; 0 unless l1 < l2. From the static weights, computed by
        TransformerLens' own `composition_scores`: rotary, QK-norm and DCMHA's compose are not in it (heads of one
        layer mix through the compose: `dcinterp.composition`).

        Args:
            mode: "Q" (C = QK), "K" (C = QK^T) or "V" (C = OV).

        Returns:
            [layer, head, layer, head]: a TransformerLens 4 `CompositionScores` (a tensor that carries `head_labels`)
            where that exists, else the tensor, as TransformerLens 3 returns.
        """
        from transformer_lens.utilities import composition_scores

        if mode not in ("Q", "K", "V"):
            raise ValueError(f"all_composition_scores: mode must be 'Q', 'K' or 'V', not {mode!r}")
        left = self.OV
        right = self.QK if mode == "Q" else self.QK.T if mode == "K" else left
        scores = composition_scores(left, right, broadcast_dims=True)
        layer = torch.arange(self.cfg.n_layers, device=scores.device)
        scores = torch.where(layer[:, None, None, None] < layer[None, None, :, None], scores, 0.0)
        try:
            from transformer_lens.model_bridge.composition_scores import CompositionScores
        except ImportError:
            return scores
        return CompositionScores(scores, list(range(self.cfg.n_layers)), self.all_head_labels)

    @property
    def all_head_labels(self) -> list[str]:
        """["L0H0", "L0H1", ...], every head in order, as TransformerLens labels them."""
        return [f"L{layer}H{head}" for layer in range(self.cfg.n_layers) for head in range(self.cfg.n_heads)]

    def tokens_to_residual_directions(self, tokens) -> Tensor:
        """The columns of `W_U` for the tokens, as TransformerLens.

        Dotted with `cache.apply_ln_to_stack(...)` (the final norm applied with its weight, see
        `dcinterp.processing.DCActivationCache`) they give each component's share of the logit; the shares add up to the
        logit less `dcinterp.logit_offset(model)` (the final norm's bias through `W_U`, plus `b_U`).

        Args:
            tokens: token ids, a tensor of any shape, or a string of one token.

        Returns:
            [*tokens.shape, d_model].
        """
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        if isinstance(tokens, int):
            tokens = torch.tensor(tokens)
        tokens = torch.as_tensor(tokens)
        return self.W_U[:, tokens.to(self.W_U.device)].movedim(0, -1)

    # ----------------------------------------------------------------------------------------------
    # Tokenizer helpers (TransformerLens names)
    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer attached; pass token ids, or set model.tokenizer")
        return self.tokenizer

    def _padding_side(self, padding_side: Literal["left", "right"] | None = None) -> Literal["left", "right"]:
        """The side text is padded on: `padding_side`, else the tokenizer's, else "right" (as TransformerLens)."""
        return padding_side or getattr(self.tokenizer, "padding_side", None) or "right"

    def to_tokens(
        self,
        input: str | list[str],
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
        move_to_device: bool = True,
        truncate: bool = True,
        allow_unknown: bool | None = None,
    ) -> Int[Tensor, "b p"]:
        """Token ids [batch, pos], as TransformerLens.

        Words the tokenizer does not know raise a ValueError naming them (never a silent [UNK]). The inspection calls,
        `to_str_tokens` and `to_string` of text, always show them as [UNK], with a warning.

        Args:
            input: a string or a list of strings.
            prepend_bos: prepend BOS (None: only where the tokenizer adds it itself).
            padding_side: "left" or "right" (None: the tokenizer's).
            move_to_device: put the ids on the model's input device.
            truncate: cut to `cfg.n_ctx` tokens.
            allow_unknown: turn the error on unknown words into one warning line (None: `model.allow_unknown_tokens`,
                for code that calls to_tokens for you).

        Returns:
            [batch, pos].

        Raises:
            ValueError: words the tokenizer does not know, named.
        """
        ids = self._encode(input, prepend_bos, allow_unknown, "to_tokens")
        tokenizer = self.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        width = max(len(i) for i in ids)
        if self._padding_side(padding_side) == "left":
            ids = [[pad] * (width - len(i)) + i for i in ids]
        else:
            ids = [i + [pad] * (width - len(i)) for i in ids]
        tokens = torch.tensor(ids, dtype=torch.long)  # long also where the text has no tokens: [batch, 0]
        if truncate and tokens.shape[1] > self.cfg.n_ctx:
            warnings.warn(
                f"to_tokens: {tokens.shape[1]} tokens cut to the model's n_ctx = {self.cfg.n_ctx} "
                "(truncate=False keeps them all)",
                stacklevel=2,
            )
            tokens = tokens[:, : self.cfg.n_ctx]
        return tokens.to(self.input_device) if move_to_device else tokens

    def _encode(self, input: str | list[str], prepend_bos: bool | None, allow_unknown: bool | None, caller: str):
        """Each text's token ids, unpadded (BOS as `to_tokens`). Words the tokenizer does not know raise a ValueError,
        or with allow_unknown give one warning line, naming them and `caller`, the method the user called."""
        tokenizer = self._need_tokenizer()
        texts = [input] if isinstance(input, str) else list(input)
        if not texts:
            raise ValueError(f"{caller}: no text (an empty list)")
        prepend_bos = self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
        check_unknown = _has_unknown_token(tokenizer)
        encodings = [tokenizer(t, return_offsets_mapping=check_unknown) for t in texts]
        ids = [e["input_ids"] for e in encodings]
        if check_unknown:
            allow_unknown = self.allow_unknown_tokens if allow_unknown is None else allow_unknown
            _report_unknown(texts, encodings, tokenizer, allow_unknown, caller)
        if prepend_bos:
            bos = tokenizer.bos_token_id
            ids = [i if i[:1] == [bos] else [bos, *i] for i in ids]
        return ids

    def to_string(self, tokens) -> str | list[str]:
        """The text of token ids, as TransformerLens.

        Args:
            tokens: ids (a list or tensor; [batch, pos] gives one string per row), or text (a string, or a list of
                strings): then the text as the model reads it, words the tokenizer does not know shown as [UNK], with
                one warning line naming them.

        Returns:
            A string, or one per row.
        """
        tokenizer = self._need_tokenizer()
        if _is_text(tokens):
            texts = [tokenizer.decode(ids) for ids in self._encode(tokens, None, True, "to_string")]
            return texts[0] if isinstance(tokens, str) else texts
        if isinstance(tokens, Tensor):
            tokens = tokens.tolist()
        if isinstance(tokens, int):
            tokens = [tokens]
        if tokens and isinstance(tokens[0], list):
            return [tokenizer.decode(t) for t in tokens]
        return tokenizer.decode(tokens)

    def to_str_tokens(
        self, input, prepend_bos: bool | None = None, padding_side: Literal["left", "right"] | None = None
    ) -> list[str] | list[list[str]]:
        """One string per token, as TransformerLens.

        Words the tokenizer does not know show as [UNK], with one warning line naming them (`to_tokens`, which feeds the
        model, raises).

        Args:
            input: a string or 1-d ids (one list), a list (one list per item), or a [batch, pos] tensor or array (one
                list per row, where TransformerLens raises; a [1, pos] one gives a single list).
            prepend_bos: as `to_tokens`, for strings only.
            padding_side: as `to_tokens`, for strings only.

        Returns:
            A list of strings, or one per item.
        """
        tokenizer = self._need_tokenizer()
        if _is_text(input):
            rows = self._encode(input, prepend_bos, True, "to_str_tokens")
            if max(len(ids) for ids in rows) > self.cfg.n_ctx:  # cut as to_tokens cuts, as TransformerLens
                longest = max(len(ids) for ids in rows)
                warnings.warn(
                    f"to_str_tokens: {longest} tokens cut to the model's n_ctx = {self.cfg.n_ctx}", stacklevel=2
                )
                rows = [ids[: self.cfg.n_ctx] for ids in rows]
            pieces = [[tokenizer.decode([i]) for i in ids] for ids in rows]
            return pieces[0] if isinstance(input, str) else pieces
        if isinstance(input, list):
            return [self.to_str_tokens(item, prepend_bos, padding_side) for item in input]
        ids = torch.as_tensor(input)
        if ids.ndim == 2 and ids.shape[0] > 1:
            return [self.to_str_tokens(row) for row in ids]
        return [tokenizer.decode([i]) for i in ids.reshape(-1).tolist()]

    def get_token_position(
        self,
        single_token: str | int | Tensor,
        input: str | Tensor,
        mode: str = "first",
        prepend_bos: bool | None = None,
        padding_side: Literal["left", "right"] | None = None,
    ) -> int:
        """Position of a token in a string or a token tensor.

        Args:
            single_token: the token: a string of one token, or its id.
            input: a string or a [pos] / [1, pos] token tensor.
            mode: "first" or "last" occurrence.
            prepend_bos: as `to_tokens`, for a string input.
            padding_side: as `to_tokens`, for a string input.

        Returns:
            The position.

        Raises:
            ValueError: a bad shape or mode, or a token that does not occur.
        """
        tokens = self.to_tokens(input, prepend_bos, padding_side) if isinstance(input, str) else torch.as_tensor(input)
        if tokens.ndim == 2:
            if tokens.shape[0] != 1:
                raise ValueError(f"get_token_position: tokens of shape {tuple(tokens.shape)}; pass [pos] or [1, pos]")
            tokens = tokens[0]
        if mode not in ("first", "last"):
            raise ValueError(f"get_token_position: mode must be 'first' or 'last', not {mode!r}")
        if isinstance(single_token, str):
            single_token = self.to_single_token(single_token)
        positions = (tokens == int(single_token)).nonzero()[:, 0]
        if not len(positions):
            raise ValueError(f"get_token_position: token {int(single_token)} does not occur in the input")
        return int(positions[0] if mode == "first" else positions[-1])

    def to_single_str_token(self, int_token: int) -> str:
        """The string of one token id, as TransformerLens.

        Args:
            int_token: the id.

        Returns:
            Its string.

        Raises:
            ValueError: not an int.
        """
        if not isinstance(int_token, int):
            raise ValueError(f"to_single_str_token: an int token id, not {type(int_token).__name__}")
        return self.to_str_tokens(torch.tensor([int_token]))[0]

    def to_single_token(self, string: str) -> int:
        """The id of a string that is one token, as TransformerLens.

        Args:
            string: the string.

        Returns:
            Its id.

        Raises:
            ValueError: the string is several tokens.
        """
        ids = self.to_tokens(string)[0]
        if ids.numel() != 1:
            raise ValueError(f"{string!r} is {ids.numel()} tokens, not one")
        return int(ids.item())

    # ----------------------------------------------------------------------------------------------
    # Generation
    @torch.no_grad()
    def generate(
        self,
        input: str | list[str] | Int[Tensor, "b p"] = "",
        max_new_tokens: int = 10,
        stop_at_eos: bool = True,
        eos_token_id: int | list[int] | None = None,
        do_sample: bool = True,
        top_k: int | None = None,
        top_p: float | None = None,
        temperature: float = 1.0,
        freq_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        use_past_kv_cache: bool = True,
        prepend_bos: bool | None = None,
        return_type: Literal["input", "str", "tokens"] = "input",
        verbose: bool = False,
        attention_mask: Int[Tensor, "b p"] | None = None,
    ) -> str | list[str] | Int[Tensor, "b p"]:
        """Continue a prompt token by token, as TransformerLens' `generate` (same arguments and defaults).

        Hooks attached to the model (`with model.hooks(...)`, `add_hook`) are active at every step. With the key-value
        cache, a hook sees the prompt at the first step and then each new token's activations (its row of a [b, h, t, s]
        hook). Both ways give the same tokens (docs/generation.md).

        Args:
            input: a string, a list of strings (of different lengths: padded on the left) or token ids [batch, pos].
            max_new_tokens: tokens to add.
            stop_at_eos: a sequence that reaches an EOS token is padded with EOS, and generation stops when all have.
            eos_token_id: one id or several (None: the tokenizer's).
            do_sample: sample with TransformerLens' `sample_logits`; False: greedy.
            top_k: sample among the k most likely tokens.
            top_p: sample within this much probability mass.
            temperature: divides the logits before sampling.
            freq_penalty: lowers the logits of tokens by how often they occurred.
            repetition_penalty: lowers the logits of tokens that occurred.
            use_past_kv_cache: run the prompt once, then each new token alone against a `DCFormerKeyValueCache` (keys,
                values and the key side of DCMHA's compose); False: every step reruns the whole sequence.
            prepend_bos: as `to_tokens`, for text input.
            return_type: "input" (the input's kind), "str" or "tokens".
            verbose: a progress bar.
            attention_mask: 1 real, 0 padding [batch, pos], needed with a padded token tensor.

        Returns:
            The prompts with their continuations, as text or token ids.
        """
        from transformer_lens.utilities import sample_logits

        if isinstance(input, (str, list)):
            texts = [input] if isinstance(input, str) else list(input)
            tokens = self.to_tokens(texts, prepend_bos=prepend_bos, padding_side="left")
            lengths = torch.tensor([len(self.to_tokens(t, prepend_bos=prepend_bos)[0]) for t in texts])
            if (lengths < tokens.shape[1]).any():
                attention_mask = (torch.arange(tokens.shape[1]) >= tokens.shape[1] - lengths[:, None]).long()
        else:
            tokens = input.to(self.input_device)
            if tokens.ndim == 1:
                tokens = tokens[None]
        if tokens.shape[0] == 0 or tokens.shape[1] == 0:
            raise ValueError(
                f"generate: the prompt has no tokens (shape {tuple(tokens.shape)}); pass prepend_bos=True "
                "to start from BOS alone"
            )
        if attention_mask is None:  # given, so that the forward never reads pads off a left padding side
            attention_mask = torch.ones_like(tokens)
        else:
            attention_mask = attention_mask.to(tokens.device)
            if attention_mask.shape != tokens.shape:
                raise ValueError(
                    f"generate: attention_mask has shape {tuple(attention_mask.shape)}, the prompt "
                    f"{tuple(tokens.shape)}"
                )
        stop_tokens = None
        if stop_at_eos:
            if eos_token_id is None:
                eos_token_id = getattr(self.tokenizer, "eos_token_id", None)
                if eos_token_id is None:
                    raise ValueError(
                        "generate: stop_at_eos needs an eos_token_id (the model has no tokenizer with one)"
                    )
            stop_tokens = torch.tensor(
                [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=tokens.device
            )
        cache = None
        if use_past_kv_cache:
            cache = DCFormerKeyValueCache.init_cache(self.cfg, tokens.device, tokens.shape[0])
        finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        for step in tqdm(range(max_new_tokens), disable=not verbose):
            if cache is None:
                mask = F.pad(attention_mask, (0, tokens.shape[1] - attention_mask.shape[1]), value=1)
                final_logits = self(tokens, attention_mask=mask)[:, -1]
            elif step == 0:
                final_logits = self(tokens, attention_mask=attention_mask, past_kv_cache=cache)[:, -1]
            else:
                new_mask = torch.ones_like(tokens[:, -1:])
                final_logits = self(tokens[:, -1:], attention_mask=new_mask, past_kv_cache=cache)[:, -1]
            if do_sample:
                new = sample_logits(
                    final_logits,
                    top_k=top_k,
                    top_p=top_p,
                    temperature=temperature,
                    freq_penalty=freq_penalty,
                    repetition_penalty=repetition_penalty,
                    tokens=tokens,
                )
            else:
                new = final_logits.argmax(-1)
            new = new.to(tokens.device)
            if stop_tokens is not None:
                new = new.masked_fill(finished, stop_tokens[0])
                finished |= torch.isin(new, stop_tokens)
            tokens = torch.cat([tokens, new[:, None]], dim=1)
            if stop_tokens is not None and finished.all():
                break
        if return_type == "tokens" or (return_type == "input" and isinstance(input, Tensor)):
            return tokens
        n_pad = (attention_mask == 0).sum(1).tolist()  # the strings without the left padding
        strings = [self.to_string(row[pad:]) for row, pad in zip(tokens, n_pad, strict=True)]
        return strings[0] if isinstance(input, str) else strings

    @classmethod
    def from_pretrained_no_processing(cls, path_or_name, **kwargs) -> "HookedDCFormer":
        """TransformerLens' name for a load with the weights as released (what `from_pretrained` gives by default).

        Args:
            path_or_name: as `from_pretrained`.
            **kwargs: `from_pretrained`'s other arguments.

        Returns:
            The model.
        """
        for option in PROCESSING_OPTIONS:
            kwargs[option] = False
        return cls.from_pretrained(path_or_name, **kwargs)

    def process_weights_(
        self,
        fold_ln: bool = True,
        center_writing_weights: bool = True,
        center_unembed: bool = True,
        fold_value_biases: bool = True,
        refactor_factored_attn_matrices: bool = False,
    ):
        """TransformerLens' weight processing, in place (`dcinterp.processing.process_weights_`).

        Args:
            fold_ln: as `dcinterp.processing.process_weights_`.
            center_writing_weights: as `dcinterp.processing.process_weights_`.
            center_unembed: as `dcinterp.processing.process_weights_`.
            fold_value_biases: as `dcinterp.processing.process_weights_`.
            refactor_factored_attn_matrices: as `dcinterp.processing.process_weights_`.

        Returns:
            The model.
        """
        from .processing import process_weights_

        return process_weights_(
            self,
            fold_ln=fold_ln,
            center_writing_weights=center_writing_weights,
            center_unembed=center_unembed,
            fold_value_biases=fold_value_biases,
            refactor_factored_attn_matrices=refactor_factored_attn_matrices,
        )


def _is_text(input) -> bool:
    """A string, or a non-empty list of strings."""
    return isinstance(input, str) or (
        isinstance(input, list) and bool(input) and all(isinstance(i, str) for i in input)
    )


def _has_unknown_token(tokenizer) -> bool:
    """Whether unknown text can become an unknown token: a word-level vocabulary with its own [UNK] (byte-level BPE
    tokenizers such as Pythia's name <|endoftext|> as unk, bos and eos, and never produce it for unknown text)."""
    unk = tokenizer.unk_token_id
    return (
        unk is not None
        and unk not in (tokenizer.bos_token_id, tokenizer.eos_token_id)
        and getattr(tokenizer, "is_fast", False)
    )


def _report_unknown(texts: list[str], encodings, tokenizer, allow_unknown: bool, caller: str) -> None:
    """The words the tokenizer maps to its unknown token: a ValueError naming them, or one warning line."""
    unk = tokenizer.unk_token_id
    words = sorted(
        {
            text[a:b]
            for text, e in zip(texts, encodings, strict=True)
            for tid, (a, b) in zip(e["input_ids"], e["offset_mapping"], strict=True)
            if tid == unk
        }
    )
    if not words:
        return
    listed = ", ".join(repr(w) for w in words[:10]) + (f" and {len(words) - 10} more" if len(words) > 10 else "")
    message = f"{caller}: not in the tokenizer's vocabulary (they become {tokenizer.unk_token}): {listed}"
    if not allow_unknown:
        raise ValueError(message + "; pass allow_unknown=True to go on with a warning")
    warnings.warn(message, stacklevel=4)  # the user's call of to_tokens, to_str_tokens or to_string
