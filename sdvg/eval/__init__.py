"""``python -m sdvg eval``: the quality-vs-speed evaluation (``run``), its summary with bootstrap intervals and its
Ray twin."""

from ..facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "ray": "evaluate_ray import_ray",
    "run": "DEFAULT_METHODS DEFAULT_TAUS METHODS PromptRunner check_eval_args check_out_dir check_plan "
           "check_run_settings evaluate format_paired format_summary load_metric parse_taus read_prompts run_settings",
    "stats": "bootstrap_ci",
})
