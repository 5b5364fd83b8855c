"""SAELens (optional extra `saelens`) on HookedDCFormer: tiny SAEs trained from raw text with
`LanguageModelSAETrainingRunner(..., override_model=model)` on a residual hook, `hook_z` and a compose dynamic
weight (`post_compose.hook_kw1`), then spliced into the model with `run_with_hooks`.

SAELens pins TransformerLens < 4, so this runs in an environment of its own (`pip install 'dcinterp[saelens]'`);
where sae_lens is not importable it is skipped.
"""

import pytest
import torch

from dcinterp import HookedDCFormer
from dcinterp.tokenizer import released_texts

sae_lens = pytest.importorskip(
    "sae_lens",
    reason="sae-lens is an optional extra that pins TransformerLens < 4: "
    "pip install 'dcinterp[saelens]' in an environment of its own",
)
datasets = pytest.importorskip("datasets", reason="SAELens' datasets dependency")

CONTEXT, BATCH_PROMPTS, STEPS = 32, 16, 300


def train_sae(model, hook_name: str, d_in: int, texts: list[str], tmp_path):
    from sae_lens import (
        LanguageModelSAERunnerConfig,
        LanguageModelSAETrainingRunner,
        LoggingConfig,
        StandardTrainingSAEConfig,
    )

    batch_tokens = CONTEXT * BATCH_PROMPTS
    cfg = LanguageModelSAERunnerConfig(
        sae=StandardTrainingSAEConfig(d_in=d_in, d_sae=4 * d_in, l1_coefficient=1.0),
        model_name="dcpythia-synth",
        model_class_name="HookedDCFormer",
        hook_name=hook_name,
        dataset_path="raw-text",
        is_dataset_tokenized=False,
        streaming=False,
        context_size=CONTEXT,
        training_tokens=batch_tokens * STEPS,
        train_batch_size_tokens=batch_tokens,
        store_batch_size_prompts=BATCH_PROMPTS,
        n_batches_in_buffer=32,
        lr=3e-3,
        device="cpu",
        prepend_bos=False,
        logger=LoggingConfig(log_to_wandb=False),
        checkpoint_path=str(tmp_path / "checkpoints"),
        output_path=str(tmp_path / "output"),
        n_checkpoints=0,
        save_final_checkpoint=False,
        verbose=False,
        n_batches_for_norm_estimate=10,
        seed=0,
    )
    dataset = datasets.Dataset.from_dict({"text": texts})  # raw text: SAELens tokenizes it with model.to_tokens
    return LanguageModelSAETrainingRunner(cfg, override_dataset=dataset, override_model=model).run()


@pytest.mark.parametrize(
    "hook_name, d_in",
    [("blocks.1.hook_resid_post", 64), ("blocks.1.attn.hook_z", 64), ("blocks.1.attn.post_compose.hook_kw1", 8)],
)
def test_sae_trains_from_raw_text_and_splices_in(hook_name, d_in, tmp_path):
    torch.manual_seed(0)
    model = HookedDCFormer.from_pretrained("dcpythia-synth")
    texts = released_texts()
    sae = train_sae(model, hook_name, d_in, texts, tmp_path)

    tokens = model.to_tokens(texts[:8], truncate=True)[:, :CONTEXT]
    _, cache = model.run_with_cache(tokens, names_filter=[hook_name])
    x = cache[hook_name].flatten(2)  # [batch, pos, d_in]: heads (or rank x heads) flattened, as SAELens does
    recon = sae(x)
    fvu = ((recon - x) ** 2).sum() / ((x - x.mean((0, 1))) ** 2).sum()
    assert fvu < 0.4, f"{hook_name}: fraction of variance unexplained {fvu:.3f}"  # it learned the activations
    assert 0 < (sae.encode(x) > 0).float().sum(-1).mean() < sae.cfg.d_sae  # sparse codes

    def splice(act, hook):  # the SAE's reconstruction in place of the activation
        return sae(act.flatten(2)).reshape(act.shape)

    spliced = model.run_with_hooks(tokens, fwd_hooks=[(hook_name, splice)])
    assert torch.isfinite(spliced).all() and (spliced - model(tokens)).abs().max() > 0
    if hook_name.endswith("hook_resid_post"):  # the same as running the rest of the model from the reconstruction
        torch.testing.assert_close(spliced, model(recon.detach(), start_at_layer=2), rtol=0, atol=1e-4)
    else:

        def replace(act, hook):
            return recon.detach().reshape(act.shape)

        torch.testing.assert_close(
            spliced, model.run_with_hooks(tokens, fwd_hooks=[(hook_name, replace)]), rtol=0, atol=1e-4
        )
