"""HookedDCFormer's components, one a file, as TransformerLens' `components`; `dcinterp.model` assembles them.

- `embed`, `unembed`: tokens to the stream and the stream to logits.
- `norms`: LayerNorm/RMSNorm (`Norm`) and QK-norm (`HeadRMSNorm`).
- `rotary`: the rotary tables and the rotation of q and k.
- `masks`: which keys a query sees, and the additive mask.
- `compose`: one Compose stage of DCMHA.
- `attention`: one attention layer (DCMHA or plain MHA).
- `mlp`: the MLP.
- `block`: one transformer block.
- `helpers`: the float32 floor and whether a hook point is read.

Eq. 4-8 beside each hook's name are in `dcinterp.model`'s docstring.
"""
