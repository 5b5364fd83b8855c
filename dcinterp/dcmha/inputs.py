"""What every path of one attention call takes: `AttentionInputs`."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

Stage = tuple[Tensor | None, ...]  # (qw1, qw2, kw1, kw2, qg, kg), None for a branch that is off


@dataclass
class AttentionInputs:
    """One attention call's inputs, as the model gives them to `dcinterp.dcmha.attend`.

    Index names: b batch, t queries, s keys (cached ones first), h heads, e head dim, r rank.

    Attributes:
        q: the queries [b, t, h, e], after the QK-norm and rotary.
        k: the keys [b, s, h, e], after the QK-norm and rotary.
        v: the values [b, s, h, e].
        mask: additive, [t, s] or [b, 1, t, s]: 0 where a query sees a key, else the dtype's minimum.
        pre: the pre-compose's dynamic weights after their hooks, or None for a stage that is off (and for MHA).
        post: the post-compose's, the same.
        window: a local layer's window, None for a global layer.
        official: the "official-inference" window semantics (window + 1 keys), else "training".
        real: [b, s], False at padded keys; None where the mask alone says which keys are hidden ([t, s]: no
            padding; [b, 1, t, s] with `real` None: padding said by the mask alone).
        key_last: the key side of `pre` and `post` as the key-value cache holds it, kw1 and kw2 [b, r, h, s] and
            kg [b, h, s]; else as the hooks hold it, kw1 and kw2 [b, s, r, h] and kg [b, s, h]. The query side is
            always qw1, qw2 [b, t, r, h] and qg [b, t, h].
    """

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Tensor
    pre: Stage | None
    post: Stage | None
    window: int | None
    official: bool
    real: Tensor | None = None
    key_last: bool = False

    @property
    def past(self) -> int:
        """The cached positions before the queries."""
        return self.k.shape[1] - self.q.shape[1]

    def stages(self, key_last: bool) -> tuple[Stage | None, Stage | None]:
        """(pre, post) with the key side in the layout asked for (views of the weights given, no copy).

        Args:
            key_last: as the cache holds the key side, else as the hooks do (`key_last` of this class).

        Returns:
            The two stages, None for a stage that is off.
        """
        if key_last == self.key_last:
            return self.pre, self.post
        source, destination = (1, -1) if key_last else (-1, 1)
        return tuple(
            None
            if stage is None
            else (*stage[:2], *(None if w is None else w.movedim(source, destination) for w in stage[2:4]), stage[4],
                  None if stage[5] is None else stage[5].movedim(source, destination))
            for stage in (self.pre, self.post)
        )  # fmt: skip
