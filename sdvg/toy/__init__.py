"""The toy world (docs/TOY_WORLD.md): procedural shape clips, a judge that reads them, and the tiny trained models
that draw them.

* ``world``: scenes, captions and the renderer;
* ``judge``: the quality metric against the world's ground truth (independent of the router's critic);
* ``dit_train``, ``critic_train``, ``train``: ``python -m sdvg toy train`` (the patch latent model, the text
  encoder, target, drafter and critic, in the real file formats);
* ``preset``: the committed trained models (``models/``), the embedded default, and its sampling settings;
* ``sheet``: contact sheets of the toy models' videos; ``cli``: ``python -m sdvg toy``.
"""
