"""Downstream evaluation of any run (`megatron-gnmr evaluate RUN_DIR`): held-out perplexity,
a multiple-choice cloze, and retention of the base's corpus for fine-tunes."""


def output_name(exact: bool) -> str:
    """Where a run's scores go: the deployed precision's and the exact base's side by side."""
    return "evaluation-exact.json" if exact else "evaluation.json"
