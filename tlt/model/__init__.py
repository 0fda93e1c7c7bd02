"""Models: the task tokenizer, the tiny/small model presets and build, evaluation, and test checkpoints.

Submodules are imported directly (`tlt.model.presets`, `tlt.model.tokenizer`,
`tlt.model.build`, ...); this package file stays empty so importing any of
them does not pull torch or transformers in.
"""
