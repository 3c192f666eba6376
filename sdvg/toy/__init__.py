"""The toy world (docs/TOY_WORLD.md): procedural shape clips, a judge that reads them, and the tiny trained models
that draw them.

* ``world``: scenes, captions and the renderer;
* ``judge``: the quality metric against the world's ground truth (independent of the router's critic);
* ``dit_train``, ``critic_train``, ``train``: ``python -m sdvg toy train`` (the patch latent model, the text
  encoder, target, drafter and critic, in the real file formats);
* ``preset``: the committed trained models (``models/``), the embedded default, and its sampling settings;
* ``sheet``: contact sheets of the toy models' videos; ``cli``: ``python -m sdvg toy``.
"""

from ..facade import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "preset": "TOY_BLOCKS TOY_DIR TOY_RATES TOY_RATE_PRIOR TOY_SCHEDULE TOY_SCORE_FRAMES TOY_SIZE TOY_STEP_NOISE TOY_TAU TOY_TAUS "
              "is_toy_tree toy_drafter_sampling toy_eval_items toy_prompts toy_tree",
})
