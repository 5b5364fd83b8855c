"""The commands that run models on the synthetic tasks, one a module (`python -m dcinterp.synth COMMAND`):

- `eval`: score checkpoints (accuracy, perplexity; the scoring is `dcinterp.synth.evaluate`);
- `ablate`: score a checkpoint with parts of its compose switched off (`dcinterp.patching`);
- `circuit`: edge-level circuit discovery on contrast pairs (`dcinterp.discovery`);
- `qk_attribution` (the `qk` command): why a head attends where it does (`dcinterp.qk`, `dcinterp.qk_weights`);
- `attribute`: head attribution of the answers of many prompts (`dcinterp.attribution`);
- `graph`: attribution graphs of a prompt's next token, attention edges split by head and branch
  (`dcinterp.attribution_graph`, `dcinterp.graph_export`).

`common` holds what they share. Each imports torch and the model inside the functions that run, so that
`python -m dcinterp.synth --help` stays fast.
"""
