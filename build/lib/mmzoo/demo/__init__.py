"""The embedded demo: synthetic scenes of flat shapes (:mod:`mmzoo.demo.shapes`) that the shipped
checkpoint (``mmzoo/assets/qwen2_vl_shapes``, retrained by ``recipes/train_demo.py``) answers about."""
