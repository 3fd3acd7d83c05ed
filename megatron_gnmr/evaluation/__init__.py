"""Downstream evaluation of any run (`megatron-gnmr evaluate RUN_DIR`): held-out perplexity,
a multiple-choice cloze, and retention of the base's corpus for fine-tunes."""
