"""``python -m sdvg eval``: the quality-vs-speed evaluation (``run``), its output folder (``folder``), its summary with bootstrap intervals and its
Ray twin."""

from ..facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "folder": "check_out_dir check_run_settings run_settings",
    "ray": "evaluate_ray import_ray",
    "run": "DEFAULT_METHODS DEFAULT_TAUS METHODS PromptRunner RewardRouting check_eval_args check_plan evaluate format_paired "
           "format_summary load_metric parse_taus read_prompts",
    "stats": "bootstrap_ci",
})
