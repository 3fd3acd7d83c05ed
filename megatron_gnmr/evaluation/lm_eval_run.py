"""`megatron-gnmr evaluate RUN_DIR --lm-eval TASKS`: lm-eval-harness tasks on a run's model
through our own forward (`lm_eval_model.RunAsLM`), tasks found in the shipped folder
(`lm_eval_tasks/`, read from local files), in `--lm-eval-include` folders and in lm-eval's
own registry (public tasks need the dataset hub, which this machine does not reach)."""

from __future__ import annotations

from pathlib import Path

from megatron_gnmr.errors import UserError

SHIPPED = Path(__file__).with_name("lm_eval_tasks")


def _lm_eval():
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as missing:
        raise UserError(f"--lm-eval needs lm-eval-harness ({missing.name} is not installed): "
                        "pip install 'megatron-gnmr[eval]' or pip install lm-eval") from None
    return lm_eval, TaskManager


def check_tasks(tasks: list[str], include: list[str]) -> object:
    """lm-eval's task manager over the shipped and included folders; each task named must be
    one it knows (refused in one line otherwise, before the model is loaded)."""
    _, TaskManager = _lm_eval()
    for folder in include:
        if not Path(folder).is_dir():
            raise UserError(f"--lm-eval-include {folder}: no such directory")
    manager = TaskManager(include_path=[str(SHIPPED), *include])
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown or not tasks:
        shipped = sorted(path.stem for path in SHIPPED.glob("*.yaml"))
        raise UserError(f"--lm-eval {','.join(tasks) or '(empty)'}: lm-eval knows no task "
                        f"{', '.join(unknown) or 'named'} (shipped: {', '.join(shipped)}; your "
                        "own: --lm-eval-include DIR with its YAML)")
    return manager


def evaluate_with_lm_eval(model, tasks: list[str], manager, limit: int | None,
                          samples: bool = False) -> dict:
    """lm-eval's results for `tasks` on `model` (a loaded run, or any lm-eval model:
    "hf" with its arguments as a pair): {"results": per task and metric, "versions",
    "n-samples"} and with `samples` each document's responses (lm-eval's own keys)."""
    lm_eval, _ = _lm_eval()
    from megatron_gnmr.evaluation.lm_eval_model import RunAsLM

    name, arguments = model if isinstance(model, tuple) else (RunAsLM(model), None)
    out = lm_eval.simple_evaluate(model=name, model_args=arguments, tasks=tasks,
                                  task_manager=manager, limit=limit, log_samples=samples,
                                  bootstrap_iters=1000)
    keys = ("results", "versions", "n-samples", *(("samples",) if samples else ()))
    return {key: out[key] for key in keys if key in out}


def table(results: dict) -> str:
    from lm_eval.utils import make_table

    return make_table(results)
